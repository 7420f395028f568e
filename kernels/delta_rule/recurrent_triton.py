"""The gated delta rule token by token in Triton: decode, MTP verify (three protocols) and commit.

GDN and KDA run through one kernel, ``_delta_rule_recurrent_kernel``: GDN's scalar gate is the
per-channel gate broadcast over K (a constexpr flag picks the load). Per value head ``hv`` (qk head
``hv // (HV // H)``) and token t, in float32 (``naive.py`` is the oracle):

    S   = Diag(exp(g_t)) S;   u = beta_t * (v_t - S^T k_t);   S = S + k_t u^T;   o_t = scale * S^T q_t

with the call's ``Recipe`` fused into the loads: qk l2norm, the gate from the raw projection
(``FusedGate``: GDN / KDA softplus gate with optional dt_bias, KDA safe gate), beta's sigmoid.

Grid and tiling: one program per (sequence, value head, V-tile of BV columns) on a one-axis grid,
the V-tile fastest (``head_and_tile``), BV per op (``block_v``). The columns of S evolve
independently (``S^T k`` and ``k u^T`` act column by column), so a program owns the K x BV slice
``pool[slot, hv, v0:v0+BV, :]`` and keeps it in registers for all T tokens: every state element is
read once and written once per call, whatever T is.

The slice is held as a [LV, BV // LV, K // KL, KL] block (``state_tile``; ``tile_split`` picks LV
and KL). Every token reduces each state column over K (``S^T k``, and ``S^T q`` for an output);
the verify is bound by issuing those reductions, not by memory (ncu on an H200, GDN B = 64,
T = 4: 80 % issue slots busy). With the plain [BV, K] block the 32 lanes lie along K and each
reduction is a 5-round shuffle tree for each of the BV columns a lane holds. Splitting the lanes
into LV groups along V and KL / 4 along K (4 contiguous floats each; the K // KL chunks stay in
registers) leaves BV / LV columns per lane and log2(KL / 4) rounds, at the price of each lane
handling K // (KL / 4) channels of every per-token K-vector (q, k, KDA's gate) instead of 4.
For a scalar gate that trade wins (GDN verify B = 64, T = 4: 99.0 -> 86.1 us with LV = 2,
KL = 64); KDA's per-channel gate formed in the kernel (three transcendentals per channel per
token) makes it lose (117.7 -> 129.8 us). So KDA's deferred verifies (with a bfloat16 pool also those
with a pending commit) read their decays, formed once per token and head by a launch before them
(``channel_decays``, ``uses_channel_decays``), and take the split layout; where KDA forms its gate
in the kernel it keeps LV = 1, KL = K, the plain layout, and so does a commit from saved u, which
has no reductions left. GDN's and KDA's deferred verifies and commits (bfloat16 pools, and
float32 pools with 16-bit inputs; KDA from one head per SM) leave this kernel for one that runs
the tokens as tensor-core products (``verify_wy_triton.py``).

The pool is ``[P, HV, V, K]`` (K-last, ``pool[slot, hv, v, k] == S[k, v]``), float32 or bfloat16
(loaded to float32, rounded to the pool dtype on store); dim 0 may have any stride (vLLM pages),
dims 1..3 are contiguous. What a call reads and writes is set by ``op`` (a_n below is
``num_accepted_tokens[n]``; a read slot < 0 marks a padding row: no read, no write, zero output):

    op          initial state from                       writes
    "decode"    pool[state_indices[n]]                   outputs; the final state back to that slot
    "buffer"    pool[state_indices[n]]                   outputs; state after token t to
                                                         buffer[buffer_rows[n], t] ([R, T_buf, HV, V, K])
    "slots"     pool[state_indices[n, a_n - 1]]        outputs; state after token t to
                                                         pool[state_indices[n, t]] where that is >= 0
    "deferred"  pool[state_indices[n]]                   outputs only (the commit replays); with
                                                         ``saved_u`` also u_t to saved_u[n, t, hv]
    "commit"    pool[state_indices[n]]                   the state after tokens 0..a_n-1 back to the
                                                         slot (nothing when a_n = 0); no outputs

A commit given the deferred verify's ``saved_u`` applies ``S = Diag(exp(g_t)) S + k_t u_t^T`` with
the saved u_t instead of recomputing ``u_t = beta_t (v_t - S^T k_t)``: the same values (the same
state and inputs) without the per-token row reduction S^T k, whose lane-shuffle trees made the
commit instruction-bound (KDA at B = 64, T = 4 on an H200: 111.5 -> 93.6 us); what is left is a
streaming read-modify-write of the state.

A "deferred" verify given ``pending`` (the previous deferred verify's k, gate and saved u, TP
tokens of the same rows) first replays its ``num_accepted_tokens[n]`` accepted tokens onto the
state in registers, as that commit would, writes the state back (rounded to the pool dtype) and
verifies from it: one read and one write of each state per engine step instead of a commit's
read-modify-write plus a verify's read. The commit runs on the verify's tile layout, so it equals
a separate commit up to rounding (the k norms' reduction order).

The buffer and slots commits are plain state copies: ``copy_committed_states``.

T is a compile-time constant (one compile per verify length, and the loop needs a bound known to
Triton's interpreter too), so a commit runs all T steps and masks those past its accepted count:
they load nothing and leave the state bit-identical.

Nothing here synchronises with the host and all Python logic depends on shapes only, so every
launch can be captured in a CUDA graph; each (shape bucket, Recipe flags) compiles once.

The pool-protocol pieces (slot resolution, state loads and stores, launch geometry, the copy
kernel) are shared with ``kernels/lightning/recurrent_triton.py``, which imports them from here.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .chunk_triton import _gate_params, _softplus as _stable_softplus
from ..common.pool_protocol import (OPS, check_pending, check_protocol, check_saved_u, check_state_layout,
                                    output_target, strides3, unit_last)

OP_DECODE, OP_BUFFER, OP_SLOTS, OP_DEFERRED, OP_COMMIT = (tl.constexpr(code) for code in range(len(OPS)))

L2NORM_EPS = tl.constexpr(1e-6)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's F.softplus default: x above it is returned as is
# ``copy_committed_states``' programs: one warp copying 1024 elements of a state. Many small
# programs beat fewer large ones (H200, 32 heads of 128 x 128, permuted slots, us per layer of a
# graph of 4-16, L2 flushed, slots / buffer; 4096 elements on 8 warps before): bfloat16 B = 64
# 36.9 -> 36.2 / 36.7 -> 35.7, B = 256 140.2 -> 137.0 / 140.1 -> 135.6; float32 B = 64 71.0 -> 69.1 /
# 71.5 -> 68.8 (copy ceilings 34-35, 129-134, 65-70). 512 elements lost at bfloat16 (42.0 at B = 64).
COMMIT_COPY_BLOCK = 1024
COMMIT_COPY_WARPS = 1


# ------------------------------------------------------------------------------------------------
# pool-protocol helpers shared by the delta-rule and Lightning kernels


@triton.jit
def read_slot(state_indices, num_accepted, i_n, stride_idx_n, stride_idx_t, num_columns, OP: tl.constexpr):
    """The slot sequence ``i_n`` starts from; negative means padding."""
    if OP == OP_SLOTS:
        # vLLM's layout: the previous step accepted a tokens, so its state sits in column a - 1
        column = tl.minimum(tl.maximum(tl.load(num_accepted + i_n) - 1, 0), num_columns - 1)
        slot = tl.load(state_indices + i_n * stride_idx_n + column * stride_idx_t)
    else:
        slot = tl.load(state_indices + i_n * stride_idx_n)
    return slot


@triton.jit
def tokens_to_run(num_accepted, i_n, live, T, OP: tl.constexpr):
    """How many of the T tokens update the state: the accepted count for a commit, T otherwise,
    0 for padding. Tokens past it are masked out rather than skipped: the count lives in device
    memory, and a loop bound read from memory is not available under Triton's interpreter."""
    if OP == OP_COMMIT:
        count = tl.where(live, tl.load(num_accepted + i_n), 0)
    else:
        count = tl.where(live, T, 0)
    return count


@triton.jit
def head_and_tile(V: tl.constexpr, BV: tl.constexpr):
    """(n * HV + hv, V-tile) of this program on a one-axis grid of N * HV * (V // BV) programs,
    the V-tile fastest: programs launched together read neighbouring pieces of one state."""
    pid = tl.program_id(0)
    return pid // (V // BV), pid % (V // BV)


@triton.jit
def tile_rows(i_v, BV: tl.constexpr, LV: tl.constexpr):
    """[LV, BV // LV]: the state columns v of this program's tile (v0 + lv * BV // LV + r)."""
    RV: tl.constexpr = BV // LV
    return i_v * BV + tl.arange(0, LV)[:, None] * RV + tl.arange(0, RV)[None, :]


@triton.jit
def channel_offsets(K: tl.constexpr, KL: tl.constexpr):
    """[K // KL, KL]: channel k = c * KL + j. Provably contiguous only in runs of 4, so that every
    load (bf16 inputs and pools too) takes 4 elements per lane and all blocks share the state's
    register layout; a bf16 load would otherwise take 8, get another layout, and Triton would
    convert the loop-carried state to it (measured: the reductions went back across all lanes)."""
    j = tl.arange(0, KL)
    j = (j // 4) * 4 + j % 4
    return tl.arange(0, K // KL)[:, None] * KL + j[None, :]


@triton.jit
def state_tile(i_hv, i_v, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, LV: tl.constexpr,
               KL: tl.constexpr):
    """Offsets of this program's slice ``pool[slot, hv, v0:v0+BV, :]`` inside one slot as a
    [LV, BV // LV, K // KL, KL] block: element (lv, r, c, j) is S[c * KL + j, v] with v from
    ``tile_rows``."""
    rows = tile_rows(i_v, BV, LV)
    return i_hv * (V * K) + rows[:, :, None, None] * K + channel_offsets(K, KL)[None, None, :, :]


@triton.jit
def load_state(pool, slot, stride_pool, tile, live):
    """The slot's ``state_tile`` block in float32; zeros for a padding row (nothing is read)."""
    return tl.load(pool + slot.to(tl.int64) * stride_pool + tile, mask=live, other=0.0).to(tl.float32)


@triton.jit
def load_buffer_row(buffer_rows, i_n, OP: tl.constexpr):
    """The buffer protocol's row for sequence ``i_n`` (unused by the other ops)."""
    row = 0
    if OP == OP_BUFFER:
        row = tl.load(buffer_rows + i_n)
    return row


@triton.jit
def store_token_state(h, t, i_n, live, pool, buffer, state_indices, buffer_row, tile,
                      stride_pool, stride_buf_r, stride_buf_t, stride_idx_n, stride_idx_t,
                      OP: tl.constexpr):
    """The buffer and slots protocols keep the state after every token."""
    if OP == OP_BUFFER:
        dst = buffer + buffer_row.to(tl.int64) * stride_buf_r + t * stride_buf_t + tile
        tl.store(dst, h.to(buffer.dtype.element_ty), mask=live)
    if OP == OP_SLOTS:
        slot = tl.load(state_indices + i_n * stride_idx_n + t * stride_idx_t)
        tl.store(pool + slot.to(tl.int64) * stride_pool + tile, h.to(pool.dtype.element_ty),
                 mask=live & (slot >= 0))


@triton.jit
def store_final_state(h, pool, slot, stride_pool, tile, count, OP: tl.constexpr):
    """Decode and commit write the final state back to the slot they read (a commit of 0 tokens
    writes nothing)."""
    if (OP == OP_DECODE) or (OP == OP_COMMIT):
        tl.store(pool + slot.to(tl.int64) * stride_pool + tile, h.to(pool.dtype.element_ty), mask=count > 0)


@triton.jit
def vector_offsets(K: tl.constexpr, LV: tl.constexpr, KL: tl.constexpr):
    """[LV, 1, K // KL, KL]: a K-vector laid out like a ``state_tile`` row, once per lane group."""
    return tl.zeros([LV, 1, 1, 1], dtype=tl.int32) + channel_offsets(K, KL)[None, None, :, :]


@triton.jit
def rows_dot(h, x):
    """[LV, BV // LV]: every tile row dotted with the K-vector x (chunks in registers, then lanes)."""
    return tl.sum(tl.sum(h * x, axis=2), axis=2)


@triton.jit
def load_head_vector(x, offset, active, factor, K: tl.constexpr, LV: tl.constexpr, KL: tl.constexpr,
                     L2NORM: tl.constexpr, ON_ROWS: tl.constexpr):
    """One token's q or k head (K values, unit stride) in float32 as [LV, 1, K // KL, KL], zeros
    when the token is inactive, to be multiplied by ``factor`` and l2-normalised when asked.
    Returns (vector, row factor [LV, 1]): with ON_ROWS the caller applies that scale to the
    row-sized results (a dot product, u), otherwise it is already in the vector and 1. Each lane
    holds BV // LV rows and K // (KL / 4) channels; ``tile_split`` picks the smaller side."""
    b_x = tl.load(x + offset + vector_offsets(K, LV, KL), mask=active, other=0.0).to(tl.float32)
    row_factor = tl.full([LV, 1], factor, dtype=tl.float32)
    if L2NORM:
        row_factor = row_factor * tl.rsqrt(rows_dot(b_x, b_x) + L2NORM_EPS)
    if not ON_ROWS:
        b_x = b_x * row_factor[:, :, None, None]
        row_factor = tl.full([LV, 1], 1.0, dtype=tl.float32)
    return b_x, row_factor


# ------------------------------------------------------------------------------------------------
# the delta-rule kernel


@triton.jit
def _softplus(x):
    # The decode's (and GDN's) softplus. chunk_triton's max(x, 0) + log(1 + e^-|x|) with the log on
    # the SFU made the decode 1.7-2.3% slower on an H200 (B = 64 / 256, bf16 pool), GDN and KDA
    # alike, and GDN's pending verify too (94.7 -> 101.8 us); KDA's verifies and commits take it
    # (``FAST_LOG``, BENCHMARKS 2026-11-28).
    return tl.where(x > SOFTPLUS_THRESHOLD, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))))


@triton.jit
def _token_log_decay(g, offset, offs_k, active, A, bias, lower_bound, PER_CHANNEL_GATE: tl.constexpr,
                     FUSED_GATE: tl.constexpr, SAFE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                     FAST_LOG: tl.constexpr):
    """A token's log decay: [LV, 1, K // KL, KL] per channel (KDA) or a scalar (GDN), from the
    prepared gate or the raw projection (``FusedGate``); 0 for an inactive token, whose update
    must leave the state bit-identical (decay exp(0) = 1, and u = 0 with k = 0)."""
    if PER_CHANNEL_GATE:
        b_g = tl.load(g + offset + offs_k, mask=active, other=0.0).to(tl.float32)
    else:
        b_g = tl.load(g + offset, mask=active, other=0.0).to(tl.float32)
    if FUSED_GATE:
        if HAS_DT_BIAS:
            b_g = b_g + bias
        if SAFE_GATE:
            b_g = lower_bound * tl.sigmoid(A * b_g)
        elif FAST_LOG:
            b_g = -A * _stable_softplus(b_g, True)
        else:
            b_g = -A * _softplus(b_g)
    return tl.where(active, b_g, 0.0)


@triton.jit
def _delta_rule_recurrent_kernel(
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
    scale, lower_bound,
    pool, buffer, state_indices, num_accepted, buffer_rows,
    stride_pool, stride_buf_r, stride_buf_t, stride_idx_n, stride_idx_t, num_columns,
    T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, LV: tl.constexpr, KL: tl.constexpr, NORM_ON_ROWS: tl.constexpr, OP: tl.constexpr,
    PER_CHANNEL_GATE: tl.constexpr, FUSED_GATE: tl.constexpr, SAFE_GATE: tl.constexpr, QK_L2NORM: tl.constexpr,
    BETA_LOGITS: tl.constexpr, SAVED_U: tl.constexpr, UNROLL: tl.constexpr, FAST_LOG: tl.constexpr,
    DECAYS: tl.constexpr,
):
    i_nh, i_v = head_and_tile(V, BV)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    offs_k = vector_offsets(K, LV, KL)
    offs_v = tile_rows(i_v, BV, LV)

    slot = read_slot(state_indices, num_accepted, i_n, stride_idx_n, stride_idx_t, num_columns, OP)
    live = slot >= 0
    count = tokens_to_run(num_accepted, i_n, live, T, OP)
    tile = state_tile(i_hv, i_v, K, V, BV, LV, KL)
    h = load_state(pool, slot, stride_pool, tile, live)  # h[lv, r, c, j] = S[c KL + j, offs_v[lv, r]]
    buffer_row = load_buffer_row(buffer_rows, i_n, OP)

    A = 1.0
    bias = 0.0
    if FUSED_GATE and not DECAYS:
        A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if dt_bias is not None:
            if PER_CHANNEL_GATE:
                bias = tl.load(dt_bias + i_hv * K + offs_k).to(tl.float32)
            else:
                bias = tl.load(dt_bias + i_hv).to(tl.float32)

    i_n64 = i_n.to(tl.int64)
    if TP > 0:
        # A deferred verify that first commits the previous verify's accepted tokens (as a commit
        # from saved u does), writes the state back as the pool holds it, and verifies from that.
        pending_count = tl.where(live, tl.load(num_accepted + i_n), 0)
        for t in tl.range(TP, loop_unroll_factor=UNROLL):
            active = t < pending_count
            k_t, k_norm = load_head_vector(pending_k, i_n64 * stride_pk_n + t * stride_pk_t + i_h * stride_pk_h,
                                           active, 1.0, K, LV, KL, QK_L2NORM, NORM_ON_ROWS)
            g_offset = i_n64 * stride_pg_n + t * stride_pg_t + i_hv * stride_pg_h
            # b_g: KDA's decay already formed with DECAYS (``channel_decays``; 1 for an inactive
            # token), else the log decay (the statements' order kept: see ``uses_channel_decays``)
            if DECAYS:
                b_g = tl.load(pending_g + g_offset + offs_k, mask=active, other=1.0)
            else:
                b_g = _token_log_decay(pending_g, g_offset, offs_k, active, A, bias, lower_bound, PER_CHANNEL_GATE,
                                       FUSED_GATE, SAFE_GATE, dt_bias is not None, FAST_LOG)
            u = tl.load(pending_u + i_n64 * stride_pu_n + t * stride_pu_t + i_hv * stride_pu_h + offs_v, mask=active,
                        other=0.0)
            if DECAYS:
                h = h * b_g
            else:
                h = h * tl.exp(b_g)
            h = h + (u * k_norm)[:, :, None, None] * k_t
        h = h.to(pool.dtype.element_ty).to(tl.float32)
        tl.store(pool + slot.to(tl.int64) * stride_pool + tile, h.to(pool.dtype.element_ty), mask=pending_count > 0)

    for t in tl.range(T, loop_unroll_factor=UNROLL):
        active = t < count
        k_t, k_norm = load_head_vector(k, i_n64 * stride_k_n + t * stride_k_t + i_h * stride_k_h, active,
                                       1.0, K, LV, KL, QK_L2NORM, NORM_ON_ROWS)
        u_off = i_n64 * stride_u_n + t * stride_u_t + i_hv * stride_u_h + offs_v
        g_offset = i_n64 * stride_g_n + t * stride_g_t + i_hv * stride_g_h
        if DECAYS:
            h = h * tl.load(g + g_offset + offs_k, mask=active, other=1.0)
        else:
            b_g = _token_log_decay(g, g_offset, offs_k, active, A, bias, lower_bound, PER_CHANNEL_GATE, FUSED_GATE,
                                   SAFE_GATE, dt_bias is not None, FAST_LOG)
            h = h * tl.exp(b_g)  # b_g: [LV, 1, K // KL, KL] (KDA) or a scalar (GDN)

        if (OP == OP_COMMIT) and SAVED_U:
            u = tl.load(saved_u + u_off, mask=active, other=0.0)
        else:
            b_v = tl.load(v + i_n64 * stride_v_n + t * stride_v_t + i_hv * stride_v_h + offs_v,
                          mask=active, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + i_n64 * stride_b_n + t * stride_b_t + i_hv * stride_b_h,
                             mask=active, other=0.0).to(tl.float32)
            if BETA_LOGITS:
                b_beta = tl.sigmoid(b_beta)
            b_beta = tl.where(active, b_beta, 0.0)
            u = b_beta * (b_v - rows_dot(h, k_t) * k_norm)
            if (OP == OP_DEFERRED) and SAVED_U:
                tl.store(saved_u + u_off, u)
        h = h + (u * k_norm)[:, :, None, None] * k_t

        if OP != OP_COMMIT:
            # padding rows have h = 0 and q = 0, so their output is exactly zero
            q_t, q_norm = load_head_vector(q, i_n64 * stride_q_n + t * stride_q_t + i_h * stride_q_h, active,
                                           scale, K, LV, KL, QK_L2NORM, NORM_ON_ROWS)
            b_o = rows_dot(h, q_t) * q_norm
            tl.store(o + i_n64 * stride_o_n + t * stride_o_t + i_hv * stride_o_h + offs_v,
                     b_o.to(o.dtype.element_ty))
        store_token_state(h, t, i_n, live, pool, buffer, state_indices, buffer_row, tile,
                          stride_pool, stride_buf_r, stride_buf_t, stride_idx_n, stride_idx_t, OP)

    store_final_state(h, pool, slot, stride_pool, tile, count, OP)


@triton.jit
def _channel_decay_kernel(g_first, g, A_log, dt_bias, decay, lower_bound, rows,
                          stride_first_n, stride_first_t, stride_first_h, stride_g_n, stride_g_t, stride_g_h,
                          T_FIRST: tl.constexpr, T: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, FUSED_GATE: tl.constexpr, SAFE_GATE: tl.constexpr,
                          HAS_DT_BIAS: tl.constexpr, FAST_LOG: tl.constexpr):
    """decay[n, t, hv, :] = exp(KDA's log decay (``_token_log_decay``)) of g_first[n, t, hv, :] for
    t < T_FIRST and of g[n, t - T_FIRST, hv, :] after, BLOCK_ROWS rows (n, t, hv) a program, into a
    contiguous float32 [N, T, HV, K]."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = row < rows
    n = row // (T * HV)
    t = row // HV % T
    hv = row % HV
    ks = tl.arange(0, K)
    A = 1.0
    bias = 0.0
    if FUSED_GATE:
        A = tl.exp(tl.load(A_log + hv, mask=live, other=0.0).to(tl.float32))[:, None]
        if HAS_DT_BIAS:
            bias = tl.load(dt_bias + hv[:, None] * K + ks[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    own = live & (t >= T_FIRST)
    offset = n.to(tl.int64) * stride_g_n + (t - T_FIRST) * stride_g_t + hv * stride_g_h
    log_decay = _token_log_decay(g, offset[:, None], ks[None, :], own[:, None], A, bias, lower_bound, True,
                                 FUSED_GATE, SAFE_GATE, HAS_DT_BIAS, FAST_LOG)
    if T_FIRST > 0:
        # a log decay is 0 where its token is inactive (``_token_log_decay``): the sum selects
        offset = n.to(tl.int64) * stride_first_n + t * stride_first_t + hv * stride_first_h
        log_decay += _token_log_decay(g_first, offset[:, None], ks[None, :], (live & (t < T_FIRST))[:, None], A,
                                      bias, lower_bound, True, FUSED_GATE, SAFE_GATE, HAS_DT_BIAS, FAST_LOG)
    tl.store(decay + row.to(tl.int64)[:, None] * K + ks[None, :], tl.exp(log_decay), mask=live[:, None])


# ------------------------------------------------------------------------------------------------
# launching (shape-only Python: safe inside CUDA-graph capture)


def device_guard(device: torch.device):
    """Triton launches on the current CUDA device; make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def block_v(N: int, HV: int, K: int, V: int, device: torch.device, op: str = "decode", mode: str = "gdn",
            state_dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(BV, num_warps) of ``op`` for a [N, HV] grid of heads with V columns each.

    One warp per program; BV grows from 4 while the grid keeps about 32K programs, then each op
    caps or raises it. Measured on an H200 (CUDA-graph replay, states from HBM, K = V = 128, 32
    value heads, one-axis grid; us at B = 64 / 256):
    - decode and commit (streaming read-modify-writes): at most 8 columns, as many small programs
      as the grid allows keep the most loads in flight. GDN float32 72.0 / 270.8 us (3.73 / 3.97
      TB/s) with 8 against 74.0 / 274.0 with 32; bfloat16 at B = 256 145.4 against 152.9, KDA
      145.4 against 177.4; 4 columns at B = 1.
    - GDN and KDA verifies from 2048 heads on (B >= 64): 16 columns, so that fewer programs repeat
      the per-token loads, norms and gates; except GDN's deferred verify on a float32 pool, which
      keeps 8 at B = 64 and 32 at B = 256 (with a pending commit, T = 4: 124.0 / 428.3 against
      132.1 / 470.5 with 16). With 16, T = 4 with a pending commit at B = 64: GDN bfloat16 112.4 ->
      101.7, KDA float32 166.0 -> 147.3, bfloat16 165.7 -> 137.3; at B = 256 against 32: GDN
      bfloat16 394.9 -> 378.5, KDA 606.0 -> 547.6 and 567.6 -> 535.6; the buffer verify, KDA
      bfloat16 B = 256, 663.4 -> 578.3 (8: 610.4), the others within 1 %. KDA's deferred verify
      reading ``channel_decays`` (2026-11-28, T = 4, verify + commit, B = 64 / 256, 16 columns
      against 8 and 32): bfloat16 112.8 / 404.6 against 121.6 / 451.1 and 120.3 / 427.3, float32
      158.9 / 559.0 against 164.7 / 592.8 and 161.6 / 566.4.
    - Lightning's verifies keep the grown width (bfloat16 B = 256 with a pending commit: 612.7 us
      with 32 against 689.7 with 16); its deferred verify takes 32 from 2048 heads (2026-11-27, B =
      64, T = 4 with a pending commit: bfloat16 187.6 -> 172.9, float32 258.3 -> 245.1; the buffer
      verify within 3 % at 8, 16 and 32).
    - KDA's commit (from saved u) from 2048 heads: 16 columns with a bfloat16 pool, 32 with a
      float32 one (2026-11-27, T = 4, deferred verify + commit, B = 64 / 256: bfloat16 152.2 / 567.1
      -> 142.9 / 538.3, float32 184.4 / 679.6 -> 179.6 / 650.5; GDN's and Lightning's commits keep
      8: GDN bfloat16 118.0 against 123.8 with 16).
    Two warps per program were slower everywhere, up to 8x (``tile_split`` lays out one warp's
    lanes); for decode, 2 / 4 / 8 warps on 8 columns each also in the plain layout (2026-11-27, GDN
    bfloat16 B = 64, per layer of a 16-layer graph: 62.2 / 95.9 / 52.8 us against 38.9 on one warp).
    So was a decode program per head (or half, quarter head) walking its V-tiles with the next
    tile's load issued ahead and q, k, the gate and beta taken once: 39.1-45.0 us against 38.5
    (float32 70.8-75.1 against 69.8). Wider K needs proportionally more threads to hold the K x BV
    slice in registers. The interpreter (CPU) runs programs one after another: there fewer, wider
    programs are faster.
    """
    if device.type != "cuda":
        return min(V, 32), 1
    bv = 4
    while bv < min(V, 32) and N * HV * (V // (2 * bv)) >= 32768:
        bv *= 2
    if op in ("decode", "commit"):
        bv = min(bv, 8)
        if op == "commit" and mode == "kda" and N * HV >= 2048:
            bv = 32 if state_dtype == torch.float32 else 16
    elif mode != "lightning" and N * HV >= 2048 and (
            op != "deferred" or mode == "kda" or state_dtype != torch.float32):
        bv = 16
    elif mode == "lightning" and op == "deferred" and N * HV >= 2048:
        bv = 32
    bv = min(bv, V)
    return bv, max(1, K * bv // 4096)


def fast_log(per_channel_gate: bool, op: str, input_dtype: torch.dtype) -> bool:
    """Whether a fused gate's softplus takes its log on the SFU (``chunk_triton._softplus``): KDA's
    verifies and commits with bf16 / fp16 inputs (an error of about 1e-7 in the log decay, far
    below their tolerance), not under the interpreter (no inline assembly). H200, B = 64, T = 4,
    us, libdevice log -> SFU: bfloat16 pool deferred verify + commit 139.6 -> 135.2, with a
    pending commit 135.9 -> 130.3, buffer 151.3 -> 146.3, slots 153.4 -> 148.8; float32 pool
    177.2 -> 175.5, 144.3 -> 132.9, 256.2 -> 254.7, 258.1 -> 254.8. The decode keeps
    ``_softplus``, and so does GDN (see there)."""
    return per_channel_gate and op != "decode" and input_dtype != torch.float32 and not triton.knobs.runtime.interpret


def register_cap(op: str, per_channel_gate: bool, pending: bool, state_dtype: torch.dtype) -> dict:
    """The launch option ``maxnreg`` where a cap pays: 128 registers for KDA with a bfloat16 pool,
    on its deferred verify with a pending commit (201 registers uncapped on an sm_90 compile, 9
    one-warp programs an SM; 128: 16, no spills) and on its commit. H200, T = 4, per layer of a
    16-layer graph, us, B = 64 / 256, with the gate formed in the kernel: pending verify 130.5 /
    498.3 -> 119.8 / 464.9; deferred verify + commit 135.3 / 518.5 -> 132.2 / 506.3 with the commit
    capped (136.2 / 519.9 with the verify capped instead); reading ``channel_decays``, the commit
    capped: 118.5 / 425.9 -> 114.0 / 407.7. Lost or tied elsewhere: float32 pool pending 133.1 ->
    134.6, commit 175.3 -> 218.8 (B = 64); GDN's pending verify (167 registers) 94.6 -> 94.4 with a
    bfloat16 pool, 122.5 -> 130.6 with a float32 one; caps of 104 or 96 lost everywhere, up to 4x
    at B = 256 (float32)."""
    if per_channel_gate and state_dtype != torch.float32 and (op == "commit" or (op == "deferred" and pending)):
        return dict(maxnreg=128)
    return {}


def uses_channel_decays(op: str, pending: bool, state_dtype: torch.dtype) -> bool:
    """Whether KDA's ``op`` reads its decays from ``channel_decays`` instead of forming the gate in
    the kernel, and then takes the split layout (``tile_split``): its commits, its deferred verifies
    and, with a bfloat16 pool, its verifies with a pending commit. H200, T = 4, per layer of a
    16-layer graph, us, B = 64 / 256, gate in the kernel -> decays read: deferred verify + commit
    bfloat16 pool 132.1 / 505.9 -> 113.7 / 407.8, float32 175.0 / 638.1 -> 159.7 / 561.9; pending
    verify, bfloat16 pool, 119.9 / 464.6 -> 117.8 / 445.6 in the plain layout, then 117.0 / 441.2
    -> 106.0 / 400.6 in the split one (the pending and new tokens' decays in one launch). A float32
    pool's pending verify keeps the gate in the kernel: reading decays it lost (131.9 / 485.0 ->
    144.7 / 543.4; 216 registers, and a reordering of its gate code alone took it from 132.9 to
    153.7 us, so its statements keep their old order). The buffer / slots verifies keep it too
    (bfloat16 146.4 / 563.4 -> 145.0 / 545.4, float32 254.8 / 986.7 -> 256.5 / 994.1: mixed), and
    the decode."""
    return op == "commit" or (op == "deferred" and (not pending or state_dtype != torch.float32))


def channel_decays(recipe, g: torch.Tensor, log_on_sfu: bool, pending_g: torch.Tensor | None = None) -> torch.Tensor:
    """KDA's per-channel decays exp(g) of g [N, T, HV, K] (the log decay, or the raw projection with
    ``recipe.fused_gate``, as the recurrent kernel reads it) as a new contiguous float32 [N, T, HV, K];
    ``log_on_sfu`` as ``fast_log``. With ``pending_g`` [N, TP, HV, K] (a pending commit's gates, same
    recipe) both in the same launch: [N, TP + T, HV, K], the pending tokens first.

    The verifies and commits read these instead of forming the gate in every program: a lane
    holds K / 32 channels in the plain layout but K / (KL / 4) in the split one, and all V / BV
    programs of a head repeat it, so with the gate formed in the kernel KDA kept the plain layout
    (``tile_split``) and its shuffle trees. One launch of N * (TP + T) * HV rows before the kernel
    (a verify with a pending commit in the split layout lost with one launch for each: H200, T = 4,
    bfloat16 pool, B = 64, 120.0 -> 127.9 us); 4 K bytes per token and value head, as long as the
    call (a deferred verify's saved u is 4 V)."""
    N, T, HV, K = g.shape
    T_first = 0 if pending_g is None else pending_g.shape[1]
    g_first = g if pending_g is None else pending_g
    A_log, dt_bias, lower_bound, gate_flags = _gate_params(recipe, g.device)
    decay = torch.empty(N, T_first + T, HV, K, dtype=torch.float32, device=g.device)
    rows = decay[..., 0].numel()
    block_rows = max(1, 2048 // K)
    with device_guard(g.device):
        _channel_decay_kernel[(triton.cdiv(rows, block_rows),)](
            g_first, g, A_log, dt_bias, decay, lower_bound, rows, *strides3(g_first), *strides3(g),
            T_FIRST=T_first, T=T_first + T, HV=HV, K=K, BLOCK_ROWS=block_rows, FAST_LOG=log_on_sfu, num_warps=4,
            **gate_flags,
        )
    return decay


def token_unroll(T: int, BV: int) -> int:
    """How far the token loop is unrolled (the next tokens' loads issue before this token's
    reductions finish). Measured on an H200, fp32 pool: at T = 4, B = 64 (8-column tiles) GDN
    verify 82.7 -> 80.1 us, commit 83.6 -> 79.2, KDA 118.0 -> 112.9 / 91.7 -> 86.5; at T = 8 the
    KDA commit went 131 -> 163 us and at B = 256 (32-column tiles) the KDA verify 422 -> 471
    (register pressure), so short loops over narrow tiles only."""
    return T if T <= 4 and BV <= 16 else 1


def tile_split(K: int, BV: int, plain: bool, op: str) -> dict:
    """LV (lane groups along V) and KL (channels per chunk) of the [LV, BV // LV, K // KL, KL]
    state block; see the module docstring. Reductions over K: 16 lanes x 4 channels along K, the
    rest of the warp along V; the plain [BV, K] layout for a commit and where ``plain`` (KDA with
    its gate formed in the kernel).

    NORM_ON_ROWS: q's and k's l2norm and q's scale multiply whichever a lane holds fewer of, its
    rows or its channels of the vector (H200, B = 64, T = 4, GDN verify: 86.4 -> 82.6 us on the
    rows; on the rows at B = 256, 32-column tiles, the bf16-pool decode went 161 -> 186 us).

    A deferred verify on tiles of 16 columns or more splits further, 8 lanes x 4 channels along K
    and the rest along V (H200, GDN verify + commit, T = 2 / 4 / 8, 32-column tiles: fp32 B = 256
    497 -> 476, 623 -> 560, 916 -> 792 us; bf16 B = 512 662 -> 632, 964 -> 869, 1657 -> 1393;
    16-column tiles, bf16, T = 4, 2026-11-27: B = 64 118.3 -> 109.7, B = 256 434.6 -> 396.0, with
    a pending commit 101.8 -> 98.2, 381.4 -> 359.0; 4 lanes along K lost: 112.5 / 117.4 at B = 64).
    Ops that store states keep 16 lanes along K: the buffer protocol lost 2-6 % with 8 (shorter
    store runs)."""
    if plain or op == "commit":
        LV, KL = 1, K
    else:
        KL = min(K, 32 if op == "deferred" and BV >= 16 else 64)
        LV = min(BV, 32 // (KL // 4))
    return dict(LV=LV, KL=KL, NORM_ON_ROWS=BV // LV < K // (KL // 4))


def protocol_args(op: str, *, state_pool, state_indices, num_accepted_tokens, intermediate_states,
                  intermediate_indices, T: int) -> dict:
    """Check the pool-side tensors of ``op`` and turn them into kernel arguments."""
    check_protocol(op, state_pool=state_pool, state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
                   intermediate_states=intermediate_states, intermediate_indices=intermediate_indices, T=T)
    buffer_strides = tuple(intermediate_states.stride()[:2]) if op == "buffer" else (0, 0)
    return dict(
        pool=state_pool, buffer=intermediate_states if op == "buffer" else None,
        state_indices=state_indices, num_accepted=num_accepted_tokens,
        buffer_rows=intermediate_indices if op == "buffer" else None,
        stride_pool=state_pool.stride(0), stride_buf_r=buffer_strides[0], stride_buf_t=buffer_strides[1],
        stride_idx_n=state_indices.stride(0), stride_idx_t=state_indices.stride(1) if state_indices.dim() == 2 else 0,
        num_columns=state_indices.shape[1] if state_indices.dim() == 2 else 1,
        OP=OPS.index(op),
    )


def delta_rule_recurrent(recipe, q, k, v, g, beta, *, op, state_pool, state_indices, out=None,
                         num_accepted_tokens=None, intermediate_states=None, intermediate_indices=None,
                         saved_u=None, pending=None):
    """Run the delta rule over T tokens of N sequences against the state pool (see the module
    docstring for what each ``op`` reads and writes).

    Args:
        recipe: the call's ``Recipe`` (mode "gdn" or "kda"; l2norm, fused gate, beta logits, scale).
        q, k: [N, T, H, K] bf16 / fp16 / fp32, any strides (q is None for op="commit").
        v: [N, T, HV, V], q's dtype, HV a multiple of H.
        g: [N, T, HV] (gdn) or [N, T, HV, K] (kda): log decay, or the raw gate projection when
           ``recipe.fused_gate`` is set. float32 (bf16 accepted).
        beta: [N, T, HV], or logits when ``recipe.beta_logits``.
        op: "decode", "buffer", "slots", "deferred" or "commit".
        state_pool: [P, HV, V, K] float32 / bfloat16, dims 1..3 contiguous.
        state_indices: int32 [N] (slots: [N, T_cols >= T]).
        out: [N, T, HV, V] in v's dtype (None for op="commit"); rows of padding get zeros.
        num_accepted_tokens: int32 [N]: for "slots" the previous step's accepted count (selects
           the read column), for "commit" the tokens to keep (0..T).
        intermediate_states, intermediate_indices: "buffer" only: [R, T_buf >= T, HV, V, K] in the
           pool dtype ([HV, V, K] contiguous) and int32 [N] rows.
        saved_u: optional float32 [N, T, HV, V] with unit last stride: "deferred" writes every
           token's u to it (padding rows get zeros), a "commit" of the same tokens reads it back
           instead of recomputing u.
        pending: "deferred" only: (k [N, TP, H, K], g, u) of a previous deferred verify of TP tokens
           of the same rows and slots with the same recipe, u its saved u (float32 [N, TP, HV, V]).
           Its first ``num_accepted_tokens[n]`` tokens (0..TP) are committed in this kernel before
           the verify, which starts from the committed state as the pool holds it: each state is
           read once and written once instead of a commit's read-modify-write plus a verify's read.
    """
    N, T, HV, V = v.shape
    H, K = k.shape[-2:]
    pending_k, pending_g, pending_u, TP = check_pending(op, pending, num_accepted_tokens, N, HV, V, saved_u=True)
    kernel_args = protocol_args(op, state_pool=state_pool, state_indices=state_indices,
                                num_accepted_tokens=None if pending is not None else num_accepted_tokens,
                                intermediate_states=intermediate_states, intermediate_indices=intermediate_indices,
                                T=T)
    if pending is not None:
        kernel_args["num_accepted"] = num_accepted_tokens
    per_channel = recipe.mode == "kda"
    gate = recipe.fused_gate
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    if per_channel:
        g = unit_last(g)
    dt_bias = None if gate is None or gate.dt_bias is None else gate.dt_bias.contiguous()
    target = output_target(out)
    check_saved_u(saved_u, op, (N, T, HV, V))
    from . import verify_wy_triton  # it imports this module's helpers
    if verify_wy_triton.applies(recipe, op, state_pool, saved_u, T, TP, K, V, k.dtype, N * HV):
        with device_guard(v.device):
            verify_wy_triton.wy_recurrent(recipe, q, k, v, g, beta, op=op, state_pool=state_pool,
                                          state_indices=state_indices, out=target,
                                          num_accepted_tokens=num_accepted_tokens, saved_u=saved_u,
                                          pending_k=pending_k, pending_g=pending_g, pending_u=pending_u, TP=TP)
        if target is not out:
            out.copy_(target)
        return out
    decays = per_channel and uses_channel_decays(op, pending is not None, state_pool.dtype)
    plain = per_channel and not decays
    log_on_sfu = fast_log(per_channel, op, k.dtype)
    if decays:
        g = channel_decays(recipe, g, log_on_sfu, pending_g)
        if pending is not None:
            pending_g, g = g[:, :TP], g[:, TP:]
    bv, num_warps = block_v(N, HV, K, V, v.device, op, recipe.mode, state_pool.dtype)
    with device_guard(v.device):
        _delta_rule_recurrent_kernel[(N * HV * (V // bv),)](
            q, k, v, g, beta, target, None if gate is None else gate.A_log.contiguous(), dt_bias, saved_u,
            pending_k, pending_g, pending_u,
            *strides3(q), *strides3(k), *strides3(v), *strides3(g), *strides3(beta), *strides3(target),
            *strides3(saved_u), *strides3(pending_k), *strides3(pending_g), *strides3(pending_u),
            T=T, TP=TP, scale=recipe.scale, **tile_split(K, bv, plain, op),
            lower_bound=gate.lower_bound if gate is not None and gate.lower_bound is not None else 0.0,
            H=H, HV=HV, K=K, V=V, BV=bv, PER_CHANNEL_GATE=per_channel, FUSED_GATE=gate is not None,
            SAFE_GATE=gate is not None and gate.lower_bound is not None, QK_L2NORM=recipe.qk_l2norm,
            BETA_LOGITS=recipe.beta_logits, SAVED_U=saved_u is not None, UNROLL=token_unroll(T, bv),
            FAST_LOG=log_on_sfu, DECAYS=decays,
            num_warps=num_warps, **register_cap(op, per_channel, pending is not None, state_pool.dtype),
            **kernel_args,
        )
    if target is not out:
        out.copy_(target)
    return out


# ------------------------------------------------------------------------------------------------
# buffer / slots commit: copy one saved state per sequence into its slot


@triton.jit
def _copy_committed_state_kernel(
    pool, source, state_indices, num_accepted, buffer_rows,
    stride_pool, stride_src_0, stride_src_1, stride_idx_n, stride_idx_t, num_columns,
    SLOT_SIZE: tl.constexpr, BLOCK: tl.constexpr, FROM_BUFFER: tl.constexpr,
):
    # the chunk fastest: CTAs launched together copy neighbouring pieces of one state
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i_n = tl.program_id(1)
    accepted = tl.load(num_accepted + i_n)
    dst = tl.load(state_indices + i_n * stride_idx_n)
    column = tl.minimum(tl.maximum(accepted - 1, 0), num_columns - 1)
    if FROM_BUFFER:
        # state after token a - 1 of the verify: buffer[rows[n], a - 1]
        row = tl.maximum(tl.load(buffer_rows + i_n), 0)
        src_offset = row.to(tl.int64) * stride_src_0 + column.to(tl.int64) * stride_src_1
        live = (dst >= 0) & (accepted > 0)
    else:
        # slots: column a - 1 holds it; with a = 1 it is already in column 0
        src_slot = tl.load(state_indices + i_n * stride_idx_n + column * stride_idx_t)
        src_offset = src_slot.to(tl.int64) * stride_src_0
        live = (dst >= 0) & (src_slot >= 0) & (accepted > 1)
    mask = live & (offs < SLOT_SIZE)
    # streamed: each byte is touched once (as ``bench_serving``'s copy ceiling does it)
    x = tl.load(source + src_offset + offs, mask=mask, cache_modifier=".cg")
    tl.store(pool + dst.to(tl.int64) * stride_pool + offs, x, mask=mask, cache_modifier=".cs")


def copy_committed_states(protocol, *, state_pool, state_indices, num_accepted_tokens,
                          intermediate_states=None, intermediate_indices=None):
    """The buffer / slots commit: per sequence n with a = num_accepted_tokens[n],

        "buffer": pool[state_indices[n]] = intermediate_states[intermediate_indices[n], a - 1]   (a >= 1)
        "slots":  pool[state_indices[n, 0]] = pool[state_indices[n, a - 1]]                     (a >= 2)

    state_pool [P, HV, V, K]; state_indices int32 [N] (buffer) or [N, T_cols] (slots);
    num_accepted_tokens int32 [N]; intermediate_states [R, T_buf, HV, V, K] in the pool dtype,
    intermediate_indices int32 [N]. Rows with a negative slot are untouched; a bit-exact copy.
    """
    check_state_layout("state_pool", state_pool, 1)
    N = state_indices.shape[0]
    slot_size = state_pool[0].numel()
    if protocol == "buffer":
        if state_indices.dim() != 1:
            raise ValueError(f"state_indices: expected [N], got {list(state_indices.shape)}")
        check_state_layout("intermediate_states", intermediate_states, 2)
        source, (stride_0, stride_1) = intermediate_states, intermediate_states.stride()[:2]
        num_columns, stride_idx_t = intermediate_states.shape[1], 0
    elif protocol == "slots":
        if state_indices.dim() != 2:
            raise ValueError(f"state_indices: expected [N, T_cols], got {list(state_indices.shape)}")
        source, stride_0, stride_1 = state_pool, state_pool.stride(0), 0
        num_columns, stride_idx_t = state_indices.shape[1], state_indices.stride(1)
    else:
        raise ValueError(f"protocol: a copy commit is 'buffer' or 'slots', got {protocol!r}")
    block = min(COMMIT_COPY_BLOCK, triton.next_power_of_2(slot_size))
    with device_guard(state_pool.device):
        _copy_committed_state_kernel[(triton.cdiv(slot_size, block), N)](
            state_pool, source, state_indices, num_accepted_tokens,
            intermediate_indices if protocol == "buffer" else None,
            state_pool.stride(0), stride_0, stride_1, state_indices.stride(0), stride_idx_t, num_columns,
            SLOT_SIZE=slot_size, BLOCK=block, FROM_BUFFER=protocol == "buffer", num_warps=COMMIT_COPY_WARPS,
        )
