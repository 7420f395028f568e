"""The output correction of a context-parallel segment: ``o = o0 + q~ S``, in one pass.

A segment that continues a sequence is prefilled once from a zero value state widened by K map
columns (``cula_serve.dist.cp``); its widened output row holds ``[o0 | q~]`` per token and value
head: o0 [V] the outputs from a zero start, q~ [K] the queries carried back to the segment's
start. Once the incoming state S [K, V] is known, the true output is ``o0 + q~ S``.

``correct_outputs`` reads each widened row once and writes the V output columns once: 2 (V + K)
+ 2 V bytes per token and head in bf16, where a batched GEMM on the strided halves makes an extra
pass over o0 (cuBLAS's ``beta = 1`` needs the addend in the output first) plus a copy. On the CPU
it is that GEMM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_TOKENS = 64
_TILES_PER_PROGRAM = 8  # token tiles per program: S is loaded once for all of them


@triton.jit
def _affine_output_kernel(widened, state, out, L,
                          s_wt, s_wh, s_st_h, s_st_v, s_ot, s_oh,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, TILES: tl.constexpr,
                          PREC: tl.constexpr):
    """Program (token tile group, value head): out[t, hv, :] = o0 + q~ S for TILES x BT tokens."""
    hv = tl.program_id(1)
    ks = tl.arange(0, K)
    vs = tl.arange(0, V)
    # S[k, v] = state[hv, v, k] (K-last)
    S = tl.load(state + hv * s_st_h + vs[None, :] * s_st_v + ks[:, None])
    if PREC == "bf16":
        S = S.to(tl.bfloat16)
    rows = tl.arange(0, BT)
    for i in range(TILES):
        t = (tl.program_id(0) * TILES + i) * BT + rows
        live = t < L
        row = widened + t[:, None].to(tl.int64) * s_wt + hv * s_wh
        o0 = tl.load(row + vs[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        q = tl.load(row + V + ks[None, :], mask=live[:, None], other=0.0)
        if PREC == "bf16":
            o0 += tl.dot(q.to(tl.bfloat16), S)
        else:
            o0 += tl.dot(q.to(tl.float32), S, input_precision="tf32x3")
        tl.store(out + t[:, None].to(tl.int64) * s_ot + hv * s_oh + vs[None, :], o0.to(out.dtype.element_ty),
                 mask=live[:, None])


def correct_outputs(widened: torch.Tensor, state: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = o0 + q~ S for one segment.

    widened: [L, HV, V + K] bf16 / fp16 / fp32, the widened prefill's output ([o0 | q~] per row;
        rows may be strided, each row's V + K values contiguous).
    state:   [HV, V, K] float32, the incoming state, K-last (state[hv, v, k] = S[k, v]).
    out:     [L, HV, V] in widened's dtype (a strided view is fine, last dim contiguous); written.
    Products take bf16 operands for bf16 outputs (q~ and o0 already carry that rounding), float32
    accuracy (tf32x3) otherwise; accumulation is float32.
    """
    L, HV, width = widened.shape
    V, K = state.shape[1:]
    if width != V + K or out.shape != (L, HV, V):
        raise ValueError(f"correct_outputs: widened {list(widened.shape)}, state {list(state.shape)} and out "
                         f"{list(out.shape)} do not match ([L, HV, V + K], [HV, V, K], [L, HV, V])")
    powers_of_two = K & (K - 1) == 0 and V & (V - 1) == 0 and min(K, V) >= 16
    if not widened.is_cuda or not powers_of_two or widened.stride(-1) != 1 or out.stride(-1) != 1:
        heads_first = widened.transpose(0, 1)  # [HV, L, V + K]
        torch.baddbmm(heads_first[..., :V], heads_first[..., V:], state.transpose(-1, -2).to(out.dtype),
                      out=out.transpose(0, 1))
        return out
    state = state.float().contiguous()
    grid = (triton.cdiv(L, _BLOCK_TOKENS * _TILES_PER_PROGRAM), HV)
    with torch.cuda.device(widened.device):
        _affine_output_kernel[grid](
            widened, state, out, L, widened.stride(0), widened.stride(1), state.stride(0), state.stride(1),
            out.stride(0), out.stride(1), K=K, V=V, BT=_BLOCK_TOKENS, TILES=_TILES_PER_PROGRAM,
            PREC="bf16" if widened.dtype == torch.bfloat16 else "tf32x3", num_warps=8)
    return out
