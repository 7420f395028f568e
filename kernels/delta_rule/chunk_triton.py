"""Chunked prefill of the gated delta rule (GDN and KDA) in Triton: one core, three stages.

The math is ``chunk_torch.py``'s WY form (read its docstring first). Per chunk of C = 64 tokens,
with G the chunk-local cumulative log gate (per token for GDN, per token and channel for KDA),
q and k l2-normalised, and S0 the state entering the chunk:

    A_ts  = sum_k k_t[k] k_s[k] exp(G_t[k] - G_s[k])          s < t     (keys against keys)
    P_ts  = scale sum_k q_t[k] k_s[k] exp(G_t[k] - G_s[k])     s <= t    (queries against keys)
    M     = I + diag(beta) A                                            (unit lower triangular)
    W     = M^-1 diag(beta) (exp(G) * K)          U~ = M^-1 diag(beta) V
    U     = U~ - W S0
    O     = scale (exp(G) * Q) S0 + P U
    S_out = exp(G_C) * S0 + (exp(G_C - G) * K)^T U

GDN is this with a scalar gate broadcast over the K channels; the state kernel is shared and a
constexpr (PER_CHANNEL) picks how a decay is applied. The intra-chunk stages differ, because a
scalar decay can be applied after a product and a per-channel one cannot.

Launches per call: three for GDN, seven for KDA (six with float32 inputs; two more with segments,
stage 3 below).
0. ``kernels.common.varlen.chunk_indices``: the (sequence, chunk) of every global chunk id, on
   the device (no host synchronisation).
1. The intra-chunk operands of every chunk, all chunks independent. l2norm, the fused gate, the
   in-chunk cumulative sum and the beta sigmoid are applied in registers.
   GDN, ``_gdn_intra_kernel``, grid ((T // C + N) x HV) (``_chunk_program``), kernels 1 and 2 in
   one: P and N = M - I as two whole-chunk products (q k^T, k k^T) times one C x C decay matrix,
   M^-1 by block doubling over the whole chunk on the tensor cores (``_invert_unit_lower``: five
   pairs of C x C products, fp16 operands with bf16 / fp16 inputs as the CuTe DSL kernel's solve,
   tf32x3 with float32 ones), held in registers for W and U~ (kernel 2's products, U~ in column
   tiles of GDN_U_TILE). It writes P, W, U~ and the state pass's row factors (l2norms, decays,
   scale: three float32 per token and value head). H200, GDN 4 x 8192: 1.04 ms against 0.73 +
   0.45 for the former pair (P and N, N back from the workspace in 16 x 16 blocks and solved in
   IEEE float32, M^-1 to the workspace; then W and U~ in a launch of their own); whole prefill
   2.08 -> 1.91 ms. Final states against the float64 oracle 4.19e-4 against 4.18e-4 (random
   keys), up to 1.14e-3 against 8.9e-4 with keys correlated within a chunk; outputs unchanged
   (2.41e-3). Not measured off Hopper: an sm_80 compile (mma.sync, operands in registers) spills
   3.3 KB a thread at the register cap, 1.6 KB uncapped, where the former intra kernel spilled
   0.9 KB. KDA, whose per-channel decays only factor safely across sub-chunk boundaries
   (below): ``_kda_gate_kernel`` first writes G (the chunk-local cumulative log gate,
   float32 [T, HV, K]) for kernels 1 to 3, then ``_kda_block_kernel``, grid ((T // C + N) x HV
   x 4,), one 16-row block of P and N per program, its decays read from G (with float32 inputs
   it computes the gates itself and writes G), then ``_kda_exact_diag_kernel`` (the diagonal
   blocks whose gates span too much for the block kernel's factored product, exactly; below),
   then ``_invert_kernel`` (one program per chunk and head, 2 warps). With bf16 / fp16 inputs the
   block kernel also writes its rows of the decayed operands of kernels 2 and 3, from the q and k
   rows, norms and G it holds for P and N: Ke = exp(G) K / |k| (W's), Qd = scale exp(G) Q / |q| (in
   the input dtype, the rounding its product applies) and Kd = exp(G_C - G) K / |k|; Ke and Kd in
   fp16, the 11 significant bits of their tf32 products (all three tiles are <= 1). Kernel 2 formed
   Qd and Kd from a second read of q, k and G, and its own decayed K from k and G (H200, KDA 4 x
   8192: kernel 2 0.998 -> 0.501 ms, this kernel 1.090 -> 1.300; whole prefill 3.61 -> 3.35 ms, 1 x
   32768 4.43 -> 4.15). The whole chunk's blocks in one program kept three sub-chunks' decayed
   tiles live and spilled 3 KB per thread (KDA 4 x 8192 on an H200: 7.80 ms against 5.82 + 0.52
   then).
   On Hopper KDA's prefill forms these operands in one CuTe DSL kernel instead (``intra_cute``),
   which hands the diagonal blocks it cannot take in fp16 to ``kda_exact_diagonal`` (the exact
   kernel's launch, its gates summed there from g).
2. KDA: ``_delta_wu_kernel``, same grid as kernel 1: U~ = M^-1 diag(beta) V and W as C-row
   products over the whole chunk in column tiles of 32, into W [T, HV, K] and U~ [T, HV, V]
   (GDN's intra kernel forms them itself). A separate launch because inside the intra-chunk
   kernels the products kept every v and k tile live and spilled (GDN 4 x 8192 on an H200 went
   from 6.01 to 4.05 ms with the split, when its intra kernel held 16-row blocks). Folded into
   kernel 3 instead (U = M^-1 diag(beta) (V - (exp(G) K) S) per chunk, no W / U~ workspace) it
   adds a dependent product to the serial loop, which costs more than this kernel (H200, GDN
   4 x 8192: state pass 1.01 -> 1.65 ms, against 0.58 for this kernel then). With bf16 / fp16
   inputs it reads the decayed K whole (Ke, kernel 1).
3. ``_delta_state_kernel``, grid (N x V / BV, HV): one program per (sequence, value head, V
   tile) walks its chunks in order, the state tile S [K, BV] in float32 registers. The V tiles
   of a sequence and head run side by side (``segments.program_ids``), so q, k, W and P come
   from HBM once (H200, GDN 4 x 8192: 1.12 -> 1.02 ms against tiles in the slowest grid axis).
   Per chunk it reads W, U~, P and the decayed Q and K and applies the four products above.
   GDN rereads the raw q and k tiles and applies kernel 1's row factors to the products: with
   the norms and gate recomputed here (and in kernel 2, then a launch of its own), GDN 4 x 8192 on
   an H200 took 1.02 ms here and 0.58 in kernel 2, against 0.91 and 0.45 (whole prefill 2.41 ->
   2.20 ms). KDA
   with bf16 / fp16 inputs reads Qd and Kd (kernel 1) and G_C: forming them here (q, k and
   G [C, K] in float32, two C x K exponentials a chunk in the serial loop, 255 registers and
   spills) cost the state pass 1.49 ms against 0.88 at KDA 4 x 8192 on an H200 (whole prefill
   3.96 -> 3.61 ms, 1 x 32768 5.29 -> 4.43, when kernel 2 formed them). With float32
   inputs KDA recomputes its gate here (numerics below: recomputing it cost 0.9 of 2.4 ms) and
   forms the decayed tiles.
   The state goes to memory only at the end (the pool slot) and at requested checkpoints;
   FLA's chunk_h writes every chunk's state, this never does.
   Where one long sequence (or a shard with few heads) would leave SMs idle, the sequences are
   cut into segments (``kernels.common.segments``): the same kernel first computes every
   segment's state map with K map columns and no outputs, a small kernel composes them, and the
   kernel then runs per segment with outputs. Two more launches, about twice the state pass's
   products, all SMs busy.

Memory traffic per token and value head, beyond reading q, k, v, g, beta and writing o: the
workspace W, U~ and P written once and read once (W and P once per V tile, mostly from L2);
KDA also M^-1 (written once, read once) and N (between its launches, 256 more bytes each way),
G (4 K bytes written once and read by the later kernels) and, with bf16 / fp16 inputs, Ke, Qd
and Kd (6 K bytes written once and read once, Qd and Kd once per V tile, where kernels 2 and 3
would otherwise reread q, k and G); GDN its row factors (12 bytes written once, read by kernel 3).
With bf16 inputs and K = V = 128 that is 2 (K + C) + 4 V = 896 bytes each way for GDN, 256 more
for KDA's M^-1; the workspace is allocated per call ([T, HV, K + V + C], about 29 MB per 1000
tokens at 32 value heads, KDA 8 MB more for M^-1; KDA's G and, with bf16 / fp16 inputs, Ke, Qd
and Kd add 10 K bytes per token and value head, about 42 MB more per 1000 tokens at 32 heads).

Numerics of the gate. exp(G_t - G_s) <= 1 for s <= t, but exp(-G_s) alone overflows float32
once a chunk's gates sum below about -88, which KDA's unbounded per-channel gate reaches easily.
Nothing here forms exp(-G) alone:
  - KDA's off-diagonal 16 x 16 blocks (rows t in sub-chunk i, columns s in sub-chunk j < i)
    split the decay at the start of sub-chunk i: with l the cumulative gate within a sub-chunk
    and e_u the sum of sub-chunk u's gates,
        exp(G_t - G_s) = exp(l_i,t) * exp(e_j - l_j,s + e_{j+1} + ... + e_{i-1}),
    both factors <= 1 since G is non-increasing. The block is then one tensor-core product of two
    decayed tiles; a factor can only underflow when the true product is smaller still.
  - KDA's diagonal blocks split the decay the same way, at the sub-chunk's start: then
    exp(l_t) <= 1 and exp(-l_s) >= 1, which is safe while the sub-chunk's gates span
    less than FACTOR_SPAN = 80 in every channel (e^80 ~ 5.5e34). A sub-chunk that spans more
    (decays below e^-80 within 16 tokens, common with engines' raw gates: per-channel decays of
    tens per token) is left to a launch of its own (``_kda_exact_diag_kernel``), which halves the
    block until its blocks span less, the pairs across halves split at the upper half's first
    row as the off-diagonal blocks are (both factors <= 1), down to single rows if need be
    (``_split_diag_block``). The choice is made on the device, per sub-chunk.
  - W uses exp(G_t) <= 1, the state update exp(G_C - G_t) <= 1 and exp(G_C) <= 1. With float32
    inputs KDA sums G_C - G_t from the gates after t (a reverse cumulative sum) instead of taking
    the difference: its float32 sums reach |G_C| in the hundreds, and the difference's rounding
    left relative errors of ~1e-5 in the decays near 1 of a chunk's last tokens (the final
    states missed the 1e-5 tolerance on an H200: 1.4e-5 to 1.7e-5). The second scan is the
    serial pass's costliest step (KDA 4 x 8192, bf16: state pass 2.85 -> 5.37 ms), so bf16 and
    fp16 inputs, whose tolerance is 5e-3, keep the difference.
  - GDN's scalar decays are one C x C matrix exp(G_t - G_s), masked to s <= t before the
    exponential. Its cumulative sums run in float64 (a few scalars per token): with strong
    decays |G| reaches the thousands within a chunk, and float32 sums would leave absolute
    errors of ~1e-4 in G_t - G_s, which the exponential turns into relative errors.

Precision. Arithmetic and the state are float32. Products follow the inputs' dtype:
  - float32 inputs: every product is "tf32x3" (float32 accuracy on the tensor cores).
  - bf16 inputs: products whose operands are both raw inputs (GDN's q k^T and k k^T, with the
    l2norm and decay applied to the 16 x 16 result) use bf16 operands, exact. Products whose
    error is amplified (KDA's decayed A and P, KDA's M^-1 times decayed K, P U, K^T U: U = U~ - W S
    is a difference of close terms) use tf32. M^-1 times V, and GDN's M^-1 times K, take "bf16x2"
    (the raw tile exact, M^-1 split into two bf16 parts: 16 bits of its mantissa, tf32 keeps 11;
    H200, 4 x 8192: GDN's W / U~ kernel 0.670 -> 0.582 ms, KDA's 0.758 -> 0.713). In the state pass
    the same split of U lost (GDN 1.02 -> 1.08-1.17 ms), so P U and K^T U stay tf32. W S and
    (exp(G) Q) S use bf16 operands: their rounding stays below the bf16 output's own. The
    workspace holds W and P in bf16, U~ in float32.
  - fp16 inputs: as bf16 with fp16 for the raw-input products and tf32 in place of bf16 and bf16x2.
  - KDA's triangular solve (16 x 16 products) is always IEEE float32 (``_mm``); GDN's (whole-chunk
    products) takes fp16 operands with bf16 / fp16 inputs, as the CuTe DSL kernel's solve does
    (unit keys keep |N| <= beta <= 1), and tf32x3 with float32 ones.
Scalar row factors (l2norm, GDN's gate, beta) are folded into the smaller operand of each
product, so raw input tiles enter the tensor cores unrounded.

Varlen and serving: no host synchronisation. Padding sequences (negative slot) read and write
nothing and get zero outputs; their chunks are skipped by the intra kernel.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..common import segments
from ..common.chunking import CHUNK_SIZE
from ..common.prep import L2NORM_EPS, Recipe
from ..common.segments import program_ids, program_span
from ..common.varlen import chunk_indices, max_chunks

SUB = tl.constexpr(16)  # rows of a sub-chunk: the block size of A, P and the triangular solve
EPS = tl.constexpr(L2NORM_EPS)
LN2 = tl.constexpr(math.log(2.0))
ROW_FACTORS = tl.constexpr(3)  # GDN's float32 row factors per token and value head (``_gdn_intra_kernel``)
LOG2_CHUNK = tl.constexpr(CHUNK_SIZE.bit_length() - 1)  # the kernels' C is CHUNK_SIZE
# KDA diagonal blocks go to the tensor cores while exp(span) stays far from float32's 3.4e38 (e^88)
FACTOR_SPAN = 80.0
MAX_HEAD_DIM = 256  # K and V are held whole in registers (as their next power of two)
WU_TILE = 32  # columns of W and U~ per product in KDA's W / U~ kernel
# Columns of U~ per product in GDN's intra kernel. H200, GDN 4 x 8192, that kernel (P, the solve, W
# and U~) 1.04 ms at 64 against 1.39 at 128 (register cap 168; uncapped 1.20 at 64). At 32 Triton
# 3.6's sm_90 code computed U~ wrong (relative error 1.2 against the float64 reference, where 64
# and 128 and the interpreter at 32 are within 2.5e-3): its product has an operand from another
# product's accumulator and a 32-column B tile.
GDN_U_TILE = 64
# Channels and warps of a KDA gate program. H200, KDA 32 heads 4 x 8192, the intra-chunk launches:
# raw gates (softplus of the fused gate) 2.800 ms on 4 warps against 2.895 on 2 and 3.600 on 1;
# prepared gates 1.936 / 1.934 / 1.938.
GATE_TILE, GATE_WARPS = 64, 4
# Register cap of the intra-chunk kernels with bf16 / fp16 inputs: KDA's block and exact diagonal
# kernels (2 warps: six programs per SM instead of four) and GDN's (4 warps: three instead of
# two), against spills (sm_90 compile of KDA's: about 900 and 120 bytes per thread). They are
# latency-bound (ncu, KDA's block kernel: 2 warps per scheduler, 4.9 cycles per issued
# instruction). H200, 32 heads 4 x 8192: KDA's intra-chunk launches, prepared / raw gates, 1.952 /
# 2.809 ms uncapped, 1.771 / 2.595 with both at 168; the block kernel alone at 200, 168, 144, 128:
# 1.989 / 2.816, 1.779 / 2.678, 1.979 / 2.871, 2.337 / 3.219. GDN's whole Triton prefill 2.376 ms
# uncapped, 2.161 with its intra kernel at 168, 2.197 at 128 (when the solve and W / U~ were not in
# it; GDN_U_TILE's comment has the kernel since). Not capped: the inverse (1.971 /
# 2.827 at 168), the W / U~ kernel (2.378 at 168 and 128) and the state pass (3.490 / 3.410).
INTRA_MAXNREG = 168
# KDA's exact diagonal blocks with bf16 / fp16 inputs: channels per piece, warps and register cap.
# H200, 32 heads 4 x 8192, raw gates, the intra-chunk launches: 2.607 ms with the whole K = 128 on
# 2 warps at 168 registers (0.903 in this kernel), 2.404-2.432 in pieces of 32 on one warp at 128;
# pieces of 32 on 2 warps 2.721, on one warp at 96 registers 2.546, pieces of 64 on one warp 2.809
# (168) and 3.047 (128), on 2 warps at 128 2.617.
EXACT_DIAG_TILE, EXACT_DIAG_WARPS, EXACT_DIAG_MAXNREG = 32, 1, 128
# Segments (kernels/common/segments.py): their transitions carry K more state columns, so few and
# long pay best (H200, GDN 1 x 32768: 3.89 ns per token-head unsegmented, 3.50 in four segments,
# 3.80 in five, 3.82 in 32); none shorter than 1024 tokens (each costs a [V, K] x [K, K] step).
SEGMENT_MIN_TOKENS = 1024
SEGMENT_PROGRAMS_PER_SM = 1


# ---------------------------------------------------------------------------------------------
# device helpers shared by both kernels


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b with float32 accumulation. PREC: "bf16" / "fp16" (operands rounded to that type),
    "bf16x2" (one operand a bf16 tile, exact, the other float32 and split into bf16 high and low
    parts, two products: it keeps 16 bits of mantissa, tf32 would keep 11), "bf16x3" (both float32,
    each split so, three products, the low x low one dropped: about 16 bits), or a float32
    ``input_precision``: "tf32", "tf32x3", "ieee"."""
    if PREC == "bf16":
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16x2":
        if a.dtype == tl.bfloat16:
            b_hi = b.to(tl.bfloat16)
            b_lo = (b.to(tl.float32) - b_hi.to(tl.float32)).to(tl.bfloat16)
            c = tl.dot(a, b_hi) + tl.dot(a, b_lo)
        else:
            tl.static_assert(b.dtype == tl.bfloat16, "bf16x2: one operand must be a bf16 tile")
            a_hi = a.to(tl.bfloat16)
            a_lo = (a.to(tl.float32) - a_hi.to(tl.float32)).to(tl.bfloat16)
            c = tl.dot(a_hi, b) + tl.dot(a_lo, b)
    elif PREC == "bf16x3":
        a_hi = a.to(tl.bfloat16)
        b_hi = b.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
        c = tl.dot(a_hi, b_hi) + tl.dot(a_hi, b_lo) + tl.dot(a_lo, b_hi)
    elif PREC == "fp16":
        c = tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return c


@triton.jit
def _inv_norm(x, QK_L2NORM: tl.constexpr):
    """Per row of a [R, D] tile: 1 / sqrt(sum(x^2) + eps) with QK_L2NORM, else 1 ([R], float32)."""
    if QK_L2NORM:
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, 1) + EPS)
    else:
        r = tl.full([x.shape[0]], 1.0, tl.float32)
    return r


@triton.jit
def _softplus(x, FAST_LOG: tl.constexpr):
    # log(1 + e^x) = max(x, 0) + log(1 + e^-|x|): e^-|x| <= 1 never overflows
    y = 1.0 + tl.exp(-tl.abs(x))
    if FAST_LOG:
        # the SFU's lg2.approx: for y in (1, 2] within about 2^-22 of log2 y (PTX ISA); Triton's
        # log is a libdevice polynomial of about a dozen FMAs, which made the raw-gate pass issue-bound
        log_y = LN2 * tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [y], dtype=tl.float32,
                                                is_pure=True, pack=1)
    else:
        log_y = tl.log(y)
    return tl.maximum(x, 0.0) + log_y


@triton.jit
def _load_tile(ptr, tok, rmask, s_t, s_d, c0, D: tl.constexpr, BD: tl.constexpr):
    """Rows ``tok`` [R], columns c0 .. c0 + BD - 1 of one head (``ptr`` points at it) of a
    token-major tensor with D columns: an [R, BD] tile in the tensor's dtype; masked rows and
    columns past D read as zero."""
    d = c0 + tl.arange(0, BD)
    return tl.load(ptr + tok[:, None] * s_t + d[None, :] * s_d, mask=rmask[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _load_rows(ptr, tok, rmask, s_t, s_d, D: tl.constexpr, BD: tl.constexpr):
    """Rows ``tok`` [R] of one head, all D columns (as BD >= D): ``_load_tile`` at column 0."""
    return _load_tile(ptr, tok, rmask, s_t, s_d, 0, D, BD)


@triton.jit
def _head_gate(A_log, dt_bias, hv, K: tl.constexpr, PER_CHANNEL: tl.constexpr, FUSED_GATE: tl.constexpr):
    """The fused gate's parameters of value head ``hv``: A = exp(A_log[hv]) (0 without a fused
    gate) and ``dt_bias`` moved to the head ([K] values for KDA, one for GDN)."""
    A = 0.0
    if FUSED_GATE:
        A = tl.exp(tl.load(A_log + hv).to(tl.float32))
    return A, dt_bias + hv * (K if PER_CHANNEL else 1)


@triton.jit
def _log_decay_rows(g, tok, rmask, s_gt, s_gk, A, dt_bias, lower_bound, c0,
                    K: tl.constexpr, BK: tl.constexpr, PER_CHANNEL: tl.constexpr,
                    FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SAFE_GATE: tl.constexpr,
                    FAST_LOG: tl.constexpr = False):
    """Log decay of rows ``tok`` of one value head (``g``, ``dt_bias`` point at it): [R, BK] for
    channels c0 .. c0 + BK - 1 (KDA) or [R] (GDN, c0 unused), float32, exactly zero on masked
    rows and channels past K so that they neither decay the state nor count in the sums.

    With FUSED_GATE, ``g`` holds the raw projection a and A = exp(A_log[hv]):
    -A * softplus(a + dt_bias), or the safe gate lower_bound * sigmoid(A * (a + dt_bias)).
    FAST_LOG: softplus' logarithm on the SFU (``_softplus``; not under the interpreter).
    """
    if PER_CHANNEL:
        kk = c0 + tl.arange(0, BK)
        mask = rmask[:, None] & (kk < K)[None, :]
        a = tl.load(g + tok[:, None] * s_gt + kk[None, :] * s_gk, mask=mask, other=0.0).to(tl.float32)
    else:
        mask = rmask
        a = tl.load(g + tok * s_gt, mask=mask, other=0.0).to(tl.float32)
    if FUSED_GATE:
        if HAS_DT_BIAS:
            if PER_CHANNEL:
                a += tl.load(dt_bias + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
            else:
                a += tl.load(dt_bias).to(tl.float32)
        if SAFE_GATE:
            a = lower_bound * tl.sigmoid(A * a)
        else:
            a = -A * _softplus(a, FAST_LOG)
    return tl.where(mask, a, 0.0)


@triton.jit
def _chunk_program(HV: tl.constexpr):
    """(global chunk, value head) of a per-chunk program, grid axis 0 = chunks x HV: the value heads
    of one chunk are neighbours in launch order, so those sharing a qk head (grouped value heads)
    read its q and k rows from HBM once, then from L2."""
    return tl.program_id(0) // HV, tl.program_id(0) % HV


@triton.jit
def _chunk_rows(chunk_table, cu_seqlens, state_indices, i_c, C: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """(live, t0, eos) of global chunk ``i_c``: its first token and its sequence's end. Not live:
    the table's padding entries and chunks of padding sequences (negative slot), which read and
    write nothing."""
    n = tl.load(chunk_table + 2 * i_c)
    live = n >= 0
    n = tl.maximum(n, 0)
    if HAS_SLOTS:
        live = live & (tl.load(state_indices + n) >= 0)
    c = tl.load(chunk_table + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    return live, bos + c * C, tl.load(cu_seqlens + n + 1).to(tl.int64)


@triton.jit
def _load_beta(beta, tok, rmask, s_bt, BETA_LOGITS: tl.constexpr):
    """beta of rows ``tok`` (``beta`` points at the value head), sigmoid of logits with
    BETA_LOGITS; exactly zero on masked rows."""
    b = tl.load(beta + tok * s_bt, mask=rmask, other=0.0).to(tl.float32)
    if BETA_LOGITS:
        b = tl.sigmoid(b)
    return tl.where(rmask, b, 0.0)


# ---------------------------------------------------------------------------------------------
# kernel 1: P and M^-1 of every chunk (nothing here depends on the state)


@triton.jit
def _factor_rows(F_ws, tok, hv, HV: tl.constexpr):
    """Where the ROW_FACTORS row factors of tokens ``tok`` at value head ``hv`` sit in ``F_ws``
    [T, HV, ROW_FACTORS]: + 0 the output's, + 1 the state update's, + 2 exp(G_t)."""
    return F_ws + (tok * HV + hv) * ROW_FACTORS


@triton.jit
def _store_tile(ptr, x, tok, rmask, hv, c0, HV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Rows ``tok``, columns c0 .. c0 + BD - 1 (those < D) of a contiguous [T, HV, D] workspace."""
    d = c0 + tl.arange(0, BD)
    tl.store(ptr + (tok[:, None] * HV + hv) * D + d[None, :], x.to(ptr.dtype.element_ty),
             mask=rmask[:, None] & (d < D)[None, :])


@triton.jit
def _store_rows(ptr, x, tok, rmask, hv, HV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Whole rows of a contiguous [T, HV, D] workspace: ``_store_tile`` at column 0."""
    _store_tile(ptr, x, tok, rmask, hv, 0, HV, D, BD)


@triton.jit
def _store_block(ws, x, t0, row0, col0, L, hv, HV: tl.constexpr, C: tl.constexpr):
    """A 16 x 16 block at (row0, col0) of the chunk's [C, C] matrix in a [T, HV, C] workspace."""
    r = row0 + tl.arange(0, SUB)
    c = col0 + tl.arange(0, SUB)
    tl.store(ws + ((t0 + r)[:, None] * HV + hv) * C + c[None, :], x.to(ws.dtype.element_ty),
             mask=(r < L)[:, None])


@triton.jit
def _load_block(ws, t0, row0, col0, L, hv, HV: tl.constexpr, C: tl.constexpr):
    """The 16 x 16 block at (row0, col0) of the chunk's [C, C] matrix in a [T, HV, C] float32
    workspace; rows past the chunk's L valid ones read as zero."""
    r = row0 + tl.arange(0, SUB)
    c = col0 + tl.arange(0, SUB)
    return tl.load(ws + ((t0 + r)[:, None] * HV + hv) * C + c[None, :], mask=(r < L)[:, None], other=0.0)


@triton.jit
def _store_P_N(P_ws, N_ws, P, A, scale, b, t0, row0, col0, L, hv, HV: tl.constexpr, C: tl.constexpr):
    """KDA: the 16 x 16 block at (row0, col0) of P (times ``scale``) and of N = diag(b) A, ``b``
    the block rows' beta, into their workspaces."""
    _store_block(P_ws, scale * P, t0, row0, col0, L, hv, HV, C)
    _store_block(N_ws, b[:, None] * A, t0, row0, col0, L, hv, HV, C)


@triton.jit
def _mm(a, b):
    """16 x 16 products of the block inversion, in IEEE float32: the solve sets the accuracy. With
    tf32 here (FLA's choice) keys correlated within a chunk raised the final states' error 2-6x
    and KDA's output past the bf16 tolerance (H200 stress check, BENCHMARKS 2026-11-27). Triton's
    "tf32x3" kept the IEEE errors but slowed the prefill (H200, 4 x 8192: GDN 2.099 -> 2.599 ms,
    KDA 3.143 -> 3.345)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _invert_unit_lower(N, r, LOG_R: tl.constexpr, PREC: tl.constexpr):
    """(I + N)^-1 for a strictly lower triangular R x R N (R = 2^LOG_R), by block doubling:
    with X_m the inverse of the diagonal m x m blocks (block diagonal), each 2m x 2m block
    [[A, 0], [C, B]] has the inverse [[A^-1, 0], [-B^-1 C A^-1, B^-1]], i.e.
    X_2m = X_m - X_m C_m X_m with C_m the lower-left m x m blocks of N. Exactly the blocked forward
    substitution, in log2(R) - 1 pairs of R x R products (``_dot`` precision PREC) instead of
    R - 1 dependent row steps (each a cross-warp reduction). ``r``: arange(0, R)."""
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - tl.where(r[:, None] // 2 == r[None, :] // 2, N, 0.0)
    for m in tl.static_range(1, LOG_R):
        lower_left = (r[:, None] >> (m + 1) == r[None, :] >> (m + 1)) & (r[:, None] >> m != r[None, :] >> m)
        X = X - _dot(X, _dot(tl.where(lower_left, N, 0.0), X, PREC), PREC)
    return X


@triton.jit
def _invert_diag16(N):
    """A 16 x 16 diagonal block's inverse, its products in IEEE float32 as ``_mm``'s."""
    return _invert_unit_lower(N, tl.arange(0, SUB), 4, "ieee")


@triton.jit
def _invert_chunk(ws, out, t0, L, hv, HV: tl.constexpr, C: tl.constexpr):
    """M^-1 from N = M - I (strictly lower, float32 [C, C] rows of a [T, HV, C] workspace) into
    ``out`` ([T, HV, C], ``ws`` itself for in place), in 16 x 16 blocks: (M^-1)_ii by block
    doubling, then row block by row block (M^-1)_ij = -(M^-1)_ii sum_{j <= m < i} N_im (M^-1)_mj.
    Writes the lower blocks only."""
    N10 = _load_block(ws, t0, SUB, 0, L, hv, HV, C)
    N20 = _load_block(ws, t0, 2 * SUB, 0, L, hv, HV, C)
    N21 = _load_block(ws, t0, 2 * SUB, SUB, L, hv, HV, C)
    N30 = _load_block(ws, t0, 3 * SUB, 0, L, hv, HV, C)
    N31 = _load_block(ws, t0, 3 * SUB, SUB, L, hv, HV, C)
    N32 = _load_block(ws, t0, 3 * SUB, 2 * SUB, L, hv, HV, C)
    I00 = _invert_diag16(_load_block(ws, t0, 0, 0, L, hv, HV, C))
    I11 = _invert_diag16(_load_block(ws, t0, SUB, SUB, L, hv, HV, C))
    I22 = _invert_diag16(_load_block(ws, t0, 2 * SUB, 2 * SUB, L, hv, HV, C))
    I33 = _invert_diag16(_load_block(ws, t0, 3 * SUB, 3 * SUB, L, hv, HV, C))
    tl.debug_barrier()  # every warp has read N before any overwrites it
    I10 = -_mm(I11, _mm(N10, I00))
    I21 = -_mm(I22, _mm(N21, I11))
    I20 = -_mm(I22, _mm(N20, I00) + _mm(N21, I10))
    I32 = -_mm(I33, _mm(N32, I22))
    I31 = -_mm(I33, _mm(N31, I11) + _mm(N32, I21))
    I30 = -_mm(I33, _mm(N30, I00) + _mm(N31, I10) + _mm(N32, I20))
    _store_block(out, I00, t0, 0, 0, L, hv, HV, C)
    _store_block(out, I10, t0, SUB, 0, L, hv, HV, C)
    _store_block(out, I11, t0, SUB, SUB, L, hv, HV, C)
    _store_block(out, I20, t0, 2 * SUB, 0, L, hv, HV, C)
    _store_block(out, I21, t0, 2 * SUB, SUB, L, hv, HV, C)
    _store_block(out, I22, t0, 2 * SUB, 2 * SUB, L, hv, HV, C)
    _store_block(out, I30, t0, 3 * SUB, 0, L, hv, HV, C)
    _store_block(out, I31, t0, 3 * SUB, SUB, L, hv, HV, C)
    _store_block(out, I32, t0, 3 * SUB, 2 * SUB, L, hv, HV, C)
    _store_block(out, I33, t0, 3 * SUB, 3 * SUB, L, hv, HV, C)


@triton.jit
def _gdn_intra_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, scale,
    cu_seqlens, chunk_table, state_indices,
    P_ws, W_ws, U_ws, F_ws,
    s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_gt, s_gh, s_gk, s_bt, s_bh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BT: tl.constexpr, C: tl.constexpr,
    QK_L2NORM: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SAFE_GATE: tl.constexpr,
    BETA_LOGITS: tl.constexpr, HAS_SLOTS: tl.constexpr, PREC_IN: tl.constexpr, PREC_RAW: tl.constexpr,
    PREC_SOLVE: tl.constexpr,
):
    """GDN, one (chunk, value head): P, W and U~ of the chunk and the row factors into the
    workspaces. P and N = M - I are two whole-chunk products of the raw q and k tiles: a scalar
    gate's decays exp(G_t - G_s) form one C x C matrix, applied to the products with the l2norm
    and beta row and column factors (G in float64: module docstring). M^-1 stays in registers
    (``_invert_unit_lower`` over the whole chunk), then W = M^-1 diag(beta exp(G) / |k|) K and
    U~ = M^-1 diag(beta) V in column tiles of BT. The row factors of the state pass go to
    ``F_ws`` [T, HV, ROW_FACTORS] float32 (``_factor_rows``)."""
    i_c, hv = _chunk_program(HV)
    h = hv // GROUP
    live, t0, eos = _chunk_rows(chunk_table, cu_seqlens, state_indices, i_c, C, HAS_SLOTS)
    if live:
        rows = tl.arange(0, C)
        tok = t0 + rows
        rmask = tok < eos
        qq = _load_rows(q + h * s_qh, tok, rmask, s_qt, s_qk, K, BK)
        kk = _load_rows(k + h * s_kh, tok, rmask, s_kt, s_kk, K, BK)
        rk = _inv_norm(kk, QK_L2NORM)
        rq = _inv_norm(qq, QK_L2NORM) * scale
        A, dt_bias = _head_gate(A_log, dt_bias, hv, K, False, FUSED_GATE)
        gg = _log_decay_rows(g + hv * s_gh, tok, rmask, s_gt, 0, A, dt_bias, lower_bound, 0, K, BK, False,
                             FUSED_GATE, HAS_DT_BIAS, SAFE_GATE).to(tl.float64)
        G = tl.cumsum(gg, 0)
        decay_in = tl.exp(G.to(tl.float32))
        factors = _factor_rows(F_ws, tok, hv, HV)
        tl.store(factors, rq * decay_in, mask=rmask)
        tl.store(factors + 1, rk * tl.exp((tl.sum(gg, 0) - G).to(tl.float32)), mask=rmask)
        tl.store(factors + 2, decay_in, mask=rmask)
        lower = rows[:, None] >= rows[None, :]
        decay = tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0).to(tl.float32)) * rk[None, :]
        kt = tl.trans(kk)
        P = _dot(qq, kt, PREC_IN) * decay * rq[:, None]
        _store_rows(P_ws, tl.where(lower, P, 0.0), tok, rmask, hv, HV, C, C)
        b = _load_beta(beta + hv * s_bh, tok, rmask, s_bt, BETA_LOGITS)
        N = tl.where(rows[:, None] > rows[None, :], _dot(kk, kt, PREC_IN) * decay * (b * rk)[:, None], 0.0)
        Minv = _invert_unit_lower(N, rows, LOG2_CHUNK, PREC_SOLVE)
        # the scalar row factors go to M^-1's columns: the raw k and v tiles enter the products unrounded
        _store_rows(W_ws, _dot(Minv * (b * rk * decay_in)[None, :], kk, PREC_RAW), tok, rmask, hv, HV, K, BK)
        Mb = Minv * b[None, :]
        for c0 in tl.static_range(0, V, BT):
            vv = _load_tile(v + hv * s_vh, tok, rmask, s_vt, s_vv, c0, V, BT)
            _store_tile(U_ws, _dot(Mb, vv, PREC_RAW), tok, rmask, hv, c0, HV, V, BT)


@triton.jit
def _kda_head(q, k, g, beta, A_log, dt_bias, hv, s_qh, s_kh, s_gh, s_bh, GROUP: tl.constexpr, K: tl.constexpr,
              FUSED_GATE: tl.constexpr):
    """KDA's per-head arguments of value head ``hv``: q and k at its qk head, g and beta at it, and
    its fused-gate constants (A, dt_bias: ``_head_gate``)."""
    A, dt_bias = _head_gate(A_log, dt_bias, hv, K, True, FUSED_GATE)
    return q + (hv // GROUP) * s_qh, k + (hv // GROUP) * s_kh, g + hv * s_gh, beta + hv * s_bh, A, dt_bias


@triton.jit
def _load_sub(q, k, g, beta, G_ws, hv, t0, row0, L, s_qt, s_qk, s_kt, s_kk, s_gt, s_gk, s_bt,
              A, dt_bias, lower_bound,
              HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, QK_L2NORM: tl.constexpr,
              FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SAFE_GATE: tl.constexpr,
              BETA_LOGITS: tl.constexpr, GATE_WS: tl.constexpr):
    """KDA: rows row0 .. row0 + 15 of the chunk starting at token t0 (L valid rows); the pointers
    are at the program's qk head (q, k) and value head (g, beta, dt_bias).

    Returns q, k [16, BK] as loaded, their inverse row norms [16], l [16, BK] float32: the
    cumulative log gate from the sub-chunk's start (zero on rows past L), e [BK]: the sum of the
    sub-chunk's gates, and beta [16]. With GATE_WS, l and e are differences of the chunk's G
    (``_kda_gate_kernel``) instead of a 16-row cumulative sum of the gates.
    """
    r = row0 + tl.arange(0, SUB)
    rmask = r < L
    tok = t0 + r
    qq = _load_rows(q, tok, rmask, s_qt, s_qk, K, BK)
    kk = _load_rows(k, tok, rmask, s_kt, s_kk, K, BK)
    b = _load_beta(beta, tok, rmask, s_bt, BETA_LOGITS)
    if GATE_WS:
        G = _load_tile(G_ws + hv * K, tok, rmask, HV * K, 1, 0, K, BK)
        # G before the sub-chunk (zero at the chunk's start) and at its last valid row
        start = _gate_row(G_ws, t0 + row0 - 1, row0 > 0, hv, HV, K, BK)
        end = _gate_row(G_ws, t0 + tl.minimum(row0 + SUB, L) - 1, True, hv, HV, K, BK)
        l = tl.where(rmask[:, None], G - start[None, :], 0.0)
        e = end - start
    else:
        gg = _log_decay_rows(g, tok, rmask, s_gt, s_gk, A, dt_bias, lower_bound, 0,
                             K, BK, True, FUSED_GATE, HAS_DT_BIAS, SAFE_GATE)
        l = tl.cumsum(gg, 0)
        e = tl.sum(gg, 0)
    return qq, kk, _inv_norm(qq, QK_L2NORM), _inv_norm(kk, QK_L2NORM), l, e, b


@triton.jit
def _gate_row(G_ws, tok, live, hv, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Token ``tok``'s row of KDA's G workspace [T, HV, K] at value head ``hv``: [BK] float32,
    zero where not ``live`` and past K."""
    ko = tl.arange(0, BK)
    return tl.load(G_ws + (tok * HV + hv) * K + ko, mask=(ko < K) & live, other=0.0)


@triton.jit
def _row_norms(x, tok, rmask, s_t, s_d, K: tl.constexpr, BK: tl.constexpr, QK_L2NORM: tl.constexpr):
    """``_inv_norm`` of rows ``tok`` of one head (``x`` points at it), read BK channels at a time:
    [R] float32."""
    if QK_L2NORM:
        sq = tl.zeros([tok.shape[0]], dtype=tl.float32)
        for c0 in range(0, K, BK):
            xx = _load_tile(x, tok, rmask, s_t, s_d, c0, K, BK).to(tl.float32)
            sq += tl.sum(xx * xx, 1)
        r = tl.rsqrt(sq + EPS)
    else:
        r = tl.full([tok.shape[0]], 1.0, tl.float32)
    return r


@triton.jit
def _decayed(x, inv_norm, factor):
    """A [16, BK] tile of q or k in float32 times its inverse row norms and a decay ``factor``."""
    return x.to(tl.float32) * (inv_norm[:, None] * factor)


@triton.jit
def _block_products(kr, qr, kc, PREC_ACC: tl.constexpr):
    """A (k k^T) and P / scale (q k^T) of one block: ``kr``, ``qr`` the row sub-chunk's k and q
    decayed by exp(l_i) (from the sub-chunk's start), ``kc`` the decayed column operand."""
    kt = tl.trans(kc)
    return _dot(kr, kt, PREC_ACC), _dot(qr, kt, PREC_ACC)


@triton.jit
def _rows_of(x, rows):
    """Row ``rows[t]`` of ``x`` in row t: a gather along axis 0 of a [16, BK] tile."""
    return tl.gather(x, tl.broadcast_to(rows[:, None], x.shape), 0)


@triton.jit
def _diag_block(A, P):
    """A strictly lower and P lower (with the diagonal): the triangles of a diagonal 16 x 16 block."""
    r = tl.arange(0, SUB)
    return tl.where(r[:, None] > r[None, :], A, 0.0), tl.where(r[:, None] >= r[None, :], P, 0.0)


@triton.jit
def _split_diag_block(qi, ki, rqi, rki, li, A, P, PREC_ACC: tl.constexpr, PREC_UNIT: tl.constexpr,
                      FACTOR_SPAN: tl.constexpr):
    """A and P / scale of a diagonal block whose gates span FACTOR_SPAN or more, exactly (lower
    triangles not yet masked), from the sub-chunk's q and k rows [16, BKD] in some BKD channels,
    the rows' inverse norms and ``li``, the cumulative gate in those channels (from any start:
    only differences within the sub-chunk are taken). These channels' terms are added to ``A``
    and ``P`` [16, 16] float32: the sums over channels split freely, and so may the choice of b.

    b is the largest block size (8, 4, 2 or 1) whose aligned b-row blocks span less than
    FACTOR_SPAN in the channels given. Pairs in different b-blocks are taken level by level, as
    the off-diagonal sub-chunk blocks are: at half size h = 8, 4, .. b, rows t in the upper half
    of a 2h-row block against rows s in its lower half, split at the upper half's first row m,
        exp(l_t - l_s) = exp(l_t - l_m) * exp(l_m - l_s),  both factors <= 1,
    one decayed tile exp(-|l - l_m|) for both sides and one product a level. Pairs within a
    b-block split at its first row f, exp(l_t - l_f) <= 1 times exp(l_f - l_s) < e^FACTOR_SPAN;
    b = 1 leaves only t = s, decay 1. The gates decide b, on the device. Each pair is taken once.
    The levels' products take PREC_UNIT (both factors <= 1; ``_kda_exact_diag_kernel`` on an H200
    at KDA 4 x 8192 with raw gates 0.984 ms in fp16 against 1.124 in tf32), the within-block one
    PREC_ACC (its column factors reach e^FACTOR_SPAN). The previous fallback, inside the block
    kernel one key column at a time (16 elementwise 16 x K exponentials and four row reductions
    across warps per column): that kernel took 4.39 ms at KDA 4 x 8192 with strong gates
    (``random_inputs``' fused ones) on an H200; now 1.10 ms, plus 0.98 ms in
    ``_kda_exact_diag_kernel``."""
    r = tl.arange(0, SUB)
    log_b = 0  # log2 of b
    for level in range(1, 4):  # spans only grow with the block size: the largest safe one wins
        if tl.max(tl.max(_rows_of(li, r >> level << level) - li, 1), 0) < FACTOR_SPAN:
            log_b = level
    for log_h in range(log_b, 4):  # h = 2^log_h, from b up to 8
        upper = (r >> log_h) % 2 == 1
        decay = tl.exp(-tl.abs(li - _rows_of(li, (r >> log_h << log_h) + tl.where(upper, 0, 1 << log_h))))
        kx = _decayed(ki, rki, decay)
        A_h, P_h = _block_products(kx, _decayed(qi, rqi, decay), kx, PREC_UNIT)
        lower = (r >> log_h) % 2 == 0
        pairs = (r[:, None] >> (log_h + 1) == r[None, :] >> (log_h + 1)) & upper[:, None] & lower[None, :]
        A += tl.where(pairs, A_h, 0.0)
        P += tl.where(pairs, P_h, 0.0)
    b = 1 << log_b
    first = _rows_of(li, (r // b) * b)
    rows = tl.exp(li - first)
    A_b, P_b = _block_products(_decayed(ki, rki, rows), _decayed(qi, rqi, rows), _decayed(ki, rki, tl.exp(first - li)),
                               PREC_ACC)
    within = r[:, None] // b == r[None, :] // b
    return A + tl.where(within, A_b, 0.0), P + tl.where(within, P_b, 0.0)


@triton.jit
def _kda_block_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, scale,
    cu_seqlens, chunk_table, state_indices,
    P_ws, N_ws,
    s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_gt, s_gh, s_gk, s_bt, s_bh,
    G_ws, Qd_ws, Kd_ws, Ke_ws, exact_marks,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
    QK_L2NORM: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SAFE_GATE: tl.constexpr,
    BETA_LOGITS: tl.constexpr, HAS_SLOTS: tl.constexpr, PREC_ACC: tl.constexpr, PREC_UNIT: tl.constexpr,
    FACTOR_SPAN: tl.constexpr,
    GATE_WS: tl.constexpr,
):
    """KDA, one (chunk, value head, row sub-chunk i): the 16 x 16 blocks (i, j <= i) of P (times
    scale) and of N = diag(beta) A into the workspaces. ``G_ws`` [T, HV, K] holds G, the cumulative
    log gate from the chunk's start (float32), for the W / U~ and state kernels: with GATE_WS
    ``_kda_gate_kernel`` wrote it and the blocks' decays are read from it; without (float32 inputs,
    whose sums keep the gates' own order: module docstring) the program computes its sub-chunks'
    gates and writes its rows of G. With GATE_WS it also writes its rows of the later
    kernels' decayed operands, from the q and k rows and norms it has in hand:
    Ke = exp(G) K / |k| (W's), Qd = scale exp(G) Q / |q| and Kd = exp(G_C - G) K / |k| (the state
    pass's), into ``Ke_ws``, ``Qd_ws`` and ``Kd_ws`` [T, HV, K] (host docstring for their dtypes).

    Per-channel decays only factor safely across sub-chunk boundaries (module docstring): with
    l_i the cumulative gate within sub-chunk i and e_u the sum of sub-chunk u's gates, j < i takes
        exp(G_t - G_s) = exp(l_i,t) * exp(e_j - l_j,s + e_{j+1} + ... + e_{i-1}),
    both factors <= 1. The diagonal block splits at the sub-chunk's start, exp(l_t) exp(-l_s),
    safe while the sub-chunk's gates span less than FACTOR_SPAN in every channel (the usual case);
    otherwise the next launch computes it exactly (``_kda_exact_diag_kernel``): the exact path here
    raised this kernel's spills from 64 to over 300 bytes per thread (sm_90 compile) and slowed it by
    about 12% on gates that never take it (H200, 4 x 8192: 2.006 -> 2.244 ms for the three
    intra-chunk launches). The program walks j from i - 1 down to 0, so that e_{j+1} + ... +
    e_{i-1} accumulates as it goes and every sub-chunk's gate is computed once per program (with
    one program per block, the blocks between j and i recomputed the gates of the sub-chunks
    between them: twice the transcendentals). Only sub-chunk i's decayed tiles and one column
    sub-chunk are live: the whole chunk in one program (2 warps) held three sub-chunks' decayed
    tiles and spilled 3 KB per thread. The four programs of a chunk and head are neighbours in
    launch order, the longest rows (i = 3, four blocks) first, so that the column sub-chunks they
    share come from L2: with i in the slowest grid axis (all chunks' i = 3 programs first) this
    kernel took 0.971 ms on an H200 at KDA 32 heads 4 x 8192 with raw gates, 0.888 now (mild
    gates 1.069 against 1.087). Taking the channels in pieces, as the exact kernel does (row norms
    first, all of a row's off-diagonal blocks as one strip product per piece, a body per i so that
    the strip is static), spilled less (sm_90 compile, 2 warps at 168: 680 -> 328 bytes of stack,
    none in pieces of 16) but ran slower in every width, warps and cap tried (H200, mild gates:
    1.09 -> 1.44 ms at best, 4 warps at 128 in pieces of 32; 2.2 on 2 warps): four products a
    piece, each with its operand conversions, instead of at most eight over the whole K."""
    tl.static_assert(C == 4 * SUB)
    chunk_head = tl.program_id(0) // 4
    i = 3 - tl.program_id(0) % 4
    i_c, hv = chunk_head // HV, chunk_head % HV
    live, t0, eos = _chunk_rows(chunk_table, cu_seqlens, state_indices, i_c, C, HAS_SLOTS)
    L = tl.minimum(eos - t0, C).to(tl.int32)
    mark = exact_marks + chunk_head * 4 + i
    if live & (i * SUB < L):
        q, k, g, beta, A, dt_bias = _kda_head(q, k, g, beta, A_log, dt_bias, hv, s_qh, s_kh, s_gh, s_bh, GROUP, K,
                                              FUSED_GATE)
        qi, ki, rqi, rki, li, ei, bi = _load_sub(
            q, k, g, beta, G_ws, hv, t0, i * SUB, L, s_qt, s_qk, s_kt, s_kk, s_gt, s_gk, s_bt, A, dt_bias,
            lower_bound, HV, K, BK, QK_L2NORM, FUSED_GATE, HAS_DT_BIAS, SAFE_GATE, BETA_LOGITS, GATE_WS)
        f = tl.exp(li)
        kr = _decayed(ki, rki, f)
        qr = _decayed(qi, rqi, f)
        if GATE_WS:
            r = i * SUB + tl.arange(0, SUB)
            start = _gate_row(G_ws, t0 + i * SUB - 1, i > 0, hv, HV, K, BK)  # G before the sub-chunk
            G_end = _gate_row(G_ws, t0 + L - 1, True, hv, HV, K, BK)  # G_C
            lift = tl.exp(start)[None, :]  # exp(G) = exp(l) exp(start), both <= 1
            _store_tile(Ke_ws, kr * lift, t0 + r, r < L, hv, 0, HV, K, BK)
            _store_tile(Qd_ws, qr * (scale * lift), t0 + r, r < L, hv, 0, HV, K, BK)
            _store_tile(Kd_ws, _decayed(ki, rki, tl.exp((G_end - start)[None, :] - li)), t0 + r, r < L, hv, 0, HV,
                        K, BK)
        if tl.max(tl.max(-li, 1), 0) < FACTOR_SPAN:
            A_blk, P_blk = _diag_block(*_block_products(kr, qr, _decayed(ki, rki, tl.exp(-li)), PREC_ACC))
            _store_P_N(P_ws, N_ws, P_blk, A_blk, scale, bi, t0, i * SUB, i * SUB, L, hv, HV, C)
            tl.store(mark, 0)
        else:  # left to ``_kda_exact_diag_kernel``
            tl.store(mark, 1)
        span = tl.zeros([BK], dtype=tl.float32)  # e_{j+1} + ... + e_{i-1}
        if PREC_UNIT == "fp16":
            # The off-diagonal blocks' factors are both <= 1 (PREC_UNIT, ``precisions``). H200, KDA
            # 32 heads 4 x 8192: this kernel 1.341 -> 1.229 ms (mild gates), 1.243 -> 1.102 (raw)
            # against tf32; errors against the float64 oracle unchanged (2.6e-3 output, 4.7e-4
            # states; also with correlated keys). The diagonal block's exp(-l) reaches
            # e^FACTOR_SPAN: PREC_ACC there.
            kr = kr.to(tl.float16)
            qr = qr.to(tl.float16)
        for step in range(0, i):
            j = i - 1 - step
            _, kj, _, rkj, lj, ej, _ = _load_sub(  # q and beta of sub-chunk j unused (not loaded)
                q, k, g, beta, G_ws, hv, t0, j * SUB, L, s_qt, s_qk, s_kt, s_kk, s_gt, s_gk, s_bt, A, dt_bias,
                lower_bound, HV, K, BK, QK_L2NORM, FUSED_GATE, HAS_DT_BIAS, SAFE_GATE, BETA_LOGITS, GATE_WS)
            A_blk, P_blk = _block_products(kr, qr, _decayed(kj, rkj, tl.exp((ej + span)[None, :] - lj)), PREC_UNIT)
            _store_P_N(P_ws, N_ws, P_blk, A_blk, scale, bi, t0, i * SUB, j * SUB, L, hv, HV, C)
            span += ej
        if not GATE_WS:
            r = i * SUB + tl.arange(0, SUB)
            _store_tile(G_ws, li + span[None, :], t0 + r, r < L, hv, 0, HV, K, BK)
    else:
        tl.store(mark, 0)


@triton.jit
def _kda_gate_kernel(g, A_log, dt_bias, lower_bound, cu_seqlens, chunk_table, state_indices, G_ws, s_gt, s_gh, s_gk,
                     HV: tl.constexpr, K: tl.constexpr, BKG: tl.constexpr, C: tl.constexpr,
                     FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SAFE_GATE: tl.constexpr,
                     HAS_SLOTS: tl.constexpr, FAST_LOG: tl.constexpr):
    """KDA, one (chunk, value head, BKG channels): G, the cumulative log gate from the chunk's
    start (float32), into ``G_ws`` [T, HV, K]. Once per chunk, so that the block kernel reads its
    sub-chunks' decays instead of scanning each of them once per row block (ten 16-row scans
    across warps per chunk: 0.25 of its 1.52 ms at KDA 4 x 8192 on an H200). This pass takes
    about 0.26 ms there with prepared gates and 64 channels on 2 warps (32 on 1: 0.29; a thread per
    channel walking the 64 rows instead of the scan: 0.27-0.52), 0.44 with raw gates on 2 warps,
    which is why it now runs on 4 (GATE_WARPS)."""
    i_c, hv = _chunk_program(HV)
    c0 = tl.program_id(1) * BKG
    live, t0, eos = _chunk_rows(chunk_table, cu_seqlens, state_indices, i_c, C, HAS_SLOTS)
    if live:
        tok = t0 + tl.arange(0, C)
        rmask = tok < eos
        A, dt_bias = _head_gate(A_log, dt_bias, hv, K, True, FUSED_GATE)
        gg = _log_decay_rows(g + hv * s_gh, tok, rmask, s_gt, s_gk, A, dt_bias, lower_bound, c0,
                             K, BKG, True, FUSED_GATE, HAS_DT_BIAS, SAFE_GATE, FAST_LOG)
        _store_tile(G_ws, tl.cumsum(gg, 0), tok, rmask, hv, c0, HV, K, BKG)


@triton.jit
def _kda_exact_diag_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, scale,
    cu_seqlens, chunk_table, state_indices,
    P_ws, N_ws, G_ws,
    s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_gt, s_gh, s_gk, s_bt, s_bh,
    exact_marks,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
    QK_L2NORM: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SAFE_GATE: tl.constexpr,
    BETA_LOGITS: tl.constexpr, HAS_SLOTS: tl.constexpr, PREC_ACC: tl.constexpr, PREC_UNIT: tl.constexpr,
    FACTOR_SPAN: tl.constexpr,
    GATE_WS: tl.constexpr, BKD: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """KDA, one (chunk, value head, sub-chunk i), arguments as the block kernel's: the diagonal 16 x 16
    block (i, i) of P and N where the block kernel left it here (gates spanning FACTOR_SPAN or more
    within the sub-chunk), exactly (``_split_diag_block``). ``exact_marks`` int8 [chunks x HV, 4]:
    the block kernel's byte per sub-chunk, nonzero where left here; an unmarked program reads its
    byte and returns. One program per sub-chunk (EXACT_DIAG_WARPS): H200, KDA 32 heads 4 x 8192,
    raw gates, the intra-chunk launches 3.17 ms on 2 warps against 3.49 with one program per chunk
    on 4 warps (its marked sub-chunks in turn); with mild gates, all unmarked, 2.048 against
    2.023 for the latter.

    The channels go in pieces of BKD (EXACT_DIAG_TILE; the row norms first, in a pass of their
    own). With q, k and l whole ([16, K] float32 each) the levels' decayed copies spilled at the
    register cap (H200, raw gates, 4 x 8192: this kernel 0.899 ms whole on 2 warps, 0.688 in
    pieces of 32 on one; 0.649 with the norms in a pass per operand, ``_row_norms``, instead of one
    pass loading both)."""
    i = tl.program_id(1)
    if tl.load(exact_marks + tl.program_id(0) * 4 + i) != 0:
        i_c, hv = _chunk_program(HV)
        live, t0, eos = _chunk_rows(chunk_table, cu_seqlens, state_indices, i_c, C, HAS_SLOTS)  # marked: live
        L = tl.minimum(eos - t0, C).to(tl.int32)
        q, k, g, beta, A, dt_bias = _kda_head(q, k, g, beta, A_log, dt_bias, hv, s_qh, s_kh, s_gh, s_bh, GROUP, K,
                                              FUSED_GATE)
        r = i * SUB + tl.arange(0, SUB)
        rmask = r < L
        tok = t0 + r
        rq = _row_norms(q, tok, rmask, s_qt, s_qk, K, BKD, QK_L2NORM)
        rk = _row_norms(k, tok, rmask, s_kt, s_kk, K, BKD, QK_L2NORM)
        A_blk = tl.zeros([SUB, SUB], dtype=tl.float32)
        P_blk = tl.zeros([SUB, SUB], dtype=tl.float32)
        for c0 in range(0, K, BKD):
            if GATE_WS:  # G itself: only differences within the sub-chunk are taken
                l = _load_tile(G_ws + hv * K, tok, rmask, HV * K, 1, c0, K, BKD)
            else:
                l = tl.cumsum(_log_decay_rows(g, tok, rmask, s_gt, s_gk, A, dt_bias, lower_bound, c0,
                                              K, BKD, True, FUSED_GATE, HAS_DT_BIAS, SAFE_GATE, FAST_LOG), 0)
            A_blk, P_blk = _split_diag_block(
                _load_tile(q, tok, rmask, s_qt, s_qk, c0, K, BKD), _load_tile(k, tok, rmask, s_kt, s_kk, c0, K, BKD),
                rq, rk, l, A_blk, P_blk, PREC_ACC, PREC_UNIT, FACTOR_SPAN)
        A_blk, P_blk = _diag_block(A_blk, P_blk)
        b = _load_beta(beta, tok, rmask, s_bt, BETA_LOGITS)
        _store_P_N(P_ws, N_ws, P_blk, A_blk, scale, b, t0, i * SUB, i * SUB, L, hv, HV, C)


@triton.jit
def _invert_kernel(cu_seqlens, chunk_table, state_indices, Minv_ws, T_ws,
                   HV: tl.constexpr, C: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """KDA, one (chunk, value head): M^-1 from N in ``Minv_ws`` into ``T_ws`` (``_invert_chunk``;
    the same workspace for in place)."""
    i_c, hv = _chunk_program(HV)
    live, t0, eos = _chunk_rows(chunk_table, cu_seqlens, state_indices, i_c, C, HAS_SLOTS)
    if live:
        _invert_chunk(Minv_ws, T_ws, t0, tl.minimum(eos - t0, C).to(tl.int32), hv, HV, C)


# ---------------------------------------------------------------------------------------------
# kernel 2 (KDA): W and U~ of every chunk


@triton.jit
def _delta_wu_kernel(
    k, v, beta,
    cu_seqlens, chunk_table, state_indices,
    Minv_ws, W_ws, U_ws, G_ws, Ke_ws,
    s_kt, s_kh, s_kk, s_vt, s_vh, s_vv, s_bt, s_bh,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BT: tl.constexpr, C: tl.constexpr, QK_L2NORM: tl.constexpr, BETA_LOGITS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, PREC_ACC: tl.constexpr, PREC_RAW: tl.constexpr, DECAYED_WS: tl.constexpr,
):
    """KDA, one (chunk, value head): U~ = M^-1 diag(beta) V and W = M^-1 diag(beta) (exp(G) * K / |k|),
    C-row products over the whole chunk in column tiles of BT, M^-1 read back from the workspace.
    The decayed K comes whole from ``Ke_ws`` with DECAYED_WS (bf16 / fp16 inputs: the block
    kernel wrote it), else from k and G (``G_ws``). (GDN's intra kernel holds M^-1 whole and
    forms its W and U~ itself.)"""
    i_c, hv = _chunk_program(HV)
    live, t0, eos = _chunk_rows(chunk_table, cu_seqlens, state_indices, i_c, C, HAS_SLOTS)
    if live:
        rows = tl.arange(0, C)
        tok = t0 + rows
        rmask = tok < eos
        Minv = tl.load(Minv_ws + (tok[:, None] * HV + hv) * C + rows[None, :],
                       mask=rmask[:, None] & (rows[None, :] <= rows[:, None]), other=0.0)
        b = _load_beta(beta + hv * s_bh, tok, rmask, s_bt, BETA_LOGITS)
        # Column tiles of BT: a whole [C, V] result tile stayed live with its operands and spilled
        # (GDN, when it ran here, 4 x 8192 on an H200: 1.23 ms at BT = V = 128, 0.86 at 32).
        Mb = Minv * b[None, :]
        for c0 in range(0, V, BT):
            vv = _load_tile(v + hv * s_vh, tok, rmask, s_vt, s_vv, c0, V, BT)
            _store_tile(U_ws, _dot(Mb, vv, PREC_RAW), tok, rmask, hv, c0, HV, V, BT)

        k += (hv // GROUP) * s_kh
        if DECAYED_WS:
            for c0 in range(0, K, BT):
                Ke = _load_tile(Ke_ws + hv * K, tok, rmask, HV * K, 1, c0, K, BT).to(tl.float32)
                _store_tile(W_ws, _dot(Mb, Ke, PREC_ACC), tok, rmask, hv, c0, HV, K, BT)
        else:
            rk = _inv_norm(_load_rows(k, tok, rmask, s_kt, s_kk, K, BK), QK_L2NORM)
            Mw = Minv * (b * rk)[None, :]
            for c0 in range(0, K, BT):
                G = _load_tile(G_ws + hv * K, tok, rmask, HV * K, 1, c0, K, BT)
                kk = _load_tile(k, tok, rmask, s_kt, s_kk, c0, K, BT).to(tl.float32)
                _store_tile(W_ws, _dot(Mw, kk * tl.exp(G), PREC_ACC), tok, rmask, hv, c0, HV, K, BT)


# ---------------------------------------------------------------------------------------------
# kernel 3: the sequential pass over chunks, state in registers


@triton.jit
def _delta_state_kernel(
    q, k, g, A_log, dt_bias, lower_bound, scale,
    cu_seqlens, state_indices, has_initial_state, checkpoint_indices, checkpoint_every, num_checkpoints,
    num_seqs, segment_tokens, initial,
    W_ws, U_ws, P_ws, G_ws, Qd_ws, Kd_ws, F_ws, out, pool,
    s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_gt, s_gh, s_gk,
    s_ot, s_oh, s_ov, s_ps, s_ph, s_pv, s_pk, s_cn, s_cj, s_in, s_ih, s_iv,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, V_VALUES: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    PER_CHANNEL: tl.constexpr, QK_L2NORM: tl.constexpr, FUSED_GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, SAFE_GATE: tl.constexpr, DECAYED_WS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, HAS_POOL: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, HAS_CKPT: tl.constexpr,
    SEGMENTED: tl.constexpr, TRANSITION: tl.constexpr,
    PREC_FAST: tl.constexpr, PREC_ACC: tl.constexpr,
):
    """One (sequence or segment, value head, V tile): S0, then per chunk
    U = U~ - W S, O = scale (exp(G) Q) S + P U, S = exp(G_C) S + (exp(G_C - G) K)^T U.
    State columns from V_VALUES to V have zero values (U~ = 0): the state-map columns.
    DECAYED_WS (KDA, bf16 / fp16 inputs): the decayed Q and K come from ``Qd_ws`` and ``Kd_ws``
    (``_kda_block_kernel``), G_C from ``G_ws``. GDN: the row factors come from ``F_ws``
    (``_gdn_intra_kernel``), applied to the products of the raw q and k tiles.

    Not SEGMENTED: program 0 is a sequence, S0 from the pool, the final state to the pool.
    SEGMENTED (``kernels.common.segments``): program 0 is a segment of ``segment_tokens``. With
    TRANSITION, every segment but its sequence's last computes its map: S0 is the pool state
    (first segment, value columns only) or [0 | I] (the rest), no outputs, the final state goes
    to ``initial`` [segments, HV, V, K] (the transitions buffer). Without, S0 is the pool state
    (first segment) or ``initial`` (the composed states), the last segment writes the pool."""
    pid, hv, v_tile = program_ids(V, BV)
    h = hv // GROUP
    ko = tl.arange(0, BK)
    vo = v_tile * BV + tl.arange(0, BV)
    kmask = ko < K
    vmask = vo < V
    rows = tl.arange(0, C)
    out += hv * s_oh + vo[None, :] * s_ov
    live, n, slot, seq_bos, bos, eos, first, last = program_span(
        cu_seqlens, state_indices, num_seqs, pid, segment_tokens, out, s_ot, vmask, C, BV, HAS_SLOTS, SEGMENTED,
        TRANSITION)
    if TRANSITION:
        # a first segment needs no map columns: its D starts from the pool state
        live = live & ((first == 0) | (v_tile * BV < V_VALUES))
    if live:
        state_mask = kmask[:, None] & vmask[None, :]
        state_offs = hv * s_ph + vo[None, :] * s_pv + ko[:, None] * s_pk  # S[k, v] = pool[slot, hv, v, k]
        initial_offs = pid.to(tl.int64) * s_in + hv * s_ih + vo[None, :] * s_iv + ko[:, None]
        S = tl.zeros([BK, BV], dtype=tl.float32)
        if first:
            if HAS_POOL:
                # with TRANSITION the pool holds the value columns only
                read = kmask[:, None] & (vo < (V_VALUES if TRANSITION else V))[None, :]
                if HAS_INIT_FLAGS:
                    read = read & (tl.load(has_initial_state + n) != 0)
                S = tl.load(pool + slot * s_ps + state_offs, mask=read, other=0.0).to(tl.float32)
        elif TRANSITION:
            S = tl.where(vo[None, :] - V_VALUES == ko[:, None], 1.0, 0.0)
        else:
            S = tl.load(initial + initial_offs, mask=state_mask, other=0.0).to(tl.float32)
        q += h * s_qh
        k += h * s_kh
        g += hv * s_gh
        A, dt_bias = _head_gate(A_log, dt_bias, hv, K, PER_CHANNEL, FUSED_GATE)
        for t0 in range(bos, eos, C):
            tok = t0 + rows
            rmask = tok < eos
            end_token = tl.minimum(eos, t0 + C) - 1  # the chunk's last token
            if DECAYED_WS:
                # KDA's G_C: the workspace's row of the chunk's last token
                G_end = _gate_row(G_ws, end_token, True, hv, HV, K, BK)
            elif PER_CHANNEL:
                gg = _log_decay_rows(g, tok, rmask, s_gt, s_gk, A, dt_bias, lower_bound, 0,
                                     K, BK, PER_CHANNEL, FUSED_GATE, HAS_DT_BIAS, SAFE_GATE)
                G = tl.cumsum(gg, 0)
                G_end = tl.sum(gg, 0)  # G at the chunk's last token (masked rows add zero)
                # float32 inputs: G_C - G_t as the sum of the gates after t (module docstring, numerics)
                G_after = tl.cumsum(gg, 0, reverse=True) - gg
            else:
                factors = _factor_rows(F_ws, tok, hv, HV)
                decay_out = tl.load(_factor_rows(F_ws, end_token, hv, HV) + 2)  # exp(G_C)

            # U = U~ - W S
            ws_row = tok[:, None] * HV + hv
            ws_k = ws_row * K + ko[None, :]  # rows of the [T, HV, K] workspaces (W, Qd, Kd)
            ws_mask = rmask[:, None] & kmask[None, :]
            Wc = tl.load(W_ws + ws_k, mask=ws_mask, other=0.0)
            U = tl.load(U_ws + ws_row * V_VALUES + vo[None, :], mask=rmask[:, None] & (vo < V_VALUES)[None, :],
                        other=0.0)
            U -= _dot(Wc, S, PREC_FAST)

            if not TRANSITION:
                # O = scale (exp(G) Q) S + P U
                if DECAYED_WS:
                    o = _dot(tl.load(Qd_ws + ws_k, mask=ws_mask, other=0.0), S, PREC_FAST)
                elif PER_CHANNEL:
                    qq = _load_rows(q, tok, rmask, s_qt, s_qk, K, BK)
                    q_dec = qq.to(tl.float32) * (_inv_norm(qq, QK_L2NORM)[:, None] * scale * tl.exp(G))
                    o = _dot(q_dec, S, PREC_FAST)
                else:
                    qq = _load_rows(q, tok, rmask, s_qt, s_qk, K, BK)
                    o = _dot(qq, S, PREC_FAST) * tl.load(factors, mask=rmask, other=0.0)[:, None]
                Pc = tl.load(P_ws + ws_row * C + rows[None, :], mask=rmask[:, None] & (rows[None, :] <= rows[:, None]),
                             other=0.0)
                o += _dot(Pc, U, PREC_ACC)
                tl.store(out + tok[:, None] * s_ot, o.to(out.dtype.element_ty), mask=rmask[:, None] & vmask[None, :])

            # S = exp(G_C) S + (exp(G_C - G) K)^T U
            if DECAYED_WS:
                k_dec = tl.load(Kd_ws + ws_k, mask=ws_mask, other=0.0)
                S = S * tl.exp(G_end)[:, None] + _dot(tl.trans(k_dec), U, PREC_ACC)
            elif PER_CHANNEL:
                kk = _load_rows(k, tok, rmask, s_kt, s_kk, K, BK)
                k_dec = kk.to(tl.float32) * (_inv_norm(kk, QK_L2NORM)[:, None] * tl.exp(G_after))
                S = S * tl.exp(G_end)[:, None] + _dot(tl.trans(k_dec), U, PREC_ACC)
            else:
                kk = _load_rows(k, tok, rmask, s_kt, s_kk, K, BK)
                U_dec = U * tl.load(factors + 1, mask=rmask, other=0.0)[:, None]
                S = S * decay_out + _dot(tl.trans(kk), U_dec, PREC_ACC)

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


# ---------------------------------------------------------------------------------------------
# host side


def _gate_params(recipe: Recipe, device):
    """(A_log, dt_bias, lower_bound, constexpr flags) of the fused gate; dummies where unused."""
    fg = recipe.fused_gate
    if fg is None:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return dummy, dummy, 0.0, dict(FUSED_GATE=False, HAS_DT_BIAS=False, SAFE_GATE=False)
    A_log = fg.A_log.contiguous()
    dt_bias = fg.dt_bias.contiguous() if fg.dt_bias is not None else A_log
    lower_bound = fg.lower_bound if fg.lower_bound is not None else 0.0
    return A_log, dt_bias, lower_bound, dict(FUSED_GATE=True, HAS_DT_BIAS=fg.dt_bias is not None,
                                             SAFE_GATE=fg.lower_bound is not None)


def precisions(dtype: torch.dtype) -> dict:
    """Product precisions for inputs of ``dtype`` (module docstring): PREC_IN for products of two
    raw inputs, PREC_ACC where errors are amplified, PREC_RAW where they are amplified and one
    operand is a raw input tile, PREC_FAST for W S and Q S, PREC_UNIT where errors are amplified
    and both operands' entries are at most 1 in magnitude (KDA's decayed q and k tiles whose
    factors are <= 1): fp16 cannot overflow there and keeps tf32's 10-bit mantissa, rounded, with
    half the mma steps and operand bytes. PREC_SOLVE for GDN's whole-chunk solve
    (``_invert_unit_lower``; KDA's 16 x 16 one is IEEE float32).

    float32 inputs take "tf32x3" (three tf32 products: float32 accuracy on the tensor cores;
    IEEE products lower to CUDA-core FMAs whose unrolled code spills heavily, and were no more
    accurate on an H200). The interpreter computes it exactly."""
    if dtype == torch.float32:
        return dict(PREC_IN="tf32x3", PREC_ACC="tf32x3", PREC_RAW="tf32x3", PREC_FAST="tf32x3", PREC_UNIT="tf32x3",
                    PREC_SOLVE="tf32x3")
    if dtype == torch.float16:
        return dict(PREC_IN="fp16", PREC_ACC="tf32", PREC_RAW="tf32", PREC_FAST="tf32", PREC_UNIT="fp16",
                    PREC_SOLVE="fp16")
    return dict(PREC_IN="bf16", PREC_ACC="tf32", PREC_RAW="bf16x2", PREC_FAST="bf16", PREC_UNIT="fp16",
                PREC_SOLVE="fp16")


def _intra_register_cap(prec: dict) -> dict:
    """The intra-chunk kernels' launch option ``maxnreg`` (INTRA_MAXNREG) for ``precisions``'
    ``prec``: none for float32 inputs, whose tf32x3 tiles already spill uncapped."""
    return dict(maxnreg=INTRA_MAXNREG) if prec["PREC_ACC"] != "tf32x3" else {}


def sequential_config(BK: int, V: int, prec_fast: str, heads: int = 0, num_sms: int = 0) -> dict:
    """(BV, num_warps, num_stages) of a kernel that walks the chunks with S [BK, BV] in registers.

    Chosen from sm_90 compiles (register spills, shared memory) so that every supported head dim
    and dtype fits 163 KB of shared memory (A100) and 227 KB (H100 / H200), then timed for bf16
    at K = 128 on an H200 (4 x 8192 tokens, BV in 16..64, 4 or 8 warps, 1 or 2 stages): BV = 64
    with 4 warps and one stage was fastest for GDN (5.87 ms against 6.64 for 64 / 8 / 2) and
    KDA (32.6 ms against 35.4 for 32 / 8 / 2). float32 operands (tf32x3 products) and K = 256
    double the tiles, hence narrower V tiles there.

    ``heads`` (sequences x value heads) and ``num_sms``, when given: where BV = 32 tiles still fit
    the SMs in one wave (one long sequence), they are used: twice the programs, half the serial
    work each (GDN 1 x 65536 on an H200: 16.0 ms against 16.6; 4 x 8192 keeps 64: 6.0 against 6.7).
    In that one wave each SM holds one or two programs that wait on their loads, so the loop
    prefetches the next chunk (two stages; GDN 1 x 32768 whole prefill 5.32 -> 4.77 ms, while
    4 x 8192 at BV = 64 went 3.21 -> 3.32 ms with two and keeps one).

    float32 inputs at K > 128 take 4 warps: with 8 warps and V tiles of 16, Triton 3.6's sm_90
    code for the tf32x3 products read out of bounds (GDN and KDA: illegal memory access; Lightning:
    wrong outputs), while the interpreter ran the same kernels exactly; 4 warps computed correctly
    (H200, K = 256, V = 128 and 256, against the float64 oracle).
    """
    BV = min(max(triton.next_power_of_2(V), 16), 64)
    one_wave = bool(heads) and heads * triton.cdiv(V, 32) <= num_sms
    if one_wave:
        BV = min(BV, 32)
    if prec_fast != "bf16" or BK > 128:
        BV = min(BV, 32)
        if prec_fast != "bf16" and BK > 128:
            BV = min(BV, 16)
        wide = max(BK, BV) > 64 and not (prec_fast == "tf32x3" and BK > 128)
        return dict(BV=BV, num_warps=8 if wide else 4, num_stages=1)
    return dict(BV=BV, num_warps=4, num_stages=2 if one_wave else 1)


def planned_segment_tokens(T: int, N: int, HV: int, K: int, V: int, num_sms: int, map_columns: int = 0,
                           requested: int | None = None) -> int:
    """Segment length of the state pass (``kernels.common.segments``), 0 for none, from shapes
    alone. Not with map columns (the state is widened already) or where the transitions' V + K
    columns exceed the state kernel's head dims."""
    if map_columns or V + K > MAX_HEAD_DIM:
        if requested:
            raise ValueError(f"segment_tokens: not with map_columns or V + K > {MAX_HEAD_DIM} (K={K}, V={V})")
        return 0
    return segments.segment_tokens(T, N, HV, V, num_sms, min_tokens=SEGMENT_MIN_TOKENS,
                                   programs_per_sm=SEGMENT_PROGRAMS_PER_SM, requested=requested)


def _kda_intra(recipe: Recipe, q, k, g, beta, cu_seqlens, table, state_indices, workspaces: tuple, gate_ws: bool):
    """KDA's intra-chunk launches (kernel 1 of the module docstring): the gate pass (with
    ``gate_ws``), the block kernel, the exact diagonal blocks and the inverse. ``workspaces`` (P,
    N, M^-1's destination, G, Qd, Kd, Ke), all [T, HV, ...]; N and the destination may be one
    tensor (in place)."""
    T, H, K = q.shape
    HV = beta.shape[1]
    C = CHUNK_SIZE
    P_ws, N_ws, T_ws, G_ws, Qd_ws, Kd_ws, Ke_ws = workspaces
    prec = precisions(q.dtype)
    A_log, dt_bias, lower_bound, gate_flags = _gate_params(recipe, q.device)
    has_slots = state_indices is not None
    slots = state_indices if has_slots else table  # (never read without slots)
    grid = (max_chunks(T, cu_seqlens.shape[0] - 1, C) * HV,)
    gate_args = (A_log, dt_bias, lower_bound)
    if gate_ws:
        _kda_gate_kernel[grid + (triton.cdiv(K, GATE_TILE),)](
            g, *gate_args, cu_seqlens, table, slots, G_ws, *g.stride(), HV=HV, K=K, BKG=GATE_TILE, C=C,
            # the SFU's log (``_softplus``): only bf16 / fp16 inputs come here (float32 ones take the
            # accurate log in the block kernel), and not under the interpreter (no inline assembly)
            HAS_SLOTS=has_slots, FAST_LOG=not triton.knobs.runtime.interpret, num_warps=GATE_WARPS, num_stages=1,
            **gate_flags)
    # Warps timed on an H200 (bf16, 4 x 8192, fused gates, one row of blocks per program, before
    # the gate pass): 2 warps 1.46 ms against 4 warps 2.05; in a later run 2 warps 1.53 against
    # 1 warp 1.71 and 2 warps with 2 stages 1.56.
    # float32 inputs (tf32x3, twice the operand tiles) take 4: an sm_90 compile (fused gate, K =
    # 128) spills 1136 bytes per thread with 4 warps, 2508 with 2 (not timed).
    exact_marks = torch.empty(grid[0], 4, dtype=torch.int8, device=q.device)  # every byte written
    warps = 4 if prec["PREC_ACC"] == "tf32x3" else 2  # the block kernel (the exact one too with float32 inputs)
    _kda_block_kernel[(grid[0] * 4,)](
        q, k, g, beta, *gate_args, recipe.scale, cu_seqlens, table, slots, P_ws, N_ws,
        *q.stride(), *k.stride(), *g.stride(), *beta.stride(), G_ws, Qd_ws, Kd_ws, Ke_ws, exact_marks,
        **_kda_constants(recipe, q, beta, has_slots, gate_ws, gate_flags), num_warps=warps, num_stages=1,
        **_intra_register_cap(prec))
    kda_exact_diagonal(recipe, q, k, g, beta, cu_seqlens, table, state_indices, P_ws, N_ws, exact_marks,
                       G_ws=G_ws if gate_ws else None)
    # 2 warps: H200, KDA 4 x 8192 bf16, 0.517 ms with 4, 0.404 with 2 (0.410 with 1, timed on GDN)
    _invert_kernel[grid](cu_seqlens, table, slots, N_ws, T_ws, HV=HV, C=C, HAS_SLOTS=has_slots, num_warps=2,
                         num_stages=1)


def _kda_constants(recipe: Recipe, q, beta, has_slots: bool, gate_ws: bool, gate_flags: dict) -> dict:
    """The constexprs KDA's block and exact diagonal kernels share."""
    K = q.shape[2]
    prec = precisions(q.dtype)
    return dict(HV=beta.shape[1], GROUP=beta.shape[1] // q.shape[1], K=K, BK=max(triton.next_power_of_2(K), 16),
                C=CHUNK_SIZE, QK_L2NORM=recipe.qk_l2norm, HAS_SLOTS=has_slots, BETA_LOGITS=recipe.beta_logits,
                PREC_ACC=prec["PREC_ACC"], PREC_UNIT=prec["PREC_UNIT"], FACTOR_SPAN=FACTOR_SPAN, GATE_WS=gate_ws,
                **gate_flags)


def kda_exact_diagonal(recipe: Recipe, q, k, g, beta, cu_seqlens, table, state_indices, P_ws, N_ws, marks,
                       G_ws=None):
    """The launch of ``_kda_exact_diag_kernel``: the diagonal 16 x 16 blocks of P (times scale) and
    N = diag(beta) A marked in ``marks`` (int8 [chunk ids x HV, 4], nonzero: computed here), exactly,
    into P_ws and N_ws [T, HV, C]; unmarked blocks are left as they are. q, k, g, beta as
    ``delta_rule_prefill``'s (raw with the recipe's fused gate, l2norm and beta sigmoid); table from
    ``varlen.chunk_indices``. ``G_ws``: G [T, HV, K] (float32) as the block kernel or ``intra_cute``
    (with the softplus gate) writes it, or None: the gates are summed here from ``g``."""
    prec = precisions(q.dtype)
    A_log, dt_bias, lower_bound, gate_flags = _gate_params(recipe, q.device)
    has_slots = state_indices is not None
    constants = _kda_constants(recipe, q, beta, has_slots, G_ws is not None, gate_flags)
    _kda_exact_diag_kernel[(marks.shape[0], CHUNK_SIZE // SUB)](
        q, k, g, beta, A_log, dt_bias, lower_bound, recipe.scale, cu_seqlens, table,
        state_indices if has_slots else table, P_ws, N_ws, G_ws if G_ws is not None else N_ws,
        *q.stride(), *k.stride(), *g.stride(), *beta.stride(), marks, **constants,
        BKD=min(constants["BK"], EXACT_DIAG_TILE), num_stages=1,
        # softplus' log on the SFU with bf16 / fp16 inputs (``_kda_gate_kernel``'s FAST_LOG)
        FAST_LOG=prec["PREC_ACC"] != "tf32x3" and not triton.knobs.runtime.interpret,
        **(dict(num_warps=4) if prec["PREC_ACC"] == "tf32x3" else
           dict(num_warps=EXACT_DIAG_WARPS, maxnreg=EXACT_DIAG_MAXNREG)))


def delta_rule_prefill(recipe: Recipe, q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices,
                       has_initial_state, out, checkpoint_every=None, checkpoint_indices=None, map_columns=0,
                       segment_tokens=None):
    """Chunked prefill of GDN / KDA over a packed varlen batch (``torch_backend.prefill`` semantics).

    q, k:   [T, H, K] bf16 / fp16 / fp32, any strides (raw if ``recipe.qk_l2norm``).
    v:      [T, HV, V], q's dtype; HV a multiple of H (value head hv reads qk head hv // (HV // H)).
    g:      [T, HV] (gdn) or [T, HV, K] (kda), float32 / bf16: the log decay, or the raw
            projection with ``recipe.fused_gate``.
    beta:   [T, HV], in (0, 1), or logits with ``recipe.beta_logits``.
    cu_seqlens: int32 [N + 1] on the device.
    state_pool: [P, HV, V, K] float32 / bfloat16, K-last (pool[s, hv, v, k] = S[k, v]), or None
            (zero initial states, nothing written).
    state_indices: int32 [N] slots (negative = padding: no read, no write, zero output), or None
            (only without a pool: every sequence is live).
    has_initial_state: bool [N] or None (all True); False starts from zeros and still writes.
    out:    [T, HV, V] in v's dtype, written in place.
    checkpoint_every, checkpoint_indices: the state after (j + 1) * checkpoint_every tokens of
            sequence n goes to slot checkpoint_indices[n, j] (int32 [N, M]) when >= 0;
            checkpoint_every is a multiple of 64.
    map_columns: 0, or K: the state (pool) and ``out`` then have V + K columns, the last K with
            zero values. Started from the identity there, they carry the segment's affine state
            map (context parallelism, ``cula_serve.dist.cp``) at the cost of wider state tiles
            only: the intra-chunk and W / U~ kernels and their workspace see the V value columns alone.
    segment_tokens: None (decided from the shapes), 0 (never) or a multiple of 64: the length of
            the segments that long sequences are cut into for the state pass, which then runs
            them in parallel and composes their state maps (``kernels.common.segments``).
    K, V + map_columns <= 256. Returns ``out``.
    """
    if recipe.mode not in ("gdn", "kda"):
        raise ValueError(f"delta_rule_prefill: mode {recipe.mode!r} is not a delta rule")
    T, H, K = q.shape
    HV, V = v.shape[1:]
    V_state = V + map_columns
    N = cu_seqlens.shape[0] - 1
    C = CHUNK_SIZE
    if max(K, V_state) > MAX_HEAD_DIM:
        raise ValueError(f"head dims K={K}, V={V_state}: the Triton prefill supports at most {MAX_HEAD_DIM}")
    if checkpoint_every and checkpoint_every % C:
        raise ValueError(f"checkpoint_every={checkpoint_every}: must be a multiple of {C}")
    device = q.device
    num_sms = segments.sm_count(device)
    tokens = planned_segment_tokens(T, N, HV, K, V, num_sms, map_columns, segment_tokens)  # validates first
    per_channel = recipe.mode == "kda"
    BK = max(triton.next_power_of_2(K), 16)
    prec = precisions(q.dtype)
    A_log, dt_bias, lower_bound, gate_flags = _gate_params(recipe, device)
    if not per_channel:
        g = g[..., None]  # one stride list for both gate shapes (the channel stride is unused)
    dummy_i32 = torch.empty(1, dtype=torch.int32, device=device)
    slots = state_indices if state_indices is not None else dummy_i32

    # W feeds only W S and P only P U: bf16 when W S takes bf16 operands. U~ stays float32
    # (U = U~ - W S is a difference of close terms).
    ws_dtype = torch.bfloat16 if prec["PREC_FAST"] == "bf16" else torch.float32
    W_ws = torch.empty(T, HV, K, dtype=ws_dtype, device=device)
    U_ws = torch.empty(T, HV, V, dtype=torch.float32, device=device)
    P_ws = torch.empty(T, HV, C, dtype=ws_dtype, device=device)
    # KDA's cumulative log gate G: computed once by its own pass and read by the other kernels;
    # float32 inputs keep the gates' own summation order (module docstring, numerics): the block
    # kernel writes G and the state pass recomputes it
    G_ws = torch.empty(T, HV, K, dtype=torch.float32, device=device) if per_channel else U_ws
    gate_ws = per_channel and prec["PREC_ACC"] != "tf32x3"
    # ... and with it the state pass's decayed Q (rounded as its product rounds it: bf16 for bf16
    # inputs, else fp16, tf32's 11 bits) and K, and W's decayed K (fp16 for their tf32 products;
    # all three tiles are <= 1)
    Qd_ws = torch.empty(T, HV, K, dtype=q.dtype, device=device) if gate_ws else W_ws
    Kd_ws = torch.empty(T, HV, K, dtype=torch.float16, device=device) if gate_ws else W_ws
    Ke_ws = torch.empty(T, HV, K, dtype=torch.float16, device=device) if gate_ws else W_ws
    # GDN's row factors (``_gdn_intra_kernel``)
    F_ws = W_ws if per_channel else torch.empty(T, HV, ROW_FACTORS.value, dtype=torch.float32, device=device)
    common = dict(HV=HV, GROUP=HV // H, K=K, BK=BK, C=C, PER_CHANNEL=per_channel,
                  QK_L2NORM=recipe.qk_l2norm, HAS_SLOTS=state_indices is not None, PREC_ACC=prec["PREC_ACC"])

    table = chunk_indices(cu_seqlens, T, C)
    grid = (max_chunks(T, N, C) * HV,)
    intra_flags = dict({key: common[key] for key in ("HV", "GROUP", "K", "BK", "C", "QK_L2NORM", "HAS_SLOTS")},
                       V=V, BETA_LOGITS=recipe.beta_logits, PREC_RAW=prec["PREC_RAW"])
    if per_channel:
        Minv_ws = torch.empty(T, HV, C, dtype=torch.float32, device=device)
        workspaces = (P_ws, Minv_ws, Minv_ws, G_ws, Qd_ws, Kd_ws, Ke_ws)
        _kda_intra(recipe, q, k, g, beta, cu_seqlens, table, state_indices, workspaces, gate_ws)
        # Three stages prefetch the next column tiles (H200, 4 x 8192, bf16: KDA 1.050 -> 1.001 ms);
        # with float32 inputs they spill (sm_90 and sm_80 compiles), so one stage.
        _delta_wu_kernel[grid](
            k, v, beta, cu_seqlens, table, slots, Minv_ws, W_ws, U_ws, G_ws, Ke_ws,
            *k.stride(), *v.stride(), *beta.stride(), BT=WU_TILE, PREC_ACC=prec["PREC_ACC"], DECAYED_WS=gate_ws,
            num_warps=4, num_stages=1 if prec["PREC_ACC"] == "tf32x3" else 3, **intra_flags)
    else:
        _gdn_intra_kernel[grid](
            q, k, v, g, beta, A_log, dt_bias, lower_bound, recipe.scale, cu_seqlens, table, slots,
            P_ws, W_ws, U_ws, F_ws, *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
            BT=GDN_U_TILE, PREC_IN=prec["PREC_IN"], PREC_SOLVE=prec["PREC_SOLVE"], **intra_flags, **gate_flags,
            num_warps=4, num_stages=1, **_intra_register_cap(prec))

    has_pool = state_pool is not None
    ckpt = checkpoint_indices if has_pool and checkpoint_every else None
    state_args = (
        q, k, g, A_log, dt_bias, lower_bound, recipe.scale,
        cu_seqlens, slots, has_initial_state if has_initial_state is not None else dummy_i32,
        ckpt if ckpt is not None else dummy_i32, checkpoint_every or C, ckpt.shape[1] if ckpt is not None else 0)
    pool_args = (W_ws, U_ws, P_ws, G_ws, Qd_ws, Kd_ws, F_ws, out, state_pool if has_pool else U_ws,
                 *q.stride(), *k.stride(), *g.stride(), *out.stride(),
                 *(state_pool.stride() if has_pool else (0, 0, 0, 0)),
                 *(ckpt.stride() if ckpt is not None else (0, 0)))
    flags = dict(HAS_POOL=has_pool, HAS_INIT_FLAGS=has_pool and has_initial_state is not None,
                 HAS_CKPT=ckpt is not None, PREC_FAST=prec["PREC_FAST"],
                 DECAYED_WS=gate_ws, **common, **gate_flags)

    launch = sequential_config(BK, V_state, prec["PREC_FAST"], heads=N * HV, num_sms=num_sms)
    if not tokens:
        _delta_state_kernel[segments.state_grid(N, HV, V_state, launch["BV"])](
            *state_args, N, 0, U_ws, *pool_args, 0, 0, 0,
            V=V_state, V_VALUES=V, SEGMENTED=False, TRANSITION=False, **launch, **flags)
        return out

    # in-card context parallelism (kernels/common/segments.py): transitions, composition, outputs
    num_ids = segments.num_segment_ids(T, N, tokens)
    transitions = torch.empty(num_ids, HV, V + K, K, dtype=torch.float32, device=device)
    launch = sequential_config(BK, V + K, prec["PREC_FAST"], heads=num_ids * HV, num_sms=num_sms)
    _delta_state_kernel[segments.state_grid(num_ids, HV, V + K, launch["BV"])](
        *state_args, N, tokens, transitions, *pool_args, *transitions.stride()[:3],
        V=V + K, V_VALUES=V, SEGMENTED=True, TRANSITION=True, **launch, **flags)
    initial = torch.empty(num_ids, HV, V, K, dtype=torch.float32, device=device)
    segments.compose_initial_states(cu_seqlens, state_indices, transitions, initial,
                                    tokens=tokens, V=V)
    launch = sequential_config(BK, V, prec["PREC_FAST"], heads=num_ids * HV, num_sms=num_sms)
    _delta_state_kernel[segments.state_grid(num_ids, HV, V, launch["BV"])](
        *state_args, N, tokens, initial, *pool_args, *initial.stride()[:3],
        V=V, V_VALUES=V, SEGMENTED=True, TRANSITION=False, **launch, **flags)
    return out
