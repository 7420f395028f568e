"""Pieces the CuTe DSL chunked prefill kernels for SM90 share (``lightning/chunk_cute.py``,
``delta_rule/chunk_cute.py``): one CTA per (sequence, value head), a producer warp streaming each
chunk's q, k, v tiles by TMA, two consumer warpgroups each owning HALF = 64 rows of the state
S^T [V, K] in wgmma accumulators and 64 output columns (GDN's kernel adds an aux warpgroup and
preparation warps, and streams v through a pipeline of its own).

Device side: the swizzled operand tiles, wgmma issue, the TMA producer and its pipeline, the
CTA's sequence, the rows' l2 norms, the state's load / restage / store, the end of a chunk (the
output's 16-byte row stores, a checkpoint), the tensor views. Host side: which tensors the kernels
take, the compile-time strides, the index checks, compile-once and the launch.
"""
from __future__ import annotations

import contextlib
import functools

import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.warp import LdMatrix8x8x16bOp

from ..delta_rule.recurrent_cute import compile_launcher
from .chunking import CHUNK_SIZE
from .cute_launch import FastLaunch
from .prep import L2NORM_EPS

C = CHUNK_SIZE
HALF = 64  # state rows and output columns per consumer warpgroup
HEAD_DIM = 128  # K and V
# chunks in flight: 3 stages (192 KB of shared memory) were mixed on an H100 for Lightning, 64
# heads, ns per token-head: 4 x 8192 0.469 -> 0.455, 8 x 1024 0.620 -> 0.637, 16 x 2048 0.495 -> 0.584
STAGES = 2
THREADS = 384  # the producer warpgroup and two consumers
PRODUCER_REGS = 24
LOG2E = 1.4426950408889634


def kmajor(rows: int, cols: int, stages: int | None = None):
    """A bf16 [rows, cols] shared-memory tile (times ``stages``) in the 128-byte swizzled layout
    that wgmma reads and TMA writes; its transposed view is the MN-major operand."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))


@cute.jit
def transposed(t: cute.Tensor) -> cute.Tensor:
    """[a, b, ...] -> [b, a, ...] over the same memory."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


@cute.jit
def block_view(t: cute.Tensor, row0, col0, rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int],
               TRANSPOSE: cutlass.Constexpr[bool] = False) -> cute.Tensor:
    """t[row0 : row0 + rows, col0 : col0 + cols] of a [C, C] matrix in shared memory (row0 a
    multiple of rows, col0 of cols), or with TRANSPOSE its transpose [cols, rows] (an MMA's B
    operand is [N, K])."""
    block = cute.local_tile(t, (rows, cols), (row0 // rows, col0 // cols))
    if const_expr(TRANSPOSE):
        return transposed(block)
    return block


@cute.jit
def pin(fragment: cute.Tensor):
    """Each 32-bit register of a wgmma register operand through an empty asm statement, so that its
    values are all computed here. Conversions the compiler sank between a warpgroup's wgmmas made
    ptxas wait for each wgmma before issuing the next (the operand registers written after the arrive)."""
    words = cute.recast_tensor(fragment, Uint32)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = Uint32(llvm.inline_asm(T.i32(), [words[i].ir_value()], "", "=r,0", has_side_effects=True,
                                          is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, accumulate: bool):
    """acc (+)= a b over the k blocks of the fragments, issued and committed (not waited on)."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for kb in cutlass.range_constexpr(cute.size(a.shape[2])):
        cute.gemm(atom, acc, a[None, None, kb], b[None, None, kb], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def load_operand(src: cute.Tensor, fragment: cute.Tensor, mma: cute.TiledMma, lane: Int32,
                 A_OPERAND: cutlass.Constexpr[bool], K_CONTIGUOUS_B: cutlass.Constexpr[bool] = False):
    """An mma.sync operand fragment from fp16 shared memory by ldmatrix: A from a row-major view
    [16, K], B from a transposed one [N, K] (ldmatrix.trans), or with K_CONTIGUOUS_B from a
    row-major [N, K] (N a multiple of 16); a matrix per 8 x 8 block."""
    k = cute.size(src.shape[1])
    if const_expr(A_OPERAND):
        atom = cute.make_copy_atom(LdMatrix8x8x16bOp(transpose=False, num_matrices=4 if k >= 16 else 2), Float16)
        copy = cute.make_tiled_copy_A(atom, mma).get_slice(lane)
    elif const_expr(K_CONTIGUOUS_B):
        atom = cute.make_copy_atom(LdMatrix8x8x16bOp(transpose=False, num_matrices=4), Float16)
        copy = cute.make_tiled_copy_B(atom, mma).get_slice(lane)
    else:
        atom = cute.make_copy_atom(LdMatrix8x8x16bOp(transpose=True, num_matrices=2 if k >= 16 else 1), Float16)
        copy = cute.make_tiled_copy_B(atom, mma).get_slice(lane)
    cute.copy(copy, copy.partition_S(src), copy.retile(fragment))


@cute.jit
def row_inv_norms(tile: cute.Tensor, dst: cute.Tensor, tid: Int32, QK_L2NORM: cutlass.Constexpr[bool],
                  THREADS: cutlass.Constexpr[int] = 128, first: Int32 = 0, COUNT: cutlass.Constexpr[int] = 0):
    """dst[r] = 1 / sqrt(sum_c tile[r, c]^2 + eps) for the 64 rows of a [64, 128] bf16 tile by
    THREADS threads (two a row, 16-byte loads), or 1: in passes of THREADS / 2 rows, COUNT of
    them from pass ``first`` (0: all). The passes are a loop, not unrolled: unrolled, GDN's two
    norm warps of the time carried 1,600 instructions (25 KB) of straight-line code, and the
    kernel's roles missed the instruction cache (H200, 4 x 8192: 0.609 -> 0.513 ns per token-head
    with the loop)."""
    passes = COUNT if const_expr(COUNT > 0) else C // (THREADS // 2)
    for p in cutlass.range(first, first + passes, unroll=1):
        row = tid // 2 + p * (THREADS // 2)
        if const_expr(QK_L2NORM):
            total = Float32(0.0)
            part = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            for c in cutlass.range_constexpr(HEAD_DIM // 16):
                col = c * 16 + (tid % 2) * 8
                cute.autovec_copy(cute.local_tile(tile[row, None], (8,), (col // 8,)), part)
                for e in cutlass.range_constexpr(8):
                    x = Float32(part[e])
                    total += x * x
            total += cute.arch.shuffle_sync_bfly(total, offset=1)
            if tid % 2 == 0:
                dst[row] = cute.math.rsqrt(total + Float32(L2NORM_EPS), fastmath=True)
        else:
            if tid % 2 == 0:
                dst[row] = Float32(1.0)


@cute.jit
def produce(tiles: tuple, v_spec: tuple, loads, bos: Int32, num_chunks: Int32, hv: Int32, v_loads=None):
    """The producer warp: each chunk's tiles into the next free stage, by TMA. ``tiles``: one
    (TMA atom, its [T, cols, heads] tiles view, head, the staged smem tile, cols) per operand
    that fills a [C, cols] box of ``loads``' stage (q and k; KDA's decayed operands and products);
    ``v_spec`` (TMA atom, tiles view, smem) v's two [C, 64] column halves of value head hv, through
    ``v_loads``' stages when given, else ``loads``'."""
    tma_v, v_tiles, sV = v_spec
    parts = []
    for tma, gmem, head, smem, cols in (*tiles, (tma_v, v_tiles, hv, sV, HALF)):
        cpasync.prefetch_descriptor(tma)
        rows = cute.domain_offset((bos, 0), gmem[None, None, head])
        g = cute.local_tile(rows, (C, cols), (None, None))  # [C, cols, chunk, column block]
        parts.append(cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                           cute.group_modes(g, 0, 2)))
    sV_part, gV_part = parts[-1]
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, loads.num_stages)
    # (without v_loads unused; a loop-carried state of its own, not an alias of ``state``, which
    # the loop rebinds)
    v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                           loads.num_stages if v_loads is None else v_loads.num_stages)
    for j in cutlass.range(num_chunks, unroll=1):
        loads.producer_acquire(state)
        full = loads.producer_get_barrier(state)
        for i in cutlass.range_constexpr(len(tiles)):
            s_part, g_part = parts[i]
            cute.copy(tiles[i][0], g_part[None, j, 0], s_part[None, state.index], tma_bar_ptr=full)
        v_full = full
        v_stage = state.index
        if const_expr(v_loads is not None):
            v_loads.producer_acquire(v_state)
            v_full = v_loads.producer_get_barrier(v_state)
            v_stage = v_state.index
        for half in cutlass.range_constexpr(2):
            cute.copy(tma_v, gV_part[None, j, half], sV_part[None, 2 * v_stage + half], tma_bar_ptr=v_full)
        loads.producer_commit(state)
        state.advance()
        if const_expr(v_loads is not None):
            v_state.advance()


@cute.jit
def store_rows(sO: cute.Tensor, out: cute.Tensor, hv: Int32, bos: Int32, j: Int32, w: Int32, L: Int32, tid: Int32,
               ZERO: cutlass.Constexpr[bool]):
    """Rows t < L of chunk j's output columns w * 64 .. w * 64 + 63 (bf16 [C, 64] in ``sO``, or
    zeros with ZERO) into out [T, V, HV], 16 bytes a thread: 8 threads a row, 16 rows a pass."""
    out_copy = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128),
        cute.make_layout((16, 8), stride=(8, 1)), cute.make_layout((1, 8)))
    thr_out = out_copy.get_slice(tid)
    src = thr_out.partition_S(sO)
    rows = thr_out.partition_S(cute.make_identity_tensor((C, HALF)))
    dst = thr_out.partition_D(cute.local_tile(cute.domain_offset((bos, 0), out[None, None, hv]), (C, HALF), (j, w)))
    fragment = cute.make_rmem_tensor(src[None, 0, 0].layout, BFloat16)
    if const_expr(ZERO):
        fragment.fill(0.0)
    for r in cutlass.range_constexpr(cute.size(src, mode=[1])):
        if rows[0, r, 0][0] < L:
            if const_expr(not ZERO):
                cute.autovec_copy(src[None, r, 0], fragment)
            cute.autovec_copy(fragment, dst[None, r, 0])


@cute.jit
def zero_rows(sO: cute.Tensor, out: cute.Tensor, hv: Int32, bos: Int32, length: Int32, w: Int32, tid: Int32):
    """A padding sequence's output columns: zeros in every row."""
    for j in cutlass.range((length + C - 1) // C, unroll=1):
        store_rows(sO, out, hv, bos, j, w, cutlass.min(length - j * C, C), tid, True)


@cute.jit
def write_checkpoint(accS: cute.Tensor, thr_st, pool: cute.Tensor, checkpoint_indices: cute.Tensor,
                     checkpoint_every: Int32, num_checkpoints: Int32, n: Int32, hv: Int32, w: Int32, j: Int32,
                     L: Int32):
    """After chunk j: the state after (c + 1) * checkpoint_every tokens into slot
    checkpoint_indices[n, c] (skipped when negative), at full chunk ends only."""
    done = (j + 1) * C
    c = done // checkpoint_every - 1
    if (L == C) & (done % checkpoint_every == 0) & (c < num_checkpoints):
        ck = Int64(checkpoint_indices[n, c])
        if ck >= 0:
            store_state(accS, thr_st, pool, ck, hv, w)


@cute.jit
def state_rows(thr_st, pool: cute.Tensor, slot: Int64, hv: Int32, w: Int32) -> cute.Tensor:
    """This thread's elements of state rows w * 64 .. w * 64 + 63 of pool[slot, hv] (K-last:
    S^T [v, k] row for row), partitioned as the state accumulator."""
    return thr_st.partition_C(cute.local_tile(pool[slot, hv, None, None], (HALF, HEAD_DIM), (w, 0)))


@cute.jit
def store_state(accS: cute.Tensor, thr_st, pool: cute.Tensor, slot: Int64, hv: Int32, w: Int32):
    """The float32 state accumulator into its rows of pool[slot, hv], in the pool's dtype."""
    dst = state_rows(thr_st, pool, slot, hv, w)
    for i in cutlass.range_constexpr(cute.size(accS)):
        dst[i] = accS[i].to(pool.element_type)


@cute.jit
def block_sequence(cu_seqlens: cute.Tensor, state_indices: cute.Tensor, HV: cutlass.Constexpr[int],
                   GROUP: cutlass.Constexpr[int], HAS_SLOTS: cutlass.Constexpr[bool]):
    """This CTA's (sequence, value head), blockIdx.x = sequence * HV + value head: (n, hv, its qk
    head h, the first token bos, length, num_chunks, slot: Int64, negative for padding)."""
    bid = cute.arch.block_idx()[0]
    n = bid // HV
    hv = bid % HV
    bos = cu_seqlens[n]
    length = cu_seqlens[n + 1] - bos
    slot = Int64(n)
    if const_expr(HAS_SLOTS):
        slot = Int64(state_indices[n])
    return n, hv, hv // GROUP, bos, length, (length + C - 1) // C, slot


@cute.jit
def block_chunk(table: cute.Tensor, state_indices: cute.Tensor, HV: cutlass.Constexpr[int],
                HAS_SLOTS: cutlass.Constexpr[bool]):
    """This CTA's (chunk, value head) of a per-chunk kernel, blockIdx.x = chunk id * HV + value head
    (``table``: ``varlen.chunk_indices``' [chunk ids, 2]): (its block index, chunk id, hv, sequence,
    live: a table entry that is a chunk, of a sequence that is not padding)."""
    bid = cute.arch.block_idx()[0]
    chunk = bid // HV
    seq = table[chunk, 0]
    live = seq >= 0
    if const_expr(HAS_SLOTS):
        if live:
            live = state_indices[seq] >= 0
    return bid, chunk, bid % HV, seq, live


@cute.jit
def block_segment(cu_seqlens: cute.Tensor, state_indices: cute.Tensor, N: Int32, tokens: Int32,
                  HV: cutlass.Constexpr[int], GROUP: cutlass.Constexpr[int], HAS_SLOTS: cutlass.Constexpr[bool]):
    """As ``block_sequence`` for a launch over segments of ``tokens`` (``kernels.common.segments``):
    blockIdx.x = segment id * HV + value head, ids in packed order, each sequence cut into
    max(1, ceil(length / tokens)) segments (as ``segments.segment_span`` counts them). Returns (n,
    hv, h, bos, length, num_chunks, slot, sid, j, last): bos and length the segment's, j its index
    in the sequence, last whether it ends it. An id past the last segment gets length 0 and slot -1.

    Each CTA walks all N sequences (two loads each): the automatic rule cuts only batches of a
    few sequences (``segments.one_pass_segment_tokens``)."""
    bid = cute.arch.block_idx()[0]
    sid = bid // HV
    hv = bid % HV
    n = Int32(-1)
    j = Int32(0)
    before = Int32(0)
    for m in cutlass.range(N, unroll=1):
        count = cutlass.max((cu_seqlens[m + 1] - cu_seqlens[m] + tokens - 1) // tokens, 1)
        if (n < 0) & (sid < before + count):
            n = m
            j = sid - before
        before += count
    live = n >= 0
    n = cutlass.max(n, 0)
    seq_end = cu_seqlens[n + 1]
    bos = cu_seqlens[n] + j * tokens
    length = cutlass.select_(live, cutlass.min(seq_end - bos, tokens), 0)
    slot = Int64(n)
    if const_expr(HAS_SLOTS):
        slot = Int64(state_indices[n])
    slot = cutlass.select_(live, slot, Int64(-1))
    return n, hv, hv // GROUP, bos, length, (length + C - 1) // C, slot, sid, j, bos + length == seq_end


def make_loads(barriers, stages: int = STAGES, tiles: int = 3, consumer_warps: int = 8, defer_sync: bool = False):
    """A producer -> consumers pipeline of TMA tiles: ``stages`` buffers, one transaction of
    ``tiles`` C x 128 bf16 tiles each (q, k and v by default), one arrive per consumer warp."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers, num_stages=stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tiles * C * HEAD_DIM * 2, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=defer_sync)


@cute.jit
def load_state(accS: cute.Tensor, thr_st, pool: cute.Tensor, has_initial_state: cute.Tensor, n: Int32, slot: Int64,
               hv: Int32, w: Int32, live, HAS_POOL: cutlass.Constexpr[bool], HAS_INIT_FLAGS: cutlass.Constexpr[bool]):
    """The state accumulator from pool[slot, hv] (K-last: S^T [v, k] row for row), or zeros for a
    padding row, a sequence without an initial state, or no pool."""
    accS.fill(0.0)
    if const_expr(HAS_POOL):
        read = live
        if const_expr(HAS_INIT_FLAGS):
            read = live & (has_initial_state[n] != 0)
        if read:
            src = state_rows(thr_st, pool, slot, hv, w)
            for i in cutlass.range_constexpr(cute.size(accS)):
                accS[i] = Float32(src[i])


@cute.jit
def stage_state(accS: cute.Tensor, tSsS: cute.Tensor):
    """The state in bf16 into shared memory, the next chunk's S^T' operand (then visible to wgmma)."""
    staged = cute.make_rmem_tensor(accS.layout, BFloat16)
    for i in cutlass.range_constexpr(cute.size(accS)):
        staged[i] = BFloat16(accS[i])
    cute.autovec_copy(staged, tSsS)
    cute.arch.fence_proxy("async.shared", space="cta")


@cute.jit
def output_store(tma_o: cute.CopyAtom, o_tiles: cute.Tensor, sO: cute.Tensor, bos: Int32, hv: Int32) -> tuple:
    """What ``finish_chunk`` needs to store a full chunk's output tile by TMA: (tma_o, the
    [TMA, consumer] partition of both consumers' sO tiles, the [TMA, chunk, consumer] partition
    of the sequence's rows of value head hv)."""
    rows = cute.domain_offset((bos, 0), o_tiles[None, None, hv])
    tiles = cute.local_tile(rows, (C, HALF), (None, None))  # [C, 64, chunk, column block]
    s_part, g_part = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                           cute.group_modes(tiles, 0, 2))
    return tma_o, s_part, g_part


@cute.jit
def output_read(tid: Int32):
    """This consumer's last TMA store has read its sO tile (then sO may be written again, and
    the CTA may exit). Called a barrier ahead of the next write: the store has had the chunk's
    whole computation to finish."""
    if tid == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def finish_chunk(accO: cute.Tensor, tOsO: cute.Tensor, accS: cute.Tensor, tSsS: cute.Tensor, sO: cute.Tensor,
                 out: cute.Tensor, thr_st, pool: cute.Tensor, checkpoint_indices: cute.Tensor,
                 checkpoint_every: Int32, num_checkpoints: Int32, n: Int32, hv: Int32, bos: Int32, j: Int32,
                 w: Int32, L: Int32, tid: Int32, HAS_CKPT: cutlass.Constexpr[bool], store=None, o_copy=None):
    """After chunk j's products (waited on): its outputs in bf16 through ``sO`` (tOsO: this thread's
    part of it in the accumulator's layout, or ``o_copy``'s partition of it: a tiled stmatrix) to
    rows t < L, the state restaged into ``tSsS`` (None: the caller keeps its operand in
    registers), and a checkpoint where one falls. With ``store``
    (``output_store``) a full chunk goes out by one thread's TMA store, asynchronously
    (``output_read`` before sO is written again); a last, partial chunk by the threads' 16-byte
    stores of its valid rows (the rows after them are another sequence's). Against the threads'
    stores of every chunk: H200, graph replay, Lightning 64 heads 4 x 8192 0.348 -> 0.326 ns per
    token-head, 8 x 1024 0.430 -> 0.402; GDN 4 x 8192 0.813 -> 0.803."""
    out_staged = cute.make_rmem_tensor(accO.layout, BFloat16)
    for i in cutlass.range_constexpr(cute.size(accO)):
        out_staged[i] = BFloat16(accO[i])
    if const_expr(o_copy is not None):
        cute.copy(o_copy, o_copy.retile(out_staged), tOsO)
    else:
        cute.autovec_copy(out_staged, tOsO)
    if const_expr(store is not None):
        cute.arch.fence_proxy("async.shared", space="cta")  # sO visible to the TMA unit
    cute.arch.barrier(barrier_id=1 + w, number_of_threads=128)  # sO written, S^T' read
    if const_expr(store is not None):
        tma_o, s_part, g_part = store
        if L == C:
            if tid == 0:
                cute.copy(tma_o, s_part[None, w], g_part[None, j, w])
                cute.arch.cp_async_bulk_commit_group()
        else:
            store_rows(sO, out, hv, bos, j, w, L, tid, False)
    else:
        store_rows(sO, out, hv, bos, j, w, L, tid, False)
    if const_expr(tSsS is not None):
        stage_state(accS, tSsS)
    if const_expr(HAS_CKPT):
        write_checkpoint(accS, thr_st, pool, checkpoint_indices, checkpoint_every, num_checkpoints, n, hv, w, j, L)


@cute.jit
def tensor_views(q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, o_ptr: cute.Pointer,
                 pool_ptr: cute.Pointer, cu_ptr: cute.Pointer, indices_ptr: cute.Pointer, init_ptr: cute.Pointer,
                 ckpt_ptr: cute.Pointer, T: Int32, N: Int32, P: Int32, num_checkpoints: Int32,
                 checkpoint_stride: Int32, STRIDES: cutlass.Constexpr[tuple], H: cutlass.Constexpr[int],
                 HV: cutlass.Constexpr[int]):
    """The kernels' views of the raw pointers and the TMA atoms of q, k, v (loads) and out
    (stores): (tma_q, q_tiles, tma_k, k_tiles, tma_v, v_tiles, out, tma_o, o_tiles, pool,
    cu_seqlens, state_indices, has_initial_state, checkpoint_indices). [T, D, heads] views, the
    row dim first: TMA tiles are [C, D] boxes of one head (v's and out's [C, 64], one per
    consumer)."""
    D = HEAD_DIM
    q_t, q_h, k_t, k_h, v_t, v_h, o_t, o_h, pool_s, pool_h = STRIDES
    q = cute.make_tensor(q_ptr, cute.make_layout((T, D, H), stride=(q_t, 1, q_h)))
    k = cute.make_tensor(k_ptr, cute.make_layout((T, D, H), stride=(k_t, 1, k_h)))
    v = cute.make_tensor(v_ptr, cute.make_layout((T, D, HV), stride=(v_t, 1, v_h)))
    o = cute.make_tensor(o_ptr, cute.make_layout((T, D, HV), stride=(o_t, 1, o_h)))
    pool = cute.make_tensor(pool_ptr, cute.make_layout((P, HV, D, D), stride=(pool_s, pool_h, D, 1)))
    cu_seqlens = cute.make_tensor(cu_ptr, cute.make_layout(N + 1))
    state_indices = cute.make_tensor(indices_ptr, cute.make_layout(N))
    has_initial_state = cute.make_tensor(init_ptr, cute.make_layout(N))
    checkpoint_indices = cute.make_tensor(
        ckpt_ptr, cute.make_layout((N, num_checkpoints), stride=(checkpoint_stride, 1)))
    load = cpasync.CopyBulkTensorTileG2SOp()
    tma_q, q_tiles = cpasync.make_tiled_tma_atom(load, q, kmajor(C, D), (C, D))
    tma_k, k_tiles = cpasync.make_tiled_tma_atom(load, k, kmajor(C, D), (C, D))
    tma_v, v_tiles = cpasync.make_tiled_tma_atom(load, v, kmajor(C, HALF), (C, HALF))
    tma_o, o_tiles = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), o, kmajor(C, HALF), (C, HALF))
    return (tma_q, q_tiles, tma_k, k_tiles, tma_v, v_tiles, o, tma_o, o_tiles, pool, cu_seqlens, state_indices,
            has_initial_state, checkpoint_indices)


# ------------------------------------------------------------------------------------------------
# host side


def strides(q, k, v, out, pool) -> tuple:
    """The kernels' STRIDES constexpr: the row and head strides of q, k, v and out, the slot and
    head strides of the pool (zeros without one). Compile-time, so that every row's address is a
    known multiple of 16 bytes at any token offset and row accesses compile to 16-byte vectors
    (with run-time strides each output element went out as a 2-byte store: H100, Lightning, 64
    heads 4 x 8192, 0.59 ns per token-head against 0.37)."""
    return (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2],
            *(pool.stride()[:2] if pool is not None else (0, 0)))


def unsupported(kernel: str, q, k, v, out, pool, tma_rows: tuple = ("q", "k", "v", "out")) -> str | None:
    """Why the ``kernel`` prefill cannot run these tensors (None when it can): bf16 q, k, v and
    out whose rows (last dim) are 128 wide, the ``tma_rows`` among them contiguous and 16-byte
    aligned (TMA loads, 16-byte stores), a pool of contiguous [128, 128] states."""
    if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype or out.dtype != q.dtype:
        return f"inputs {q.dtype}: the CuTe DSL {kernel} prefill takes bf16 q, k, v and out"
    widths = (q.shape[-1], k.shape[-1], v.shape[-1], out.shape[-1])
    if widths != (HEAD_DIM,) * 4:
        return f"head dims (q, k, v, out) {widths}: the CuTe DSL {kernel} prefill takes {HEAD_DIM}"
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if name not in tma_rows:
            continue
        stride = x.stride()
        if stride[-1] != 1 or x.data_ptr() % 16 or any(s % 8 for s in stride[:-1]):  # 8 bf16 = 16 bytes
            return f"{name}: rows must be contiguous and 16-byte aligned for TMA (strides {stride})"
    if pool is not None and pool.stride()[2:] != (HEAD_DIM, 1):
        return f"state_pool strides {pool.stride()}: each [V, K] state must be contiguous"
    return None


def checkpoints(state_pool, checkpoint_every, checkpoint_indices):
    """The int32 [N, M] checkpoint slots with unit column stride, or None when no checkpoint is
    written; checks ``checkpoint_every``."""
    if checkpoint_every and checkpoint_every % C:
        raise ValueError(f"checkpoint_every={checkpoint_every}: must be a multiple of {C}")
    ckpt = checkpoint_indices if state_pool is not None and checkpoint_every else None
    if ckpt is not None and ckpt.stride(1) != 1:
        ckpt = ckpt.contiguous()
    return ckpt


def check_index_dtypes(cu_seqlens, state_indices, has_initial_state, ckpt):
    """The index tensors' dtypes as the kernels read them (int32, bool for the flags)."""
    for name, x, dtype in (("cu_seqlens", cu_seqlens, torch.int32), ("state_indices", state_indices, torch.int32),
                           ("has_initial_state", has_initial_state, torch.bool),
                           ("checkpoint_indices", ckpt, torch.int32)):
        if x is not None and x.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype}, got {x.dtype}")


def launch_arguments(recipe, q, k, v, out, cu_seqlens, state_pool, state_indices, has_initial_state, ckpt,
                     checkpoint_every) -> tuple:
    """(scalars, constexprs) that every prefill launcher takes: the 7 ``SCALARS`` (T, N, P,
    num_checkpoints, checkpoint_every, checkpoint_stride, scale) and the compile-time strides,
    head counts and flags. ``ckpt``: from ``checkpoints``."""
    has_pool = state_pool is not None
    scalars = (q.shape[0], cu_seqlens.shape[0] - 1, state_pool.shape[0] if has_pool else 1,
               0 if ckpt is None else ckpt.shape[1], checkpoint_every or C, 0 if ckpt is None else ckpt.stride(0),
               recipe.scale)
    constexprs = (("STRIDES", strides(q, k, v, out, state_pool)), ("H", q.shape[1]), ("HV", v.shape[1]),
                  ("QK_L2NORM", recipe.qk_l2norm), ("HAS_SLOTS", state_indices is not None), ("HAS_POOL", has_pool),
                  ("HAS_INIT_FLAGS", has_pool and has_initial_state is not None), ("HAS_CKPT", ckpt is not None))
    return scalars, constexprs


# TMA bases and 16-byte row stores (KDA's state pass: its operand tiles)
ALIGNED = ("q", "k", "v", "out", "q_carried", "Qd", "Ke", "Kd", "P", "T")
SCALARS = (64, 1, 1, 0, C, 0, 1.0)  # T, N, P, num_checkpoints, checkpoint_every, checkpoint_stride, scale


@functools.lru_cache(maxsize=None)
def _compiled(launcher, names: tuple, dtypes: tuple, constexprs: tuple, extra_scalars: int) -> FastLaunch:
    return compile_launcher(launcher, tuple((dtype, name in ALIGNED) for name, dtype in zip(names, dtypes)),
                            (*SCALARS, *(C,) * extra_scalars), dict(constexprs))


def launch(launcher, names: tuple, tensors: tuple, scalars: tuple, constexprs: tuple, device: torch.device):
    """Run ``launcher`` (a ``cute.jit`` function of pointers named ``names``, the 7 ``SCALARS`` and
    any further Int32 scalars, a stream and ``constexprs``) on ``tensors`` (None: never read, a
    null int32 pointer), compiled once per configuration. Host work per call is kept small (it is
    not hidden behind the kernel when the GPU waits on it): strides and flags are compile-time,
    the arguments go to the compiled program as raw values (``cute_launch.FastLaunch``), and
    devices are switched only when the tensors sit on another one."""
    dtypes = tuple(torch.int32 if x is None else x.dtype for x in tensors)
    compiled = _compiled(launcher, names, dtypes, constexprs, len(scalars) - len(SCALARS))
    addresses = [0 if x is None else x.data_ptr() for x in tensors]
    here = device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if here else torch.cuda.device(device):
        compiled(addresses, scalars, torch.cuda.current_stream().cuda_stream)
