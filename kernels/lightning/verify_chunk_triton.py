"""Lightning's deferred verify and commit in Triton as one chunk of products on the tensor cores.

The token-by-token kernel (``recurrent_triton.py``) reduces the state over K once per token for
its output; a deferred verify of T = 4 tokens and its commit took 2.2x a decode step there (H200,
B = 64, bfloat16 pool). Here the T <= 16 tokens of one (sequence, value head) are the rows of a
block and every state product is one ``tl.dot``. For the state S^T [V, K] (the pool's K-last
layout) entering the verify, a = exp(d) the head's decay, queries q_t times the scale and keys k_t
(l2-normalised when asked), tokens t = 0 .. T - 1:

    o_t = a^(t+1) S^T q_t + sum_{s <= t} a^(t-s) (q_t . k_s) v_s
    i.e. O = diag(a^(t+1)) Q S + (D * Q K^T) V,   D_ts = a^(t-s) (s <= t), 0 above

which is S_t = a S_{t-1} + k_t v_t^T, o_t = S_t^T q_t unrolled (``naive.py``). A commit of the first
n tokens is S^T <- a^n S^T + sum_{s < n} v_s (a^(n-1-s) k_s)^T, one product of 16 token rows.

A verify program takes one (sequence, value head) and walks the head's V tiles of 32 columns with
three tiles' state loads in flight: Q, K, Q K^T and D are formed once per head
(``verify_wy_triton.tiles_walked``: a tile a program below one head per SM). A commit program
takes one V tile (faster than walking: its per-head work is small).

Precisions: Q S takes Q in two bfloat16 parts against a bfloat16 state (exact as stored) or a
float32 state in two bfloat16 parts (``verify_wy_triton.times_state``); Q K^T and (D * Q K^T) V are
tf32 (v exact in it); the commit's product takes v exact in bfloat16 and the decayed keys in two
bfloat16 parts (fp16 v: both in two parts). Only 16-bit inputs come here: float32 inputs keep the
token kernel's float32 arithmetic (their 1e-5 tolerance).

H200, T = 4, Lightning 64 heads, K = V = 128, per layer of a 16-layer CUDA graph
(bench_serving's step functions, one process), token kernel -> this, us, B = 64: bfloat16 pool,
verify 82.8 -> 45.0, verify + commit 162.6 -> 118.7 (decode 75.1: 2.17x -> 1.58x); float32 pool
101.2 -> 79.0 and 236.6 -> 218.4 (decode 147.7: 1.60x -> 1.48x). B = 256, bfloat16: verify +
commit 597.2 -> 447.4. The commit walking the head's tiles instead of a tile a program: B = 64
122.0 (bfloat16), 226.2 (float32), B = 256 444.9; the verify a tile a program: 70.5, 133.3 and
265.5 (verify alone); 16 columns on one warp within 3% either way, 64 on four slower.

Where: "deferred" verifies and "commit"s, bfloat16 or float32 pools, 16-bit inputs, T <= 16,
K in {64, 128} and V a multiple of 32. Everything else runs the token kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.pool_protocol import strides3
from ..common.segments import sm_count
from ..delta_rule.chunk_triton import _dot
from ..delta_rule.recurrent_triton import L2NORM_EPS, head_and_tile
from ..delta_rule.verify_wy_triton import ROWS, TILE_STAGES, TILE_V, bf16_parts, tiles_walked, times_state


def applies(op: str, state_pool: torch.Tensor, T: int, K: int, V: int, input_dtype: torch.dtype) -> bool:
    """Whether ``recurrent_triton.lightning_recurrent`` runs ``op`` here (module docstring)."""
    return (op in ("deferred", "commit") and state_pool.dtype in (torch.bfloat16, torch.float32)
            and input_dtype in (torch.bfloat16, torch.float16) and T <= ROWS and K in (64, 128)
            and V % TILE_V == 0)


@triton.jit
def _lightning_chunk_kernel(
    q, k, v, decay, o,
    stride_q_n, stride_q_t, stride_q_h,
    stride_k_n, stride_k_t, stride_k_h,
    stride_v_n, stride_v_t, stride_v_h,
    stride_o_n, stride_o_t, stride_o_h,
    scale, pool, state_indices, num_accepted, stride_pool, stride_idx_n,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    QK_L2NORM: tl.constexpr, COMMIT: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
):
    """One (sequence, value head, group of TILES V tiles of BV columns): with COMMIT the commit of
    the first num_accepted[n] of T tokens into the pool, else the deferred verify of T tokens
    (outputs into ``o``). A padding row (slot < 0) reads and writes no state and gets zero outputs."""
    i_nh, i_grp = head_and_tile(V, BV * TILES)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    i_n64 = i_n.to(tl.int64)
    rows = tl.arange(0, ROWS)
    ks = tl.arange(0, K)
    slot = tl.load(state_indices + i_n * stride_idx_n)
    live = slot >= 0
    head_state = pool + slot.to(tl.int64) * stride_pool + i_hv * V * K
    log_decay = tl.load(decay + i_hv).to(tl.float32)
    if COMMIT:
        accepted = tl.where(live, tl.load(num_accepted + i_n), 0)
        active = (rows < accepted) & (rows < T)
    else:
        active = (rows < T) & live
    keys = tl.load(k + i_n64 * stride_k_n + rows[:, None] * stride_k_t + i_h * stride_k_h + ks[None, :],
                   mask=active[:, None], other=0.0).to(tl.float32)
    if QK_L2NORM:
        keys = keys * tl.rsqrt(tl.sum(keys * keys, 1) + L2NORM_EPS)[:, None]
    if COMMIT:
        # a^(n-1-s); the rows past n are zero keys (the power clamped so that its exp stays finite)
        keys = keys * tl.exp(log_decay * tl.maximum(accepted - 1 - rows, 0).to(tl.float32))[:, None]
        state_decay = tl.exp(log_decay * accepted.to(tl.float32))
    else:
        queries = tl.load(q + i_n64 * stride_q_n + rows[:, None] * stride_q_t + i_h * stride_q_h + ks[None, :],
                          mask=active[:, None], other=0.0).to(tl.float32)
        if QK_L2NORM:
            queries = queries * (scale * tl.rsqrt(tl.sum(queries * queries, 1) + L2NORM_EPS))[:, None]
        else:
            queries = queries * scale
        lag = (rows[:, None] - rows[None, :]).to(tl.float32)
        scores = tl.dot(queries, tl.trans(keys), input_precision="tf32")
        coupling = tl.where(lag >= 0, tl.exp(log_decay * tl.maximum(lag, 0.0)), 0.0) * scores  # D * Q K^T
        decay_in = tl.exp(log_decay * (rows + 1).to(tl.float32))
        Q_hi, Q_lo = bf16_parts(queries)

    for j in tl.range(TILES, num_stages=STAGES):
        vs = (i_grp * TILES + j) * BV + tl.arange(0, BV)
        state = head_state + vs[:, None] * K + ks[None, :]
        S = tl.load(state, mask=live, other=0.0)  # S^T [BV, K] in the pool's dtype
        values = tl.load(v + i_n64 * stride_v_n + rows[:, None] * stride_v_t + i_hv * stride_v_h + vs[None, :],
                         mask=active[:, None], other=0.0)
        if COMMIT:
            if values.dtype == tl.bfloat16:
                update = _dot(tl.trans(values), keys, "bf16x2")
            else:
                update = _dot(tl.trans(values.to(tl.float32)), keys, "bf16x3")
            tl.store(state, (S.to(tl.float32) * state_decay + update).to(pool.dtype.element_ty), mask=accepted > 0)
        else:
            history = tl.dot(coupling, values.to(tl.float32), input_precision="tf32")
            out = decay_in[:, None] * times_state(Q_hi, Q_lo, S) + history
            tl.store(o + i_n64 * stride_o_n + rows[:, None] * stride_o_t + i_hv * stride_o_h + vs[None, :],
                     out.to(o.dtype.element_ty), mask=(rows < T)[:, None])


def lightning_chunk(recipe, q, k, v, decay, *, op: str, state_pool, state_indices, out,
                    num_accepted_tokens) -> None:
    """Launch ``op`` where ``applies``; arguments as ``recurrent_triton.lightning_recurrent`` takes
    them after its checks (``out`` the output target; q and out are None for a commit)."""
    N, T, HV, V = v.shape
    H, K = k.shape[-2:]
    commit = op == "commit"
    tiles = 1 if commit else tiles_walked(N, HV, V, TILE_V, sm_count(state_pool.device))
    if commit:  # no queries, no outputs: the kernel never touches them
        q, out, num_accepted = k, v, num_accepted_tokens
    else:
        num_accepted = state_indices
    _lightning_chunk_kernel[(N * HV * (V // (TILE_V * tiles)),)](
        q, k, v, decay, out,
        *strides3(q), *strides3(k), *strides3(v), *strides3(out),
        recipe.scale, state_pool, state_indices, num_accepted, state_pool.stride(0), state_indices.stride(0),
        T=T, H=H, HV=HV, K=K, V=V, BV=TILE_V, QK_L2NORM=recipe.qk_l2norm, COMMIT=commit, TILES=tiles,
        STAGES=TILE_STAGES, num_warps=2,
    )
