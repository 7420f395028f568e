"""In-card context parallelism: long sequences cut into segments that run on the SMs in parallel.

A chunked prefill walks each sequence's chunks in order, one program per (sequence, value head,
V tile), because every chunk needs the state the chunk before it left. One long sequence (or a
tensor-parallel shard with few heads) then gives the GPU a few dozen programs and leaves most
SMs idle. The fix is exact, not an approximation (DESIGN section 5): a segment maps the state it
receives affinely,

    S_out = A S_in + D          S [K, V]; D the segment's final state from a zero start;
                                A [K, K] for the delta rule, exp(d L) I for Lightning (L tokens)

so the segments' (A, D) can be computed in parallel and composed afterwards. Three launches:

1. Transitions, grid (segment x state tile, value head), all segments but each sequence's last:
   the prefill's state pass without outputs. A first segment starts from its pool state, so its
   D already carries it (no A needed). Any other segment starts from [0 | I]: the delta rule's
   state widened by K columns that start as the identity and see zero values (the map columns of
   ``kernels.delta_rule.chunk_triton``), which end as A^T; Lightning's A is a known scalar.
   Results go to ``transitions`` [segments, HV, V (+ K), K], K-last like the pool.
2. Composition, ``compose_initial_states``, grid (sequence, value head, V tile): the serial part,
   one small step per segment, S_{j+1} = A_j S_j + D_j (S_1 = D_0), into ``initial``
   [segments, HV, V, K]. In K-last rows X = S^T this reads X_{j+1} = X_j A_j^T + D_j^T, and the
   map columns hold exactly A_j^T: one [BV, K] x [K, K] product per step. Lightning's scalar A
   costs nothing to apply, so its chain would wait on each D_j's load; four load together instead.
3. The prefill's ordinary state pass with outputs, grid (segment x V tile, value head), each
   segment from its pool state (first) or its composed initial state; the last writes the pool,
   every segment writes the checkpoints that fall inside it.

The work of the state pass roughly doubles for the delta rule (its transitions carry K more
columns) and grows by a quarter for Lightning (one product of four); it pays where the
unsegmented pass would leave SMs idle, which ``segment_tokens`` decides from shapes alone.

The CuTe DSL GDN and KDA prefills (``kernels/delta_rule/chunk_cute.py``) need no third launch:
their one state pass computes every segment's transition and outputs together, from zeros (value
rows) and the identity (map rows, whose outputs are the carried queries q~); then
``affine_output.join_segments`` writes the final states (composition with ``final_pool``) and adds
q~ S to the outputs of the segments that continue a sequence (in one launch where no sequence has
more than two segments). ``one_pass_segment_tokens`` is their rule.

Segments are ``segment_tokens`` long (a multiple of the chunk size, so chunk boundaries and
checkpoints fall where they fall without segments), the last one of a sequence shorter; an empty
sequence has one empty segment, whose program writes its slot as an unsegmented one would. Segment
ids follow the packed order (sequence 0's segments first); every program finds its own from
``cu_seqlens`` (``segment_span``), so the grid is sized by the bound T // segment_tokens + N and
no table is built on the host or in an extra launch. Host work matters: on an H200 the
three-launch scheme's segmented GDN 1 x 2048 took the same device time as the unsegmented one
(0.27 ms) and about twice its eager time; the one-pass scheme adds one launch, or two past two
segments.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunking import CHUNK_SIZE
from .varlen import SEQ_BLOCK, locate_pieces, max_chunks, piece_counts

# below this mean length the segmented pass's two more launches cost more host time than they save
MIN_SEQUENCE_TOKENS = 4096
# the delta rule's composition launch: rows of X a program, warps, pipelined loads. H200, graph replay,
# L2 flushed: a TP4 shard (8 heads, eight 1024-token segments) 62 -> 26 us against SMALL_COMPOSE_LAUNCH
# (the loads of A_j then waited in each step), 32 heads in two segments 18 -> 16 us. Three stages of
# the float32 [K, K] map take about 216 KB of shared memory (64 rows asked for 320 KB): GPUs with
# less than Hopper's 227 KB a block keep the one-stage launch
COMPOSE_LAUNCH = dict(BV=16, num_warps=8, num_stages=3)
SMALL_COMPOSE_LAUNCH = dict(BV=32, num_warps=4, num_stages=1)


def sm_count(device) -> int:
    """The multiprocessors of a CUDA ``device``; 0 elsewhere (no segments unless requested)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def requested_segment_tokens(requested) -> int:
    """A caller's ``segment_tokens``: 0 (never) or a positive multiple of the chunk size, checked."""
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0 or requested % CHUNK_SIZE:
        raise ValueError(f"segment_tokens: expected 0 (no segments) or a positive multiple of {CHUNK_SIZE}, "
                         f"got {requested!r}")
    return requested


def segment_tokens(num_tokens: int, num_seqs: int, num_heads: int, V: int, num_sms: int, *, min_tokens: int,
                   programs_per_sm: int, requested: int | None = None) -> int:
    """Tokens per segment, or 0 for no segments, from shapes alone (no host synchronisation).

    num_tokens, num_seqs: the packed batch. num_heads, V: value heads and state columns (the
    state pass runs one program per 64 of them). num_sms: the GPU's SMs (0: not a GPU, no
    segments unless requested). min_tokens: the shortest segment worth its composition step.
    programs_per_sm: how many programs the family's segmented passes want (fewer where the
    transitions cost more). requested: the caller's choice (0: never; a positive multiple of the
    chunk size: that length), overriding the rule.

    The rule: segment only when the unsegmented pass would leave SMs without a program (it runs
    best with one or two per SM: on an H200, GDN 4 x 8192 at 256 programs lost 2.58 -> 2.88-4.80
    ns per token-head when cut into segments), then cut the batch's tokens into about
    ``programs_per_sm`` programs per SM, and only where the mean sequence is MIN_SEQUENCE_TOKENS
    long or more and holds two segments (a 2048-token sequence cut in four lost: 4.27 -> 5.96-8.49
    eager, the same device time plus two launches of host work).
    """
    if requested is not None:
        return requested_segment_tokens(requested)
    per_segment = num_heads * triton.cdiv(V, 64)
    if not num_sms or num_seqs * per_segment >= num_sms:
        return 0
    segments = triton.cdiv(programs_per_sm * num_sms, per_segment)
    tokens = max(triton.cdiv(triton.cdiv(num_tokens, segments), CHUNK_SIZE) * CHUNK_SIZE, min_tokens)
    long_enough = num_tokens >= num_seqs * max(MIN_SEQUENCE_TOKENS, 2 * tokens)
    return tokens if long_enough else 0


# The one-pass scheme (the CuTe DSL GDN and KDA prefills, module docstring) cuts a batch where its
# longest CTA gets this many tokens shorter, in segments of at least ONE_PASS_MIN_SEGMENT_TOKENS
# (each later segment costs a CTA of map rows and its share of the join). The rule minimises device
# time (what a CUDA graph replays, and what an eager prefill waits for once the host runs ahead);
# the eager call's host work grows by the join's launch. H200, graph replay, 32 GDN heads, us,
# unsegmented against the rule: 1 x 1024 60.8 / 58.5, 1 x 2048 106.2 / 87.7, 1 x 3072 151.6 / 118.0;
# a TP4 shard of 8 heads 1 x 1024 59.1 / 47.5, 1 x 2048 104.7 / 61.2 (segments of 256: 61.3); 16
# heads 1 x 2048 105.2 / 69.7; KDA 8 heads 1 x 2048 127.8 / 96.5 (256: 101.7), 32 heads 1 x 2048
# 205.5 / 196.2, 1 x 1024 115.6 / 119.4 (its one loss).
ONE_PASS_MIN_SAVED_TOKENS = 512
ONE_PASS_MIN_SEGMENT_TOKENS = 512


def one_pass_segment_tokens(num_tokens: int, num_seqs: int, num_heads: int, num_sms: int, *,
                            checkpoints: bool = False, requested: int | None = None) -> int:
    """Tokens per segment of the one-pass scheme, 0 for none, from shapes alone (no host
    synchronisation).

    requested: None (this rule), 0 (never) or a positive multiple of the chunk size (that length;
    not with checkpoints, which the one-pass segments do not write). The rule: one CTA per
    (sequence, value head) runs a chunk in about the same time wherever it is, so a batch that
    leaves SMs idle is cut into s segments per sequence, 2 s - 1 CTAs per head (a segment that
    continues a sequence also runs its K map rows), as many as fit in one wave (s >= 2), each at
    least ONE_PASS_MIN_SEGMENT_TOKENS long, where that shortens the mean sequence's path by
    ONE_PASS_MIN_SAVED_TOKENS or more."""
    if requested is not None:
        tokens = requested_segment_tokens(requested)
        if tokens and checkpoints:
            raise ValueError(f"segment_tokens={requested}: one-pass segments (the CuTe DSL GDN and KDA prefills) "
                             "write no checkpoints (give 0 or None, or the triton backend)")
        return tokens
    if checkpoints or not num_sms or not num_seqs:
        return 0
    pieces = (num_sms // (num_seqs * num_heads) + 1) // 2
    tokens = max(triton.cdiv(num_tokens, num_seqs * max(pieces, 1) * CHUNK_SIZE) * CHUNK_SIZE,
                 ONE_PASS_MIN_SEGMENT_TOKENS)
    saved = num_tokens / num_seqs - tokens
    return tokens if pieces >= 2 and saved >= ONE_PASS_MIN_SAVED_TOKENS else 0


def num_segment_ids(num_tokens: int, num_seqs: int, tokens: int) -> int:
    """Segment ids of a packed batch (an upper bound: ids past the last segment are idle), the
    grid size of a launch over segments."""
    return max_chunks(num_tokens, num_seqs, tokens)


@triton.jit
def segment_span(cu_seqlens, num_seqs, sid, tokens):
    """Tokens of segment ``sid``: (live, sequence, the sequence's first token, the segment's first
    token, its end, first segment of its sequence, last segment). Not live: ids past the last
    segment (then the span is empty). A sequence has max(1, ceil(length / tokens)) segments: an
    empty one has an empty segment, whose program writes its slot as the unsegmented pass does.
    O(N) per program (``locate_pieces``), for the few long sequences that are segmented."""
    seq, j = locate_pieces(cu_seqlens, num_seqs, sid + tl.zeros([1], dtype=tl.int32), tokens, True)
    seq = tl.sum(seq, 0)
    j = tl.maximum(tl.sum(j, 0), 0)
    live = seq >= 0
    n = tl.maximum(seq, 0)
    seq_bos = tl.load(cu_seqlens + n).to(tl.int64)
    seq_eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    bos = seq_bos + j.to(tl.int64) * tokens
    eos = tl.where(live, tl.minimum(bos + tokens, seq_eos), bos)
    return live, n, seq_bos, bos, eos, j == 0, eos == seq_eos


def state_grid(programs: int, heads: int, V: int, BV: int) -> tuple[int, int]:
    """The launch grid of a state pass over ``programs`` sequences or segments, ``heads`` value
    heads and V state columns in tiles of BV, in the layout ``program_ids`` reads."""
    return programs * triton.cdiv(V, BV), heads


@triton.jit
def program_ids(V: tl.constexpr, BV: tl.constexpr):
    """(sequence or segment, value head, V tile) of a state-pass program, grid
    (programs x V tiles, value heads). The V tiles of one sequence and head are neighbours in
    launch order, so they run together and the q and k rows they all read (and the delta rule's
    W and P) come from HBM once, then from L2."""
    tiles: tl.constexpr = (V + BV - 1) // BV
    return tl.program_id(0) // tiles, tl.program_id(1), tl.program_id(0) % tiles


@triton.jit
def program_span(cu_seqlens, state_indices, num_seqs, pid, tokens, out, s_ot, vmask,
                 C: tl.constexpr, BV: tl.constexpr, HAS_SLOTS: tl.constexpr, SEGMENTED: tl.constexpr,
                 TRANSITION: tl.constexpr):
    """What state-pass program ``pid`` works on: (live, sequence, its slot, the sequence's first
    token, the program's first token, its end, first segment, last segment). Program ``pid`` is
    sequence ``pid`` (not SEGMENTED: first and last) or segment ``pid`` (``segment_span``).

    Padding sequences (negative slot) are not live; outside TRANSITION their output rows are
    zeroed here (``out`` at the program's head and V tile, rows strided by ``s_ot``), the pool is
    neither read nor written. With TRANSITION a sequence's last segment is not live either."""
    if SEGMENTED:
        live, n, seq_bos, bos, eos, first, last = segment_span(cu_seqlens, num_seqs, pid, tokens)
    else:
        n = pid
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
        live, seq_bos, first, last = n >= 0, bos, n >= 0, n >= 0
    if HAS_SLOTS:
        slot = tl.load(state_indices + n).to(tl.int64)
    else:
        slot = n.to(tl.int64)
    if TRANSITION:
        live = live & (last == 0)
    elif live & (slot < 0):
        rows = tl.arange(0, C)
        for t0 in range(bos, eos, C):
            tok = t0 + rows
            tl.store(out + tok[:, None] * s_ot, tl.zeros([C, BV], dtype=out.dtype.element_ty),
                     mask=(tok < eos)[:, None] & vmask[None, :])
    return live & (slot >= 0), n, slot, seq_bos, bos, eos, first, last


@triton.jit
def compose_program(cu_seqlens, state_indices, tokens, n, tile, K: tl.constexpr, V: tl.constexpr,
                    BV: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """A composition program's (V rows, K columns, row mask) for sequence n and V tile ``tile``, and
    its sequence's (live, count, sid): whether it has segments to compose (more than one, and a
    slot when there are slots), how many, and its first segment's id (the segments of the
    sequences before it)."""
    vo = tile * BV + tl.arange(0, BV)
    length = tl.load(cu_seqlens + n + 1) - tl.load(cu_seqlens + n)
    count = (length + tokens - 1) // tokens
    live = count > 1
    if HAS_SLOTS:
        live = live & (tl.load(state_indices + n) >= 0)
    sid = 0
    for n0 in range(0, n, SEQ_BLOCK):
        before, counts = piece_counts(cu_seqlens, n0, n, tokens, True)
        sid += tl.sum(counts, 0)
    return vo, tl.arange(0, K), (vo < V)[:, None], live, count, sid.to(tl.int64)


@triton.jit
def _compose_kernel(cu_seqlens, state_indices, transitions, initial, tokens, pool,
                    s_tn, s_th, s_tv, s_in, s_ih, s_iv, s_ps, s_ph, s_pv,
                    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HAS_SLOTS: tl.constexpr,
                    FINAL: tl.constexpr):
    """The delta rule's composition, one (sequence, value head, V tile): X_{j+1} = X_j A_j^T +
    D_j^T over the sequence's segments (module docstring), rows vo of X = S^T, float32. FINAL:
    the last segment's transition too, X_count, into the sequence's slot of ``pool``."""
    n, hv = tl.program_id(0), tl.program_id(1)
    vo, ko, vmask, live, count, sid = compose_program(cu_seqlens, state_indices, tokens, n, tl.program_id(2),
                                                      K, V, BV, HAS_SLOTS)
    if live:
        transitions += hv * s_th
        initial += hv * s_ih
        rows = vo[:, None] * s_tv + ko[None, :]
        X = tl.load(transitions + sid * s_tn + rows, mask=vmask, other=0.0)  # D_0: from the pool state
        tl.store(initial + (sid + 1) * s_in + vo[:, None] * s_iv + ko[None, :], X, mask=vmask)
        # no load depends on the chain, so the loop pipelines them ahead of its products
        for j in range(1, count - 1 + FINAL):
            base = transitions + (sid + j) * s_tn
            D = tl.load(base + rows, mask=vmask, other=0.0)
            A_t = tl.load(base + (V + ko)[:, None] * s_tv + ko[None, :])  # [K, K]: A_j^T
            X = tl.dot(X, A_t, input_precision="tf32x3") + D
            tl.store(initial + (sid + j + 1) * s_in + vo[:, None] * s_iv + ko[None, :], X, mask=vmask & (j < count - 1))
        if FINAL:
            if HAS_SLOTS:
                slot = tl.load(state_indices + n).to(tl.int64)
            else:
                slot = n.to(tl.int64)
            tl.store(pool + slot * s_ps + hv * s_ph + vo[:, None] * s_pv + ko[None, :], X.to(pool.dtype.element_ty),
                     mask=vmask)


@triton.jit
def _segment_final(transitions, j, end, rows, s_tn, vmask):
    """D_j, the final state of segment j from zero (rows of a [BV, K] tile); zero for j >= end."""
    return tl.load(transitions + j * s_tn + rows, mask=vmask & (j < end), other=0.0)


@triton.jit
def _composed(X, initial, j, end, out_rows, s_in, vmask):
    """X_{j+1} into ``initial`` (only for j < end); returns it."""
    tl.store(initial + (j + 1) * s_in + out_rows, X, mask=vmask & (j < end))
    return X


@triton.jit
def _scalar_compose_kernel(cu_seqlens, state_indices, transitions, initial, decay, tokens,
                           s_tn, s_th, s_tv, s_in, s_ih, s_iv,
                           K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """Lightning's composition, one (sequence, value head, V tile): X_{j+1} = c X_j + D_j with the
    scalar map c = exp(d tokens) of a full segment. The D_j do not depend on the chain, so four of
    them load together before four steps use them: the chain waits on memory once per four
    segments instead of once per segment (a loop of single steps took 29 us for the 16 segments of
    a TP4 shard, 16 heads 1 x 8192, on an H200)."""
    hv = tl.program_id(1)
    vo, ko, vmask, live, count, sid = compose_program(cu_seqlens, state_indices, tokens, tl.program_id(0),
                                                      tl.program_id(2), K, V, BV, HAS_SLOTS)
    if live:
        rows = vo[:, None] * s_tv + ko[None, :]
        out_rows = vo[:, None] * s_iv + ko[None, :]
        transitions += hv * s_th + sid * s_tn
        initial += hv * s_ih + sid * s_in
        end = count - 1  # transitions D_1 .. D_{count-2} are composed; the last segment's is not needed
        X = _composed(_segment_final(transitions, 0, end, rows, s_tn, vmask), initial, 0, end, out_rows, s_in, vmask)
        c = tl.exp(tl.load(decay + hv).to(tl.float32) * tokens)  # every segment but the last is full
        for j in range(1, end, 4):
            D0 = _segment_final(transitions, j, end, rows, s_tn, vmask)
            D1 = _segment_final(transitions, j + 1, end, rows, s_tn, vmask)
            D2 = _segment_final(transitions, j + 2, end, rows, s_tn, vmask)
            D3 = _segment_final(transitions, j + 3, end, rows, s_tn, vmask)
            X = _composed(X * c + D0, initial, j, end, out_rows, s_in, vmask)
            X = _composed(X * c + D1, initial, j + 1, end, out_rows, s_in, vmask)
            X = _composed(X * c + D2, initial, j + 2, end, out_rows, s_in, vmask)
            X = _composed(X * c + D3, initial, j + 3, end, out_rows, s_in, vmask)


def compose_initial_states(cu_seqlens, state_indices, transitions, initial, *, tokens: int, V: int, decay=None,
                           final_pool=None):
    """Launch 2 of the module docstring: every non-first segment's initial state into ``initial``.

    cu_seqlens: int32 [N + 1]; state_indices: int32 [N] or None (negative: padding, skipped);
    transitions: float32 [S, HV, V + K, K] (delta rule: D then A^T) or [S, HV, V, K] with
    ``decay`` [HV] (Lightning: A = exp(decay * tokens)); initial: float32 [S, HV, V, K], written
    at the non-first segments of live sequences. S = ``num_segment_ids``.
    final_pool: None, or the [P, HV, V, K] pool (float32 / bf16, K-last) that gets each segmented
    sequence's final state, composed through its last segment's transition as well (for callers
    that compute every segment's transition and no second state pass: the CuTe DSL GDN and KDA prefills).
    """
    N = cu_seqlens.shape[0] - 1
    HV, K = initial.shape[1], initial.shape[3]
    if decay is not None:
        if final_pool is not None:
            raise ValueError("final_pool: only the delta rule's composition (the CuTe DSL GDN and KDA prefills) "
                             "writes it")
        BV = min(V, 16)
        _scalar_compose_kernel[(N, HV, triton.cdiv(V, BV))](
            cu_seqlens, state_indices if state_indices is not None else cu_seqlens, transitions, initial, decay,
            tokens, transitions.stride(0), transitions.stride(1), transitions.stride(2),
            initial.stride(0), initial.stride(1), initial.stride(2),
            K=K, V=V, BV=BV, HAS_SLOTS=state_indices is not None, num_warps=4)
        return initial
    launch = COMPOSE_LAUNCH
    if transitions.is_cuda and torch.cuda.get_device_capability(transitions.device)[0] not in (9, 10):
        launch = SMALL_COMPOSE_LAUNCH
    BV = min(V, launch["BV"])
    final = final_pool is not None
    _compose_kernel[(N, HV, triton.cdiv(V, BV))](
        cu_seqlens, state_indices if state_indices is not None else cu_seqlens, transitions, initial,
        tokens, final_pool if final else initial,
        transitions.stride(0), transitions.stride(1), transitions.stride(2),
        initial.stride(0), initial.stride(1), initial.stride(2),
        *(final_pool.stride()[:3] if final else (0, 0, 0)),
        K=K, V=V, BV=BV, HAS_SLOTS=state_indices is not None, FINAL=int(final), num_warps=launch["num_warps"],
        num_stages=launch["num_stages"])
    return initial
