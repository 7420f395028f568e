"""KDA's intra-chunk stage in one CuTe DSL kernel for SM90: from a chunk's q, k, g and beta, the
operands KDA's state pass streams (``chunk_cute._kda_kernel``): P, M^-1 and the decayed Q and K.

Per chunk of C = 64 rows and value head (``chunk_triton.py``'s docstring has the whole chunked
form), with G the chunk-local cumulative log gate (per channel, non-increasing down the chunk) and
q, k l2-normalised:

    P_ts = scale sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])    (s <= t)
    A_ts =       sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])    (s < t),    N = diag(beta) A
    M^-1 = (I + N)^-1,   Qd = scale exp(G) q,   Ke = exp(G) k,   Kd = exp(G_C - G) k

Nothing forms exp(-G) alone: it overflows float32 once a chunk's gates sum below -88. The chunk is
cut into four blocks of 16 rows; with b(t) the row before t's block (G_{-1} = 0) and e(t) its last
row, every element gets two factors at most 1,

    F_t = exp(G_t - G_b(t)),    H_t = exp(G_e(t) - G_t),

and the products take them as
- below the diagonal (t in block i, s in block j < i):
      exp(G_t - G_s) = F_t * exp(G_b(i) - G_e(j)) * H_s,
  one fp16 product per block of q F (or k F) against k H scaled per channel by the pair's vector
  in registers: all three factors <= 1, so fp16 (tf32's 11 significant bits) cannot overflow;
- on the diagonal: exp(G_t - G_s) = F_t / F_s, with k / F up to exp of the block's span. fp16 takes
  it while every channel of the block spans less than SPAN_LIMIT (e^8, well inside fp16's range,
  and F stays in its normal range). A block that spans more (engines' raw gates, tens per token,
  often do) is marked, and ``chunk_triton.kda_exact_diagonal`` computes it exactly afterwards (the
  exact split of ``_split_diag_block``), before the solve; it returns at once for unmarked blocks.
The state pass's operands come from the same factors, products of two factors <= 1 (an underflow
only where the true value is smaller still): exp(G_t) = F_t exp(G_b(t)), exp(G_C - G_t) = H_t
exp(G_C - G_e(t)).

One CTA of 128 threads per (chunk, value head), three CTAs an SM:
1. the l2 norms of q's and k's 64 rows (a lane per row, 16-byte loads), beta;
2. block by block, thread c sums channel c's gates (log2 units) and forms channel c of the tiles
   q F, k F, k H and k / F (fp16, 128-byte swizzled shared memory), the blocks' marks, then the
   pairs' and the blocks' vectors. A block's inputs (gates, q, k) are loaded while the block before
   is formed: loaded where used, every row waited for memory;
3. the ten 16 x 16 blocks of P and A on mma.sync (m16n8k16, fp16 in, float32 out), warp w blocks
   w, w + 4, w + 8 of ``BLOCKS``: P (whole rows, zeros above the diagonal) and N = diag(beta) A
   to global; Qd, Ke and Kd from the tiles times the blocks' vectors, in 16-byte stores.
Then ``chunk_triton.kda_exact_diagonal`` for the marked blocks and ``solve_cute.kda_solve`` (N to
M^-1 in 3xTF32, a kernel of its own: six CTAs an SM hide its serial substitutions, which inside
this kernel, at two CTAs an SM, cost more than N's round trip). Together they replace the Triton
gate pass, block kernel and exact diagonal and G's [T, HV, K] float32 round trip: G is written at
each chunk's last row only (the state pass's), but for the softplus gate, whose unbounded decays
mark most blocks: there every row, which ``kda_exact_diagonal`` then reads instead of summing the
gates again. H200, KDA 32 heads 4 x 8192 (profiler): this kernel 0.94 ms with prepared gates, where
the gate pass and block kernel it replaces took 0.26 and 1.09 (an earlier profile, BENCHMARKS.md);
the whole prefill 1.90 -> 1.53 ns per token-head.
"""
from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int8, Int32, const_expr
from cutlass.cute.nvgpu.warp import MmaF16BF16Op
import cuda.bindings.driver as cuda

from ..common.chunking import CHUNK_SIZE
from ..common.cute_prefill import HEAD_DIM, LOG2E, block_chunk, kmajor, launch, load_operand, pin
from ..common.prep import L2NORM_EPS, Recipe
from ..common.varlen import chunk_indices
from .chunk_triton import kda_exact_diagonal
from .recurrent_cute import GATE_NONE, GATE_SAFE, GATE_SOFTPLUS, _log_decay, _sigmoid, gate_kind
from .solve_cute import kda_solve

C = CHUNK_SIZE
K = HEAD_DIM
SUB = 16  # rows of a block
THREADS = 128  # a thread per channel while forming the tiles
# CTAs an SM must fit (the register cap follows): 74 KB of shared memory and at most 168 registers each
MIN_CTAS = 3
# a diagonal block's per-channel gate span that its fp16 product takes (k / F <= e^8 |k|)
SPAN_LIMIT = 8.0
LN2 = 0.6931471805599453
# the ten blocks (i, j <= i) of P and A, longest rows first; warp w takes blocks w, w + 4, w + 8
BLOCKS = ((3, 0), (3, 1), (3, 2), (3, 3), (2, 0), (2, 1), (2, 2), (1, 0), (1, 1), (0, 0))
BLOCK_CODES = sum((4 * i + j) << (4 * n) for n, (i, j) in enumerate(BLOCKS))  # 4 bits a block
PAIR_ROWS = 7  # the scale vectors of the blocks below the diagonal, (i, j) in row i (i - 1) / 2 + j, then ones
# The code is loops, not unrolled: unrolled (about 10,000 instructions) the warps missed the
# instruction cache 41% of the time (ncu, H200, KDA 32 heads 4 x 2048).


@cute.jit
def _row_norms(q: cute.Tensor, k: cute.Tensor, sRq: cute.Tensor, sRk: cute.Tensor, t0: Int32, L: Int32,
               h: Int32, warp: Int32, lane: Int32, QK_L2NORM: cutlass.Constexpr[bool]):
    """1 / |q_t| and 1 / |k_t| (l2, with eps) of the chunk's rows into sRq, sRk [C]: warp w rows
    16 w .. 16 w + 15, lanes 0 .. 15 q's and 16 .. 31 k's, a row each in 16-byte loads; 1 without
    QK_L2NORM."""
    row = warp * SUB + lane % SUB
    inv = Float32(1.0)
    if const_expr(QK_L2NORM):
        total = Float32(0.0)
        part = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
        src = t0 + cutlass.min(row, L - 1)
        for v in cutlass.range_constexpr(K // 8):
            if lane < SUB:
                cute.autovec_copy(cute.local_tile(q[src, h, None], (8,), (v,)), part)
            else:
                cute.autovec_copy(cute.local_tile(k[src, h, None], (8,), (v,)), part)
            for e in cutlass.range_constexpr(8):
                x = Float32(part[e])
                total += x * x
        inv = cute.math.rsqrt(total + Float32(L2NORM_EPS), fastmath=True)
    if lane < SUB:
        sRq[row] = inv
    else:
        sRk[row] = inv


@cute.jit
def _load_inputs(g: cute.Tensor, q: cute.Tensor, k: cute.Tensor, dst: cute.Tensor, t0: Int32, row0: Int32, L: Int32,
                 h: Int32, hv: Int32, c: Int32):
    """Channel c of rows row0 .. row0 + 15 (the last valid row's in place of rows past L) of the
    gate inputs, q and k into ``dst`` [48] float32, in that order."""
    for r in cutlass.range_constexpr(SUB):
        row = t0 + cutlass.min(row0 + r, L - 1)
        dst[r] = Float32(g[row, hv, c])
        dst[SUB + r] = Float32(q[row, h, c])
        dst[2 * SUB + r] = Float32(k[row, h, c])


@cute.jit
def _b_operand(mma: cute.TiledMma, thr, tile: cute.Tensor, vector: cute.Tensor, lane: Int32):
    """One 16-row block as an mma's B operand (``tile``: [16, K] fp16, K contiguous; ldmatrix),
    each element times ``vector`` [K] at its channel."""
    fragment = mma.make_fragment_B(thr.partition_shape_B((SUB, K)))
    load_operand(tile, fragment, mma, lane, False, True)
    coords = thr.partition_B(cute.make_identity_tensor((SUB, K)))
    for e in cutlass.range_constexpr(cute.size(fragment)):
        fragment[e] = Float16(Float32(fragment[e]) * vector[coords[e][1]])
    return fragment


@cute.jit
def _warp_blocks(sQF: cute.Tensor, sKF: cute.Tensor, sKHR: cute.Tensor, sPairs: cute.Tensor, sBeta: cute.Tensor,
                 P: cute.Tensor, N_ws: cute.Tensor, scale: Float32, t0: Int32, L: Int32, hv: Int32, warp: Int32,
                 lane: Int32):
    """This warp's blocks (i, j) of P and A (step 3 of the module docstring), their rows t < L to
    global: P scaled (zeros above the diagonal within a diagonal block), N = beta_t A_ts. The B
    operand is k H of block j scaled by the pair's vector, or on the diagonal k / F (rows C + 16 i
    of ``sKHR``) times ones."""
    mma = cute.make_tiled_mma(MmaF16BF16Op(Float16, Float32, (16, 8, 16)), permutation_mnk=(SUB, SUB, K))
    thr = mma.get_slice(lane)
    coords = thr.partition_C(cute.make_identity_tensor((SUB, SUB)))
    for n in cutlass.range(warp, len(BLOCKS), 4, unroll=1):
        code = Int32((cutlass.Int64(BLOCK_CODES) >> (4 * n)) & 15)
        i = code // 4
        j = code % 4
        diagonal = i == j
        a_q = mma.make_fragment_A(thr.partition_shape_A((SUB, K)))
        a_k = mma.make_fragment_A(thr.partition_shape_A((SUB, K)))
        load_operand(cute.local_tile(sQF, (SUB, K), (i, 0)), a_q, mma, lane, True)
        load_operand(cute.local_tile(sKF, (SUB, K), (i, 0)), a_k, mma, lane, True)
        pair = cutlass.select_(diagonal, Int32(PAIR_ROWS - 1), i * (i - 1) // 2 + j)
        b_rows = cutlass.select_(diagonal, C // SUB + i, j)  # k / F of block i, or k H of block j
        fragment = _b_operand(mma, thr, cute.local_tile(sKHR, (SUB, K), (b_rows, 0)), sPairs[pair, None], lane)
        acc_p = cute.make_rmem_tensor(thr.partition_shape_C((SUB, SUB)), Float32)
        acc_a = cute.make_rmem_tensor(thr.partition_shape_C((SUB, SUB)), Float32)
        acc_p.fill(0.0)
        acc_a.fill(0.0)
        cute.gemm(mma, acc_p, a_q, fragment, acc_p)
        cute.gemm(mma, acc_a, a_k, fragment, acc_a)
        for e in cutlass.range_constexpr(cute.size(acc_p) // 2):
            r, s = coords[2 * e]  # elements 2 e and 2 e + 1: columns s and s + 1 of row r
            row = i * SUB + r
            if row < L:
                p_pair = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
                n_pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
                b = sBeta[row]
                for x in cutlass.range_constexpr(2):
                    above = diagonal & (s + x > r)
                    p_pair[x] = BFloat16(cutlass.select_(above, Float32(0.0), scale * acc_p[2 * e + x]))
                    n_pair[x] = b * acc_a[2 * e + x]
                col = j * SUB + s
                cute.autovec_copy(p_pair, cute.local_tile(P[t0 + row, hv, None], (2,), (col // 2,)))
                cute.autovec_copy(n_pair, cute.local_tile(N_ws[t0 + row, hv, None], (2,), (col // 2,)))


@cute.jit
def _state_operands(sQF: cute.Tensor, sKF: cute.Tensor, sKHR: cute.Tensor, sLift: cute.Tensor,
                    sSettle: cute.Tensor, Qd: cute.Tensor, Ke: cute.Tensor, Kd: cute.Tensor, scale: Float32,
                    t0: Int32, L: Int32, hv: Int32, tid: Int32):
    """The state pass's rows t < L from the tiles (step 3): Qd = scale (q F) exp(G_b), Ke = (k F)
    exp(G_b), Kd = (k H) exp(G_C - G_e), ``sLift`` and ``sSettle`` [4, K] holding the two vectors of
    each block; eight channels of a row a thread, 16-byte loads and stores."""
    per_row = K // 8
    for p in cutlass.range(C * per_row // THREADS, unroll=1):
        row = (p * THREADS + tid) // per_row
        v = (p * THREADS + tid) % per_row
        if row < L:
            block = row // SUB
            qf = cute.make_rmem_tensor(cute.make_layout(8), Float16)
            kf = cute.make_rmem_tensor(cute.make_layout(8), Float16)
            kh = cute.make_rmem_tensor(cute.make_layout(8), Float16)
            lift = cute.make_rmem_tensor(cute.make_layout(8), Float32)
            settle = cute.make_rmem_tensor(cute.make_layout(8), Float32)
            cute.autovec_copy(cute.local_tile(sQF[row, None], (8,), (v,)), qf)
            cute.autovec_copy(cute.local_tile(sKF[row, None], (8,), (v,)), kf)
            cute.autovec_copy(cute.local_tile(sKHR[row, None], (8,), (v,)), kh)
            cute.autovec_copy(cute.local_tile(sLift[block, None], (8,), (v,)), lift)
            cute.autovec_copy(cute.local_tile(sSettle[block, None], (8,), (v,)), settle)
            qd = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            ke = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            kd = cute.make_rmem_tensor(cute.make_layout(8), Float16)
            for e in cutlass.range_constexpr(8):
                qd[e] = BFloat16(scale * Float32(qf[e]) * lift[e])
                ke[e] = BFloat16(Float32(kf[e]) * lift[e])
                kd[e] = Float16(Float32(kh[e]) * settle[e])
            cute.autovec_copy(qd, cute.local_tile(Qd[t0 + row, hv, None], (8,), (v,)))
            cute.autovec_copy(ke, cute.local_tile(Ke[t0 + row, hv, None], (8,), (v,)))
            cute.autovec_copy(kd, cute.local_tile(Kd[t0 + row, hv, None], (8,), (v,)))


@cute.kernel
def _intra_kernel(q: cute.Tensor, k: cute.Tensor, g: cute.Tensor, beta: cute.Tensor, A_log: cute.Tensor,
                  dt_bias: cute.Tensor, cu_seqlens: cute.Tensor, table: cute.Tensor, state_indices: cute.Tensor,
                  P: cute.Tensor, N_ws: cute.Tensor, Qd: cute.Tensor, Ke: cute.Tensor, Kd: cute.Tensor,
                  G_ws: cute.Tensor, marks: cute.Tensor, scale: Float32,
                  HV: cutlass.Constexpr[int], GROUP: cutlass.Constexpr[int], QK_L2NORM: cutlass.Constexpr[bool],
                  GATE: cutlass.Constexpr[int], HAS_DT_BIAS: cutlass.Constexpr[bool],
                  LOWER_BOUND: cutlass.Constexpr[float], BETA_LOGITS: cutlass.Constexpr[bool],
                  HAS_SLOTS: cutlass.Constexpr[bool]):
    """One (chunk, value head), blockIdx.x = chunk id * HV + value head (module docstring)."""
    tid = cute.arch.thread_idx()[0]
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = tid % 32
    bid, chunk, hv, seq, live = block_chunk(table, state_indices, HV, HAS_SLOTS)

    blocks = C // SUB

    @cute.struct
    class Shared:
        qf: cute.struct.Align[cute.struct.MemRange[Float16, C * K], 1024]
        kf: cute.struct.Align[cute.struct.MemRange[Float16, C * K], 1024]
        khr: cute.struct.Align[cute.struct.MemRange[Float16, 2 * C * K], 1024]  # k H, then k / F
        pairs: cute.struct.Align[cute.struct.MemRange[Float32, PAIR_ROWS * K], 16]
        ends: cute.struct.Align[cute.struct.MemRange[Float32, 3 * blocks * K], 16]  # G_e, exp(G_b), exp(G_C - G_e)
        rows: cute.struct.Align[cute.struct.MemRange[Float32, 3 * C], 16]
        flags: cute.struct.MemRange[Int32, 4 * blocks]

    storage = cutlass.utils.SmemAllocator().allocate(Shared)
    # 128-byte swizzled rows: the 8 rows of an ldmatrix, or of a B fragment's loads, in distinct banks
    tile = kmajor(C, K)
    sQF = storage.qf.get_tensor(tile.outer, swizzle=tile.inner)
    sKF = storage.kf.get_tensor(tile.outer, swizzle=tile.inner)
    tiles2 = kmajor(2 * C, K)
    sKHR = storage.khr.get_tensor(tiles2.outer, swizzle=tiles2.inner)
    sPairs = cute.make_tensor(storage.pairs.data_ptr(), cute.make_layout((PAIR_ROWS, K), stride=(K, 1)))
    block_vectors = cute.make_layout((blocks, K), stride=(K, 1))
    sEnds, sLift, sSettle = (cute.make_tensor(storage.ends.data_ptr() + e * blocks * K, block_vectors)
                             for e in range(3))
    rows = storage.rows.data_ptr()
    sRq, sRk, sBeta = (cute.make_tensor(rows + e * C, cute.make_layout(C)) for e in range(3))
    sFlags = cute.make_tensor(storage.flags.data_ptr(), cute.make_layout((4, blocks), stride=(blocks, 1)))

    marked = Int32(0)
    if live:
        t0 = cu_seqlens[seq] + table[chunk, 1] * C
        L = cutlass.min(cu_seqlens[seq + 1] - t0, C)
        h = hv // GROUP
        c = tid

        # 1. norms; beta
        _row_norms(q, k, sRq, sRk, t0, L, h, warp, lane, QK_L2NORM)
        if tid < C:
            b = Float32(beta[t0 + cutlass.min(tid, L - 1), hv])
            if const_expr(BETA_LOGITS):
                b = _sigmoid(b)
            sBeta[tid] = cutlass.select_(tid < L, b, Float32(0.0))
        A = Float32(0.0)
        bias = Float32(0.0)
        if const_expr(GATE != GATE_NONE):
            A = cute.math.exp(Float32(A_log[hv]), fastmath=True)
            if const_expr(HAS_DT_BIAS):
                bias = Float32(dt_bias[hv * K + c])
        cute.arch.barrier(barrier_id=0, number_of_threads=THREADS)

        # 2. block by block, channel c's gates summed down the chunk (log2 units; rows past L add
        # nothing), then its tiles
        # a block's inputs (gates, q, k: channel c of 16 rows) are loaded during the block before
        # and pinned at its start; loaded where used, they made every row wait for memory
        inputs = cute.make_rmem_tensor(cute.make_layout(3 * SUB), Float32)
        _load_inputs(g, q, k, inputs, t0, 0, L, h, hv, c)
        G = Float32(0.0)
        for i in cutlass.range(blocks, unroll=1):
            pin(inputs)
            values = [inputs[e] for e in range(3 * SUB)]
            _load_inputs(g, q, k, inputs, t0, cutlass.min(i + 1, blocks - 1) * SUB, L, h, hv, c)
            start = G
            Gb = []
            for r in cutlass.range_constexpr(SUB):
                G = G + cutlass.select_(i * SUB + r < L, _log_decay(values[r], bias, A, Float32(LOWER_BOUND), GATE)
                                        * Float32(LOG2E), Float32(0.0))
                Gb.append(G)
            sEnds[i, c] = G
            sLift[i, c] = cute.math.exp2(start, fastmath=True)
            over = cute.arch.vote_any_sync(start - G >= Float32(SPAN_LIMIT * LOG2E))
            if lane == 0:
                sFlags[warp, i] = cutlass.select_(over, Int32(1), Int32(0))
            for r in cutlass.range_constexpr(SUB):
                t = i * SUB + r
                qv = cutlass.select_(t < L, values[SUB + r] * sRq[t], Float32(0.0))
                kv = cutlass.select_(t < L, values[2 * SUB + r] * sRk[t], Float32(0.0))
                f = cute.math.exp2(Gb[r] - start, fastmath=True)
                sQF[t, c] = Float16(qv * f)
                sKF[t, c] = Float16(kv * f)
                sKHR[t, c] = Float16(kv * cute.math.exp2(G - Gb[r], fastmath=True))
                sKHR[C + t, c] = Float16(kv * cute.arch.rcp_approx(f))
                if const_expr(GATE == GATE_SOFTPLUS):
                    if t < L:
                        G_ws[t0 + t, hv, c] = Gb[r] * Float32(LN2)
        if const_expr(GATE != GATE_SOFTPLUS):
            G_ws[t0 + L - 1, hv, c] = G * Float32(LN2)
        for i in cutlass.range_constexpr(blocks):
            sSettle[i, c] = cute.math.exp2(G - sEnds[i, c], fastmath=True)
        for p in cutlass.range_constexpr(PAIR_ROWS - 1):
            i = 1 + (p >= 1) + (p >= 3)
            j = p - i * (i - 1) // 2
            sPairs[p, c] = cute.math.exp2(sEnds[i - 1, c] - sEnds[j, c], fastmath=True)
        sPairs[PAIR_ROWS - 1, c] = Float32(1.0)
        cute.arch.barrier(barrier_id=0, number_of_threads=THREADS)
        for i in cutlass.range_constexpr(blocks):
            marked = marked | ((sFlags[0, i] | sFlags[1, i] | sFlags[2, i] | sFlags[3, i]) << i)

        # 3. P and N; the state pass's operands
        _warp_blocks(sQF, sKF, sKHR, sPairs, sBeta, P, N_ws, scale, t0, L, hv, warp, lane)
        _state_operands(sQF, sKF, sKHR, sLift, sSettle, Qd, Ke, Kd, scale, t0, L, hv, tid)
        # P's blocks above the diagonal: zeros, so that whole rows can be read
        r = tid // 2
        if r < L:
            zeros = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            zeros.fill(0.0)
            for v in cutlass.range_constexpr(C // 16):
                col = (tid % 2) * (C // 2) + 8 * v
                if col >= SUB * (r // SUB + 1):
                    cute.autovec_copy(zeros, cute.local_tile(P[t0 + r, hv, None], (8,), (col // 8,)))
    if tid < C // SUB:
        marks[bid, tid] = Int8((marked >> tid) & 1)


@cute.jit
def _launch(q_ptr: cute.Pointer, k_ptr: cute.Pointer, g_ptr: cute.Pointer, beta_ptr: cute.Pointer,
            A_log_ptr: cute.Pointer, dt_bias_ptr: cute.Pointer, cu_ptr: cute.Pointer, table_ptr: cute.Pointer,
            indices_ptr: cute.Pointer, p_ptr: cute.Pointer, n_ptr: cute.Pointer, qd_ptr: cute.Pointer,
            ke_ptr: cute.Pointer, kd_ptr: cute.Pointer, G_ptr: cute.Pointer, marks_ptr: cute.Pointer,
            T: Int32, N: Int32, P: Int32, num_checkpoints: Int32, checkpoint_every: Int32,
            checkpoint_stride: Int32, scale: Float32, num_ids: Int32, stream: cuda.CUstream,
            STRIDES: cutlass.Constexpr[tuple], H: cutlass.Constexpr[int], HV: cutlass.Constexpr[int],
            QK_L2NORM: cutlass.Constexpr[bool], GATE: cutlass.Constexpr[int], HAS_DT_BIAS: cutlass.Constexpr[bool],
            LOWER_BOUND: cutlass.Constexpr[float], BETA_LOGITS: cutlass.Constexpr[bool],
            HAS_SLOTS: cutlass.Constexpr[bool]):
    """Views of the raw pointers and the launch of ``_intra_kernel`` (num_ids x HV CTAs). q, k [T,
    H, K] bf16 and g [T, HV, K], beta [T, HV] at STRIDES (q's, k's, g's, beta's; K contiguous);
    A_log float32 [HV], dt_bias float32 [HV, K]; the chunk table int32 [num_ids, 2]; P, N [T, HV, C]
    and Qd, Ke, Kd, G [T, HV, K] contiguous; marks int8 [num_ids x HV, 4]. P, num_checkpoints,
    checkpoint_every and checkpoint_stride: unused (``cute_prefill.launch``'s scalars)."""
    q_strides, k_strides, g_strides, beta_strides = STRIDES
    q = cute.make_tensor(q_ptr, cute.make_layout((T, H, K), stride=q_strides))
    k = cute.make_tensor(k_ptr, cute.make_layout((T, H, K), stride=k_strides))
    g = cute.make_tensor(g_ptr, cute.make_layout((T, HV, K), stride=g_strides))
    beta = cute.make_tensor(beta_ptr, cute.make_layout((T, HV), stride=beta_strides))
    A_log = cute.make_tensor(A_log_ptr, cute.make_layout(HV))
    dt_bias = cute.make_tensor(dt_bias_ptr, cute.make_layout(HV * K))
    cu_seqlens = cute.make_tensor(cu_ptr, cute.make_layout(N + 1))
    table = cute.make_tensor(table_ptr, cute.make_layout((num_ids, 2), stride=(2, 1)))
    state_indices = cute.make_tensor(indices_ptr, cute.make_layout(N))
    rows = cute.make_layout((T, HV, C), stride=(HV * C, C, 1))
    columns = cute.make_layout((T, HV, K), stride=(HV * K, K, 1))
    P_ws, N_ws = (cute.make_tensor(ptr, rows) for ptr in (p_ptr, n_ptr))
    Qd, Ke, Kd, G_ws = (cute.make_tensor(ptr, columns) for ptr in (qd_ptr, ke_ptr, kd_ptr, G_ptr))
    marks = cute.make_tensor(marks_ptr, cute.make_layout((num_ids * HV, 4), stride=(4, 1)))
    _intra_kernel(q, k, g, beta, A_log, dt_bias, cu_seqlens, table, state_indices, P_ws, N_ws, Qd, Ke, Kd, G_ws,
                  marks, scale, HV, HV // H, QK_L2NORM, GATE, HAS_DT_BIAS, LOWER_BOUND, BETA_LOGITS, HAS_SLOTS).launch(
        grid=(num_ids * HV, 1, 1), block=(THREADS, 1, 1), stream=stream, min_blocks_per_mp=MIN_CTAS,
        preferred_smem_carveout=100)


_POINTERS = ("q", "k", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "table", "state_indices", "P", "N", "Qd", "Ke",
             "Kd", "G", "marks")


def _rows_aligned(x: torch.Tensor) -> torch.Tensor:
    """x with its last dimension contiguous and 16-byte aligned rows (the norms' loads), copied if not."""
    if x.stride(-1) != 1 or x.data_ptr() % 16 or any(s % 8 for s in x.stride()[:-1]):
        return x.contiguous()
    return x


def kda_chunk_operands(recipe: Recipe, q, k, g, beta, *, cu_seqlens, state_indices) -> dict:
    """KDA's per-chunk operands for the CuTe DSL state pass (``chunk_cute.kda_prefill``), as
    [T, HV, ...] tensors with rows packed as the tokens (each chunk's rows t < L only: a chunk's rows
    past its sequence's end are the next sequence's, or never written for padding sequences):

        P   bf16 [T, HV, C]    scale q_t . k_s exp(G_t - G_s) / (|q_t| |k_s|)  (s <= t, zeros above)
        T   fp16 [T, HV, C]    M^-1 = (I + diag(beta) A)^-1 (unit lower triangular, zeros above)
        Qd  bf16 [T, HV, K]    scale exp(G) Q / |q|
        Ke  bf16 [T, HV, K]    exp(G) K / |k|
        Kd  fp16 [T, HV, K]    exp(G_C - G) K / |k|      (G_C: G at the chunk's last valid row)
        G   float32 [T, HV, K] G: at each chunk's last valid row (G_C) only, or with the
                               softplus gate every row t < L (what ``kda_exact_diagonal`` reads:
                               that unbounded gate marks most blocks)

    q, k: [T, H, K] bf16 (K = 128); g: [T, HV, K] float32 / bf16, the log decay or with
    ``recipe.fused_gate`` the raw projection; beta: [T, HV] float32 / bf16 (logits with
    ``recipe.beta_logits``); cu_seqlens int32 [N + 1]; state_indices int32 [N] or None (negative:
    padding, nothing read or written)."""
    T, H, _ = q.shape
    HV = beta.shape[1]
    device = q.device
    empty = lambda dims, dtype: torch.empty(T, HV, dims, dtype=dtype, device=device)  # noqa: E731
    out = dict(P=empty(C, torch.bfloat16), T=empty(C, torch.float16), Qd=empty(K, torch.bfloat16),
               Ke=empty(K, torch.bfloat16), Kd=empty(K, torch.float16), G=empty(K, torch.float32))
    N_ws = empty(C, torch.float32)
    table = chunk_indices(cu_seqlens, T, C)
    marks = torch.empty(table.shape[0] * HV, C // SUB, dtype=torch.int8, device=device)  # every byte written
    q_rows, k_rows = _rows_aligned(q), _rows_aligned(k)
    if g.stride(-1) != 1:
        g = g.contiguous()
    gate = recipe.fused_gate
    A_log = dt_bias = None
    if gate is not None:
        A_log = gate.A_log.float().contiguous()
        dt_bias = None if gate.dt_bias is None else gate.dt_bias.float().contiguous()
    kind = gate_kind(gate)
    tensors = (q_rows, k_rows, g, beta, A_log, dt_bias, cu_seqlens, table, state_indices, out["P"], N_ws,
               out["Qd"], out["Ke"], out["Kd"], out["G"], marks)
    constexprs = (("STRIDES", (q_rows.stride(), k_rows.stride(), g.stride(), beta.stride())), ("H", H), ("HV", HV),
                  ("QK_L2NORM", recipe.qk_l2norm), ("GATE", kind), ("HAS_DT_BIAS", dt_bias is not None),
                  ("LOWER_BOUND", float(gate.lower_bound) if kind == GATE_SAFE else 0.0),
                  ("BETA_LOGITS", recipe.beta_logits), ("HAS_SLOTS", state_indices is not None))
    launch(_launch, _POINTERS, tensors, (T, cu_seqlens.shape[0] - 1, 1, 0, C, 0, recipe.scale, table.shape[0]),
           constexprs, device)
    kda_exact_diagonal(recipe, q, k, g, beta, cu_seqlens, table, state_indices, out["P"], N_ws, marks,
                       G_ws=out["G"] if kind == GATE_SOFTPLUS else None)
    kda_solve(N_ws, out["T"], table, cu_seqlens, state_indices)
    return out
