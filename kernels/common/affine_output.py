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
``join_segments`` is what the one-pass segmented prefills call after their state pass: the
composition (final states) and that correction, in one launch where no sequence has more than two
segments (a second segment's S is its first segment's final state, so nothing waits on a chain):
H200, graph replay, L2 flushed, the join alone, 32 heads in two 1024-token segments 34.1 -> 26.8 us,
16 heads in two of 2048 28.6 -> 23.9, 32 heads in two of 16384 152.3 -> 146.0; in the whole prefill
(32 heads, one sequence of 4096 to 32768 tokens) graph replay within 1% and the eager call one
launch's host work shorter (1 x 8192: 357 -> 274-319 us) (2026-11-28).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segments import compose_initial_states, compose_program, num_segment_ids, segment_span

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
# ``join_segments``' one launch where sequences have at most two segments: the correction's tiles
# (LONG_SEGMENT_TILES from LONG_SEGMENT_TOKENS), and a BV x BK block of the final state a program
TWO_SEGMENT_JOIN_LAUNCH = dict(BT=64, TILES=2, num_warps=4, num_stages=2)
TWO_SEGMENT_FINAL_BLOCK = dict(BV=32, BK=64)


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
def _correct_segment(out, carried, states, sid, group, hv, cu_seqlens, state_indices, num_seqs, tokens,
                     s_ot, s_oh, s_ct, s_ch, s_sn, s_sh, s_sv,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, TILES: tl.constexpr,
                     SPLIT: tl.constexpr, HAS_SLOTS: tl.constexpr, PREVIOUS: tl.constexpr):
    """out[t] += q~[t] S for the TILES x BT tokens of token group ``group`` of segment ``sid`` at
    value head ``hv``, where the segment continues a live sequence. S [K, V] float32 is read K-last
    from ``states``: states[sid] (its composed initial state) or, PREVIOUS, states[sid - 1] (the
    previous segment's final state, rows [:V] of its transitions). SPLIT (bf16 q~): S as two bf16
    parts, split once, two bf16 products a tile (16 bits of S's mantissa, where the output keeps 8);
    else one tf32x3 product (float32 accuracy)."""
    live, n, seq_bos, bos, eos, first, last = segment_span(cu_seqlens, num_seqs, sid, tokens)
    if HAS_SLOTS:
        live = live & (tl.load(state_indices + n) >= 0)
    if live & (first == 0):
        ks = tl.arange(0, K)
        vs = tl.arange(0, V)
        S = tl.load(states + (sid - PREVIOUS).to(tl.int64) * s_sn + hv * s_sh + vs[None, :] * s_sv + ks[:, None])
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


@triton.jit
def _segment_output_kernel(out, carried, initial, cu_seqlens, state_indices, num_seqs, tokens, groups,
                           s_ot, s_oh, s_ct, s_ch, s_in, s_ih, s_iv,
                           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, TILES: tl.constexpr,
                           SPLIT: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """Program (segment id x token group, value head): ``_correct_segment`` with S the segment's
    composed initial state."""
    _correct_segment(out, carried, initial, tl.program_id(0) // groups, tl.program_id(0) % groups, tl.program_id(1),
                     cu_seqlens, state_indices, num_seqs, tokens, s_ot, s_oh, s_ct, s_ch, s_in, s_ih, s_iv,
                     K, V, BT, TILES, SPLIT, HAS_SLOTS, 0)


@triton.jit
def _two_segment_join_kernel(out, carried, transitions, pool, cu_seqlens, state_indices, num_seqs, tokens, groups,
                             s_ot, s_oh, s_ct, s_ch, s_tn, s_th, s_tv, s_ps, s_ph, s_pv,
                             K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                             BT: tl.constexpr, TILES: tl.constexpr, SPLIT: tl.constexpr, HAS_SLOTS: tl.constexpr,
                             HAS_POOL: tl.constexpr):
    """``join_segments`` where no sequence has more than two segments: no composition chain, so one
    launch in which no program waits for another. Programs (segment id x token group, value head)
    first: a second segment's correction with S = D_0, its first segment's final state
    (transitions[sid - 1]); then (sequence x V tile x K block, value head): a block of the
    sequence's final state X = D_0 A_1^T + D_1 (X = S^T, float32; BV x BK, so that A_1^T comes in
    K x BK column blocks) into its slot of ``pool``."""
    pid = tl.program_id(0)
    hv = tl.program_id(1)
    blocks: tl.constexpr = (V // BV) * (K // BK)
    corrections = tl.num_programs(0) - num_seqs * blocks
    if pid < corrections:
        _correct_segment(out, carried, transitions, pid // groups, pid % groups, hv, cu_seqlens, state_indices,
                         num_seqs, tokens, s_ot, s_oh, s_ct, s_ch, s_tn, s_th, s_tv, K, V, BT, TILES, SPLIT,
                         HAS_SLOTS, 1)
    elif HAS_POOL:
        block = (pid - corrections) % blocks
        n = (pid - corrections) // blocks
        vo, ko, vmask, live, count, first_id = compose_program(cu_seqlens, state_indices, tokens, n,
                                                               block // (K // BK), K, V, BV, HAS_SLOTS)
        if live:
            kc = block % (K // BK) * BK + tl.arange(0, BK)
            D_0 = tl.load(transitions + first_id * s_tn + hv * s_th + vo[:, None] * s_tv + ko[None, :],
                          mask=vmask, other=0.0)
            second = transitions + (first_id + 1) * s_tn + hv * s_th
            D_1 = tl.load(second + vo[:, None] * s_tv + kc[None, :], mask=vmask, other=0.0)
            A_t = tl.load(second + (V + ko)[:, None] * s_tv + kc[None, :])  # [K, BK] of A_1^T
            X = tl.dot(D_0, A_t, input_precision="tf32x3") + D_1
            slot = tl.load(state_indices + n).to(tl.int64) if HAS_SLOTS else n.to(tl.int64)
            tl.store(pool + slot * s_ps + hv * s_ph + vo[:, None] * s_pv + kc[None, :], X.to(pool.dtype.element_ty),
                     mask=vmask)


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


def join_segments(cu_seqlens, state_indices, transitions, carried, out, pool, *, tokens: int) -> None:
    """After a one-pass segmented state pass (the CuTe DSL GDN and KDA prefills): each segmented
    sequence's final state into its slot of ``pool`` and q~ S added to the outputs of the segments
    that continue a sequence. Where no sequence can have more than two segments (T <= 2 x tokens,
    from shapes alone) in one launch (``_two_segment_join_kernel``), else in two
    (``segments.compose_initial_states`` with ``final_pool``, then ``correct_segment_outputs``).

    cu_seqlens: int32 [N + 1]; state_indices: int32 [N] or None (negative: padding, skipped);
    transitions: float32 [S, HV, V + K, K], each segment's final value rows D_j^T, then map rows
    A_j^T (S = ``segments.num_segment_ids``); carried: [T, HV, K] the map rows' outputs q~; out:
    [T, HV, V] holding o0, corrected in place; pool: [P, HV, V, K] float32 / bf16, K-last, or None.
    """
    T, HV, V = out.shape
    K = carried.shape[-1]
    N = cu_seqlens.shape[0] - 1
    if T > 2 * tokens:
        initial = torch.empty(transitions.shape[0], HV, V, K, dtype=torch.float32, device=out.device)
        compose_initial_states(cu_seqlens, state_indices, transitions, initial, tokens=tokens, V=V, final_pool=pool)
        correct_segment_outputs(cu_seqlens, state_indices, carried, initial, out, tokens=tokens)
        return
    split = carried.dtype == torch.bfloat16
    launch = TWO_SEGMENT_JOIN_LAUNCH if split else FLOAT_SEGMENT_OUTPUT_LAUNCH
    if split and tokens >= LONG_SEGMENT_TOKENS:
        launch = {**launch, "TILES": LONG_SEGMENT_TILES}
    groups = triton.cdiv(tokens, launch["BT"] * launch["TILES"])
    BV, BK = TWO_SEGMENT_FINAL_BLOCK["BV"], TWO_SEGMENT_FINAL_BLOCK["BK"]
    has_pool = pool is not None
    _two_segment_join_kernel[(num_segment_ids(T, N, tokens) * groups + N * (V // BV) * (K // BK), HV)](
        out, carried, transitions, pool if has_pool else transitions, cu_seqlens,
        state_indices if state_indices is not None else cu_seqlens, N, tokens, groups,
        out.stride(0), out.stride(1), carried.stride(0), carried.stride(1),
        transitions.stride(0), transitions.stride(1), transitions.stride(2),
        *(pool.stride()[:3] if has_pool else (0, 0, 0)),
        K=K, V=V, BV=BV, BK=BK, BT=launch["BT"], TILES=launch["TILES"], SPLIT=split,
        HAS_SLOTS=state_indices is not None, HAS_POOL=has_pool, num_warps=launch["num_warps"],
        num_stages=launch["num_stages"])
