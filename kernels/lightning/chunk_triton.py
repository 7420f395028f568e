"""Chunked prefill of Lightning attention in Triton: one kernel, one pass over the tokens.

The math is ``chunk_torch.py``'s (read its docstring first). With the constant log decay d <= 0
of a value head, chunk positions t = 0 .. L - 1 (L <= C = 64 valid tokens), q and k optionally
l2-normalised, and S0 the state entering the chunk:

    O     = scale (exp((t + 1) d) * Q) S0 + (scale Q K^T * exp((t - s) d), masked to s <= t) V
    S_out = exp(L d) S0 + (exp((L - 1 - s) d) * K)^T V

There is no delta rule, so no triangular solve and nothing to precompute per chunk: one program
per (sequence, value head, V tile), grid (N x V / BV, HV), walks its chunks with the state tile
S [K, BV] in float32 registers and does four products per chunk (Q K^T, Q S, (Q K^T) V, K^T V).
Every input byte is read once per V tile; the V tiles of a sequence and head run side by side
(``segments.program_ids``), so q and k come from HBM once and from L2 for the other tiles (H200,
64 heads 4 x 8192: 1.155 -> 1.041 ms against tiles in the slowest grid axis). o is written
once, and the state touches memory only at the start, the end and at requested checkpoints.
Unsegmented, q, k, v and o move through descriptors of each sequence's rows where their layout
allows (``kernels.common.tma``: TMA on sm_90, masked loads past the sequence's end for free).
Launches per call: one; where one long sequence (or a shard with few heads) would leave SMs
idle, three: the segments' final states from zero in parallel, their composition (Lightning's
segment map is the scalar exp(d L)) and the output pass per segment (``kernels.common.segments``).

All decays are exp of d times a token distance (t - s >= 0, t + 1, L - 1 - s >= 0): exact, never
above 1, with no cumulative sums to cancel.

Precision follows ``kernels.delta_rule.chunk_triton.precisions`` (whose device helpers and
launch configuration this module shares): float32 inputs run every product in tf32x3 (float32
accuracy on the tensor cores). bf16 inputs take Q K^T with the raw bf16 tiles (exact), Q S and
(Q K^T) V with bf16 operands (their rounding stays below the bf16 output's own) and the state
update K^T V as "bf16x2" (the state carries its error across chunks: the raw k tile times the
decayed v split into two bf16 parts, 16 bits of its mantissa kept); fp16 inputs take it in tf32.
Row factors (l2norm, decays) are applied to the [C, C] matrix or to V, so q and k enter the
tensor cores as loaded.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import segments
from ..common.chunking import CHUNK_SIZE
from ..common.prep import Recipe
from ..common.segments import program_ids, program_span
from ..common.tma import descriptor_ready, ensure_scratch_allocator
from ..delta_rule.chunk_triton import MAX_HEAD_DIM, _dot, _inv_norm, _load_rows, precisions, sequential_config

# Segments (kernels/common/segments.py): a transition is one product of the four, composing one
# multiply-add per state element, so many short segments pay (H200, TP4 shard 16 heads 1 x 32768:
# 3.88 ns per token-head unsegmented, 1.20 in 2048-token segments, 1.45 in 4096, 2.04 in 8192).
SEGMENT_MIN_TOKENS = 256
SEGMENT_PROGRAMS_PER_SM = 4


@triton.jit
def _lightning_kernel(
    q, k, v, decay, scale,
    cu_seqlens, state_indices, has_initial_state, checkpoint_indices, checkpoint_every, num_checkpoints,
    num_seqs, segment_tokens, initial,
    out, pool,
    s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_ot, s_oh, s_ov,
    s_ps, s_ph, s_pv, s_pk, s_cn, s_cj, s_in, s_ih, s_iv,
    GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, QK_L2NORM: tl.constexpr,
    HAS_SLOTS: tl.constexpr, HAS_POOL: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, HAS_CKPT: tl.constexpr,
    SEGMENTED: tl.constexpr, TRANSITION: tl.constexpr,
    PREC_IN: tl.constexpr, PREC_FAST: tl.constexpr, PREC_RAW: tl.constexpr, DESCRIPTORS: tl.constexpr,
):
    """One (sequence or segment, value head, V tile): S0, then per chunk the output and the
    state update of the module docstring.

    Not SEGMENTED: program 0 is a sequence, S0 from the pool, the final state to the pool.
    SEGMENTED (``kernels.common.segments``): program 0 is a segment of ``segment_tokens``. With
    TRANSITION, every segment but its sequence's last computes D, its final state from the pool
    state (first segment) or from zeros, with no outputs, into ``initial`` [segments, HV, V, K].
    Without, S0 is the pool state (first segment) or ``initial`` (the composed states), and the
    last segment writes the pool.

    DESCRIPTORS: q, k, v and out move through descriptors of the program's rows
    (``kernels.common.tma``; the launcher checks that they can be built), else through masked
    pointers."""
    pid, hv, v_tile = program_ids(V, BV)
    h = hv // GROUP
    ko = tl.arange(0, BK)
    vo = v_tile * BV + tl.arange(0, BV)
    kmask = ko < K
    vmask = vo < V
    rows = tl.arange(0, C)
    out_head = out + hv * s_oh
    out += hv * s_oh + vo[None, :] * s_ov
    live, n, slot, seq_bos, bos, eos, first, last = program_span(
        cu_seqlens, state_indices, num_seqs, pid, segment_tokens, out, s_ot, vmask, C, BV, HAS_SLOTS, SEGMENTED,
        TRANSITION)
    if live:
        state_mask = kmask[:, None] & vmask[None, :]
        state_offs = hv * s_ph + vo[None, :] * s_pv + ko[:, None] * s_pk  # S[k, v] = pool[slot, hv, v, k]
        initial_offs = pid.to(tl.int64) * s_in + hv * s_ih + vo[None, :] * s_iv + ko[:, None]
        S = tl.zeros([BK, BV], dtype=tl.float32)
        if first:
            if HAS_POOL:
                read = state_mask
                if HAS_INIT_FLAGS:
                    read = read & (tl.load(has_initial_state + n) != 0)
                S = tl.load(pool + slot * s_ps + state_offs, mask=read, other=0.0).to(tl.float32)
        elif not TRANSITION:
            S = tl.load(initial + initial_offs, mask=state_mask, other=0.0).to(tl.float32)
        q += h * s_qh
        k += h * s_kh
        v += hv * s_vh
        if DESCRIPTORS:
            rows_left = (eos - bos).to(tl.int32)
            q_rows = tl.make_tensor_descriptor(q + bos * s_qt, [rows_left, K], [s_qt, 1], [C, BK])
            k_rows = tl.make_tensor_descriptor(k + bos * s_kt, [rows_left, K], [s_kt, 1], [C, BK])
            v_rows = tl.make_tensor_descriptor(v + bos * s_vt, [rows_left, V], [s_vt, 1], [C, BV])
            out_rows = tl.make_tensor_descriptor(out_head + bos * s_ot, [rows_left, V], [s_ot, 1], [C, BV])
        d = tl.load(decay + hv).to(tl.float32)
        t = rows.to(tl.float32)
        # exp((t - s) d) on s <= t: the in-chunk decay matrix, the same for every chunk
        causal = rows[:, None] >= rows[None, :]
        D = tl.exp(tl.where(causal, t[:, None] - t[None, :], 0.0) * d)
        D = tl.where(causal, D, 0.0)
        for t0 in range(bos, eos, C):
            tok = t0 + rows
            rmask = tok < eos
            L = tl.minimum(eos - t0, C).to(tl.float32)
            if DESCRIPTORS:
                row = (t0 - bos).to(tl.int32)
                kk = k_rows.load([row, 0])
                vv = v_rows.load([row, v_tile * BV])
            else:
                kk = _load_rows(k, tok, rmask, s_kt, s_kk, K, BK)
                vv = tl.load(v + tok[:, None] * s_vt + vo[None, :] * s_vv, mask=rmask[:, None] & vmask[None, :],
                             other=0.0)
            rk = _inv_norm(kk, QK_L2NORM)
            if not TRANSITION:
                if DESCRIPTORS:
                    qq = q_rows.load([row, 0])
                else:
                    qq = _load_rows(q, tok, rmask, s_qt, s_qk, K, BK)
                rq = _inv_norm(qq, QK_L2NORM) * scale
                A = _dot(qq, tl.trans(kk), PREC_IN) * (D * rq[:, None] * rk[None, :])
                o = _dot(qq, S, PREC_FAST) * (rq * tl.exp((t + 1.0) * d))[:, None] + _dot(A, vv, PREC_FAST)
                if DESCRIPTORS:
                    out_rows.store([row, v_tile * BV], o.to(out.dtype.element_ty))
                else:
                    tl.store(out + tok[:, None] * s_ot, o.to(out.dtype.element_ty), mask=rmask[:, None] & vmask[None, :])
            # distances clamped at 0: rows past L hold zero k and v, and must not overflow to inf * 0
            v_dec = vv.to(tl.float32) * (rk * tl.exp(tl.maximum(L - 1.0 - t, 0.0) * d))[:, None]
            S = S * tl.exp(L * d) + _dot(tl.trans(kk), v_dec, PREC_RAW)
            if HAS_CKPT and not TRANSITION:
                # the state after (j + 1) * checkpoint_every tokens of the sequence, at full chunk ends only
                done = t0 + C - seq_bos
                j = done // checkpoint_every - 1
                due = (done % checkpoint_every == 0) & (t0 + C <= eos) & (j < num_checkpoints)
                ck = tl.load(checkpoint_indices + n * s_cn + j * s_cj, mask=due, other=-1).to(tl.int64)
                tl.store(pool + ck * s_ps + state_offs, S.to(pool.dtype.element_ty), mask=state_mask & (ck >= 0))
        if TRANSITION:
            tl.store(initial + initial_offs, S, mask=state_mask)
        elif HAS_POOL:
            if last:
                tl.store(pool + slot * s_ps + state_offs, S.to(pool.dtype.element_ty), mask=state_mask)


def planned_segment_tokens(T: int, N: int, HV: int, V: int, device: torch.device, requested: int | None = None) -> int:
    """Tokens per segment that ``lightning_prefill`` cuts this batch into (0: none), from shapes
    alone (``segments.segment_tokens`` with Lightning's constants)."""
    return segments.segment_tokens(T, N, HV, V, segments.sm_count(device), min_tokens=SEGMENT_MIN_TOKENS,
                                   programs_per_sm=SEGMENT_PROGRAMS_PER_SM, requested=requested)


def lightning_prefill(recipe: Recipe, q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices,
                      has_initial_state, out, checkpoint_every=None, checkpoint_indices=None, segment_tokens=None):
    """Chunked prefill of Lightning attention over a packed varlen batch
    (``torch_backend.prefill`` semantics).

    q, k:   [T, H, K] bf16 / fp16 / fp32, any strides (raw if ``recipe.qk_l2norm``).
    v:      [T, HV, V], q's dtype; HV a multiple of H (value head hv reads qk head hv // (HV // H)).
    g:      [HV], the per-head log decay d <= 0 (float32 / bf16). beta: None.
    cu_seqlens, state_pool, state_indices, has_initial_state, out, checkpoint_every,
    checkpoint_indices, segment_tokens: as for ``kernels.delta_rule.chunk_triton.delta_rule_prefill``
            (Lightning's segment map is the scalar exp(d * segment_tokens): no map columns).
    K, V <= 256. Returns ``out``.
    """
    if recipe.mode != "lightning":
        raise ValueError(f"lightning_prefill: mode {recipe.mode!r} is not lightning")
    if beta is not None:
        raise ValueError("lightning_prefill: beta is not used by lightning")
    T, H, K = q.shape
    HV, V = v.shape[1:]
    N = cu_seqlens.shape[0] - 1
    C = CHUNK_SIZE
    if max(K, V) > MAX_HEAD_DIM:
        raise ValueError(f"head dims K={K}, V={V}: the Triton prefill supports at most {MAX_HEAD_DIM}")
    if checkpoint_every and checkpoint_every % C:
        raise ValueError(f"checkpoint_every={checkpoint_every}: must be a multiple of {C}")
    device = q.device
    BK = max(triton.next_power_of_2(K), 16)
    prec = precisions(q.dtype)
    dummy_i32 = torch.empty(1, dtype=torch.int32, device=device)
    has_pool = state_pool is not None
    ckpt = checkpoint_indices if has_pool and checkpoint_every else None
    args = (q, k, v, g, recipe.scale,
            cu_seqlens, state_indices if state_indices is not None else dummy_i32,
            has_initial_state if has_initial_state is not None else dummy_i32,
            ckpt if ckpt is not None else dummy_i32, checkpoint_every or C, ckpt.shape[1] if ckpt is not None else 0)
    tail = (out, state_pool if has_pool else out,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            *(state_pool.stride() if has_pool else (0, 0, 0, 0)), *(ckpt.stride() if ckpt is not None else (0, 0)))
    flags = dict(GROUP=HV // H, K=K, V=V, BK=BK, C=C, QK_L2NORM=recipe.qk_l2norm,
                 HAS_SLOTS=state_indices is not None, HAS_POOL=has_pool,
                 HAS_INIT_FLAGS=has_pool and has_initial_state is not None, HAS_CKPT=ckpt is not None,
                 # the state update is the raw k tile times the decayed v: PREC_RAW, "bf16x2" for bf16
                 # inputs (more accurate than tf32 and lighter on registers; H200, 64 heads, device
                 # time per token-head: 4 x 8192 0.497 -> 0.472 ns, TP4 1 x 8192 1.264 -> 1.116)
                 PREC_IN=prec["PREC_IN"], PREC_FAST=prec["PREC_FAST"], PREC_RAW=prec["PREC_RAW"])

    launch = sequential_config(BK, V, prec["PREC_FAST"])
    if prec["PREC_FAST"] == "bf16":
        # No product here waits on another chunk's loads (the delta rule's U = U~ - W S does), so
        # prefetching the next chunk pays. H200, 64 heads, bf16, device time per token-head with
        # the bf16x2 state update, 2 stages against 3: 4 x 8192 0.475 -> 0.423 ns, 8 x 1024 0.547
        # -> 0.461, TP4 16 heads 1 x 8192 (segmented) 1.114 -> 1.019 (with the tf32 update three
        # had won). At K = 256 one stage is also wrong: Triton 3.6's sm_90 code for it gave
        # outputs off by 100% there (the interpreter ran it exactly); two compute correctly.
        launch = dict(launch, num_stages=2)
    tokens = planned_segment_tokens(T, N, HV, V, device, segment_tokens)
    if not tokens:
        # Rows through descriptors where they can be built. H200, 64 heads, bf16, device time per
        # token-head against masked pointers: 4 x 8192 0.418 -> 0.377 ns, 8 x 1024 0.459 -> 0.449.
        # Segments keep pointers (TP4 16 heads 1 x 8192: 1.009 -> 1.038 with descriptors).
        descriptors = descriptor_ready(q, k, v, out)
        if descriptors:
            ensure_scratch_allocator()
        _lightning_kernel[segments.state_grid(N, HV, V, launch["BV"])](
            *args, N, 0, out, *tail, 0, 0, 0, SEGMENTED=False, TRANSITION=False, DESCRIPTORS=descriptors,
            **launch, **flags)
        return out

    # in-card context parallelism (kernels/common/segments.py): transitions, composition, outputs
    num_ids = segments.num_segment_ids(T, N, tokens)
    grid = segments.state_grid(num_ids, HV, V, launch["BV"])
    transitions = torch.empty(num_ids, HV, V, K, dtype=torch.float32, device=device)
    _lightning_kernel[grid](*args, N, tokens, transitions, *tail, *transitions.stride()[:3],
                            SEGMENTED=True, TRANSITION=True, DESCRIPTORS=False, **launch, **flags)
    initial = torch.empty_like(transitions)
    segments.compose_initial_states(cu_seqlens, state_indices, transitions, initial,
                                    tokens=tokens, V=V, decay=g)
    _lightning_kernel[grid](*args, N, tokens, initial, *tail, *initial.stride()[:3],
                            SEGMENTED=True, TRANSITION=False, DESCRIPTORS=False, **launch, **flags)
    return out
