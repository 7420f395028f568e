"""The output correction of a context-parallel segment: ``o = o0 + q~ S``, in one pass.

A segment that continues a sequence is prefilled once from a zero value state widened by K map
columns (``cula_serve.dist.cp``); its widened output row holds ``[o0 | q~]`` per token and value
head: o0 [V] the outputs from a zero start, q~ [K] the queries carried back to the segment's
start. Once the incoming state S [K, V] is known, the true output is ``o0 + q~ S``.

``correct_outputs`` reads each widened row once and writes the V output columns once: 2 (V + K)
+ 2 V bytes per token and head in bf16, where a batched GEMM on the strided halves makes an extra
pass over o0 (cuBLAS's ``beta = 1`` needs the addend in the output first) plus a copy. On the CPU
it is that GEMM.

``correct_segment_outputs`` is the same correction for in-card segments (``segments``), where o0
is already in ``out`` and q~ in a [T, HV, K] buffer, for every segment of a batch in one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segments import num_segment_ids, segment_span

_BLOCK_TOKENS = 64
_TILES_PER_PROGRAM = 8  # token tiles per program: S is loaded once for all of them
# ``correct_segment_outputs``'s launch: BT-row tiles, TILES of them a program (S split once for
# them all). Its callers run on Hopper only (the CuTe DSL GDN and KDA prefills). H200, graph replay,
# L2 flushed, us for 32 value heads with one 16384-token segment / 8 heads with seven 1024-token
# segments (a TP4 shard): 128-row tiles, four a program, 8 warps, 3 stages (S's parts and the q~
# stages about 160 KB of shared memory: one program an SM) 195 / 30; 64-row tiles, 4 warps, 2 stages,
# four a program 163 / 26.5, eight 142 / 36: eight where segments are long, four where they are
# short (eight make 112 programs there, for 132 SMs) (2026-11-28; 64-row tf32x3 tiles at first:
# 421 / 60)
SEGMENT_OUTPUT_LAUNCH = dict(BT=64, TILES=4, num_warps=4, num_stages=2)
LONG_SEGMENT_TILES = 8
LONG_SEGMENT_TOKENS = 8192
# Other q~ dtypes (tf32x3 products): three stages of float32 q~ tiles asked for 320 KB of shared
# memory (an H200 refused the launch), so 64-row tiles and one stage
FLOAT_SEGMENT_OUTPUT_LAUNCH = dict(BT=64, TILES=4, num_warps=4, num_stages=1)


@triton.jit
def _add_carried(o0, q, S, PREC: tl.constexpr):
    """o0 + q S for a tile of rows: o0 [BT, V] float32, q [BT, K] the carried queries, S [K, V]
    float32; bf16 products (PREC "bf16") or float32 accuracy (tf32x3), float32 accumulation."""
    if PREC == "bf16":
        product = tl.dot(q.to(tl.bfloat16), S.to(tl.bfloat16))
    else:
        product = tl.dot(q.to(tl.float32), S, input_precision="tf32x3")
    return o0 + product


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
        S = S.to(tl.bfloat16)  # once, not per tile
    rows = tl.arange(0, BT)
    for i in range(TILES):
        t = (tl.program_id(0) * TILES + i) * BT + rows
        live = t < L
        row = widened + t[:, None].to(tl.int64) * s_wt + hv * s_wh
        o0 = tl.load(row + vs[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        q = tl.load(row + V + ks[None, :], mask=live[:, None], other=0.0)
        tl.store(out + t[:, None].to(tl.int64) * s_ot + hv * s_oh + vs[None, :],
                 _add_carried(o0, q, S, PREC).to(out.dtype.element_ty), mask=live[:, None])


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


@triton.jit
def _segment_output_kernel(out, carried, initial, cu_seqlens, state_indices, num_seqs, tokens, groups,
                           s_ot, s_oh, s_ct, s_ch, s_in, s_ih, s_iv,
                           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, TILES: tl.constexpr,
                           SPLIT: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """Program (segment id x token group, value head): out[t] += q~[t] S for the TILES x BT tokens
    of its group, where the segment continues a live sequence (S its composed initial state).
    SPLIT (bf16 q~): S as two bf16 parts, split once per program, two bf16 products a tile
    (16 bits of S's mantissa, where the output keeps 8); else one tf32x3 product (float32
    accuracy)."""
    sid = tl.program_id(0) // groups
    group = tl.program_id(0) % groups
    hv = tl.program_id(1)
    live, n, seq_bos, bos, eos, first, last = segment_span(cu_seqlens, num_seqs, sid, tokens)
    if HAS_SLOTS:
        live = live & (tl.load(state_indices + n) >= 0)
    if live & (first == 0):
        ks = tl.arange(0, K)
        vs = tl.arange(0, V)
        S = tl.load(initial + sid.to(tl.int64) * s_in + hv * s_ih + vs[None, :] * s_iv + ks[:, None])
        if SPLIT:
            S_hi = S.to(tl.bfloat16)
            S_lo = (S - S_hi.to(tl.float32)).to(tl.bfloat16)
        rows = tl.arange(0, BT)
        for i in range(TILES):
            t = bos + (group * TILES + i) * BT + rows
            keep = (t < eos)[:, None]
            dst = out + t[:, None] * s_ot + hv * s_oh + vs[None, :]
            o0 = tl.load(dst, mask=keep, other=0.0).to(tl.float32)
            q = tl.load(carried + t[:, None] * s_ct + hv * s_ch + ks[None, :], mask=keep, other=0.0)
            if SPLIT:
                o = tl.dot(q, S_lo, tl.dot(q, S_hi, o0))
            else:
                o = _add_carried(o0, q, S, "tf32x3")
            tl.store(dst, o.to(out.dtype.element_ty), mask=keep)


def correct_segment_outputs(cu_seqlens, state_indices, carried, initial, out, *, tokens: int) -> torch.Tensor:
    """In-card context parallelism (``kernels.common.segments``) run as one prefill pass: every
    segment that continues a live sequence was prefilled from a zero value state, with K map rows
    whose outputs are its carried queries q~; now that its initial state S is composed, add q~ S.

    cu_seqlens: int32 [N + 1]; state_indices: int32 [N] or None (negative: padding, skipped);
    carried: [T, HV, K] (bf16) the map rows' outputs, read at those segments' tokens;
    initial: float32 [segment ids, HV, V, K] (K-last), from ``segments.compose_initial_states``;
    out: [T, HV, V], rows contiguous, holding o0 there; corrected in place: with bf16 q~ by two bf16
    products against S's two bf16 parts (16 bits of its mantissa, twice what a bf16 output keeps),
    else with float32 accuracy (tf32x3).
    """
    T, HV, V = out.shape
    K = carried.shape[-1]
    N = cu_seqlens.shape[0] - 1
    num_ids = num_segment_ids(T, N, tokens)
    split = carried.dtype == torch.bfloat16
    launch = SEGMENT_OUTPUT_LAUNCH if split else FLOAT_SEGMENT_OUTPUT_LAUNCH
    if split and tokens >= LONG_SEGMENT_TOKENS:
        launch = {**launch, "TILES": LONG_SEGMENT_TILES}
    groups = triton.cdiv(tokens, launch["BT"] * launch["TILES"])
    _segment_output_kernel[(num_ids * groups, HV)](
        out, carried, initial, cu_seqlens, state_indices if state_indices is not None else cu_seqlens, N, tokens,
        groups, out.stride(0), out.stride(1), carried.stride(0), carried.stride(1), initial.stride(0),
        initial.stride(1), initial.stride(2), K=K, V=V, BT=launch["BT"], TILES=launch["TILES"],
        SPLIT=split, HAS_SLOTS=state_indices is not None, num_warps=launch["num_warps"],
        num_stages=launch["num_stages"])
    return out
