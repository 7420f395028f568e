"""KDA's per-chunk triangular solve in CuTe DSL for SM90: M^-1 = (I + N)^-1 on the tensor cores, as
accurate as float32 (three tf32 products per product, "3xTF32").

N is the strictly lower triangular C x C matrix diag(beta) A of one chunk (``chunk_triton.py``'s
docstring: A_ts = sum_k k_t[k] k_s[k] exp(G_t[k] - G_s[k]) / (|k_t| |k_s|), s < t), float32, as
KDA's block kernels write it; M^-1 is unit lower triangular. Per chunk and value head, one CTA of
four warps, in 16 x 16 blocks (i, j: rows 16 i .., columns 16 j ..):

1. the diagonal blocks (M^-1)_ii = (I + N_ii)^-1 by forward substitution in float32 (warp i, a
   lane per column: x_t = [t = c] - sum_{m < t} N_tm x_m);
2. the blocks below them in two doublings, X_RC = -(X_RR N_RC) X_CC for the rows R and columns C
   of a diagonal block's lower left part: the 16 x 16 ones of the two 32-row blocks, then the
   lower left 32 x 32 (that is (M^-1)_ij = -(M^-1)_ii sum_{j <= m < i} N_im (M^-1)_mj, the
   blocked substitution, in three dependent steps);
3. the rows t < L of M^-1 (zeros above the diagonal) into the fp16 workspace the CuTe DSL state
   pass reads (``chunk_cute._kda_kernel``).

The doublings' products run on mma.sync m16n8k8 with tf32 operands and float32 accumulation, each
operand x split into hi = rn_tf32(x) and lo = rn_tf32(x - hi) and the product taken as hi hi +
hi lo + lo hi: what it drops is about 2^-21 of each operand, against tf32's 2^-11. The solve sets
the accuracy of everything after it: with keys correlated within a chunk M^-1 has large entries, and
tf32's 11 bits there multiplied the final states' error by 2 to 6 (BENCHMARKS 2026-11-27 02:05,
``chunk_triton._mm``). ``chunk_triton._invert_chunk`` computes the same blocks with IEEE float32
products on the CUDA cores, bound by the layout conversions of its 16 x 16 products (ncu: the L1 /
shared pipe 91% busy): the Triton backend keeps it, KDA's Hopper prefill runs this kernel.

One chunk per CTA (128 threads, 72 registers, 35 KB of shared memory: six CTAs an SM); the warps of
a pair split each doubling's first product by columns and share it through N's upper right quarter,
which nothing else reads (nor loads: it lies above the diagonal). X above its diagonal is zeroed
only where the doublings read it; the store masks the rest. H200, KDA 32 heads 4 x 8192 (profiler,
ms): Triton's inverse 0.404, this kernel 0.220 (0.256 with X zeroed and N loaded whole, 0.267 with
each warp computing its pair's first product whole, 44 KB a CTA); the whole prefill 2.08 -> 1.90
ns per token-head. Its M^-1 matches Triton's IEEE one to 6.5e-7
(relative), and the prefill's errors against the float64 oracle are unchanged, correlated keys
included. ncu (the first version): the L1 / shared pipe 87% busy, DRAM 30%, 12.2 cycles per
issued instruction of a warp: bound by the shared-memory accesses of its 16 x 16 blocks, not by
its bytes (about 0.1 ms at HBM bandwidth).
"""
from __future__ import annotations

import contextlib
import functools

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T
from cutlass.cute.nvgpu.warp import MmaTF32Op
import cuda.bindings.driver as cuda

from ..common.chunking import CHUNK_SIZE
from ..common.cute_prefill import block_chunk, block_view, transposed
from .recurrent_cute import compile_launcher

C = CHUNK_SIZE
SUB = 16  # rows of a diagonal block, and of each warp's product
THREADS = 128
# float32 row stride of the shared matrices: the A fragments' 8 rows x 4 columns of a load fall in 32
# distinct banks (68 = 4 mod 32); the B fragments' transposed reads keep two-way conflicts
ROW = C + 4


@cute.jit
def _tf32(x: Float32) -> Int32:
    """The bits of x rounded to tf32 (10 stored mantissa bits, to nearest): an mma operand."""
    return Int32(llvm.inline_asm(T.i32(), [Float32(x).ir_value()], "cvt.rna.tf32.f32 $0, $1;", "=r,f",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def _split(src: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor):
    """hi and lo tf32 parts of each float32 element of ``src`` (a partitioned shared-memory view)."""
    for i in cutlass.range_constexpr(cute.size(hi)):
        x = Float32(src[i])
        h = _tf32(x)
        hi[i] = h
        lo[i] = _tf32(x - Float32(llvm.bitcast(T.f32(), h.ir_value())))


@cute.jit
def _product(A: cute.Tensor, Bt: cute.Tensor, lane: Int32):
    """One warp's A B (A [16, K], B^T = Bt [N, K], float32 in shared memory) in 3xTF32: the
    accumulator fragment and its (row, column) coordinates."""
    k = cute.size(A.shape[1])
    n = cute.size(Bt.shape[0])
    mma = cute.make_tiled_mma(MmaTF32Op((16, 8, 8)), permutation_mnk=(SUB, n, k))
    thr = mma.get_slice(lane)
    a_hi = mma.make_fragment_A(thr.partition_shape_A(A.shape))
    a_lo = mma.make_fragment_A(thr.partition_shape_A(A.shape))
    b_hi = mma.make_fragment_B(thr.partition_shape_B(Bt.shape))
    b_lo = mma.make_fragment_B(thr.partition_shape_B(Bt.shape))
    _split(thr.partition_A(A), a_hi, a_lo)
    _split(thr.partition_B(Bt), b_hi, b_lo)
    acc = cute.make_rmem_tensor(thr.partition_shape_C((SUB, n)), Float32)
    acc.fill(0.0)
    # the small terms first
    cute.gemm(mma, acc, a_lo, b_hi, acc)
    cute.gemm(mma, acc, a_hi, b_lo, acc)
    cute.gemm(mma, acc, a_hi, b_hi, acc)
    return acc, thr.partition_C(cute.make_identity_tensor((SUB, n)))


@cute.jit
def _double(X: cute.Tensor, Nc: cute.Tensor, Zt: cute.Tensor, scratch: cute.Tensor, sX: cute.Tensor, row0,
            col0, lane: Int32, half: Int32, pair: Int32):
    """A warp pair's block -(X Nc) Z of M^-1 (X [16, K1], Nc [K1, N1], Z^T = Zt [N2, N1]), this warp's
    part: half ``half`` of X Nc's columns into the pair's ``scratch`` [16, N1] (an accumulator's
    layout is not the next product's A operand's at tf32), then, once the pair has written it,
    scratch Z into sX[row0 .., col0 ..]."""
    n1 = cute.size(Nc.shape[1])
    part, coords = _product(X, transposed(cute.local_tile(Nc, (cute.size(Nc.shape[0]), n1 // 2), (0, half))),
                            lane)
    for i in cutlass.range_constexpr(cute.size(part)):
        r, c = coords[i]
        scratch[r, half * (n1 // 2) + c] = part[i]
    cute.arch.barrier(barrier_id=1 + pair, number_of_threads=64)
    result, coords = _product(cute.local_tile(scratch, (SUB, n1), (0, 0)), Zt, lane)
    for i in cutlass.range_constexpr(cute.size(result)):
        r, c = coords[i]
        sX[row0 + r, col0 + c] = -result[i]


@cute.jit
def _diagonal_block(sN: cute.Tensor, sX: cute.Tensor, base: Int32, c: Int32):
    """Column c of (I + N_bb)^-1 for the diagonal block at rows / columns base .. base + 15, by
    forward substitution in float32 (left-looking: each x_t from the x_m before it)."""
    row = cute.make_rmem_tensor(cute.make_layout(SUB), Float32)
    x = []
    for t in cutlass.range_constexpr(SUB):
        cute.autovec_copy(cute.local_tile(sN[base + t, None], (SUB,), (base // SUB,)), row)  # one row, broadcast
        acc = cutlass.select_(c == t, Float32(1.0), Float32(0.0))
        for m in cutlass.range_constexpr(t):
            acc = acc - row[m] * x[m]
        x.append(acc)
    for t in cutlass.range_constexpr(SUB):
        sX[base + t, base + c] = x[t]


@cute.jit
def _store_half_row(sX: cute.Tensor, t_ws: cute.Tensor, t0: Int32, r: Int32, hv: Int32, half: Int32):
    """Half ``half`` of row r of M^-1 in fp16 to token t0 + r's row of ``t_ws``, zeros above the
    diagonal (where sX holds zeros, the scratch, or nothing written)."""
    row = cute.make_rmem_tensor(cute.make_layout(C // 2), Float32)
    row.fill(0.0)
    if half * (C // 2) <= r:
        cute.autovec_copy(cute.local_tile(sX[r, None], (C // 2,), (half,)), row)
    out = cute.make_rmem_tensor(cute.make_layout(C // 2), Float16)
    for e in cutlass.range_constexpr(C // 2):
        out[e] = Float16(cutlass.select_(half * (C // 2) + e <= r, row[e], Float32(0.0)))
    cute.autovec_copy(out, cute.local_tile(t_ws[t0 + r, hv, None], (C // 2,), (half,)))


@cute.kernel
def _solve_kernel(n_ws: cute.Tensor, t_ws: cute.Tensor, table: cute.Tensor, cu_seqlens: cute.Tensor,
                  state_indices: cute.Tensor, HV: cutlass.Constexpr[int], HAS_SLOTS: cutlass.Constexpr[bool]):
    """One (chunk, value head), blockIdx.x = chunk id * HV + value head (module docstring)."""
    tid = cute.arch.thread_idx()[0]
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = tid % 32
    bid, chunk, hv, seq, live = block_chunk(table, state_indices, HV, HAS_SLOTS)

    @cute.struct
    class Shared:
        n: cute.struct.Align[cute.struct.MemRange[Float32, C * ROW], 16]
        x: cute.struct.Align[cute.struct.MemRange[Float32, C * ROW], 16]

    storage = cutlass.utils.SmemAllocator().allocate(Shared)
    sN = cute.make_tensor(storage.n.data_ptr(), cute.make_layout((C, C), stride=(ROW, 1)))
    sX = cute.make_tensor(storage.x.data_ptr(), cute.make_layout((C, C), stride=(ROW, 1)))
    # a warp pair's intermediate, at most [16, 32]: rows 16 p .. of N's upper right quarter, which
    # nothing reads (N is strictly lower)
    pair = warp // 2
    half = warp % 2
    scratch = cute.local_tile(sN, (SUB, C // 2), (pair, 1))
    if live:
        t0 = cu_seqlens[seq] + table[chunk, 1] * C
        L = cutlass.min(cu_seqlens[seq + 1] - t0, C)

        # N's rows, a half row per thread (strictly lower: what lies on and above the diagonal was
        # never written, and rows t >= L belong to the next sequence); the upper right quarter,
        # above the diagonal, is neither loaded nor stored (the pairs' scratch)
        r = tid // 2
        side = tid % 2
        if (side == 0) | (r >= C // 2):
            row = cute.make_rmem_tensor(cute.make_layout(C // 2), Float32)
            row.fill(0.0)
            if r < L:
                cute.autovec_copy(cute.local_tile(n_ws[t0 + r, hv, None], (C // 2,), (side,)), row)
            for e in cutlass.range_constexpr(C // 2):
                row[e] = cutlass.select_(side * (C // 2) + e < r, row[e], Float32(0.0))
            cute.autovec_copy(row, cute.local_tile(sN[r, None], (C // 2,), (side,)))
        # zeros where the doublings read X above its diagonal blocks: rows 0 .. 15 at columns
        # 16 .. 31 and rows 32 .. 47 at columns 48 .. 63 (the rest of X above the diagonal is
        # masked at the store)
        if ((r < SUB) & (side == 0)) | ((r // SUB == 2) & (side == 1)):
            zeros = cute.make_rmem_tensor(cute.make_layout(SUB), Float32)
            zeros.fill(0.0)
            cute.autovec_copy(zeros, cute.local_tile(sX[r, None], (SUB,), (2 * side + 1,)))
        cute.arch.sync_threads()

        # 1. the diagonal blocks, warp i block i, a lane per column
        if lane < SUB:
            _diagonal_block(sN, sX, warp * SUB, lane)
        cute.arch.sync_threads()

        # 2. the 32-row blocks: R = 32 p + 16 .., C = 32 p .. by warps 2 p and 2 p + 1, 8 columns each
        corner = 2 * SUB * pair
        _double(block_view(sX, corner + SUB, corner + SUB, SUB, SUB), block_view(sN, corner + SUB, corner, SUB, SUB),
                block_view(sX, corner, corner + 8 * half, SUB, 8, True), scratch, sX, corner + SUB,
                corner + 8 * half, lane, half, pair)
        cute.arch.sync_threads()
        # rows 32 .. 63 from rows 0 .. 31: rows 32 + 16 p .. by warps 2 p and 2 p + 1, 16 columns each
        _double(block_view(sX, C // 2 + SUB * pair, C // 2, SUB, C // 2), block_view(sN, C // 2, 0, C // 2, C // 2),
                block_view(sX, 0, SUB * half, C // 2, SUB, True), scratch, sX, C // 2 + SUB * pair, SUB * half,
                lane, half, pair)
        cute.arch.sync_threads()

        # 3. rows t < L in fp16
        if r < L:
            _store_half_row(sX, t_ws, t0, r, hv, side)


@cute.jit
def _launch(n_ptr: cute.Pointer, t_ptr: cute.Pointer, table_ptr: cute.Pointer, cu_ptr: cute.Pointer,
            indices_ptr: cute.Pointer, num_tokens: Int32, N: Int32, num_ids: Int32, stream: cuda.CUstream,
            HV: cutlass.Constexpr[int], HAS_SLOTS: cutlass.Constexpr[bool]):
    """Views of the raw pointers and the launch of ``_solve_kernel`` (num_ids x HV CTAs): N float32
    and T fp16 contiguous [T, HV, C]; the chunk table int32 [num_ids, 2]; cu_seqlens int32 [N + 1];
    state_indices int32 [N]."""
    n_ws = cute.make_tensor(n_ptr, cute.make_layout((num_tokens, HV, C), stride=(HV * C, C, 1)))
    t_ws = cute.make_tensor(t_ptr, cute.make_layout((num_tokens, HV, C), stride=(HV * C, C, 1)))
    table = cute.make_tensor(table_ptr, cute.make_layout((num_ids, 2), stride=(2, 1)))
    cu_seqlens = cute.make_tensor(cu_ptr, cute.make_layout(N + 1))
    state_indices = cute.make_tensor(indices_ptr, cute.make_layout(N))
    _solve_kernel(n_ws, t_ws, table, cu_seqlens, state_indices, HV, HAS_SLOTS).launch(
        grid=(num_ids * HV, 1, 1), block=(THREADS, 1, 1), stream=stream)


_POINTERS = ((torch.float32, True), (torch.float16, True), (torch.int32, False), (torch.int32, False),
             (torch.int32, False))


@functools.lru_cache(maxsize=None)
def _compiled(HV: int, has_slots: bool):
    return compile_launcher(_launch, _POINTERS, (C, 1, 2), dict(HV=HV, HAS_SLOTS=has_slots))


def kda_solve(N_ws: torch.Tensor, T_ws: torch.Tensor, table: torch.Tensor, cu_seqlens: torch.Tensor,
              state_indices: torch.Tensor | None):
    """T_ws[rows t < L of each chunk] = (I + N)^-1 (fp16, zeros above the diagonal) from N_ws (float32,
    strictly lower; what lies on and above the diagonal is not read), per chunk of the packed batch
    and value head. N_ws float32 and T_ws fp16 contiguous [T, HV, C]; table int32 [num_ids, 2] from
    ``varlen.chunk_indices``; cu_seqlens int32 [N + 1]; state_indices int32 [N] or None (chunks of
    sequences with a negative slot are skipped)."""
    num_tokens, HV, _ = N_ws.shape
    has_slots = state_indices is not None
    launch = _compiled(HV, has_slots)
    tensors = (N_ws, T_ws, table, cu_seqlens, state_indices if has_slots else cu_seqlens)  # (never read without slots)
    here = N_ws.device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if here else torch.cuda.device(N_ws.device):
        launch([x.data_ptr() for x in tensors], (num_tokens, cu_seqlens.shape[0] - 1, table.shape[0]),
               torch.cuda.current_stream().cuda_stream)
