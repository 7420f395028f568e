"""Chunked prefill of Lightning attention in CuTe DSL for SM90: TMA loads, wgmma, warp-specialised.

The math is ``chunk_triton.py``'s (read its docstring first); per chunk of C = 64 tokens, with the
constant log decay d <= 0 of a value head, rows t = 0 .. L - 1 valid and S0 the entering state:

    O     = (scale rq_t exp((t + 1) d)) * (Q S0) + (scale rq_t rk_s exp((t - s) d) [s <= t] * Q K^T) V
    S_out = exp(L d) S0 + K^T (rk_s exp((L - 1 - s) d) [s < L] * V)

(rq, rk: the rows' inverse l2 norms with ``qk_l2norm``, else 1). One CTA per (sequence, value
head), three warpgroups:
- warpgroup 0, the producer: one warp streams each chunk's q, k and v tiles (64 x K, 64 x K,
  64 x V, bf16) into a ring of STAGES shared-memory buffers by TMA, against mbarriers;
- warpgroups 1 and 2, the consumers: each owns V / 2 = 64 columns of the state and the output.
  It holds S^T [64 v, K] in float32 wgmma accumulators for the whole sequence (the pool's K-last
  layout, so the state is read and written once, row for row), and per chunk runs
      P  = Q K^T                 wgmma, both operands from shared memory
      O  = Q S^T'                wgmma, S^T' the previous chunk's state in bf16 in shared memory
      O  = r_t * O + (D * P) V   P rescaled and causally masked in registers, the A operand
      S^T = exp(L d) S^T + (w_s * V)^T K   the decayed v from registers as two bf16 parts
  and writes O through shared memory in 16-byte rows (only rows t < L) and its bf16 S^T for the
  next chunk's Q S^T'.

Precision is the Triton kernel's for bf16 inputs: Q K^T from the raw tiles (exact products),
Q S and P V with bf16 operands (their rounding stays below the bf16 output's own), and the state
update with the raw k tile times the decayed v split into hi + lo bf16 parts (16 bits of its
mantissa), so that the state, which carries its error across chunks, stays near float32.

Rows past the sequence's end in its last chunk hold the next sequence's tokens (or TMA's zeros
past the tensor's end): every factor that multiplies them (w_s, and the causal mask for P) is
zero by selection, and their outputs are not stored. Padding sequences (negative slot) get zero
outputs and the pool is neither read nor written. Supported: bf16 q / k / v with K = V = 128 and
16-byte aligned rows, float32 or bf16 pools; the dispatcher passes anything else to Triton.

There are no segments: a sequence and head is one CTA's chain, so a batch of few sequences and
heads (a TP4 shard on one long sequence) fills few SMs, and automatic dispatch gives it to the
Triton kernel's segments instead (``cute_backend.defers``). Elsewhere this kernel is the faster
one: H100, 64 heads, device time per token-head, 4 x 8192 0.381 against Triton's 0.431, 8 x 1024
0.467 against 0.509 (BENCHMARKS.md). Its decay factors come from a table of exp(i d), i = 0 .. C,
taken once per CTA, and P's (with the causal mask) stay in registers: H200, graph replay, 4 x 8192
0.383 -> 0.351 (0.367 with the table alone), 8 x 1024 0.469 -> 0.431, the same outputs. Without
``qk_l2norm`` the row norms are left out altogether (no norm pass, no rq / rk loads in the
factors): 0.313 -> 0.296 (after the TMA stores of ``cute_prefill.finish_chunk``).
"""
from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup
import cuda.bindings.driver as cuda

from ..common.cute_prefill import (C, HALF, HEAD_DIM, LOG2E, PRODUCER_REGS, STAGES, THREADS, block_sequence,
                                   check_index_dtypes, checkpoints, finish_chunk, gemm, kmajor, launch,
                                   launch_arguments, load_state, make_loads, output_read, output_store, produce,
                                   row_inv_norms, stage_state, store_state, tensor_views, transposed,
                                   unsupported as unsupported_rows, zero_rows)
from ..common.prep import Recipe

CONSUMER_REGS = 240
POWERS = C + 8  # exp(i d) for i = 0 .. C, a table per consumer (rows of 16-byte multiples)


@cute.jit
def _consume(storage, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, loads, w: Int32, tid: Int32,
             out: cute.Tensor, tma_o: cute.CopyAtom, o_tiles: cute.Tensor, pool: cute.Tensor, decay: cute.Tensor,
             has_initial_state: cute.Tensor, checkpoint_indices: cute.Tensor, checkpoint_every: Int32,
             num_checkpoints: Int32, scale: Float32,
             n: Int32, hv: Int32, bos: Int32, length: Int32, num_chunks: Int32, slot: Int64, live,
             state_layout: cutlass.Constexpr, out_layout: cutlass.Constexpr, QK_L2NORM: cutlass.Constexpr[bool],
             HAS_POOL: cutlass.Constexpr[bool], HAS_INIT_FLAGS: cutlass.Constexpr[bool],
             HAS_CKPT: cutlass.Constexpr[bool]):
    """A consumer warpgroup: state and output columns w * 64 .. w * 64 + 63 (module docstring)."""
    bar = 1 + w
    sS = storage.sS.get_tensor(state_layout.outer, swizzle=state_layout.inner)[None, None, w]
    sO_both = storage.sO.get_tensor(out_layout.outer, swizzle=out_layout.inner)
    sO = sO_both[None, None, w]
    rq = cute.make_tensor(storage.rq.data_ptr() + w * C, cute.make_layout(C))
    rk = cute.make_tensor(storage.rk.data_ptr() + w * C, cute.make_layout(C))
    powers = cute.make_tensor(storage.powers.data_ptr() + w * POWERS, cute.make_layout(POWERS))

    K_ = warpgroup.OperandMajorMode.K
    MN = warpgroup.OperandMajorMode.MN
    mma_ss = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K_, K_, Float32, (1, 1, 1), (C, HALF))
    mma_pv = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K_, MN, Float32, (1, 1, 1), (C, HALF),
                                               a_source=warpgroup.OperandSource.RMEM)
    mma_st = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K_, MN, Float32, (1, 1, 1), (HALF, HEAD_DIM),
                                               a_source=warpgroup.OperandSource.RMEM)
    thr_ss = mma_ss.get_slice(tid)
    thr_pv = mma_pv.get_slice(tid)
    thr_st = mma_st.get_slice(tid)

    # operands: per stage for q / k / v, fixed for the state
    tSrQ = mma_ss.make_fragment_A(thr_ss.partition_A(sQ))                       # Q [t, k]
    tSrK = mma_ss.make_fragment_B(thr_ss.partition_B(sK))                       # K [s, k]
    tOrS = mma_ss.make_fragment_B(thr_ss.partition_B(sS))                       # S^T' [v, k]
    tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(transposed(sV)))          # V as [v, s]
    tUrK = mma_st.make_fragment_B(thr_st.partition_B(transposed(sK)))          # K as [k, s]
    tUsV = thr_st.partition_A(transposed(sV))                                  # V^T [v, s] elements
    accP = cute.make_rmem_tensor(thr_ss.partition_shape_C((C, C)), Float32)
    accO = cute.make_rmem_tensor(thr_ss.partition_shape_C((C, HALF)), Float32)
    accS = cute.make_rmem_tensor(thr_st.partition_shape_C((HALF, HEAD_DIM)), Float32)
    tOrP = mma_pv.make_fragment_A(thr_pv.partition_shape_A((C, C)))
    tUrV_hi = mma_st.make_fragment_A(thr_st.partition_shape_A((HALF, C)))
    tUrV_lo = mma_st.make_fragment_A(thr_st.partition_shape_A((HALF, C)))
    # the (row, column) coordinates of each thread's fragment elements
    cP = thr_ss.partition_C(cute.make_identity_tensor((C, C)))
    cU = thr_st.partition_A(cute.make_identity_tensor((HALF, C)))

    d = Float32(decay[hv]) * Float32(LOG2E)  # exp(x d) = exp2(x d log2 e)
    # every decay factor of the chunk is exp(i d) for an integer 0 <= i <= C: a table of them,
    # taken once, instead of 96 exponentials per thread and chunk
    if tid <= C:
        powers[tid] = cute.math.exp2(Float32(tid) * d, fastmath=True)
    load_state(accS, thr_st, pool, has_initial_state, n, slot, hv, w, live, HAS_POOL, HAS_INIT_FLAGS)
    tSsS = thr_st.partition_C(sS)
    tOsO = thr_ss.partition_C(sO)
    store = output_store(tma_o, o_tiles, sO_both, bos, hv)

    if live:
        stage_state(accS, tSsS)  # S^T' for the first chunk's Q S^T'
        cute.arch.barrier(barrier_id=bar, number_of_threads=128)  # the powers written
        # P's decays with its causal mask, the same in every chunk: kept in registers
        causal = []
        for i in cutlass.range_constexpr(cute.size(accP)):
            t, s = cP[i]
            f = cutlass.select_(s <= t, powers[cutlass.max(t - s, 0)], Float32(0.0))
            causal.append(f if const_expr(QK_L2NORM) else f * scale)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        for j in cutlass.range(num_chunks, unroll=1):
            L = cutlass.min(length - j * C, C)
            loads.consumer_wait(state)
            stage = state.index
            v_half = 2 * stage + w
            if const_expr(QK_L2NORM):  # without, rq = rk = 1 is left out of every factor
                row_inv_norms(sQ[None, None, stage], rq, tid, QK_L2NORM)
                row_inv_norms(sK[None, None, stage], rk, tid, QK_L2NORM)
            output_read(tid)
            cute.arch.barrier(barrier_id=bar, number_of_threads=128)  # rq, rk, S^T', sO free

            warpgroup.fence()
            gemm(mma_ss, accP, tSrQ[None, None, None, stage], tSrK[None, None, None, stage], False)
            gemm(mma_ss, accO, tSrQ[None, None, None, stage], tOrS, False)
            # the state update needs only this chunk's v and k: issue it before waiting on P
            decay_L = powers[L]
            for i in cutlass.range_constexpr(cute.size(tUrV_hi)):
                s = cU[i][1]
                ws = powers[cutlass.max(L - 1 - s, 0)]
                if const_expr(QK_L2NORM):
                    ws = ws * rk[s]
                x = Float32(tUsV[None, None, None, v_half][i]) * cutlass.select_(s < L, ws, Float32(0.0))
                hi = BFloat16(x)
                tUrV_hi[i] = hi
                tUrV_lo[i] = BFloat16(x - Float32(hi))
            warpgroup.wait_group(0)
            for i in cutlass.range_constexpr(cute.size(accS)):
                accS[i] = accS[i] * decay_L
            warpgroup.fence()
            gemm(mma_st, accS, tUrV_hi, tUrK[None, None, None, stage], True)
            gemm(mma_st, accS, tUrV_lo, tUrK[None, None, None, stage], True)

            # P -> (scale rq_t rk_s exp((t - s) d) [s <= t]) P in bf16, the A operand of P V
            for i in cutlass.range_constexpr(cute.size(accP)):
                t, s = cP[i]
                if const_expr(QK_L2NORM):
                    tOrP[i] = BFloat16(accP[i] * (causal[i] * (scale * rq[t] * rk[s])))
                else:
                    tOrP[i] = BFloat16(accP[i] * causal[i])
            for i in cutlass.range_constexpr(cute.size(accO)):
                t = cP[i][0]
                if const_expr(QK_L2NORM):
                    accO[i] = accO[i] * (scale * rq[t] * powers[t + 1])
                else:
                    accO[i] = accO[i] * (scale * powers[t + 1])
            warpgroup.fence()
            gemm(mma_pv, accO, tOrP, tOrV[None, None, None, v_half], True)
            warpgroup.wait_group(0)
            loads.consumer_release(state)
            state.advance()

            finish_chunk(accO, tOsO, accS, tSsS, sO, out, thr_st, pool, checkpoint_indices, checkpoint_every,
                         num_checkpoints, n, hv, bos, j, w, L, tid, HAS_CKPT, store)
        output_read(tid)
        if const_expr(HAS_POOL):
            store_state(accS, thr_st, pool, slot, hv, w)
    else:
        zero_rows(sO, out, hv, bos, length, w, tid)  # padding: zero output rows, no state


@cute.kernel
def _lightning_kernel(
    tma_q: cute.CopyAtom, q_tiles: cute.Tensor, tma_k: cute.CopyAtom, k_tiles: cute.Tensor,
    tma_v: cute.CopyAtom, v_tiles: cute.Tensor,
    out: cute.Tensor, tma_o: cute.CopyAtom, o_tiles: cute.Tensor, pool: cute.Tensor, decay: cute.Tensor,
    cu_seqlens: cute.Tensor, state_indices: cute.Tensor,
    has_initial_state: cute.Tensor, checkpoint_indices: cute.Tensor, checkpoint_every: Int32, num_checkpoints: Int32,
    scale: Float32,
    GROUP: cutlass.Constexpr[int], HV: cutlass.Constexpr[int], QK_L2NORM: cutlass.Constexpr[bool],
    HAS_SLOTS: cutlass.Constexpr[bool], HAS_POOL: cutlass.Constexpr[bool], HAS_INIT_FLAGS: cutlass.Constexpr[bool],
    HAS_CKPT: cutlass.Constexpr[bool],
):
    """One (sequence, value head): blockIdx.x = sequence * HV + value head (module docstring)."""
    tidx = cute.arch.thread_idx()[0]
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    wg = warp // 4
    n, hv, h, bos, length, num_chunks, slot = block_sequence(cu_seqlens, state_indices, HV, GROUP, HAS_SLOTS)
    live = slot >= 0

    tile_layout = kmajor(C, HEAD_DIM, STAGES)
    v_layout = kmajor(C, HALF, 2 * STAGES)  # stage s holds v's column halves at 2 s and 2 s + 1
    state_layout = kmajor(HALF, HEAD_DIM, 2)  # one bf16 S^T' per consumer
    out_layout = kmajor(C, HALF, 2)  # one output tile per consumer

    @cute.struct
    class Shared:
        barriers: cute.struct.MemRange[Int64, STAGES * 2]
        sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(tile_layout)], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(tile_layout)], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(v_layout)], 1024]
        sS: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(state_layout)], 1024]
        sO: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(out_layout)], 1024]
        rq: cute.struct.MemRange[Float32, 2 * C]
        rk: cute.struct.MemRange[Float32, 2 * C]
        powers: cute.struct.MemRange[Float32, 2 * POWERS]

    storage = cutlass.utils.SmemAllocator().allocate(Shared)
    sQ = storage.sQ.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
    sK = storage.sK.get_tensor(tile_layout.outer, swizzle=tile_layout.inner)
    sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)

    loads = make_loads(storage.barriers.data_ptr())

    if wg == 0:
        cute.arch.warpgroup_reg_dealloc(PRODUCER_REGS)
        if warp == 0:
            if live:
                produce(((tma_q, q_tiles, h, sQ, HEAD_DIM), (tma_k, k_tiles, h, sK, HEAD_DIM)),
                        (tma_v, v_tiles, sV), loads, bos, num_chunks, hv)
    else:
        cute.arch.warpgroup_reg_alloc(CONSUMER_REGS)
        _consume(storage, sQ, sK, sV, loads, wg - 1, tidx - 128 * wg, out, tma_o, o_tiles, pool, decay,
                 has_initial_state, checkpoint_indices, checkpoint_every, num_checkpoints, scale, n, hv, bos, length,
                 num_chunks, slot, live, state_layout, out_layout, QK_L2NORM, HAS_POOL, HAS_INIT_FLAGS, HAS_CKPT)


@cute.jit
def _launch(
    q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, o_ptr: cute.Pointer, pool_ptr: cute.Pointer,
    decay_ptr: cute.Pointer, cu_ptr: cute.Pointer, indices_ptr: cute.Pointer, init_ptr: cute.Pointer,
    ckpt_ptr: cute.Pointer,
    T: Int32, N: Int32, P: Int32, num_checkpoints: Int32, checkpoint_every: Int32, checkpoint_stride: Int32,
    scale: Float32, stream: cuda.CUstream,
    STRIDES: cutlass.Constexpr[tuple], H: cutlass.Constexpr[int], HV: cutlass.Constexpr[int],
    QK_L2NORM: cutlass.Constexpr[bool], HAS_SLOTS: cutlass.Constexpr[bool], HAS_POOL: cutlass.Constexpr[bool],
    HAS_INIT_FLAGS: cutlass.Constexpr[bool], HAS_CKPT: cutlass.Constexpr[bool],
):
    """Views of the raw pointers, the TMA descriptors and the launch. STRIDES are compile-time
    (``cute_prefill.strides`` says why), which leaves the launch 7 scalars to pass instead of 17."""
    (tma_q, q_tiles, tma_k, k_tiles, tma_v, v_tiles, o, tma_o, o_tiles, pool, cu_seqlens, state_indices,
     has_initial_state, checkpoint_indices) = tensor_views(q_ptr, k_ptr, v_ptr, o_ptr, pool_ptr, cu_ptr, indices_ptr,
                                                           init_ptr, ckpt_ptr, T, N, P, num_checkpoints,
                                                           checkpoint_stride, STRIDES, H, HV)
    decay = cute.make_tensor(decay_ptr, cute.make_layout(HV))
    _lightning_kernel(
        tma_q, q_tiles, tma_k, k_tiles, tma_v, v_tiles, o, tma_o, o_tiles, pool, decay, cu_seqlens, state_indices,
        has_initial_state, checkpoint_indices, checkpoint_every, num_checkpoints, scale,
        HV // H, HV, QK_L2NORM, HAS_SLOTS, HAS_POOL, HAS_INIT_FLAGS, HAS_CKPT,
    ).launch(grid=(N * HV, 1, 1), block=(THREADS, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# host side

_POINTERS = ("q", "k", "v", "out", "pool", "decay", "cu_seqlens", "state_indices", "has_initial_state",
             "checkpoint_indices")


def unsupported(q, k, v, out, pool) -> str | None:
    """Why this kernel cannot run these tensors (None when it can): ``cute_prefill.unsupported``."""
    return unsupported_rows("Lightning", q, k, v, out, pool)


def lightning_prefill(recipe: Recipe, q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices,
                      has_initial_state, out, checkpoint_every=None, checkpoint_indices=None):
    """Chunked prefill of Lightning attention over a packed varlen batch (``torch_backend.prefill``
    semantics; arguments as ``chunk_triton.lightning_prefill``'s without segments).

    q, k: [T, H, 128] bf16; v, out: [T, HV, 128] bf16 (rows 16-byte aligned: ``unsupported``);
    g: [HV] log decay d <= 0; state_pool [P, HV, 128, 128] float32 / bf16, K-last;
    cu_seqlens int32 [N + 1]; state_indices int32 [N]; has_initial_state bool [N];
    checkpoint_indices int32 [N, M]. Returns ``out``.

    Host work per call is kept small (it is not hidden behind the kernel when the GPU waits on
    it): one check, ten pointers, seven scalars; strides and flags are compile-time constants.
    """
    if recipe.mode != "lightning":
        raise ValueError(f"lightning_prefill: mode {recipe.mode!r} is not lightning")
    if beta is not None:
        raise ValueError("lightning_prefill: beta is not used by lightning")
    why = unsupported(q, k, v, out, state_pool)
    if why:
        raise ValueError(why)
    ckpt = checkpoints(state_pool, checkpoint_every, checkpoint_indices)
    check_index_dtypes(cu_seqlens, state_indices, has_initial_state, ckpt)
    # an absent tensor is never read (its HAS_* flag is off): a null int32 pointer stands in
    tensors = (q, k, v, out, out if state_pool is None else state_pool, g if g.dtype == torch.float32 else g.float(),
               cu_seqlens, state_indices, has_initial_state, ckpt)
    scalars, constexprs = launch_arguments(recipe, q, k, v, out, cu_seqlens, state_pool, state_indices,
                                           has_initial_state, ckpt, checkpoint_every)
    launch(_launch, _POINTERS, tensors, scalars, constexprs, q.device)
    return out
