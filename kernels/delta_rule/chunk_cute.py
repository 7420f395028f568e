"""Chunked prefill of the gated delta rule in CuTe DSL for SM90: GDN in one fused kernel, KDA's state pass.

The math is ``chunk_torch.py``'s WY form (read ``chunk_triton.py``'s docstring first). Per chunk of
C = 64 tokens, rows t = 0 .. L - 1 valid, G the chunk-local cumulative log gate, rk / rq the rows'
inverse l2 norms (or 1), beta zero on rows t >= L, S^T [V, K] the entering state (the pool's
K-last layout):

    A_ts  = beta_t rk_t rk_s exp(G_t - G_s) k_t . k_s   (s < t)         T = (I + A)^-1
    T'    = T diag(beta)
    Z     = (S^T K^T) diag(exp(G) rk)                    (V x C)
    U^T   = (V^T - Z) T'^T                               (V x C: the delta rule's new values)
    O^T   = (scale rq_t exp(G_t)) * (S^T Q^T) + U^T P^T,  P_ts = scale rq_t rk_s exp(G_t - G_s) q_t . k_s  (s <= t)
    S^T  <- exp(G_L-1) S^T + (U^T * (exp(G_L-1 - G_s) rk_s [s < L])) K

U^T is V^T T'^T - S^T W^T with W = T diag(beta exp(G) rk) K, the WY form's, without forming W;
the kernel forms it as ((V^T - Z) diag(beta)) T^T.
With beta zero past the end, rows t >= L of A, rows and columns t >= L of T', and so columns
t >= L of U^T are exactly zero: the next sequence's tokens that fill the chunk's tail (or TMA's
zeros past the tensor) change nothing.
Every exponent is <= 0: nothing overflows.

One CTA per (sequence, value head), four warpgroups specialised so that one chunk's state-free
products (A, P, the solve) overlap the previous chunk's state chain:
- warpgroup 0, loads: warp 0 streams each chunk's q and k tiles into a ring of QK_STAGES
  shared-memory buffers and v into V_STAGES, by TMA; warps 1 and 2 prepare the chunk's per-row
  vectors in the slot of its q / k stage (``_prepare``): the gates (the fused gate, a warp scan
  for G, the beta sigmoid, exp(G) and the tail decays, loaded a chunk ahead), then, with the
  state warpgroups' row norms, the factors each consumer takes whole (``_combine``: one exp2 per
  element of A and P, one multiplication per element of Z, U and O);
- warpgroup 3, the aux, a chunk ahead (``_aux``): P = Q K^T and A = K K^T (wgmma), scaled;
  T = (I + A)^-1 (``_invert``: 8 x 8 diagonal blocks by forward substitution in float32, then
  three doublings on the tensor cores in fp16), solved in place in one of PRODUCT_STAGES fp16
  buffers that the state reads as is; P goes to the same stage of a bf16 buffer;
- warpgroups 1 and 2, the state (``_state_math``), each owning V / 2 = 64 state rows S^T [64 v, K]
  in float32 wgmma accumulators for the whole sequence, S^T in bf16 registers as the products'
  A operand. Per chunk: S^T K^T and O^T = S^T Q^T, then U^T = ((V^T - Z) diag(beta)) T^T with
  the left factor from registers, then O^T += U^T P^T and the state update with U^T from
  registers, the output through shared memory by TMA store. The two take turns to issue each
  group of wgmma (``_issue_turn``; in segments too). While their first products run they compute
  the next chunk's row norms of q (warpgroup 0) and k (1) for the preparation (``_state_norms``).
(V^T - Z) diag(beta) and T are fp16 operands (11 significant bits; their values must stay within
fp16's 65504); the state update's U^T is one bf16 operand, as in FLA's and FlashInfer's updates.
S^T (in S K^T and S Q^T) and P are bf16 operands, as S^T and P are in FLA's pipeline; the
accumulations are float32. Relative error against the torch reference at the model shapes:
3.2e-3 to 3.3e-3 (Triton's kernel 2.7e-3, FLA 4.7e-3; the bf16 tolerance is 5e-3). With T' =
T diag(beta) in bf16 against V^T - Z in two bf16 parts it was 3.6e-3, with V^T - Z in one bf16
part 4.0e-3. U^T in two bf16 parts (hi + lo: 16 bits of mantissa, as Lightning's update keeps)
gave final states 1.7e-3 closer (relative, at 1024 to 32768 tokens a sequence) and outputs
2e-4 to 4e-4, for a third product per chunk: 6-9% of the time.

Registers: 24 / 104 / 192 per thread for loads / aux / state. With fewer than 192 the state's
products do not fit ptxas's wgmma pipeline and it serialises every wgmma of the kernel (a wait
after each one, aux included: "wgmma.mma_async instructions are serialized due to insufficient
register resources"); the aux fits 104 since its solve runs from fp16 shared memory, its
factors come whole from ``_combine`` and its matrices leave by stmatrix. S^T's bf16 copy is
``pin``ned before its products: conversions the compiler sank between them made ptxas wait on
each wgmma before the next.

Speed (H200, bench_serving, CUDA-graph replay, ns per token-head; in brackets the version with
serialised wgmma, a tf32 solve from float32 shared memory and registers 24 / 120 / 184, in the
same bench a run earlier): 4 x 8192 0.584 (0.694), 8 x 1024 0.681 (0.822), 1 x 2048 2.15 (2.96),
with segments 1 x 32768 1.63 (1.81), TP4 1 x 8192 3.09 (3.45); since the composition and
correction launches were retuned, 1.43 and 2.10 (same kernel). ncu's warp-state samples
(4 x 8192, at 0.620, when the aux still formed T' in bf16 and V^T was loaded under S^T's
products) put the aux at about 97% busy and the state warpgroups at about 94%. The aux: the
scaling of P and A 39% of its samples, the solve 36% (its mma.sync often waiting for the tensor
pipe the state's wgmma hold), T' 10%, its products, P's stores and spill reloads the rest. Both
lose time to instruction-cache misses (no_inst stalls: the roles' unrolled code) and to spill
reloads (long-scoreboard stalls at LDL).
Since the aux is told apart by ``wg > 2`` (ptxas spills 64 bytes a thread instead of 180) and
U's operand is pinned: 4 x 8192 0.598, 8 x 1024 0.688, 1 x 2048 2.095, segmented 1 x 32768 1.354
and TP4 2.026 (2026-11-28). ncu then (4 x 8192): the state warpgroups wait 16% of their samples
for the aux's products and 19% for their own wgmmas; the aux's samples are its scalings (45%) and
the solve (30%), and instruction-cache misses a fifth of both roles' stalls. A chunk took about
4.9 us at 4 x 8192, 4.3 us at 1 x 2048, where splitting the value columns over two CTAs (one
state warpgroup, two aux ones) did not shorten it. Then the load warpgroup's norm warps ran their
row passes as a loop instead of 1,600 unrolled instructions (``cute_prefill.row_inv_norms``):
4 x 8192 0.609 -> 0.513, 8 x 1024 0.703 -> 0.610, 1 x 2048 2.104 -> 2.028 (same process, graph
replay): the kernel's code (about 72 KB of SASS before, 54 after) is shared by four roles on each SM
sub-partition's instruction cache. Both norm warps then ran one copy of that code (one call on a
view of sQ's and sK's stages): 4 x 8192 0.513 -> 0.500. Then U^T in one bf16 part for the update
instead of two, and the state warpgroups taking turns to issue: 4 x 8192 0.499 -> 0.457, 8 x 1024
0.595 -> 0.553, 1 x 2048 1.987 -> 1.807, segmented 1 x 32768 1.240 -> 1.192, TP4 1.914 -> 1.853
(same process); the bench a run later: 0.428, 0.568, 1.811, 1.221, 1.842 (BENCHMARKS.md).
ncu's stall samples then (4 x 2048, SASS source counters): the state warpgroups waited a third
of theirs for the aux's products, and the aux, never waiting, spent 37% of its samples scaling P
(its exponents' loads stalled behind the products' shared-memory traffic) and 30% in the solve.
So the state warpgroups now wait for the products after issuing S^T K^T and S^T Q^T, which need
none of them, and the aux runs P's product alone, reading the exponents while it runs, then A's
(``_aux``): 4 x 8192 0.461 -> 0.450 -> 0.412, 1 x 32768 1.245 -> 1.170 -> 1.100 (same process,
bitwise the same outputs). The aux then waited a third of its samples for the preparation warps'
``ready``; the segmented builds spread the row norms over three warps (then). The bench:
4 x 8192 0.414, 8 x 1024 0.522, 1 x 2048 1.776, 1 x 32768 0.982, TP4 1.681 (BENCHMARKS.md).
Without the in-kernel norms (timing only) the kernel was 9% faster (4 x 8192 0.413 -> 0.379, 1 x 2048
1.78 -> 1.62), and faster norm code made it slower (a reading: the norm warps took issue slots
from the aux).
The state warpgroups now compute the norms in the window where they waited for the aux, a chunk
ahead, and the preparation only combines: 4 x 8192 0.414 -> 0.384, 8 x 1024 0.525 -> 0.503, 1 x 2048
1.771 -> 1.627 (same process, graph replay, bitwise the same outputs; 2026-11-28); the bench: 4 x
8192 0.371, 8 x 1024 0.495, 1 x 2048 1.614, 1 x 32768 0.917, TP4 1.602.
The first warp-specialised version had the aux form -W = -T'' K as well (T'' = T diag(beta
exp(G) rk)) and the state subtract S^T W^T: 0.800 at 4 x 8192.
Earlier (H100, the serial kernel) a chunk took about 13.9k cycles: the solve 4.5k (since then
on the tensor cores), the chain's products and scalings 3.7k, K K^T / Q K^T and their scaling
1.8k, the output and the state's restaging 1.2k, gates and norms 1.1k, W 0.8k.

Segments (in-card context parallelism, ``kernels/common/segments.py``): one sequence is only HV
CTAs, so a batch that leaves SMs idle is cut into segments (``segments.one_pass_segment_tokens``) that run
side by side, in one state pass (the Triton kernel recomputes its segments in a second one):
- a sequence's first segment runs its value rows from the pool state as above;
- every later segment runs twice, on two CTAs: its value rows from zeros (outputs o0, final
  state D), and its K map rows, the state widened as ``map_columns`` does: rows that start as
  the identity and see zero values, whose outputs are the carried queries q~ and whose final
  state is the segment's map A^T;
- ``affine_output.join_segments`` then chains S_{j+1} = S_j A_j + D_j into each segment's
  initial state and the sequence's final state (into the pool), and adds q~ S_j to the later
  segments' outputs (one launch where no sequence has more than two segments, else two).
A sequence cut in s segments takes 2 s - 1 CTAs per head. H200, device time: a TP4 shard, 1 x 8192
in eight segments, kernel 91 us (profiler), composition 26 and correction 30 (graph replay, L2
flushed; 62 and 60 before their launches were retuned); 1 x 32768 in two, kernel 1246 us,
correction 194 (421), composition 16 (18); the correction since its 64-row tiles (2026-11-28): 26.5
and 142 us (``affine_output``), the bench 1.681 -> 1.620 and 0.982 -> 0.924 ns per token-head. H100,
32 heads, CUDA-graph replay:
1 x 32768 tokens 3.80 -> 2.33 ns per token-head (two segments); a TP4 shard of 8 heads, 1 x 8192:
14.8 -> 3.86 (eight). Short batches too, where segments save 512 tokens or more (H200, graph
replay, 32 heads, 1 x 2048 in two: 106.2 -> 87.7 us, the bench 1.630 -> 1.336 ns per token-head;
an eager call has the join's launch more to issue). Segments write no checkpoints: with
checkpoints a batch runs unsegmented (automatic dispatch then gives the few-CTA batches to
Triton, ``cute_backend.defers``).

Supported: bf16 q / k / v with K = V = 128 and 16-byte aligned rows, float32 / bf16 gates and beta
as given or fused (``Recipe.fused_gate``, ``beta_logits``), float32 or bf16 pools, padding slots,
has_initial_state, GVA, qk l2norm, checkpoints (unsegmented), dense states (through the API),
segments; the dispatcher passes anything else to Triton.

KDA (``kda_prefill``): the per-channel gate's decays do not factor out of a product as GDN's
scalar ones do, so KDA's intra-chunk stage is a kernel of its own (``intra_cute.kda_chunk_operands``:
P and A in 16 x 16 blocks on mma.sync from decay-factored fp16 tiles, the diagonal blocks whose
gates span too much left to Triton's exact kernel, then the 3xTF32 solve of ``solve_cute``); it
writes per chunk P (bf16), T = M^-1 (fp16), Qd = scale exp(G) Q / |q| and Ke = exp(G) K / |k|
(bf16), Kd = exp(G_C - G) K / |k| (fp16) and G at the chunk's last row. ``_kda_kernel`` then runs
the state chain of the state warpgroups above (``_state_math`` with PER_CHANNEL) on those tiles,
streamed by TMA, in place of Triton's W / U~ kernel and state pass:
    Z = S^T Ke^T,  U^T = ((V^T - Z) diag(beta)) T^T,  O^T = S^T Qd^T + U^T P^T,
    S^T <- S^T diag(exp(G_C)) + U^T Kd
with U^T in two fp16 parts against fp16 Kd (22 and 11 significant bits, as Triton's tf32 product
keeps 11), Z and O from S^T's bf16 copy as GDN's. (One fp16 part, 2026-11-28, same process, graph
replay: 4 x 8192 2.327 -> 2.358 ns per token-head, a TP4 shard of 8 heads on 8192 tokens 4.08 ->
4.03; two kept.) Warp 0 of the load warpgroup streams the five
tiles (64 KB a chunk, KDA_STAGES of them) and v; warps 1 .. 3 write beta and exp(G_C) per chunk
and zero Kd's rows past the sequence. A chunk's rows past its sequence are the next sequence's,
or for a padding sequence never written (any bits, NaN included): U's and Z's columns there are
selected to zero rather than multiplied by beta's zeros, and Kd's rows are zeroed (0 x NaN is
NaN in the update). H200, bench_serving, CUDA-graph replay, ns per token-head (Triton's whole
prefill / this): 4 x 8192 3.197 / 2.294, 8 x 1024 3.342 / 2.471, 1 x 2048 4.448 / 3.504,
unsegmented 1 x 32768 3.976 (Triton in segments) / 3.062; a TP4 shard of 8 heads on one 8192-token
sequence 5.564 (segments) / 6.799, which dispatch gave to Triton.
Relative error 3.3e-3 to 3.4e-3 against the torch reference (Triton 3.0e-3, FLA 4.8e-3).
Long sequences run in segments as GDN's do (``_state_math`` is the same chain; the intra-chunk
kernels do not care where a segment starts, chunk boundaries do not move): a segment's value rows
and K map rows on two CTAs, then ``join_segments``. H200, graph replay, ns per token-head, whole
/ in segments (Triton's prefill): a TP4 shard of 8 heads on one 8192-token sequence 6.503 /
3.493 (5.382) in segments of 1024, 1 x 32768 at 32 heads 2.714 / 2.382 (3.766) in two. (Those were
with Triton's intra-chunk stage; ``intra_cute``'s docstring and BENCHMARKS.md have today's.) The
intra-chunk stage is not fused into the state pass yet.
"""
from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32, Int64, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.warp import LdMatrix8x8x16bOp, MmaF16BF16Op, StMatrix8x8x16bOp
import cuda.bindings.driver as cuda

from ..common.cute_prefill import (C, HALF, HEAD_DIM, LOG2E, block_segment, block_sequence, block_view,
                                   check_index_dtypes, checkpoints, finish_chunk, gemm, kmajor, launch,
                                   launch_arguments, load_operand, load_state, make_loads, output_read,
                                   output_store, pin, produce, row_inv_norms, store_state, tensor_views, transposed,
                                   unsupported as unsupported_rows, zero_rows)
from ..common import segments
from ..common.affine_output import join_segments
from ..common.prep import Recipe
from .intra_cute import kda_chunk_operands
from .recurrent_cute import GATE_NONE, GATE_SOFTPLUS, _log_decay, _sigmoid

BLOCK = 16  # rows of an mma.sync tile in the solve, and of the diagonal blocks its first doubling makes
# fp16 row stride of A in shared memory: 144 bytes, so that the 16-byte pieces of 8 consecutive
# rows fall in distinct banks (T is in the swizzled layout the state's wgmma reads)
ROW_STRIDE = C + 8
GDN_THREADS = 512  # the load warpgroup, two state warpgroups, the aux warpgroup
QK_STAGES = 3  # q / k tiles in flight: a chunk's are read from the aux's turn to the end of the state's
V_STAGES = 2
PRODUCT_STAGES = 2  # P and T buffers: the aux writes the next chunk's while the state warpgroups read this one's
VECTORS = 12  # per-row float32 vectors of a chunk (``_vectors``)
# the stages above make 195 KB of shared memory; a third P / T or v stage (211 KB) takes the
# carveout from 196 to 228 KB and leaves L1 28 KB instead of 60 (the spills' stack alone, 56 bytes
# a thread, is 28 KB a CTA; not profiled): 4 x 8192 0.454 -> 0.506 ns per token-head, 1 x 2048
# 1.80 -> 2.22 (H200, 2026-11-28)
# registers per thread: 65536 over the four warpgroups, each starting with 65536 / GDN_THREADS
# (aux 136 / state 176 and 152 / 168 measured within 2% of these, either way by shape)
LOAD_REGS = 24
AUX_REGS = 104
STATE_REGS = 192
# KDA's state pass (``_kda_kernel``): the load warpgroup (TMA, preparation) and two state warpgroups
KDA_THREADS = 384
KDA_STAGES = 2  # Qd, Ke, Kd, P and T of a chunk (64 KB) in flight
KDA_LOAD_REGS = 40
KDA_STATE_REGS = 232
# named barriers: 0 is the CTA's, 1 and 2 each state warpgroup's (``finish_chunk``)
AUX = 3  # the aux warpgroup
PAIR = 4  # 4 and 5: the aux's warps 0 and 1, and 2 and 3, in the solve
PREPARE = 6  # the load warpgroup's warps 1 and 2
ORDER = 7  # 7 and 8: the state warpgroups' turns to issue their wgmma (``_issue_turn``)


@cute.jit
def _load_gates(g: cute.Tensor, beta: cute.Tensor, row0: Int32, L: Int32, hv: Int32, lane: Int32) -> list:
    """The raw gate inputs and betas of rows 2 lane and 2 lane + 1 of a chunk starting at token
    row0 with L valid rows (zeros past L), as [g, g, beta, beta]. Loaded a chunk ahead, so that
    the loads' latency passes during the chunk before (H100: the gate phase had cost 1.6 of 13.5
    us per chunk with the loads in it)."""
    raw = []
    for e in cutlass.range_constexpr(2):
        x = Float32(0.0)
        if 2 * lane + e < L:
            x = Float32(g[row0 + 2 * lane + e, hv])
        raw.append(x)
    for e in cutlass.range_constexpr(2):
        b = Float32(0.0)
        if 2 * lane + e < L:
            b = Float32(beta[row0 + 2 * lane + e, hv])
        raw.append(b)
    return raw


@cute.jit
def _chunk_gates(raw: list, sG: cute.Tensor, sB: cute.Tensor, sDecay: cute.Tensor, sTail: cute.Tensor, L: Int32,
                 A: Float32, bias: Float32, lane: Int32, GATE: cutlass.Constexpr[int],
                 BETA_LOGITS: cutlass.Constexpr[bool]):
    """One warp, for the 64 rows of a chunk (two a lane, from ``_load_gates``): sG[t] = G_t (the
    cumulative log gate within the chunk), sB[t] = beta_t, sDecay[t] = exp(G_t) and sTail[t] =
    exp(G_last - G_t) [t < L]; rows t >= L get g = 0 and beta = 0. The exponentials are taken
    here once per row rather than per element where they are used (each consumer thread needs
    16 distinct ones 32 times; H100, 4 x 8192: 16.9k -> 13.9k cycles per chunk, 21 -> 5 spills)."""
    gs = []
    for e in cutlass.range_constexpr(2):
        valid = 2 * lane + e < L
        x = _log_decay(raw[e], bias, A, Float32(0.0), GATE)
        b = raw[2 + e]
        if const_expr(BETA_LOGITS):
            b = _sigmoid(b)
        gs.append(cutlass.select_(valid, x, Float32(0.0)))
        sB[2 * lane + e] = cutlass.select_(valid, b, Float32(0.0))
    pair = gs[0] + gs[1]
    inclusive = pair
    for offset in (1, 2, 4, 8, 16):
        y = cute.arch.shuffle_sync_up(inclusive, offset=offset)
        inclusive = cutlass.select_(lane >= offset, inclusive + y, inclusive)
    last = cute.arch.shuffle_sync(inclusive, 31)  # G_63 = G_last: rows past L add zeros
    G = [inclusive - gs[1], inclusive]
    for e in cutlass.range_constexpr(2):
        t = 2 * lane + e
        sG[t] = G[e]
        sDecay[t] = cute.math.exp2(G[e] * Float32(LOG2E), fastmath=True)
        sTail[t] = cutlass.select_(t < L, cute.math.exp2((last - G[e]) * Float32(LOG2E), fastmath=True),
                                   Float32(0.0))


@cute.jit
def _invert(sA: cute.Tensor, sT: cute.Tensor, ctid: Int32):
    """T = (I + A)^-1 for the strictly lower A (64 x 64, fp16 in shared memory, zero on and above
    the diagonal) by the aux warpgroup, into sT's strictly lower part (fp16; its diagonal and
    upper part hold the identity from the start and are never written).

    The diagonal 8 x 8 blocks first: column c of T_II solves (I + A_II) x = e_c in float32, a
    thread per column, right-looking (a chain of 8 dependent steps). Then three doublings, each
    T_RC = -(T_RR A_RC) T_CC for the rows R and columns C of a diagonal block's lower left part:
    the 8 x 8 ones of the 16-row blocks (a warp each), the 16 x 16 ones of the 32-row blocks (two
    warps, 8 columns each) and the lower left 32 x 32 (a warp per 16 x 16). The products run on
    the tensor cores in fp16 with float32 accumulation (``_chain``): 11 significant bits, as tf32's
    operands have, at half the instructions. fp16's range (65504) bounds A and T: keys of large
    norm without the in-kernel l2norm could exceed it, where the delta rule itself expands
    (beta |k|^2 > 2); the engines' GDN layers normalise q and k in the kernel."""
    warp_id = ctid // 32
    lane = ctid % 32
    if lane < BLOCK:
        c = BLOCK * warp_id + lane
        base = (c // 8) * 8
        d = c - base
        # the block's rows, 16 bytes each, and its column c: x = e_d - A e_d - ..., the unit x_d
        # entering through its column of A (zero on and above the diagonal)
        rows = cute.make_rmem_tensor(cute.make_layout((8, 8), stride=(8, 1)), Float16)
        for i in cutlass.range_constexpr(8):
            cute.autovec_copy(cute.local_tile(sA[base + i, None], (8,), (base // 8,)), rows[i, None])
        x = [-Float32(sA[base + i, c]) for i in range(8)]
        for m in cutlass.range_constexpr(8):
            for i in cutlass.range_constexpr(m + 1, 8):
                x[i] = x[i] - Float32(rows[i, m]) * x[m]
        for i in cutlass.range_constexpr(1, 8):
            if i > d:
                sT[base + i, c] = Float16(x[i])
    cute.arch.sync_warp()
    corner = BLOCK * warp_id
    # 16-row blocks: R = corner + 8 .. + 15, C = corner .. + 7, as rows 8 .. 15 of a 16-row
    # product whose rows 0 .. 7 multiply T's zero block above T_RR
    _chain(block_view(sT, corner, corner + 8, BLOCK, 8), block_view(sA, corner + 8, corner, 8, 8, True),
           block_view(sT, corner, corner, 8, 8, True), sT, corner, corner, lane, 8)
    # 32-row blocks: R = 32 h + 16 .. + 31, C = 32 h .. + 15, columns n0 .. n0 + 7 of T_RC by warp 2 h + n0 / 8
    h = warp_id // 2
    n0 = 8 * (warp_id % 2)
    pair_corner = 2 * BLOCK * h
    cute.arch.barrier(barrier_id=PAIR + h, number_of_threads=64)
    _chain(block_view(sT, pair_corner + BLOCK, pair_corner + BLOCK, BLOCK, BLOCK),
           block_view(sA, pair_corner + BLOCK, pair_corner, BLOCK, BLOCK, True),
           block_view(sT, pair_corner, pair_corner + n0, BLOCK, 8, True), sT, pair_corner + BLOCK, pair_corner + n0,
           lane)
    cute.arch.barrier(barrier_id=AUX, number_of_threads=128)
    # rows 32 .. 63 from rows 0 .. 31: rows 32 + 16 y .. + 15, columns n1 .. n1 + 15 by warp 2 y + n1 / 16
    y = warp_id // 2
    n1 = BLOCK * (warp_id % 2)
    _chain(block_view(sT, C // 2 + BLOCK * y, C // 2, BLOCK, C // 2), block_view(sA, C // 2, 0, C // 2, C // 2, True),
           block_view(sT, 0, n1, C // 2, BLOCK, True), sT, C // 2 + BLOCK * y, n1, lane)


@cute.jit
def _chain(X: cute.Tensor, Yt: cute.Tensor, Zt: cute.Tensor, sT: cute.Tensor, row0, col0, lane: Int32,
           FIRST_ROW: cutlass.Constexpr[int] = 0):
    """One warp's -(X Y) Z (X [16, K1], Y^T = Yt [K2 = N1, K1], Z^T = Zt [N2, K2]) on the tensor
    cores (mma.sync, fp16 operands, float32 accumulation) into sT[row0 + r, col0 + c] for the
    rows r >= FIRST_ROW of the [16, N2] result. X Y stays in registers: an accumulator fragment
    is, element for element, the A operand of the next product."""
    k1 = cute.size(X.shape[1])
    n1 = cute.size(Yt.shape[0])
    n2 = cute.size(Zt.shape[0])
    mma1 = cute.make_tiled_mma(MmaF16BF16Op(Float16, Float32, (16, 8, cutlass.min(k1, 16))),
                               permutation_mnk=(16, n1, k1))
    thr1 = mma1.get_slice(lane)
    x = mma1.make_fragment_A(thr1.partition_shape_A(X.shape))
    y = mma1.make_fragment_B(thr1.partition_shape_B(Yt.shape))
    load_operand(X, x, mma1, lane, True)
    load_operand(Yt, y, mma1, lane, False)
    xy = cute.make_rmem_tensor(thr1.partition_shape_C((16, n1)), Float32)
    xy.fill(0.0)
    cute.gemm(mma1, xy, x, y, xy)
    mma2 = cute.make_tiled_mma(MmaF16BF16Op(Float16, Float32, (16, 8, cutlass.min(n1, 16))),
                               permutation_mnk=(16, n2, n1))
    thr2 = mma2.get_slice(lane)
    a = mma2.make_fragment_A(thr2.partition_shape_A((16, n1)))
    z = mma2.make_fragment_B(thr2.partition_shape_B(Zt.shape))
    load_operand(Zt, z, mma2, lane, False)
    for i in cutlass.range_constexpr(cute.size(a)):
        a[i] = Float16(-xy[i])
    acc = cute.make_rmem_tensor(thr2.partition_shape_C((16, n2)), Float32)
    acc.fill(0.0)
    cute.gemm(mma2, acc, a, z, acc)
    rc = thr2.partition_C(cute.make_identity_tensor((16, n2)))
    for i in cutlass.range_constexpr(cute.size(acc) // 2):
        r, c = rc[2 * i]
        if r >= FIRST_ROW:
            pair = cute.make_rmem_tensor(cute.make_layout(2), Float16)
            pair[0] = Float16(acc[2 * i])
            pair[1] = Float16(acc[2 * i + 1])
            cute.autovec_copy(pair, cute.local_tile(sT[row0 + r, None], (2,), ((col0 + c) // 2,)))


@cute.jit
def _vectors(storage, slot: Int32) -> tuple:
    """Chunk slot ``slot``'s per-row vectors in shared memory, each float32 [C]: first (G, beta,
    exp(G), tail, rq, rk) as ``_chunk_gates`` and ``row_inv_norms`` write them, then the factors
    their consumers take (``_combine``)."""
    base = storage.vectors.data_ptr() + slot * (VECTORS * C)
    return tuple(cute.make_tensor(base + e * C, cute.make_layout(C)) for e in range(VECTORS))


@cute.jit
def _combine(vectors: tuple, scale: Float32, log2_scale: Float32, r: Int32):
    """Row r's factors, one vector each, so that a consumer thread reads one value per row or
    column instead of three: the aux's exponents (log2 domain, one exp2 per element)
        P_ts = q_t . k_s * exp2(p_row_t - column_s),  A_ts = k_t . k_s * exp2(a_row_t - column_s)
    with column_s = G_s log2(e) - log2(rk_s), p_row_t = G_t log2(e) + log2(rq_t scale),
    a_row_t = G_t log2(e) + log2(rk_t beta_t) (beta 0: -inf, a zero row), and the state's
    z_s = exp(G_s) rk_s, u_s = tail_s rk_s, o_t = scale rq_t exp(G_t)."""
    sG, sB, sDecay, sTail, rq, rk, column, p_row, a_row, z, u, o = vectors
    G = sG[r] * Float32(LOG2E)
    log2_rk = cute.math.log2(rk[r], fastmath=True)
    log2_rq = cute.math.log2(rq[r], fastmath=True)
    column[r] = G - log2_rk
    p_row[r] = G + log2_rq + log2_scale
    a_row[r] = G + log2_rk + cute.math.log2(sB[r], fastmath=True)
    z[r] = sDecay[r] * rk[r]
    u[r] = sTail[r] * rk[r]
    o[r] = scale * rq[r] * sDecay[r]


@cute.jit
def _prepare(storage, loads, ready, normed, g: cute.Tensor, beta: cute.Tensor,
             A_log: cute.Tensor, dt_bias: cute.Tensor, scale: Float32, hv: Int32, bos: Int32, length: Int32,
             num_chunks: Int32, warp: Int32, lane: Int32, GATE: cutlass.Constexpr[int],
             HAS_DT_BIAS: cutlass.Constexpr[bool], BETA_LOGITS: cutlass.Constexpr[bool]):
    """Warps 1 and 2 of the load warpgroup: each chunk's vectors into the slot of its q / k stage
    (which holds nothing older once the chunk's tiles have landed). Warp 1 the gates (their raw
    inputs loaded a chunk ahead); once the state warpgroups have written the chunk's row norms
    (``normed``, ``_state_norms``), both warps form, a row a thread, the factors the aux and the
    state take (``_combine``) and commit ``ready``, which the aux waits for."""
    A = Float32(1.0)
    bias = Float32(0.0)
    if const_expr(GATE != GATE_NONE):
        A = cute.math.exp(Float32(A_log[hv]), fastmath=True)
        if const_expr(HAS_DT_BIAS):
            bias = Float32(dt_bias[hv])
    log2_scale = cute.math.log2(scale, fastmath=True)
    gate_warp = warp == 1
    # only the gate warp loads (the other's empty rows load nothing)
    raw = _load_gates(g, beta, bos, cutlass.select_(gate_warp, length, 0), hv, lane)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QK_STAGES)
    for j in cutlass.range(num_chunks, unroll=1):
        loads.consumer_wait(state)
        vectors = _vectors(storage, state.index)
        if gate_warp:
            sG, sB, sDecay, sTail = vectors[:4]
            _chunk_gates(raw, sG, sB, sDecay, sTail, cutlass.min(length - j * C, C), A, bias, lane, GATE,
                         BETA_LOGITS)
        raw = _load_gates(g, beta, bos + (j + 1) * C, cutlass.select_(gate_warp, length - (j + 1) * C, 0), hv,
                          lane)
        normed.consumer_wait(state)
        cute.arch.barrier(barrier_id=PREPARE, number_of_threads=64)
        _combine(vectors, scale, log2_scale, (warp - 1) * 32 + lane)
        normed.consumer_release(state)
        ready.producer_commit(state)
        state.advance()


@cute.jit
def _aux(storage, sQ: cute.Tensor, sK: cute.Tensor, loads, ready, products, tid: Int32, num_chunks: Int32,
         products_layout: cutlass.Constexpr):
    """The aux warpgroup, a chunk ahead of the state warpgroups: per chunk P = Q K^T and A = K K^T
    (wgmma), scaled by the gates and norms (A in fp16), then T = (I + A)^-1 (``_invert``) in fp16,
    solved in place in the chunk's slot of ``products`` (the state takes beta on its side); P
    goes to the same slot of the bf16 buffer."""
    sP = storage.sP.get_tensor(products_layout.outer, swizzle=products_layout.inner)
    sT = storage.sT.get_tensor(products_layout.outer, swizzle=products_layout.inner)
    sA = cute.make_tensor(storage.sA.data_ptr(), cute.make_layout((C, C), stride=(ROW_STRIDE, 1)))

    K_ = warpgroup.OperandMajorMode.K
    mma_ss = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K_, K_, Float32, (1, 1, 1), (C, C))
    thr_ss = mma_ss.get_slice(tid)
    tXrK = mma_ss.make_fragment_A(thr_ss.partition_A(sK))                       # K [t, k]
    tXrQ = mma_ss.make_fragment_A(thr_ss.partition_A(sQ))                       # Q [t, k]
    tXrKb = mma_ss.make_fragment_B(thr_ss.partition_B(sK))                      # K [s, k]
    accA = cute.make_rmem_tensor(thr_ss.partition_shape_C((C, C)), Float32)
    accP = cute.make_rmem_tensor(thr_ss.partition_shape_C((C, C)), Float32)
    cX = thr_ss.partition_C(cute.make_identity_tensor((C, C)))
    # the 64 x 64 matrices move between registers (the accumulator's layout) and shared memory by
    # stmatrix / ldmatrix: an address per four 8 x 8 blocks, where element stores into the swizzled
    # tiles kept an address per element live (and spilled)
    p_copy = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                        BFloat16), mma_ss).get_slice(tid)
    a_copy = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                                        Float16), mma_ss).get_slice(tid)
    tPsP = p_copy.partition_D(sP)
    tAsA = a_copy.partition_D(sA)
    p_staged = cute.make_rmem_tensor(accP.layout, BFloat16)
    a_staged = cute.make_rmem_tensor(accA.layout, Float16)

    # T's diagonal and upper part: the identity, for good (the solve writes below the diagonal)
    for e in cutlass.range(tid, C * C, 128, unroll=1):
        for b in cutlass.range_constexpr(PRODUCT_STAGES):
            sT[e // C, e % C, b] = Float16(cutlass.select_(e // C == e % C, Float32(1.0), Float32(0.0)))
    cute.arch.barrier(barrier_id=AUX, number_of_threads=128)

    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QK_STAGES)
    out = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, PRODUCT_STAGES)
    for j in cutlass.range(num_chunks, unroll=1):
        loads.consumer_wait(state)
        stage = state.index
        # P's product alone, then A's once P is stored. With both in flight (64 of the 104
        # registers) the exponents' rows and columns were read only after the wait, each load right
        # before its use, behind the products' shared-memory traffic (ncu: the scaling of P 37% of
        # the aux's stall samples, the state warpgroups waiting for the aux a third of theirs), and
        # the solve spilled. Now they are read while P's product runs (the compiler keeps one load
        # per distinct row or column: 20 registers) and the solve does not spill: H200, graph
        # replay, 4 x 8192 0.450 -> 0.412 ns per token-head, 1 x 32768 1.160 -> 1.100.
        warpgroup.fence()
        gemm(mma_ss, accP, tXrQ[None, None, None, stage], tXrKb[None, None, None, stage], False)
        ready.consumer_wait(state)
        vectors = _vectors(storage, stage)
        column, p_row, a_row = vectors[6], vectors[7], vectors[8]
        exponents = [(p_row[cX[i][0]], a_row[cX[i][0]], column[cX[i][1]]) for i in range(cute.size(accP))]
        warpgroup.wait_group(0)
        for i in cutlass.range_constexpr(cute.size(accP)):
            t, s = cX[i]
            f = cute.math.exp2(exponents[i][0] - exponents[i][2], fastmath=True)
            accP[i] = cutlass.select_(s <= t, accP[i] * f, Float32(0.0))
        p_staged.store(accP.load().to(BFloat16))  # as a whole: two values a conversion
        products.producer_acquire(out)
        cute.copy(p_copy, p_copy.retile(p_staged), tPsP[None, None, None, out.index])
        warpgroup.fence()
        gemm(mma_ss, accA, tXrK[None, None, None, stage], tXrKb[None, None, None, stage], False)
        warpgroup.wait_group(0)
        loads.consumer_release(state)
        for i in cutlass.range_constexpr(cute.size(accA)):
            t, s = cX[i]
            f = cute.math.exp2(exponents[i][1] - exponents[i][2], fastmath=True)
            accA[i] = cutlass.select_(s < t, accA[i] * f, Float32(0.0))
        a_staged.store(accA.load().to(Float16))
        cute.copy(a_copy, a_copy.retile(a_staged), tAsA)
        cute.arch.barrier(barrier_id=AUX, number_of_threads=128)  # A written

        _invert(sA, sT[None, None, out.index], tid)
        cute.arch.fence_proxy("async.shared", space="cta")  # P and T visible to the state's wgmma
        products.producer_commit(out)
        cute.arch.barrier(barrier_id=AUX, number_of_threads=128)  # A read: the next chunk's may be written
        state.advance()
        out.advance()


@cute.jit
def _issue_turn(w: Int32, j: Int32, ORDERED: cutlass.Constexpr[bool], FIRST_GROUP: cutlass.Constexpr[bool] = False):
    """State warpgroup w waits until the other has issued its last group of wgmma (warpgroup 0
    goes first: no wait before its first group of chunk 0). Taking turns, one warpgroup's
    products finish while the other's still run, and its conversions overlap them; issued
    together, both finished late and then left the tensor cores idle together (H200, graph
    replay, ns per token-head: 4 x 8192 0.498 -> 0.487, 1 x 2048 1.997 -> 1.947). KDA's segmented
    builds do not take turns (ORDERED false): its 1 x 32768 measured 2.273 -> 2.298 with them (the
    segmented builds of both measured 0.3-1.9% slower with turns before GDN's state warpgroups took
    the row norms; since then GDN's gain: 1 x 32768 0.921 -> 0.908, a TP4 shard 1.603 -> 1.588)."""
    if const_expr(ORDERED and FIRST_GROUP):
        if (w == 1) | (j > 0):
            cute.arch.barrier(barrier_id=ORDER + w, number_of_threads=256)
    elif const_expr(ORDERED):
        cute.arch.barrier(barrier_id=ORDER + w, number_of_threads=256)


@cute.jit
def _pass_turn(w: Int32, j: Int32, num_chunks: Int32, ORDERED: cutlass.Constexpr[bool],
               LAST_GROUP: cutlass.Constexpr[bool] = False):
    """After issuing: the other state warpgroup's turn (warpgroup 1 passes none after the last
    chunk's last group, so that every arrive has its wait)."""
    if const_expr(ORDERED and LAST_GROUP):
        if (w == 0) | (j < num_chunks - 1):
            cute.arch.barrier_arrive(barrier_id=ORDER + 1 - w, number_of_threads=256)
    elif const_expr(ORDERED):
        cute.arch.barrier_arrive(barrier_id=ORDER + 1 - w, number_of_threads=256)


@cute.jit
def _state_norms(storage, loads, normed, ahead, norm_out, w: Int32, tid: Int32, QK_L2NORM: cutlass.Constexpr[bool]):
    """State warpgroup w's share of chunk ``ahead``'s row norms, for the preparation warps
    (``normed``): warpgroup 0 q's, 1 k's, a warp per 16 rows (``row_inv_norms``), into rq / rk of
    the chunk's vectors (rk follows rq, as sK's stages follow sQ's)."""
    loads.consumer_wait(ahead)
    normed.producer_acquire(norm_out)
    both = kmajor(C, HEAD_DIM, 2 * QK_STAGES)
    sQK = storage.sQ.get_tensor(both.outer, swizzle=both.inner)
    rq = _vectors(storage, ahead.index)[4]
    dst = cute.make_tensor(rq.iterator + w * C, rq.layout)
    row_inv_norms(sQK[None, None, ahead.index + w * QK_STAGES], dst, tid % 32, QK_L2NORM, 32, tid // 32, 1)
    normed.producer_commit(norm_out)


@cute.jit
def _state_math(storage, operands: tuple, sV: cute.Tensor, loads, v_loads, products, w: Int32,
                tid: Int32, out: cute.Tensor, tma_o: cute.CopyAtom, o_tiles: cute.Tensor, pool: cute.Tensor,
                has_initial_state: cute.Tensor, checkpoint_indices: cute.Tensor, checkpoint_every: Int32,
                num_checkpoints: Int32, n: Int32, hv: Int32, bos: Int32, length: Int32,
                num_chunks: Int32, slot: Int64, live, segment: tuple, out_layout: cutlass.Constexpr,
                HAS_POOL: cutlass.Constexpr[bool], HAS_INIT_FLAGS: cutlass.Constexpr[bool],
                HAS_CKPT: cutlass.Constexpr[bool], SEGMENTED: cutlass.Constexpr[bool],
                PER_CHANNEL: cutlass.Constexpr[bool] = False, normed=None, QK_L2NORM: cutlass.Constexpr[bool] = False):
    """A state warpgroup: state rows and output columns w * 64 .. w * 64 + 63 (module docstring),
    the chunk's chain from the aux's products.

    ``operands`` (Q, K_z, K_u, P, T) staged [C, D, stages]: the tiles of S^T Q^T, Z = S^T K_z^T and
    the update's U^T K_u, and the products. GDN: raw q, k, k (bf16, row factors applied around the
    products) and P / T in the aux's PRODUCT_STAGES buffers, ``products`` the aux's pipeline.
    PER_CHANNEL (KDA, ``_kda_kernel``): the decayed Qd, Ke (bf16) and Kd (fp16), used as they
    are, and P / T, all in the stage of ``loads``; ``products`` the preparation warps' ``ready``
    (the stage's beta and exp(G_C) vectors, Kd's rows past the sequence zeroed). The update then
    takes U^T in two fp16 parts against Kd (GDN's: one bf16 part against K), and S^T's columns
    decay by exp(G_C) one by one.
    The two state warpgroups take turns to issue each group of wgmma (``_issue_turn``; KDA's only
    unsegmented).
    ``normed`` (GDN): the pipeline that hands the preparation warps the row norms these warpgroups
    compute a chunk ahead (``_state_norms``, with QK_L2NORM); None for KDA, whose operands come
    normalised.

    SEGMENTED: ``segment`` = (transitions, q_carried, sid, j, last, maps), the CTA a segment's
    (``_gdn_kernel``): value rows (maps false) start from the pool in a sequence's first segment
    (j = 0) and from zeros after it; map rows start from the identity and see zero values, their
    outputs go to q_carried. Final states go to transitions[sid] (value rows 0 .. 127, map rows
    128 .. 255) except a whole sequence's, which goes to the pool."""
    sQ, sK, sK_update, sP, sT = operands
    sO_both = storage.sO.get_tensor(out_layout.outer, swizzle=out_layout.inner)
    sO = sO_both[None, None, w]

    K_ = warpgroup.OperandMajorMode.K
    MN = warpgroup.OperandMajorMode.MN
    RMEM = warpgroup.OperandSource.RMEM
    mma_up = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K_, K_, Float32, (1, 1, 1), (HALF, C),
                                               a_source=RMEM)
    update_type = Float16 if const_expr(PER_CHANNEL) else BFloat16
    mma_st = sm90_utils.make_trivial_tiled_mma(update_type, update_type, K_, MN, Float32, (1, 1, 1),
                                               (HALF, HEAD_DIM), a_source=RMEM)
    # U^T = ((V^T - Z) diag(beta)) T^T with T as the aux leaves it, in fp16
    mma_u = sm90_utils.make_trivial_tiled_mma(Float16, Float16, K_, K_, Float32, (1, 1, 1), (HALF, C),
                                              a_source=RMEM)
    thr_up = mma_up.get_slice(tid)
    thr_u = mma_u.get_slice(tid)
    thr_st = mma_st.get_slice(tid)

    # V^T [v, s] into Z's layout, and O^T [v, t] out of it, over the [s, v] tiles: ldmatrix.trans
    # and stmatrix.trans, four 8 x 8 blocks an instruction instead of an element
    v_copy = cute.make_tiled_copy_C(cute.make_copy_atom(LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                                        BFloat16), mma_up).get_slice(tid)
    o_copy = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                                        BFloat16), mma_up).get_slice(tid)
    tVsV = v_copy.partition_S(transposed(sV))
    tVrV = cute.make_rmem_tensor(thr_up.partition_shape_C((HALF, C)), BFloat16)
    tZrT = mma_u.make_fragment_B(thr_u.partition_B(sT))                         # T [t, s]
    tXrK = mma_up.make_fragment_B(thr_up.partition_B(sK))                       # K [s, k]
    tOrQ = mma_up.make_fragment_B(thr_up.partition_B(sQ))                       # Q [t, k]
    tOrP = mma_up.make_fragment_B(thr_up.partition_B(sP))                       # P [t, s]
    tSrK = mma_st.make_fragment_B(thr_st.partition_B(transposed(sK_update)))   # K as [k, s]
    accU = cute.make_rmem_tensor(thr_up.partition_shape_C((HALF, C)), Float32)
    accX = cute.make_rmem_tensor(thr_up.partition_shape_C((HALF, C)), Float32)
    accO = cute.make_rmem_tensor(thr_up.partition_shape_C((HALF, C)), Float32)
    accS = cute.make_rmem_tensor(thr_st.partition_shape_C((HALF, HEAD_DIM)), Float32)
    # S^T in bf16 as the register A operand (the accumulator's layout is the operand's)
    tUrS = mma_up.make_fragment_A(thr_up.partition_shape_A((HALF, HEAD_DIM)))
    tUrU = mma_up.make_fragment_A(thr_up.partition_shape_A((HALF, C)))
    tUrZ = mma_u.make_fragment_A(thr_u.partition_shape_A((HALF, C)))
    tSrU = mma_st.make_fragment_A(thr_st.partition_shape_A((HALF, C)))  # (KDA: its hi part)
    tSrU_lo = mma_st.make_fragment_A(thr_st.partition_shape_A((HALF, C))) if const_expr(PER_CHANNEL) else None
    ORDERED = not (SEGMENTED and PER_CHANNEL)
    cU = thr_up.partition_C(cute.make_identity_tensor((HALF, C)))  # (row, column) of each element
    cS = thr_st.partition_C(cute.make_identity_tensor((HALF, HEAD_DIM)))

    if const_expr(SEGMENTED):
        transitions, q_carried, sid, j_segment, last, maps = segment
        load_state(accS, thr_st, pool, has_initial_state, n, slot, hv, w, live & (j_segment == 0) & (maps == 0),
                   HAS_POOL, HAS_INIT_FLAGS)
        if maps != 0:
            rows = thr_st.partition_C(cute.make_identity_tensor((HALF, HEAD_DIM)))
            for i in cutlass.range_constexpr(cute.size(accS)):
                r, c = rows[i]
                accS[i] = cutlass.select_(w * HALF + r == c, Float32(1.0), Float32(0.0))
    else:
        load_state(accS, thr_st, pool, has_initial_state, n, slot, hv, w, live, HAS_POOL, HAS_INIT_FLAGS)
    tOsO = o_copy.partition_D(transposed(sO))
    store = output_store(tma_o, o_tiles, sO_both, bos, hv)

    if live:
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, loads.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, v_loads.num_stages)
        chunk = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, PRODUCT_STAGES)
        # GDN: the row norms a chunk ahead (``_state_norms``)
        ahead = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, loads.num_stages)
        norm_out = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, loads.num_stages)
        for j in cutlass.range(num_chunks, unroll=1):
            L = cutlass.min(length - j * C, C)
            for i in cutlass.range_constexpr(cute.size(accS)):
                tUrS[i] = BFloat16(accS[i])
            pin(tUrS)
            output_read(tid)
            loads.consumer_wait(state)
            stage = state.index

            # Z = (S^T K^T) diag(exp(G) rk) and the output's S^T Q^T, the only products of S^T's bf16 copy
            _issue_turn(w, j, ORDERED, True)
            warpgroup.fence()
            gemm(mma_up, accX, tUrS, tXrK[None, None, None, stage], False)
            gemm(mma_up, accO, tUrS, tOrQ[None, None, None, stage], False)
            _pass_turn(w, j, num_chunks, ORDERED)
            if const_expr(normed is not None):
                # the next chunk's norms while these products run and the aux finishes this chunk's
                # solve: the state waited here anyway, and the preparation warps computing them took
                # issue slots from the aux (module docstring: 4 x 8192 0.414 -> 0.384 ns per token-head)
                # chunks 0 and 1 in the first iteration, one call site for the instruction cache
                for _ in cutlass.range(cutlass.select_(j == 0, 0, j + 1), cutlass.min(j + 2, num_chunks), unroll=1):
                    _state_norms(storage, loads, normed, ahead, norm_out, w, tid, QK_L2NORM)
                    ahead.advance()
                    norm_out.advance()
            # the chunk's products (and vectors) only now, under S^T's: they need none of them, and
            # the aux finishes its solve meanwhile
            product_stage = stage
            if const_expr(PER_CHANNEL):
                products.consumer_wait(state)
                sB, gate_decay = _kda_vectors(storage, stage)
            else:
                products.consumer_wait(chunk)
                product_stage = chunk.index
                vectors = _vectors(storage, stage)
                sB, sDecay, z, u, o = vectors[1], vectors[2], vectors[9], vectors[10], vectors[11]
            v_loads.consumer_wait(v_state)
            warpgroup.wait_group(0)
            # V^T only now: loaded under the products it would share the registers with S^T's copy
            cute.copy(v_copy, tVsV[None, None, None, 2 * v_state.index + w], v_copy.retile(tVrV))
            # U^T = ((V^T - Z) diag(beta)) T^T (S^T W^T without forming W); map rows see zero values
            for i in cutlass.range_constexpr(cute.size(accX)):
                s = cU[i][1]
                v = Float32(tVrV[i])
                if const_expr(SEGMENTED):
                    v = cutlass.select_(maps == 0, v, Float32(0.0))
                if const_expr(PER_CHANNEL):
                    # a select, not beta's zero: Ke's rows past the sequence may hold anything
                    tUrZ[i] = Float16(cutlass.select_(s < L, (v - accX[i]) * sB[s], Float32(0.0)))
                else:
                    tUrZ[i] = Float16((v - accX[i] * z[s]) * sB[s])
            pin(tUrZ)  # else ptxas waited on each of U's wgmmas: the conversions had sunk between them
            # V^T was read through the generic proxy and the stage is refilled by TMA (the async
            # proxy): without this fence the segmented build's last ldmatrix.trans of V^T sat right
            # before the release's arrive, still in flight, and the refill raced it (one chunk's U
            # in one warpgroup perturbed in about a third of 1 x 32768 calls on an H200)
            cute.arch.fence_proxy("async.shared", space="cta")
            v_loads.consumer_release(v_state)
            _issue_turn(w, j, ORDERED)
            warpgroup.fence()
            gemm(mma_u, accU, tUrZ, tZrT[None, None, None, product_stage], False)
            _pass_turn(w, j, num_chunks, ORDERED)
            if const_expr(not PER_CHANNEL):
                for i in cutlass.range_constexpr(cute.size(accO)):
                    t = cU[i][1]
                    accO[i] = accO[i] * o[t]
            cute.arch.barrier(barrier_id=1 + w, number_of_threads=128)  # the last output store has read sO
            warpgroup.wait_group(0)
            for i in cutlass.range_constexpr(cute.size(accU)):
                s = cU[i][1]
                x = accU[i]
                if const_expr(PER_CHANNEL):
                    # T's rows past the sequence may hold anything: U's columns there are dropped
                    x = cutlass.select_(s < L, x, Float32(0.0))
                tUrU[i] = BFloat16(x)
                if const_expr(PER_CHANNEL):
                    hi = update_type(x)
                    tSrU[i] = hi
                    tSrU_lo[i] = update_type(x - Float32(hi))
                else:
                    # the update's column factors (KDA's are in Kd); one bf16 part, as FLA's and
                    # FlashInfer's updates take it: the state then differs from two parts' by
                    # 1.7e-3 (relative, at every length from 1024 to 32768 tokens), 6-9% faster
                    tSrU[i] = update_type(x * u[s])
            if const_expr(PER_CHANNEL):
                for i in cutlass.range_constexpr(cute.size(accS)):
                    accS[i] = accS[i] * gate_decay[cS[i][1]]
            else:
                decay_L = sDecay[C - 1]
                for i in cutlass.range_constexpr(cute.size(accS)):
                    accS[i] = accS[i] * decay_L
            _issue_turn(w, j, ORDERED)
            warpgroup.fence()
            gemm(mma_up, accO, tUrU, tOrP[None, None, None, product_stage], True)
            gemm(mma_st, accS, tSrU, tSrK[None, None, None, stage], True)
            if const_expr(PER_CHANNEL):
                gemm(mma_st, accS, tSrU_lo, tSrK[None, None, None, stage], True)
            _pass_turn(w, j, num_chunks, ORDERED, True)
            warpgroup.wait_group(0)
            if const_expr(not PER_CHANNEL):
                products.consumer_release(chunk)
            loads.consumer_release(state)
            chunk.advance()
            state.advance()
            v_state.advance()

            if const_expr(SEGMENTED):  # no checkpoints with segments
                if maps != 0:
                    finish_chunk(accO, tOsO, accS, None, sO, q_carried, thr_st, pool, checkpoint_indices,
                                 checkpoint_every, num_checkpoints, n, hv, bos, j, w, L, tid, False, o_copy=o_copy)
                else:
                    finish_chunk(accO, tOsO, accS, None, sO, out, thr_st, pool, checkpoint_indices,
                                 checkpoint_every, num_checkpoints, n, hv, bos, j, w, L, tid, False, store, o_copy)
            else:
                finish_chunk(accO, tOsO, accS, None, sO, out, thr_st, pool, checkpoint_indices, checkpoint_every,
                             num_checkpoints, n, hv, bos, j, w, L, tid, HAS_CKPT, store, o_copy)
        output_read(tid)
        if const_expr(SEGMENTED):
            if (j_segment == 0) & last & (maps == 0):
                if const_expr(HAS_POOL):
                    store_state(accS, thr_st, pool, slot, hv, w)
            else:
                store_state(accS, thr_st, transitions, Int64(sid), hv, w + 2 * maps)
        elif const_expr(HAS_POOL):
            store_state(accS, thr_st, pool, slot, hv, w)
    else:
        if const_expr(SEGMENTED):
            if maps == 0:
                zero_rows(sO, out, hv, bos, length, w, tid)  # padding: zero output rows, no state
        else:
            zero_rows(sO, out, hv, bos, length, w, tid)


def _swizzled(storage, *fields) -> list:
    """The shared-memory tensors of ``storage``'s fields (name, swizzled layout), in order."""
    return [getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner) for name, layout in fields]


@cute.jit
def _set_registers(count: cutlass.Constexpr[int], THREADS: cutlass.Constexpr[int] = GDN_THREADS):
    """This warpgroup's registers per thread set to ``count`` (setmaxnreg): .dec below the launch's
    share of the register file for THREADS threads, .inc above (.dec must not raise the count)."""
    if const_expr(count < 65536 // THREADS // 8 * 8):
        cute.arch.warpgroup_reg_dealloc(count)
    else:
        cute.arch.warpgroup_reg_alloc(count)


@cute.kernel
def _gdn_kernel(
    tma_q: cute.CopyAtom, q_tiles: cute.Tensor, tma_k: cute.CopyAtom, k_tiles: cute.Tensor,
    tma_v: cute.CopyAtom, v_tiles: cute.Tensor,
    out: cute.Tensor, tma_o: cute.CopyAtom, o_tiles: cute.Tensor, pool: cute.Tensor, g: cute.Tensor,
    beta: cute.Tensor, A_log: cute.Tensor, dt_bias: cute.Tensor,
    cu_seqlens: cute.Tensor, state_indices: cute.Tensor, has_initial_state: cute.Tensor,
    checkpoint_indices: cute.Tensor, checkpoint_every: Int32, num_checkpoints: Int32, scale: Float32,
    transitions: cute.Tensor, q_carried: cute.Tensor, N: Int32, segment_tokens: Int32,
    GROUP: cutlass.Constexpr[int], HV: cutlass.Constexpr[int], QK_L2NORM: cutlass.Constexpr[bool],
    GATE: cutlass.Constexpr[int], HAS_DT_BIAS: cutlass.Constexpr[bool], BETA_LOGITS: cutlass.Constexpr[bool],
    HAS_SLOTS: cutlass.Constexpr[bool], HAS_POOL: cutlass.Constexpr[bool], HAS_INIT_FLAGS: cutlass.Constexpr[bool],
    HAS_CKPT: cutlass.Constexpr[bool], SEGMENTED: cutlass.Constexpr[bool],
):
    """One (sequence, value head): blockIdx.x = sequence * HV + value head (module docstring).
    SEGMENTED: one (segment, value head, row group), blockIdx.x = segment id * HV + value head
    (``cute_prefill.block_segment``), blockIdx.y = 0 for the value rows, 1 for the K map rows (a
    sequence's first segment has none: its CTA exits)."""
    tidx = cute.arch.thread_idx()[0]
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    wg = warp // 4
    segment = ()
    if const_expr(SEGMENTED):
        n, hv, h, bos, length, num_chunks, slot, sid, j_segment, last = block_segment(
            cu_seqlens, state_indices, N, segment_tokens, HV, GROUP, HAS_SLOTS)
        maps = Int32(cute.arch.block_idx()[1])
        live = (slot >= 0) & ((maps == 0) | (j_segment > 0))
        segment = (transitions, q_carried, sid, j_segment, last, maps)
    else:
        n, hv, h, bos, length, num_chunks, slot = block_sequence(cu_seqlens, state_indices, HV, GROUP, HAS_SLOTS)
        live = slot >= 0

    tile_layout = kmajor(C, HEAD_DIM, QK_STAGES)
    v_layout = kmajor(C, HALF, 2 * V_STAGES)  # stage s holds v's column halves at 2 s and 2 s + 1
    out_layout = kmajor(C, HALF, 2)  # one output tile per state warpgroup
    products_layout = kmajor(C, C, PRODUCT_STAGES)  # P (bf16), T (fp16: the same 16-bit layout)

    @cute.struct
    class Shared:
        barriers: cute.struct.MemRange[Int64, 2 * (3 * QK_STAGES + V_STAGES + PRODUCT_STAGES)]
        # sK's stages right after sQ's (a multiple of 1024 bytes): ``_prepare`` reads them as one tensor
        sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(tile_layout)], 1024]
        sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(tile_layout)], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(v_layout)], 1024]
        sO: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(out_layout)], 1024]
        sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(products_layout)], 1024]
        sA: cute.struct.Align[cute.struct.MemRange[Float16, C * ROW_STRIDE], 16]
        sT: cute.struct.Align[cute.struct.MemRange[Float16, cute.cosize(products_layout)], 1024]
        vectors: cute.struct.Align[cute.struct.MemRange[Float32, QK_STAGES * VECTORS * C], 16]

    storage = cutlass.utils.SmemAllocator().allocate(Shared)
    sQ, sK, sV, sP, sT = _swizzled(storage, ("sQ", tile_layout), ("sK", tile_layout), ("sV", v_layout),
                                   ("sP", products_layout), ("sT", products_layout))

    barriers = storage.barriers.data_ptr()
    loads = make_loads(barriers, QK_STAGES, 2, 12, defer_sync=True)  # read by the aux and state warps
    v_loads = make_loads(barriers + 2 * QK_STAGES, V_STAGES, 1, 8, defer_sync=True)
    ready = pipeline.PipelineAsync.create(
        barrier_storage=barriers + 2 * (QK_STAGES + V_STAGES), num_stages=QK_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 64),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1), defer_sync=True)
    # the state warpgroups' row norms to the preparation warps (``_state_norms``)
    normed = pipeline.PipelineAsync.create(
        barrier_storage=barriers + 2 * (2 * QK_STAGES + V_STAGES + PRODUCT_STAGES), num_stages=QK_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 64), defer_sync=True)
    products = pipeline.PipelineAsync.create(
        barrier_storage=barriers + 2 * (2 * QK_STAGES + V_STAGES), num_stages=PRODUCT_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256))

    if wg == 0:
        _set_registers(LOAD_REGS)
        if live:
            if warp == 0:
                produce(((tma_q, q_tiles, h, sQ, HEAD_DIM), (tma_k, k_tiles, h, sK, HEAD_DIM)), (tma_v, v_tiles, sV),
                        loads, bos, num_chunks, hv, v_loads)
            elif warp < 3:
                _prepare(storage, loads, ready, normed, g, beta, A_log, dt_bias, scale, hv, bos, length, num_chunks,
                         warp, tidx % 32, GATE, HAS_DT_BIAS, BETA_LOGITS)
    elif wg > 2:  # not ``wg == 3``, and the aux's tid from wg: ptxas then spills 64 bytes, not 180
        _set_registers(AUX_REGS)
        if live:
            _aux(storage, sQ, sK, loads, ready, products, tidx - 128 * wg, num_chunks, products_layout)
    else:
        _set_registers(STATE_REGS)
        _state_math(storage, (sQ, sK, sK, sP, sT), sV, loads, v_loads, products, wg - 1, tidx - 128 * wg, out, tma_o,
                    o_tiles, pool, has_initial_state, checkpoint_indices, checkpoint_every, num_checkpoints, n, hv,
                    bos, length, num_chunks, slot, live, segment, out_layout, HAS_POOL, HAS_INIT_FLAGS, HAS_CKPT,
                    SEGMENTED, False, normed, QK_L2NORM)


@cute.jit
def _segment_views(transitions_ptr: cute.Pointer, carried_ptr: cute.Pointer, T: Int32, N: Int32,
                   segment_tokens: Int32, HV: cutlass.Constexpr[int], SEGMENTED: cutlass.Constexpr[bool]):
    """(transitions [ids, HV, 256, 128] float32, q_carried [T, 128, HV] bf16, ids): the segmented
    launches' outputs, ids the CTAs' first grid dimension over HV (sequences, or at most
    T // segment_tokens + N segments)."""
    D = HEAD_DIM
    ids = N
    if const_expr(SEGMENTED):
        ids = T // segment_tokens + N
    transitions = cute.make_tensor(transitions_ptr, cute.make_layout((ids, HV, 2 * D, D),
                                                                     stride=(HV * 2 * D * D, 2 * D * D, D, 1)))
    q_carried = cute.make_tensor(carried_ptr, cute.make_layout((T, D, HV), stride=(HV * D, 1, D)))
    return transitions, q_carried, ids


@cute.jit
def _launch(
    q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, o_ptr: cute.Pointer, pool_ptr: cute.Pointer,
    g_ptr: cute.Pointer, beta_ptr: cute.Pointer, A_log_ptr: cute.Pointer, dt_bias_ptr: cute.Pointer,
    cu_ptr: cute.Pointer, indices_ptr: cute.Pointer, init_ptr: cute.Pointer, ckpt_ptr: cute.Pointer,
    transitions_ptr: cute.Pointer, carried_ptr: cute.Pointer,
    T: Int32, N: Int32, P: Int32, num_checkpoints: Int32, checkpoint_every: Int32, checkpoint_stride: Int32,
    scale: Float32, segment_tokens: Int32, stream: cuda.CUstream,
    STRIDES: cutlass.Constexpr[tuple], GATE_STRIDES: cutlass.Constexpr[tuple], H: cutlass.Constexpr[int],
    HV: cutlass.Constexpr[int], QK_L2NORM: cutlass.Constexpr[bool], GATE: cutlass.Constexpr[int],
    HAS_DT_BIAS: cutlass.Constexpr[bool], BETA_LOGITS: cutlass.Constexpr[bool], HAS_SLOTS: cutlass.Constexpr[bool],
    HAS_POOL: cutlass.Constexpr[bool], HAS_INIT_FLAGS: cutlass.Constexpr[bool], HAS_CKPT: cutlass.Constexpr[bool],
    SEGMENTED: cutlass.Constexpr[bool],
):
    """Views of the raw pointers, the TMA descriptors and the launch; strides are compile-time
    (``cute_prefill.strides`` says why). GATE_STRIDES: the row and head strides of g and beta.
    SEGMENTED: segments of ``segment_tokens``; transitions float32 [segment ids, HV, 256, 128] and
    the map rows' outputs q_carried bf16 [T, HV, 128], both contiguous."""
    (tma_q, q_tiles, tma_k, k_tiles, tma_v, v_tiles, o, tma_o, o_tiles, pool, cu_seqlens, state_indices,
     has_initial_state, checkpoint_indices) = tensor_views(q_ptr, k_ptr, v_ptr, o_ptr, pool_ptr, cu_ptr, indices_ptr,
                                                           init_ptr, ckpt_ptr, T, N, P, num_checkpoints,
                                                           checkpoint_stride, STRIDES, H, HV)
    g_t, g_h, b_t, b_h = GATE_STRIDES
    g = cute.make_tensor(g_ptr, cute.make_layout((T, HV), stride=(g_t, g_h)))
    beta = cute.make_tensor(beta_ptr, cute.make_layout((T, HV), stride=(b_t, b_h)))
    A_log = cute.make_tensor(A_log_ptr, cute.make_layout(HV))
    dt_bias = cute.make_tensor(dt_bias_ptr, cute.make_layout(HV))
    transitions, q_carried, ids = _segment_views(transitions_ptr, carried_ptr, T, N, segment_tokens, HV, SEGMENTED)
    _gdn_kernel(
        tma_q, q_tiles, tma_k, k_tiles, tma_v, v_tiles, o, tma_o, o_tiles, pool, g, beta, A_log, dt_bias, cu_seqlens,
        state_indices, has_initial_state, checkpoint_indices, checkpoint_every, num_checkpoints, scale,
        transitions, q_carried, N, segment_tokens,
        HV // H, HV, QK_L2NORM, GATE, HAS_DT_BIAS, BETA_LOGITS, HAS_SLOTS, HAS_POOL, HAS_INIT_FLAGS, HAS_CKPT,
        SEGMENTED,
    ).launch(grid=(ids * HV, 2 if SEGMENTED else 1, 1), block=(GDN_THREADS, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# KDA: the state pass over the intra-chunk operands of ``intra_cute.kda_chunk_operands``


@cute.jit
def _kda_vectors(storage, slot: Int32) -> tuple:
    """Chunk slot ``slot``'s vectors: beta float32 [C] (zero past the sequence) and exp(G_C)
    float32 [HEAD_DIM], the state's per-channel decay over the chunk."""
    base = storage.vectors.data_ptr() + slot * (C + HEAD_DIM)
    return cute.make_tensor(base, cute.make_layout(C)), cute.make_tensor(base + C, cute.make_layout(HEAD_DIM))


@cute.jit
def _kda_inputs(gate: cute.Tensor, beta: cute.Tensor, row0: Int32, L: Int32, hv: Int32, warp: Int32,
                lane: Int32) -> list:
    """A preparation warp's raw inputs for the chunk of L rows (L <= 0: none) from token row0,
    loaded a chunk ahead: warp 1 the betas of rows 2 lane and 2 lane + 1, warp 2 G at the chunk's
    last row for channels 4 lane .. 4 lane + 3 (zeros where nothing is loaded)."""
    raw = []
    for e in cutlass.range_constexpr(4):
        x = Float32(0.0)
        if (warp == 1) & (e < 2) & (2 * lane + e < L):
            x = Float32(beta[row0 + 2 * lane + e, hv])
        if (warp == 2) & (L > 0):
            x = Float32(gate[row0 + L - 1, hv, 4 * lane + e])
        raw.append(x)
    return raw


@cute.jit
def _kda_prepare(storage, sKd: cute.Tensor, loads, ready, gate: cute.Tensor, beta: cute.Tensor, hv: Int32,
                 bos: Int32, length: Int32, num_chunks: Int32, warp: Int32, lane: Int32,
                 BETA_LOGITS: cutlass.Constexpr[bool]):
    """Warps 1 .. 3 of the load warpgroup, per chunk once its tiles have landed: warp 1 the betas
    (zero past the sequence), warp 2 exp(G_C), warp 3 zeros into Kd's rows past the sequence
    (they hold the next sequence's rows, or nothing ever written: the update multiplies them by
    U's zero columns, and 0 x NaN is NaN); then ``ready``."""
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KDA_STAGES)
    raw = _kda_inputs(gate, beta, bos, cutlass.min(length, C), hv, warp, lane)
    zero = cute.make_rmem_tensor(cute.make_layout(8), Float16)
    zero.fill(0.0)
    for j in cutlass.range(num_chunks, unroll=1):
        L = cutlass.min(length - j * C, C)
        loads.consumer_wait(state)
        sB, gate_decay = _kda_vectors(storage, state.index)
        if warp == 1:
            for e in cutlass.range_constexpr(2):
                b = raw[e]
                if const_expr(BETA_LOGITS):
                    b = _sigmoid(b)
                sB[2 * lane + e] = cutlass.select_(2 * lane + e < L, b, Float32(0.0))
        elif warp == 2:
            for e in cutlass.range_constexpr(4):
                gate_decay[4 * lane + e] = cute.math.exp2(raw[e] * Float32(LOG2E), fastmath=True)
        elif L < C:
            tile = sKd[None, None, state.index]
            for p in cutlass.range(lane, (C - L) * (HEAD_DIM // 8), 32, unroll=1):
                cute.autovec_copy(zero, cute.local_tile(tile[L + p // (HEAD_DIM // 8), None], (8,),
                                                        (p % (HEAD_DIM // 8),)))
            cute.arch.fence_proxy("async.shared", space="cta")  # the zeros visible to the update's wgmma
        raw = _kda_inputs(gate, beta, bos + (j + 1) * C, cutlass.min(length - (j + 1) * C, C), hv, warp, lane)
        ready.producer_commit(state)
        state.advance()


@cute.kernel
def _kda_kernel(
    tma_qd: cute.CopyAtom, qd_tiles: cute.Tensor, tma_ke: cute.CopyAtom, ke_tiles: cute.Tensor,
    tma_kd: cute.CopyAtom, kd_tiles: cute.Tensor, tma_p: cute.CopyAtom, p_tiles: cute.Tensor,
    tma_t: cute.CopyAtom, t_tiles: cute.Tensor, tma_v: cute.CopyAtom, v_tiles: cute.Tensor,
    out: cute.Tensor, tma_o: cute.CopyAtom, o_tiles: cute.Tensor, pool: cute.Tensor, gate: cute.Tensor,
    beta: cute.Tensor, cu_seqlens: cute.Tensor, state_indices: cute.Tensor, has_initial_state: cute.Tensor,
    checkpoint_indices: cute.Tensor, checkpoint_every: Int32, num_checkpoints: Int32,
    transitions: cute.Tensor, q_carried: cute.Tensor, N: Int32, segment_tokens: Int32,
    HV: cutlass.Constexpr[int], BETA_LOGITS: cutlass.Constexpr[bool], HAS_SLOTS: cutlass.Constexpr[bool],
    HAS_POOL: cutlass.Constexpr[bool], HAS_INIT_FLAGS: cutlass.Constexpr[bool], HAS_CKPT: cutlass.Constexpr[bool],
    SEGMENTED: cutlass.Constexpr[bool],
):
    """KDA, one (sequence, value head), blockIdx.x = sequence * HV + value head: warp 0 streams
    each chunk's Qd, Ke, Kd, P and T tiles (``loads``) and v (``v_loads``) by TMA, warps 1 .. 3
    prepare its vectors (``_kda_prepare``), warpgroups 1 and 2 run the state chain
    (``_state_math`` with PER_CHANNEL). SEGMENTED: one (segment, value head, row group), as
    ``_gdn_kernel``'s."""
    tidx = cute.arch.thread_idx()[0]
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    wg = warp // 4
    segment = ()
    if const_expr(SEGMENTED):
        n, hv, _, bos, length, num_chunks, slot, sid, j_segment, last = block_segment(
            cu_seqlens, state_indices, N, segment_tokens, HV, 1, HAS_SLOTS)
        maps = Int32(cute.arch.block_idx()[1])
        live = (slot >= 0) & ((maps == 0) | (j_segment > 0))
        segment = (transitions, q_carried, sid, j_segment, last, maps)
    else:
        n, hv, _, bos, length, num_chunks, slot = block_sequence(cu_seqlens, state_indices, HV, 1, HAS_SLOTS)
        live = slot >= 0

    tile_layout = kmajor(C, HEAD_DIM, KDA_STAGES)
    v_layout = kmajor(C, HALF, 2 * V_STAGES)
    out_layout = kmajor(C, HALF, 2)
    products_layout = kmajor(C, C, KDA_STAGES)

    @cute.struct
    class Shared:
        barriers: cute.struct.MemRange[Int64, 2 * (2 * KDA_STAGES + V_STAGES)]
        sQd: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(tile_layout)], 1024]
        sKe: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(tile_layout)], 1024]
        sKd: cute.struct.Align[cute.struct.MemRange[Float16, cute.cosize(tile_layout)], 1024]
        sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(v_layout)], 1024]
        sO: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(out_layout)], 1024]
        sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(products_layout)], 1024]
        sT: cute.struct.Align[cute.struct.MemRange[Float16, cute.cosize(products_layout)], 1024]
        vectors: cute.struct.Align[cute.struct.MemRange[Float32, KDA_STAGES * (C + HEAD_DIM)], 16]

    storage = cutlass.utils.SmemAllocator().allocate(Shared)
    sQd, sKe, sKd, sV, sP, sT = _swizzled(storage, ("sQd", tile_layout), ("sKe", tile_layout), ("sKd", tile_layout),
                                          ("sV", v_layout), ("sP", products_layout), ("sT", products_layout))

    barriers = storage.barriers.data_ptr()
    # one transaction of three [C, 128] and two [C, C] 16-bit tiles: four [C, 128] tiles' bytes
    loads = make_loads(barriers, KDA_STAGES, 4, 8, defer_sync=True)
    v_loads = make_loads(barriers + 2 * KDA_STAGES, V_STAGES, 1, 8, defer_sync=True)
    ready = pipeline.PipelineAsync.create(
        barrier_storage=barriers + 2 * (KDA_STAGES + V_STAGES), num_stages=KDA_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 96),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1))

    if wg == 0:
        _set_registers(KDA_LOAD_REGS, KDA_THREADS)
        if live:
            if warp == 0:
                produce(((tma_qd, qd_tiles, hv, sQd, HEAD_DIM), (tma_ke, ke_tiles, hv, sKe, HEAD_DIM),
                         (tma_kd, kd_tiles, hv, sKd, HEAD_DIM), (tma_p, p_tiles, hv, sP, C),
                         (tma_t, t_tiles, hv, sT, C)), (tma_v, v_tiles, sV), loads, bos, num_chunks, hv, v_loads)
            else:
                _kda_prepare(storage, sKd, loads, ready, gate, beta, hv, bos, length, num_chunks, warp, tidx % 32,
                             BETA_LOGITS)
    else:
        _set_registers(KDA_STATE_REGS, KDA_THREADS)
        _state_math(storage, (sQd, sKe, sKd, sP, sT), sV, loads, v_loads, ready, wg - 1, tidx - 128 * wg, out,
                    tma_o, o_tiles, pool, has_initial_state, checkpoint_indices, checkpoint_every, num_checkpoints,
                    n, hv, bos, length, num_chunks, slot, live, segment, out_layout, HAS_POOL, HAS_INIT_FLAGS,
                    HAS_CKPT, SEGMENTED, True)


@cute.jit
def _kda_launch(
    qd_ptr: cute.Pointer, ke_ptr: cute.Pointer, kd_ptr: cute.Pointer, p_ptr: cute.Pointer, t_ptr: cute.Pointer,
    v_ptr: cute.Pointer, o_ptr: cute.Pointer, pool_ptr: cute.Pointer, gate_ptr: cute.Pointer, beta_ptr: cute.Pointer,
    cu_ptr: cute.Pointer, indices_ptr: cute.Pointer, init_ptr: cute.Pointer, ckpt_ptr: cute.Pointer,
    transitions_ptr: cute.Pointer, carried_ptr: cute.Pointer,
    T: Int32, N: Int32, P: Int32, num_checkpoints: Int32, checkpoint_every: Int32, checkpoint_stride: Int32,
    scale: Float32, segment_tokens: Int32, stream: cuda.CUstream,
    STRIDES: cutlass.Constexpr[tuple], BETA_STRIDES: cutlass.Constexpr[tuple], HV: cutlass.Constexpr[int],
    BETA_LOGITS: cutlass.Constexpr[bool], HAS_SLOTS: cutlass.Constexpr[bool], HAS_POOL: cutlass.Constexpr[bool],
    HAS_INIT_FLAGS: cutlass.Constexpr[bool], HAS_CKPT: cutlass.Constexpr[bool], SEGMENTED: cutlass.Constexpr[bool],
):
    """Views of the raw pointers, the TMA descriptors and the launch of ``_kda_kernel`` (N x HV
    CTAs; SEGMENTED: segment ids x HV x 2, as ``_launch``'s). Qd, Ke, Kd, G: contiguous [T, HV,
    128]; P, T: contiguous [T, HV, C]; STRIDES as ``cute_prefill.strides`` gives them for (Qd, Ke,
    v, out, pool). ``scale`` is in Qd and P. transitions and q_carried as ``_launch``'s."""
    (tma_qd, qd_tiles, tma_ke, ke_tiles, tma_v, v_tiles, o, tma_o, o_tiles, pool, cu_seqlens, state_indices,
     has_initial_state, checkpoint_indices) = tensor_views(qd_ptr, ke_ptr, v_ptr, o_ptr, pool_ptr, cu_ptr, indices_ptr,
                                                           init_ptr, ckpt_ptr, T, N, P, num_checkpoints,
                                                           checkpoint_stride, STRIDES, HV, HV)
    D = HEAD_DIM
    load = cpasync.CopyBulkTensorTileG2SOp()
    kd = cute.make_tensor(kd_ptr, cute.make_layout((T, D, HV), stride=(HV * D, 1, D)))
    tma_kd, kd_tiles = cpasync.make_tiled_tma_atom(load, kd, kmajor(C, D), (C, D))
    products = []
    for ptr in (p_ptr, t_ptr):
        x = cute.make_tensor(ptr, cute.make_layout((T, C, HV), stride=(HV * C, 1, C)))
        products.append(cpasync.make_tiled_tma_atom(load, x, kmajor(C, C), (C, C)))
    (tma_p, p_tiles), (tma_t, t_tiles) = products
    gate = cute.make_tensor(gate_ptr, cute.make_layout((T, HV, D), stride=(HV * D, D, 1)))
    beta = cute.make_tensor(beta_ptr, cute.make_layout((T, HV), stride=BETA_STRIDES))
    transitions, q_carried, ids = _segment_views(transitions_ptr, carried_ptr, T, N, segment_tokens, HV, SEGMENTED)
    _kda_kernel(
        tma_qd, qd_tiles, tma_ke, ke_tiles, tma_kd, kd_tiles, tma_p, p_tiles, tma_t, t_tiles, tma_v, v_tiles,
        o, tma_o, o_tiles, pool, gate, beta, cu_seqlens, state_indices, has_initial_state, checkpoint_indices,
        checkpoint_every, num_checkpoints, transitions, q_carried, N, segment_tokens,
        HV, BETA_LOGITS, HAS_SLOTS, HAS_POOL, HAS_INIT_FLAGS, HAS_CKPT, SEGMENTED,
    ).launch(grid=(ids * HV, 2 if SEGMENTED else 1, 1), block=(KDA_THREADS, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# host side

_POINTERS = ("q", "k", "v", "out", "pool", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "state_indices",
             "has_initial_state", "checkpoint_indices", "transitions", "q_carried")


def unsupported(mode: str, q, k, v, out, pool) -> str | None:
    """Why these kernels cannot run a call (None when they can): GDN and KDA, the rows
    ``cute_prefill.unsupported`` admits. KDA's q and k go to the intra-chunk kernel, which takes any
    strides (copying q or k whose rows are not 16-byte aligned): only v and out need TMA's rows."""
    if mode not in ("gdn", "kda"):
        return f"no CuTe DSL delta-rule prefill for {mode}"
    tma_rows = ("v", "out") if mode == "kda" else ("q", "k", "v", "out")
    return unsupported_rows(mode.upper(), q, k, v, out, pool, tma_rows)


def gdn_prefill(recipe: Recipe, q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices, has_initial_state, out,
                checkpoint_every=None, checkpoint_indices=None, segment_tokens=None):
    """Chunked prefill of GDN over a packed varlen batch (``torch_backend.prefill`` semantics).

    q, k: [T, H, 128] bf16; v, out: [T, HV, 128] bf16 (rows 16-byte aligned); g: [T, HV] float32 /
    bf16, the log decay or with ``recipe.fused_gate`` the raw projection; beta: [T, HV] float32 /
    bf16, in (0, 1) or logits with ``recipe.beta_logits``; state_pool [P, HV, 128, 128] float32 /
    bf16, K-last, or None; cu_seqlens int32 [N + 1]; state_indices int32 [N] (negative: padding);
    has_initial_state bool [N]; checkpoint_indices int32 [N, M] with checkpoint_every a multiple
    of 64. segment_tokens: None (``segments.one_pass_segment_tokens`` decides), 0 (no segments) or a
    multiple of 64.
    Returns ``out``.
    """
    why = unsupported(recipe.mode, q, k, v, out, state_pool)
    if why:
        raise ValueError(why)
    ckpt = checkpoints(state_pool, checkpoint_every, checkpoint_indices)
    T, N, HV = q.shape[0], cu_seqlens.shape[0] - 1, v.shape[1]
    tokens = segments.one_pass_segment_tokens(T, N, HV, segments.sm_count(q.device), checkpoints=ckpt is not None,
                                              requested=segment_tokens)
    check_index_dtypes(cu_seqlens, state_indices, has_initial_state, ckpt)
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (q.shape[0], v.shape[1]):
            raise ValueError(f"{name}: expected [{q.shape[0]}, {v.shape[1]}], got {tuple(x.shape)}")
    gate = recipe.fused_gate
    A_log = None if gate is None else gate.A_log.float().contiguous()
    dt_bias = None if gate is None or gate.dt_bias is None else gate.dt_bias.float().contiguous()
    transitions, q_carried = _segment_buffers(T, N, HV, tokens, q.device)
    # an absent tensor (None) is never read (its flag is off)
    tensors = (q, k, v, out, state_pool, g, beta, A_log, dt_bias, cu_seqlens, state_indices, has_initial_state,
               ckpt, transitions, q_carried)
    scalars, constexprs = launch_arguments(recipe, q, k, v, out, cu_seqlens, state_pool, state_indices,
                                           has_initial_state, ckpt, checkpoint_every)
    constexprs += (("GATE_STRIDES", (*g.stride(), *beta.stride())),
                   ("GATE", GATE_NONE if gate is None else GATE_SOFTPLUS), ("HAS_DT_BIAS", dt_bias is not None),
                   ("BETA_LOGITS", recipe.beta_logits), ("SEGMENTED", bool(tokens)))
    launch(_launch, _POINTERS, tensors, (*scalars, tokens), constexprs, q.device)
    if tokens:
        join_segments(cu_seqlens, state_indices, transitions, q_carried, out, state_pool, tokens=tokens)
    return out


def _segment_buffers(T: int, N: int, HV: int, tokens: int, device) -> tuple:
    """(transitions, q_carried) of a segmented state pass (None, None without segments): every
    segment's final value and map rows, float32 [segment ids, HV, 256, 128], and the map rows'
    outputs, the carried queries, bf16 [T, HV, 128]."""
    if not tokens:
        return None, None
    num_ids = segments.num_segment_ids(T, N, tokens)
    return (torch.empty(num_ids, HV, 2 * HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device),
            torch.empty(T, HV, HEAD_DIM, dtype=torch.bfloat16, device=device))


_KDA_POINTERS = ("Qd", "Ke", "Kd", "P", "T", "v", "out", "pool", "G", "beta", "cu_seqlens", "state_indices",
                 "has_initial_state", "checkpoint_indices", "transitions", "q_carried")


def kda_prefill(recipe: Recipe, q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices, has_initial_state, out,
                checkpoint_every=None, checkpoint_indices=None, segment_tokens=None):
    """Chunked prefill of KDA over a packed varlen batch (``torch_backend.prefill`` semantics): the
    intra-chunk operands (``intra_cute.kda_chunk_operands``: P, M^-1 and the decayed Q and K tiles
    per chunk), then the state pass on the tensor cores (``_kda_kernel``,
    one CTA per sequence and value head, or per segment as GDN's: ``segment_tokens`` as
    ``gdn_prefill``'s).

    q, k: [T, H, 128] bf16, any strides; v, out: [T, HV, 128] bf16 (rows 16-byte aligned); g: [T, HV,
    128] float32 / bf16, the log decay or with ``recipe.fused_gate`` the raw projection; beta: [T, HV]
    float32 / bf16, in (0, 1) or logits with ``recipe.beta_logits``; state_pool [P, HV, 128, 128]
    float32 / bf16, K-last, or None; cu_seqlens int32 [N + 1]; state_indices int32 [N] (negative:
    padding); has_initial_state bool [N]; checkpoint_indices int32 [N, M] with checkpoint_every a
    multiple of 64. Returns ``out``.
    """
    why = unsupported(recipe.mode, q, k, v, out, state_pool)
    if why:
        raise ValueError(why)
    ckpt = checkpoints(state_pool, checkpoint_every, checkpoint_indices)
    check_index_dtypes(cu_seqlens, state_indices, has_initial_state, ckpt)
    T, N, HV = q.shape[0], cu_seqlens.shape[0] - 1, v.shape[1]
    tokens = segments.one_pass_segment_tokens(T, N, HV, segments.sm_count(q.device), checkpoints=ckpt is not None,
                                              requested=segment_tokens)
    for name, x, shape in (("g", g, (T, HV, HEAD_DIM)), ("beta", beta, (T, HV))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected {list(shape)}, got {list(x.shape)}")

    ops = kda_chunk_operands(recipe, q, k, g, beta, cu_seqlens=cu_seqlens, state_indices=state_indices)
    transitions, q_carried = _segment_buffers(T, N, HV, tokens, q.device)
    tensors = (ops["Qd"], ops["Ke"], ops["Kd"], ops["P"], ops["T"], v, out, state_pool, ops["G"], beta, cu_seqlens,
               state_indices, has_initial_state, ckpt, transitions, q_carried)
    scalars, constexprs = launch_arguments(recipe, ops["Qd"], ops["Ke"], v, out, cu_seqlens, state_pool,
                                           state_indices, has_initial_state, ckpt, checkpoint_every)
    constexprs = tuple((name, value) for name, value in constexprs if name not in ("H", "QK_L2NORM"))
    constexprs += (("BETA_STRIDES", beta.stride()), ("BETA_LOGITS", recipe.beta_logits), ("SEGMENTED", bool(tokens)))
    launch(_kda_launch, _KDA_POINTERS, tensors, (*scalars, tokens), constexprs, q.device)
    if tokens:
        join_segments(cu_seqlens, state_indices, transitions, q_carried, out, state_pool, tokens=tokens)
    return out
