"""GDN's and KDA's deferred verify and commit in Triton, in WY form on the tensor cores.

The token-by-token kernel (``recurrent_triton.py``) reduces the state over K twice per token and
is bound by issuing those reductions: GDN's verify + commit of T = 4 tokens took 2.7x a decode
step on a bfloat16 pool, 2.2x on a float32 one (H200, B = 64). Here the T tokens
of one (sequence, value head, V tile) are a 16-row block and every state product is one
``tl.dot``. The math, for the state S^T [V, K] (the pool's K-last layout) entering the verify,
l2-normalised keys k_t and queries q_t (q times the scale), G_t the cumulative log gate of the
verify's tokens, beta_t:

    A_ts = beta_t exp(G_t - G_s) k_t . k_s   (s < t)        X = (I + A)^-1
    u    = X diag(beta) (V - diag(exp(G)) K S)               (each token's u, as the token kernel saves it)
    o    = diag(exp(G)) Q S + P u,   P_ts = exp(G_t - G_s) q_t . k_s   (s <= t)

which is the recurrence h_t = exp(g_t) h_{t-1} + k_t u_t^T, u_t = beta_t (v_t - (exp(g_t) h_{t-1})^T k_t),
o_t = h_t^T q_t unrolled (``naive.py``). The rows of the block are k_0 .. k_7 then q_0 .. q_7
(T <= 8), so that S K^T and S Q^T are one product [K; Q] S^T, k . k and q . k one product of
the block with itself, and u and P u one product (M = [X; P X] times diag(beta) (V - exp(G) K S)).
X is a product of log2(T) factors: A is strictly lower with T live rows, so A^T = 0 and
(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...

A commit of the first a_n tokens from their saved u is S^T <- exp(G_a) S^T + u^T (exp(G_a - G) K)
(rows s < a_n), one product of 16 token rows; a verify with a pending commit runs it first and
verifies from the committed state as the pool holds it (rounded to bfloat16). The standalone
commit runs the same code, so that the two paths agree bit for bit.

KDA's gate decays each channel on its own: exp(G_t - G_s) becomes a [K] vector per pair, so the
decays go into the block's rows before the state products ((K * exp(G)) S^T, channel by channel)
and into the pair products as two factors, A_ts = beta_t sum_c k_t[c] exp(G_t[c] - G_r[c])
k_s[c] exp(G_r[c] - G_s[c]) with r the middle token, one product. Each factor stays finite once
a token's log decay is floored at LOG_DECAY_FLOOR (-20: no factor beyond exp(80) at T <= 8); a
pair's decay then reads exp(-20) = 2e-9 where it is smaller, against the bfloat16 outputs'
2^-9. The pairs above the diagonal, where the factors' product may overflow, are masked out. The
state's and the commit's decays stay exact. The gates, their cumulative sums and exponentials are
formed on the rows of the T distinct tokens and spread over the 16-row block (``_rows_repeated``).

A program takes one (sequence, value head) and walks the head's V tiles of 32 columns, with the
next tile's state loads in flight while it works on the current one: everything that does not
depend on the state (the block, its norms and gates, A, X, P, the commit's decayed keys) is formed
once per head instead of once per tile. Below one head per SM (N * HV < the GPU's SMs, e.g. B = 1)
each tile is its own program instead, for parallelism.

Precisions: the state products take the block in two bfloat16 parts (hi + lo, 16 bits of
mantissa), split once per program, against a bfloat16 state, exact as stored, or against a float32
state in two bfloat16 parts as well (three products: hi hi, hi lo, lo hi); the small 16 x 16
products are tf32; the commit's product takes both operands in two bfloat16 parts (three products).
A float32 pool takes this path only with 16-bit inputs (bfloat16 tolerances); float32 inputs keep
the token kernel's float32 arithmetic.

H200, T = 4, GDN 16 / 32 heads, per layer of a 16-layer CUDA graph (bench_serving's step
functions, one process), us, B = 64 / 256. bfloat16 pool, the token kernel -> this kernel's first
form (a program per V tile of 64 or 128 columns) -> this: verify with a pending commit 94.1 / 351.5
-> 70.8 / 261.9 -> 56.8 / 200.8, deferred verify + commit 105.2 / 388.2 -> 77.0 / 268.8 -> 70.6 /
237.9, against a decode step of 38.5 / 143.1 (1.47x and 1.83x at B = 64). float32 pool, the token
kernel -> this: 120.7 / 425.1 -> 93.0 / 324.5 and 152.1 / 557.0 -> 126.5 / 446.1, against 69.6 /
268.1 (1.34x and 1.82x). KDA 32 heads, bfloat16 pool, token kernel -> this: 107.3 / 408.1 ->
64.8 / 234.1 and 113.7 / 408.5 -> 74.7 / 261.9, against 37.9 / 143.1 (1.71x and 1.97x at B = 64);
float32 pool with bfloat16 inputs: 132.0 / 485.0 -> 105.2 / 359.9 and 159.3 / 560.0 -> 131.9 /
473.2, against 69.8 / 268.7 (1.51x and 1.89x). KDA at B = 1 lost (8.5 -> 10.5 us with a bfloat16
pool, before the gates on distinct rows). The commit's product in tf32 was 2.3 us slower and in IEEE
float32 25x slower (the products on CUDA-core FMAs spill); kept in the token kernel, the
standalone commit was 5 us faster but disagreed with the commit inside a verify by 9e-4
(relative, bfloat16 pool), against the 1e-4 that the two paths are held to.

Where: "deferred" verifies (with or without a pending commit) and "commit"s from saved u, T <= 8
(a pending verify's up to 16), K in {64, 128} and V a multiple of 32; bfloat16 pools, or float32
pools with 16-bit inputs; KDA from one head per SM. Everything else runs the token kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_triton import _dot, _gate_params
from .recurrent_triton import L2NORM_EPS, _token_log_decay, fast_log, head_and_tile
from ..common.pool_protocol import strides3
from ..common.segments import sm_count

ROWS = tl.constexpr(16)  # tl.dot's smallest M and K
KEY_ROWS = tl.constexpr(8)  # rows 0 .. 7 keys, 8 .. 15 queries: T <= 8
TILE_V = 32  # state columns of a V tile
TILE_STAGES = 3  # V tiles whose state loads are in flight at once
LOG_DECAY_FLOOR = tl.constexpr(-20.0)  # KDA's pair decays: each token's log decay floored here


def applies(recipe, op: str, state_pool: torch.Tensor, saved_u, T: int, TP: int, K: int, V: int,
            input_dtype: torch.dtype, heads: int) -> bool:
    """Whether ``recurrent_triton.delta_rule_recurrent`` runs ``op`` here (module docstring) for
    ``heads`` = N * HV. A commit of up to 16 tokens does, a verify of up to 8: a verify of 9 to 16
    tokens with a pending commit runs the token kernel, whose commit agrees with this one to
    rounding, not bit for bit. KDA only from a head per SM: its per-channel decays make the
    per-head work larger, so that small batches (B = 1) lost to the token kernel."""
    pool_ok = state_pool.dtype == torch.bfloat16 or (
        state_pool.dtype == torch.float32 and input_dtype in (torch.bfloat16, torch.float16))
    family_ok = recipe.mode == "gdn" or (recipe.mode == "kda" and heads >= sm_count(state_pool.device))
    return (pool_ok and family_ok and op in ("deferred", "commit") and saved_u is not None
            and T <= (ROWS if op == "commit" else KEY_ROWS) and TP <= ROWS and K in (64, 128)
            and V % TILE_V == 0)


def launch_shape(op: str, TP: int, N: int, HV: int, V: int, num_sms: int, per_channel: bool
                 ) -> tuple[int, int, int, int]:
    """(V tile, warps, tiles a program walks, tiles whose loads are in flight). H200, T = 4, K = V =
    128, per layer of a 16-layer graph, us, B = 64 unless said:
    - 32 columns on 2 warps, a head's 4 tiles a program, 3 in flight: GDN 16 / 32 heads, bfloat16
      pool, verify / verify with a pending commit / verify + commit 27.9 / 60.0 / 70.6 against
      46.8 / 93.6 / 89.4 with a tile a program and 31.5 / 73.3 / 80.0 with 2 tiles; float32 pool,
      B = 256, 158.2 / 379.7 / 446.0 against 280.7 / 474.7 / 572.0 with a tile a program. 64
      columns on 2 or 4 warps in 2 tiles were slower (float32 verify: 59.0, 53.9 against 47.2), so
      were 2 or 4 in flight instead of 3 (50.9, 48.9);
    - the verify with a pending commit from 8 heads per SM on: 16 columns on 1 warp in 8 tiles
      (GDN bfloat16 56.8 / 200.8 against 60.0 / 221.8 at B = 64 / 256, float32 101.2 / 345.5 against
      105.3 / 379.7; KDA 32 heads bfloat16 64.7 against 71.0), everything else slower there at B = 8;
    - the commit: 16 columns on 2 warps in 8 tiles (verify + commit, KDA bfloat16 83.5 -> 78.2 at
      B = 64, 282.8 -> 264.8 at B = 256; GDN bfloat16 71.0 -> 69.5 and 237.4 -> 235.2; GDN float32
      126.8 -> 127.0);
    - KDA's verify: 32 columns on 1 warp (bfloat16 34.0 -> 32.0, B = 256 109.2 -> 99.9), which
      GDN's did not gain from (27.7 -> 28.2); 2 in flight below 32 heads per SM (B = 64: 32.0 ->
      30.7 and verify + commit 76.2 -> 74.6; B = 256: 255.2 -> 261.5 with 2; float32 pool 132.8 ->
      132.0 and 481.8 -> 476.5);
    - below one head per SM a tile a program: B = 1 (32 heads), bfloat16, 4.4 / 5.8 / 7.8 against
      5.7 / 9.8 / 11.8 with 4 tiles."""
    if N * HV < num_sms:
        return TILE_V, 2, 1, TILE_STAGES
    if op == "commit":
        return 16, 2, V // 16, TILE_STAGES
    if TP > 0 and N * HV >= 8 * num_sms:
        return 16, 1, V // 16, TILE_STAGES
    if TP == 0 and per_channel and N * HV >= 8 * num_sms:
        return TILE_V, 1, V // TILE_V, 2 if N * HV < 32 * num_sms else TILE_STAGES
    return TILE_V, 2, V // TILE_V, TILE_STAGES


def tiles_walked(N: int, HV: int, V: int, BV: int, num_sms: int) -> int:
    """V tiles of BV columns a program walks: the whole head from one head per SM on, else one
    (more programs for small batches)."""
    return V // BV if N * HV >= num_sms else 1


@triton.jit
def bf16_parts(x):
    """A float32 tile as bfloat16 hi + lo parts (16 bits of mantissa between them)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def times_state(block_hi, block_lo, S):
    """block S for a [16, K] float32 block given as ``bf16_parts`` and a state tile S^T [BV, K] as
    the pool holds it: against a bfloat16 state, exact as stored, two products; against a float32
    one, the state in two bfloat16 parts too, three (hi hi, hi lo, lo hi)."""
    St = tl.trans(S)
    if S.dtype == tl.bfloat16:
        product = tl.dot(block_hi, St) + tl.dot(block_lo, St)
    else:
        S_hi, S_lo = bf16_parts(St)
        product = tl.dot(block_hi, S_hi) + tl.dot(block_hi, S_lo) + tl.dot(block_lo, S_hi)
    return product


@triton.jit
def _rows_repeated(x):
    """[16, K] from x [R, K] (R a power of two up to 16): row r is x's row r mod R. KDA forms its
    per-channel gates and their exponentials on the R = T (rounded up) rows of distinct tokens and
    spreads them over the 16-row block here (formed on all 16 rows: a verify with a pending commit
    90.3 us against 74.8, H200, B = 64, T = 4)."""
    R: tl.constexpr = x.shape[0]
    return tl.reshape(tl.broadcast_to(x[None, :, :], (ROWS // R, R, x.shape[1])), (ROWS, x.shape[1]))


@triton.jit
def _token_cumsum(log_decay, is_key):
    """G of each row's token for rows [keys; queries] ([16]): the running sum over the key rows,
    restarted at the first query row (query row 8 + t has key row t's G)."""
    return tl.cumsum(log_decay, 0) - tl.where(is_key, 0.0, tl.sum(tl.where(is_key, log_decay, 0.0), 0))


@triton.jit
def _wy_kernel(
    q, k, v, g, beta, o, A_log, dt_bias, saved_u, pending_k, pending_g, pending_u,
    stride_q_n, stride_q_t, stride_q_h,
    stride_k_n, stride_k_t, stride_k_h,
    stride_v_n, stride_v_t, stride_v_h,
    stride_g_n, stride_g_t, stride_g_h,
    stride_b_n, stride_b_t, stride_b_h,
    stride_o_n, stride_o_t, stride_o_h,
    stride_u_n, stride_u_t, stride_u_h,
    stride_pk_n, stride_pk_t, stride_pk_h,
    stride_pg_n, stride_pg_t, stride_pg_h,
    stride_pu_n, stride_pu_t, stride_pu_h,
    scale, lower_bound, pool, state_indices, num_accepted, stride_pool, stride_idx_n,
    T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, LOG2_T: tl.constexpr, FUSED_GATE: tl.constexpr, SAFE_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, QK_L2NORM: tl.constexpr, BETA_LOGITS: tl.constexpr,
    PER_CHANNEL: tl.constexpr, FAST_LOG: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
    GATE_ROWS: tl.constexpr, PENDING_GATE_ROWS: tl.constexpr,
):
    """One (sequence, value head, group of TILES V tiles of BV columns): with TP > 0 the commit of
    the first num_accepted[n] of TP pending tokens (k, g, u: ``pending_*``) into the pool, then with
    T > 0 the verify of T tokens (outputs into ``o``, u into ``saved_u``), tile by tile with STAGES
    tiles' loads in flight. A padding row (slot < 0) reads and writes no state and gets zero
    outputs and u."""
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
    A = 1.0
    bias = 0.0
    if FUSED_GATE:
        A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            if PER_CHANNEL:
                bias = tl.load(dt_bias + i_hv * K + ks).to(tl.float32)[None, :]
            else:
                bias = tl.load(dt_bias + i_hv).to(tl.float32)

    if TP > 0:
        accepted = tl.where(live, tl.load(num_accepted + i_n), 0)
        committed = (rows < accepted) & (rows < TP)
        keys = tl.load(pending_k + i_n64 * stride_pk_n + rows[:, None] * stride_pk_t + i_h * stride_pk_h + ks[None, :],
                       mask=committed[:, None], other=0.0).to(tl.float32)
        if QK_L2NORM:
            keys = keys * tl.rsqrt(tl.sum(keys * keys, 1) + L2NORM_EPS)[:, None]
        if PER_CHANNEL:  # [PENDING_GATE_ROWS, K]: the state decays along its K columns
            gate_rows = tl.arange(0, PENDING_GATE_ROWS)
            gate_committed = (gate_rows < accepted) & (gate_rows < TP)
            pending_offsets = i_n64 * stride_pg_n + gate_rows * stride_pg_t + i_hv * stride_pg_h
            log_decay_c = _token_log_decay(pending_g, pending_offsets[:, None], ks[None, :], gate_committed[:, None],
                                           A, bias, lower_bound, True, FUSED_GATE, SAFE_GATE, HAS_DT_BIAS, FAST_LOG)
            G_end = tl.sum(log_decay_c, 0)[None, :]
            # decayed to the last token; rows from TP on repeat earlier tokens' decays on zero keys
            keys_after = keys * _rows_repeated(tl.exp(G_end - tl.cumsum(log_decay_c, 0)))
        else:
            pending_offsets = i_n64 * stride_pg_n + rows * stride_pg_t + i_hv * stride_pg_h
            log_decay_c = _token_log_decay(pending_g, pending_offsets, 0, committed, A, bias, lower_bound, False,
                                           FUSED_GATE, SAFE_GATE, HAS_DT_BIAS, False)
            G_end = tl.sum(log_decay_c, 0)
            keys_after = keys * tl.exp(G_end - tl.cumsum(log_decay_c, 0))[:, None]

    if T > 0:
        token = rows % KEY_ROWS
        is_key = rows < KEY_ROWS
        active = (token < T) & live
        key_rows = active & is_key
        k_offsets = i_n64 * stride_k_n + token[:, None] * stride_k_t + i_h * stride_k_h + ks[None, :]
        q_offsets = i_n64 * stride_q_n + token[:, None] * stride_q_t + i_h * stride_q_h + ks[None, :]
        # the block [K; Q]: row r the key (r < 8) or the query (r >= 8) of token r mod 8
        KQ = tl.load(tl.where(is_key[:, None], k + k_offsets, q + q_offsets), mask=active[:, None],
                     other=0.0).to(tl.float32)
        factor = tl.where(is_key, 1.0, scale)
        if QK_L2NORM:
            factor = factor * tl.rsqrt(tl.sum(KQ * KQ, 1) + L2NORM_EPS)
        KQ = KQ * factor[:, None]
        earlier = is_key[None, :] & (token[None, :] <= token[:, None])  # (row, key column s <= its token)
        if PER_CHANNEL:  # on the GATE_ROWS tokens' rows, then spread: key row t and query row 8 + t
            gate_tokens = tl.arange(0, GATE_ROWS)
            gate_active = (gate_tokens < T) & live
            gate_offsets = i_n64 * stride_g_n + gate_tokens * stride_g_t + i_hv * stride_g_h
            log_decay = _token_log_decay(g, gate_offsets[:, None], ks[None, :], gate_active[:, None], A, bias,
                                         lower_bound, True, FUSED_GATE, SAFE_GATE, HAS_DT_BIAS, FAST_LOG)
            # the pairs' decays as a product of two factors around the token REF, each within
            # exp(+-4 * LOG_DECAY_FLOOR) once a token's log decay is floored (module docstring)
            G_floor = tl.cumsum(tl.maximum(log_decay, LOG_DECAY_FLOOR), 0)
            G_ref = tl.sum(tl.where(gate_tokens[:, None] == (T - 1) // 2, G_floor, 0.0), 0)[None, :]
            gram = tl.dot(KQ * _rows_repeated(tl.exp(G_floor - G_ref)),
                          tl.trans(KQ * _rows_repeated(tl.exp(G_ref - G_floor))), input_precision="tf32")
            decayed_gram = tl.where(earlier, gram, 0.0)  # above the diagonal: may be inf
        else:
            gate_offsets = i_n64 * stride_g_n + token * stride_g_t + i_hv * stride_g_h
            log_decay = _token_log_decay(g, gate_offsets, 0, active, A, bias, lower_bound, False, FUSED_GATE,
                                         SAFE_GATE, HAS_DT_BIAS, False)
            G = _token_cumsum(log_decay, is_key)
            gram = tl.dot(KQ, tl.trans(KQ), input_precision="tf32")
            decayed_gram = tl.exp(tl.where(earlier, G[:, None] - G[None, :], -float("inf"))) * gram
        b = tl.load(beta + i_n64 * stride_b_n + token * stride_b_t + i_hv * stride_b_h, mask=key_rows,
                    other=0.0).to(tl.float32)
        if BETA_LOGITS:
            b = tl.sigmoid(b)
        b = tl.where(key_rows, b, 0.0)
        A_mat = tl.where(is_key[:, None] & (token[None, :] < token[:, None]), decayed_gram, 0.0) * b[:, None]
        X = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0) - A_mat
        power = A_mat
        for _ in tl.static_range(LOG2_T - 1):
            power = tl.dot(power, power, input_precision="tf32")
            X = X + tl.dot(X, power, input_precision="tf32")
        P = tl.where(is_key[:, None], 0.0, decayed_gram)
        M = tl.where(is_key[:, None], X, tl.dot(P, X, input_precision="tf32"))
        if PER_CHANNEL:  # the decays go into the block, channel by channel
            KQ_hi, KQ_lo = bf16_parts(KQ * _rows_repeated(tl.exp(tl.cumsum(log_decay, 0))))
            decay_in = 1.0
        else:
            KQ_hi, KQ_lo = bf16_parts(KQ)  # once for all tiles (``_dot``'s splits would form them per tile)
            decay_in = tl.exp(G)[:, None]

    if TP > 0 and PER_CHANNEL:
        keys_hi, keys_lo = bf16_parts(keys_after)
    for j in tl.range(TILES, num_stages=STAGES):
        vs = (i_grp * TILES + j) * BV + tl.arange(0, BV)
        state = head_state + vs[:, None] * K + ks[None, :]
        S = tl.load(state, mask=live, other=0.0)  # S^T [BV, K] in the pool's dtype
        if TP > 0:
            u = tl.load(pending_u + i_n64 * stride_pu_n + rows[:, None] * stride_pu_t + i_hv * stride_pu_h
                        + vs[None, :], mask=committed[:, None], other=0.0)
            S = S.to(tl.float32)
            if PER_CHANNEL or pool.dtype.element_ty == tl.float32:
                # S first the accumulator of a product of zeros (exact): the compiler then stages
                # the tile in swizzled shared memory for the tensor cores' layout; with KDA's
                # per-channel decay first, or a float32 tile, it chose an unswizzled one (8-way
                # bank conflicts: KDA's commit took 61 us against GDN's 43 at B = 64)
                S = tl.dot(tl.zeros([BV, ROWS], tl.bfloat16), tl.zeros([ROWS, K], tl.bfloat16), S)
            if PER_CHANNEL:  # the update's products accumulate into the decayed state: 2.6 us faster
                u_hi, u_lo = bf16_parts(tl.trans(u))
                S = tl.dot(u_lo, keys_hi, tl.dot(u_hi, keys_lo, tl.dot(u_hi, keys_hi, S * tl.exp(G_end))))
            else:  # added after: 1-5 us faster for GDN
                S = S * tl.exp(G_end) + _dot(tl.trans(u), keys_after, "bf16x3")
            S = S.to(pool.dtype.element_ty)
            tl.store(state, S, mask=accepted > 0)
        if T > 0:
            values = tl.load(v + i_n64 * stride_v_n + token[:, None] * stride_v_t + i_hv * stride_v_h + vs[None, :],
                             mask=key_rows[:, None], other=0.0).to(tl.float32)
            KQS = times_state(KQ_hi, KQ_lo, S)  # [K S^T; Q S^T]
            right = tl.where(is_key[:, None], b[:, None] * (values - decay_in * KQS), 0.0)
            Z = tl.dot(M, right, input_precision="tf32")  # key rows: u; query rows: P u
            tl.store(saved_u + i_n64 * stride_u_n + token[:, None] * stride_u_t + i_hv * stride_u_h + vs[None, :], Z,
                     mask=(is_key & (token < T))[:, None])
            out = decay_in * KQS + Z
            tl.store(o + i_n64 * stride_o_n + token[:, None] * stride_o_t + i_hv * stride_o_h + vs[None, :],
                     out.to(o.dtype.element_ty), mask=(~is_key & (token < T))[:, None])


def wy_recurrent(recipe, q, k, v, g, beta, *, op: str, state_pool, state_indices, out, num_accepted_tokens,
                 saved_u, pending_k, pending_g, pending_u, TP: int) -> None:
    """Launch ``op`` where ``applies``; arguments as ``recurrent_triton.delta_rule_recurrent``
    takes them after its checks (``out`` the output target, the pending tensors unit-last)."""
    N, T, HV, V = saved_u.shape
    H, K = k.shape[-2:]
    T_verify = T
    if op == "commit":  # the commit of a pending verify, with no verify after it
        pending_k, pending_g, pending_u, TP, T_verify = k, g, saved_u, T, 0
    BV, num_warps, tiles, stages = launch_shape(op, TP, N, HV, V, sm_count(state_pool.device), recipe.mode == "kda")
    A_log, dt_bias, lower_bound, gate_flags = _gate_params(recipe, state_pool.device)
    _wy_kernel[(N * HV * (V // (BV * tiles)),)](
        q, k, v, g, beta, out, A_log, dt_bias, saved_u, pending_k, pending_g, pending_u,
        *strides3(q), *strides3(k), *strides3(v), *strides3(g), *strides3(beta), *strides3(out),
        *strides3(saved_u), *strides3(pending_k), *strides3(pending_g), *strides3(pending_u),
        recipe.scale, lower_bound, state_pool, state_indices, num_accepted_tokens, state_pool.stride(0),
        state_indices.stride(0), T=T_verify, TP=TP, H=H, HV=HV, K=K, V=V, BV=BV,
        LOG2_T=max(1, (T_verify - 1).bit_length()), QK_L2NORM=recipe.qk_l2norm, BETA_LOGITS=recipe.beta_logits,
        PER_CHANNEL=recipe.mode == "kda", FAST_LOG=fast_log(recipe.mode == "kda", op, k.dtype), TILES=tiles,
        STAGES=stages, GATE_ROWS=triton.next_power_of_2(max(T_verify, 1)),
        PENDING_GATE_ROWS=triton.next_power_of_2(max(TP, 1)), num_warps=num_warps, **gate_flags,
    )
