"""Decode, MTP verify (three protocols) and commit in CuTe DSL for SM90: GDN, KDA and Lightning.

The math is that of the Triton kernels in float32, token by token (the deferred verify in the
equivalent WY form below; ``naive.py`` and ``kernels/lightning/naive.py`` are the oracles). Per
value head ``hv`` (qk head ``hv // (HV // H)``):

    delta rule (GDN: scalar g_t, KDA: per-channel g_t):
        S = Diag(exp(g_t)) S;   u = beta_t * (v_t - S^T k_t);   S = S + k_t u^T;   o_t = scale * S^T q_t
    Lightning (constant log decay d_hv, no delta rule):
        S = exp(d_hv) S + k_t v_t^T;                                               o_t = scale * S^T q_t

with the call's ``Recipe`` fused into the loads (qk l2norm, the gate from the raw projection, beta's
sigmoid). One kernel serves the three families (constexpr ``FAMILY``) and every op of the pool
protocol (constexpr ``OP``; the table of what each op reads and writes is in
``recurrent_triton.py``). The deferred verify can save every token's u for its commit
(``saved_u``), which then applies ``S = Diag(exp(g_t)) S + k_t u_t^T`` without reductions.

Thread mapping. The state is K-last (``pool[slot, hv, v, :]`` is column v of S, K contiguous). G
lanes share a column, each holding a run of CH = K / G of its channels, for R columns; a warp thus
owns R * 32 / G consecutive columns of one (sequence, value head), a CTA WARPS warps of them; the
grid has N * HV * V / (R * 32 / G * WARPS) CTAs on one axis, the V-tile fastest (CTAs launched
together read neighbouring pieces of a state: H200, T = 4 with a pending commit at B = 64, GDN
float32 100.9 -> 96.6 us, KDA 109.7 -> 105.7, Lightning 176.2 -> 165.7). ``launch_shape`` picks
(R, G, WARPS) per op and pool dtype from sweeps. The R x CH floats stay in registers for all T
tokens: every state element is read once and written at most once per call (plus the states a
buffer / slots verify keeps).

Reductions. A token reduces every column over K (``S^T k``, ``S^T q``): R partial sums per lane,
each spread over the G lanes of a group. They are reduce-scattered (``_scatter_sum``): at each of
log2(R) rounds a lane keeps half of its values and adds its partner's copy of that half (R - 1
shuffles in all), then log2(G / R) butterfly rounds finish one column's sum. The output needs
nothing more (a lane writes it); u is needed by every lane of the group, R more shuffles
(``_all_sum``). Fewer lanes per column mean fewer shuffles but longer runs of k and q per lane.

Tokens are prepared once per CTA. The warps load the T tokens' q, k, gate and beta (warp w takes
tokens w, w + WARPS, ...), normalise them and apply the fused gate, and leave them in shared memory
as G runs of CH channels, padded against bank conflicts (``_prep_index``); each lane then reads
its run per token. A scalar decay (GDN, Lightning) is folded: the registers hold S' with
S = gamma_t S', gamma_t the product of the decays so far, so a token's decay costs no pass over
the state; once the product falls below FOLD_FLOOR it is applied to S' (and 1 / gamma_t never
grows large). KDA's per-channel decays are applied to the state token by token.

Deferred verify (WY form). It writes no state, so it never forms one: with Gamma_t the product of
the decays up to t and D_ts those after s up to t (per channel for KDA, all <= 1),
    u_t = beta_t (v_t - (Gamma_t k_t) . S0 - sum_{s<t} A_ts u_s),   A_ts = k_t . (D_ts k_s)
    o_t = (Gamma_t q_t) . S0 + sum_{s<=t} B_ts u_s,                 B_ts = q_t . (D_ts k_s)
The 2T dot products with S0 are independent of each other (no token waits for the previous
token's update: the sequential form was latency-bound, 89 us against 65 now at B = 64, T = 4 on
an H200); A and B are computed once per CTA (``_pair_coefficients``) and the per-column
triangular recurrence is T^2 scalar steps on the lane that holds the column's sums.

Tensor cores. A bfloat16 pool's state is exactly bfloat16, so from 2048 heads a deferred verify
(GDN or KDA) takes its 2T dot products on the tensor cores (``_tensor_core_dots``, R = G = 4:
mma.sync with the state as the A operand where the loads put it, the decayed keys and queries
split into three bfloat16 parts, so float32 products) instead of 2T reduce-scatters per lane, and
so does its pending commit (``_tensor_core_commit``: the state tile is the accumulator, u and the
decayed keys go in three bfloat16 parts, the products of parts packed into the k slots). Its
lanes hold their channels in 16-byte pieces (``_lane_state``), so that a quad's loads cover whole
sectors, and ptxas is told how many CTAs an SM must fit (``launch_shape``'s MIN_CTAS). H200,
T = 4, us, reductions -> tensor cores (-> capped registers): verify then a separate commit, GDN
B = 64 84.0 -> 75.2 -> 73.8, B = 256 299.2 -> 252.9 -> 242.7; KDA 93.2 -> 81.1 -> 79.3, 325.2 ->
274.8 -> 264.2. With a pending commit (three CTAs an SM), its commit on the tensor cores and KDA's
closed form spread over the warps: GDN 66.8 -> 58.5 at B = 64 (it had kept the reductions),
238.1 -> 202.5 at B = 256; KDA (whose commit had run in float32 on the registers) 67.2 -> 58.9,
227.6 -> 205.1; at T = 8 GDN 165.7 -> 98.1, KDA 159.4 -> 107.6 (B = 64). A commit a piece at a
time in float32 (193 registers uncapped) and buffer / slots verifies in the WY form on the tensor
cores (255 registers) did not pay.

Memory. With STAGE the state goes through shared memory by cp.async (coalesced, issued as soon
as the slot is known, awaited only after the tokens are prepared: a plain register load was
scheduled by ptxas after the gate's arithmetic, one more DRAM round trip at B = 1), and stores of
runs longer than 16 bytes go back through it and out in coalesced 16-byte units
(``_store_state``). Without STAGE, loads and stores go between registers and memory directly:
the L1 absorbs the partly used sectors, and a CTA needs no shared memory for the state, so more
CTAs fit on an SM (the deferred verify's choice at scale). Loads that do not depend on the slot
(the tokens' inputs, v or the saved u) are issued first, so that their latency overlaps the slot's.

A deferred verify can first commit the previous deferred verify of the same rows (``pending``,
constexpr TP > 0: its tokens' k, gate and saved u, Lightning's v): the accepted tokens are applied
to the registers as a commit applies them, the state is written back rounded to the pool dtype
and the verify goes on from exactly that. An engine's step then reads and writes each state once
(a decode step's bytes) instead of a commit's read-modify-write plus the verify's read. KDA's
accepted tokens go in closed form (``_decayed_pending_keys``): one per-channel decay of the state
and its decayed keys instead of a decay pass per token (H200, T = 4 after T = 4, us: bfloat16 pool
B = 64 76.2 -> 74.4, B = 256 265.0 -> 257.3; float32 106.7 -> 104.4, 387.2 -> 381.7).

Padding rows (slot < 0) read and write no state and get zero outputs (and zero saved u); a commit
runs only its accepted tokens (a warp-uniform branch on ``num_accepted_tokens``).

Compilation happens once per configuration (``_compiled``); a call builds raw pointers and passes
shapes and strides as scalars, so nothing compiles or synchronises at run time and every launch
can be captured in a CUDA graph. The pool may be strided in its slot dim (vLLM pages) with any
stride: a pool whose slots are 16-byte aligned (``_vector_pool``) gets vector loads and stores,
any other an element-wise variant.
"""
from __future__ import annotations

import functools

import torch

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu.warp import MmaF16BF16Op
from cutlass.cute.runtime import AddressSpace, make_fake_stream, make_ptr
from cutlass.memory.smem import SmemAllocator
import cuda.bindings.driver as cuda

from ..common.cute_launch import FastLaunch
from ..common.pool_protocol import (OPS, check_pending, check_protocol, check_saved_u, output_target, strides3,
                                    unit_last)

OP_DECODE, OP_BUFFER, OP_SLOTS, OP_DEFERRED, OP_COMMIT = range(len(OPS))
FAMILIES = ("gdn", "kda", "lightning")
GDN, KDA, LIGHTNING = range(len(FAMILIES))
GATE_NONE, GATE_SOFTPLUS, GATE_SAFE = range(3)  # prepared log decay; -A softplus(a + b); lb sigmoid(A (a + b))

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default: x above it is returned as is
FOLD_FLOOR = 2.0 ** -60  # a folded scalar decay below this is applied to the state (1 / it stays far from overflow)
# bool tensors (a prefill's has_initial_state) are read as bytes
DTYPES = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
          torch.int32: cutlass.Int32, torch.int8: cutlass.Int8, torch.bool: cutlass.Uint8}


# ------------------------------------------------------------------------------------------------
# device helpers


@cute.jit
def _butterfly(x: Float32, first_offset: cutlass.Constexpr[int]) -> Float32:
    """x summed over the lanes that differ in bits first_offset .. 1 of the lane id."""
    offset = first_offset
    while cutlass.const_expr(offset >= 1):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=offset)
        offset = offset // 2
    return x


@cute.jit
def _row_partials(S: cute.Tensor, x: list, R: cutlass.Constexpr[int], CH: cutlass.Constexpr[int]) -> list:
    """This lane's part of every column's dot product with the vector x (its CH channels): R
    partial sums."""
    partial = []
    for r in cutlass.range_constexpr(R):
        acc = Float32(0.0)
        for c in cutlass.range_constexpr(CH):
            acc = acc + S[r, c] * x[c]
        partial.append(acc)
    return partial


@cute.jit
def _scatter_sum(values: list, lane: Int32, G: cutlass.Constexpr[int]) -> Float32:
    """Reduce-scatter R = len(values) per-lane partial sums over each group of G lanes (R a power
    of two <= G): returns the group's sum of ``values[row]``, row = ``_writer_row(lane % G, R, G)[1]``."""
    offset = G // 2
    while cutlass.const_expr(len(values) > 1):
        half = len(values) // 2
        upper = (lane & offset) != 0
        kept = []
        for i in cutlass.range_constexpr(half):
            keep = cutlass.select_(upper, values[i + half], values[i])
            send = cutlass.select_(upper, values[i], values[i + half])
            kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset=offset))
        values = kept
        offset = offset // 2
    return _butterfly(values[0], offset)


def _scattered_lane(row: int, R: int, G: int) -> int:
    """The lowest lane of a group that holds column ``row``'s sum after ``_scatter_sum`` of R
    values: bit s of the lane (from log2(G) - 1 down) is bit log2(R) - 1 - (log2(G) - 1 - s) of the row."""
    lane, offset, half = 0, G // 2, R // 2
    while half >= 1:
        if row & half:
            lane |= offset
        offset //= 2
        half //= 2
    return lane


@cute.jit
def _all_sum(values: list, lane: Int32, G: cutlass.Constexpr[int]) -> list:
    """The R column sums of ``_scatter_sum``, every one on every lane of the group (R more shuffles)."""
    R = len(values)
    mine = _scatter_sum(values, lane, G)
    sums = [mine]
    if cutlass.const_expr(R > 1):
        first = lane - lane % G
        sums = [cute.arch.shuffle_sync(mine, first + _scattered_lane(r, R, G)) for r in range(R)]
    return sums


@cute.jit
def _writer_row(part: Int32, R: cutlass.Constexpr[int], G: cutlass.Constexpr[int]):
    """(whether this lane writes a column sum after ``_scatter_sum``, which of its group's R
    columns); ``part`` is the lane's index within its group of G."""
    spread = G // R  # lanes holding each sum
    row = Int32(0)
    half = R // 2
    offset = G // 2
    while cutlass.const_expr(half >= 1):
        row = row + cutlass.select_((part & offset) != 0, Int32(half), Int32(0))
        half = half // 2
        offset = offset // 2
    return part % spread == 0, row


@cute.jit
def _pick(values: list, index: Int32) -> Float32:
    """values[index] for a runtime index (a select chain over the registers)."""
    picked = values[0]
    for r in cutlass.range_constexpr(1, len(values)):
        picked = cutlass.select_(index == r, values[r], picked)
    return picked


@cute.jit
def _softplus(x: Float32) -> Float32:
    capped = cutlass.min(x, Float32(SOFTPLUS_THRESHOLD))
    return cutlass.select_(x > SOFTPLUS_THRESHOLD, x, cute.log(1.0 + cute.exp(capped, fastmath=True), fastmath=True))


@cute.jit
def _sigmoid(x: Float32) -> Float32:
    return cute.arch.rcp_approx(1.0 + cute.exp(-x, fastmath=True))


@cute.jit
def _log_decay(a: Float32, bias: Float32, A: Float32, lower_bound: Float32, GATE: cutlass.Constexpr[int]) -> Float32:
    """The log decay from the gate input: as given, or the fused gate of ``kernels.common.prep``."""
    g = a
    if cutlass.const_expr(GATE == GATE_SOFTPLUS):
        g = -A * _softplus(a + bias)
    if cutlass.const_expr(GATE == GATE_SAFE):
        g = lower_bound * _sigmoid(A * (a + bias))
    return g


@cute.jit
def _scaled(vals: list, factor, L2NORM: cutlass.Constexpr[bool]) -> list:
    """This lane's channels of a q or k head times ``factor``, l2-normalised over the whole head
    (all 32 lanes) when asked."""
    f = Float32(factor)
    if cutlass.const_expr(L2NORM):
        sq = Float32(0.0)
        for x in vals:
            sq = sq + x * x
        f = f * cute.rsqrt(_butterfly(sq, 16) + L2NORM_EPS)
    return [x * f for x in vals]


@cute.jit
def _token_inputs(q: cute.Tensor, k: cute.Tensor, g: cute.Tensor, beta: cute.Tensor, i_n: Int32, t: Int32,
                  i_h: Int32, i_hv: Int32, c0: Int32, VEC: cutlass.Constexpr[int], OP: cutlass.Constexpr[int],
                  FAMILY: cutlass.Constexpr[int], SAVED_U: cutlass.Constexpr[bool]):
    """One token's loads for the lane owning channels c0 .. c0 + VEC - 1, in float32: (k [VEC],
    q [VEC] or [] for a commit, the gate input [VEC] (KDA) / [1] (GDN) / [], beta [1] or [])."""
    kk = [Float32(k[i_n, t, i_h, c0 + c]) for c in range(VEC)]
    qq = []
    if cutlass.const_expr(OP != OP_COMMIT):
        qq = [Float32(q[i_n, t, i_h, c0 + c]) for c in range(VEC)]
    gg = []
    if cutlass.const_expr(FAMILY == KDA):
        gg = [Float32(g[i_n, t, i_hv, c0 + c]) for c in range(VEC)]
    if cutlass.const_expr(FAMILY == GDN):
        gg = [Float32(g[i_n, t, i_hv, 0])]
    bb = []
    if cutlass.const_expr(FAMILY != LIGHTNING and not (OP == OP_COMMIT and SAVED_U)):
        bb = [Float32(beta[i_n, t, i_hv, 0])]
    return kk, qq, gg, bb


@cute.jit
def _prepare(inputs: tuple, A: Float32, bias: list, lower_bound: Float32, scale: Float32,
             OP: cutlass.Constexpr[int], FAMILY: cutlass.Constexpr[int], GATE: cutlass.Constexpr[int],
             QK_L2NORM: cutlass.Constexpr[bool], BETA_LOGITS: cutlass.Constexpr[bool]):
    """A token's ``_token_inputs`` made ready for the update: (k [VEC] normalised, the decay
    factor(s) exp(g) [VEC] (KDA) or [1], beta, q [VEC] normalised and scaled or [] for a commit).
    Lightning's decay is the head's, exp(d_hv) = A."""
    k_raw, q_raw, g_raw, b_raw = inputs
    kt = _scaled(k_raw, 1.0, QK_L2NORM)
    decay = [A]
    if cutlass.const_expr(FAMILY != LIGHTNING):
        decay = [cute.exp(_log_decay(g_raw[c], bias[c], A, lower_bound, GATE), fastmath=True)
                 for c in range(len(g_raw))]
    b = Float32(1.0)
    if cutlass.const_expr(len(b_raw) > 0):
        b = b_raw[0]
        if cutlass.const_expr(BETA_LOGITS):
            b = _sigmoid(b)
    qt = []
    if cutlass.const_expr(OP != OP_COMMIT):
        qt = _scaled(q_raw, scale, QK_L2NORM)
    return kt, decay, b, qt


def _padding(channels: int, per_unit: int) -> int:
    """Elements appended to each lane's run of ``channels`` in shared memory so that the lanes of
    a quarter warp, reading 16-byte units (``per_unit`` elements) at the same position of their
    runs, hit distinct banks: the run's length in units is made odd."""
    if channels < per_unit or (channels // per_unit) % 2:
        return 0
    return per_unit


@cute.jit
def _view(ptr: cute.Pointer, offset, rows: cutlass.Constexpr[int], row_stride, n: cutlass.Constexpr[int],
          align: cutlass.Constexpr[int]) -> cute.Tensor:
    """[rows, n] elements at ``offset`` (a multiple of ``align``), rows ``row_stride`` apart."""
    if cutlass.const_expr(align > 1):
        offset = cute.assume(offset, divby=align)
    return cute.make_tensor(ptr + offset, cute.make_layout((rows, n), stride=(row_stride, 1)))


@cute.jit
def _lane_state(ptr: cute.Pointer, offset, R: cutlass.Constexpr[int], K: cutlass.Constexpr[int],
                CH: cutlass.Constexpr[int], PIECE: cutlass.Constexpr[int], G: cutlass.Constexpr[int],
                align: cutlass.Constexpr[int]) -> cute.Tensor:
    """A lane's share of R state columns (K elements each, from ``offset``): CH channels a column in
    pieces of PIECE contiguous ones, G * PIECE apart (``_physical_channel``); element [r, c] is the
    lane's channel c of column r."""
    if cutlass.const_expr(PIECE == CH):
        return _view(ptr, offset, R, K, CH, align)
    if cutlass.const_expr(align > 1):
        offset = cute.assume(offset, divby=align)
    return cute.make_tensor(ptr + offset, cute.make_layout((R, (PIECE, CH // PIECE)), stride=(K, (1, G * PIECE))))


@cute.jit
def _physical_channel(channel, G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int],
                      PIECE: cutlass.Constexpr[int]):
    """The head channel behind prepared-vector position ``channel`` (``_prep_index``'s order: G runs
    of CH, run ``part`` being what state lane ``part`` holds, ``_lane_state``)."""
    part = channel // CH
    within = channel % CH
    return (within // PIECE) * (G * PIECE) + part * PIECE + within % PIECE


@cute.jit
def _unit(ptr: cute.Pointer, offset, n: cutlass.Constexpr[int]) -> cute.Tensor:
    """One copy unit of n elements at ``offset`` (a multiple of n), as a copy atom takes it."""
    if cutlass.const_expr(n > 1):
        offset = cute.assume(offset, divby=n)
    return cute.make_tensor(ptr + offset, cute.make_layout((n, 1), stride=(1, n)))


@cute.jit
def _raw_registers(src: cute.Tensor) -> cute.Tensor:
    """A [rows, n] view (n possibly (PIECE, pieces), ``_lane_state``) copied (vectorised) into
    registers of its own dtype, row-major."""
    row = cute.make_layout(src.shape[1])
    loaded = cute.make_rmem_tensor(cute.make_layout(src.shape, stride=(cute.size(row), row.stride)), src.element_type)
    cute.autovec_copy(src, loaded)
    return loaded


@cute.jit
def _registers(src: cute.Tensor) -> cute.Tensor:
    """``_raw_registers`` in float32."""
    loaded = _raw_registers(src)
    values = cute.make_rmem_tensor(loaded.layout, Float32)
    values.store(loaded.load().to(Float32))
    return values


@cute.jit
def _state_unit(e: Int32, K: cutlass.Constexpr[int], CH: cutlass.Constexpr[int], PAD: cutlass.Constexpr[int]):
    """Where element e of a warp's block of columns (K contiguous elements each) sits in its
    shared-memory copy: each column as G runs of CH channels, each run followed by PAD elements."""
    within = e % K
    return (e // K) * ((K // CH) * (CH + PAD)) + (within // CH) * (CH + PAD) + within % CH


@cute.jit
def _store_state(S: cute.Tensor, factor: Float32, share: cute.Tensor, block: cute.Tensor, dst: cute.Pointer,
                 dst_offset: Int64, lane: Int32, lane_offset: Int32, K: cutlass.Constexpr[int],
                 CH: cutlass.Constexpr[int], PAD: cutlass.Constexpr[int], PER_COPY: cutlass.Constexpr[int],
                 STAGE: cutlass.Constexpr[bool], PIECE: cutlass.Constexpr[int], G: cutlass.Constexpr[int]):
    """factor * S (this lane's float32 register share) into the warp's block of columns at
    ``dst + dst_offset`` (this lane's runs start ``lane_offset`` further), in the destination dtype.

    A lane's share of a column is a run of CH contiguous elements (or pieces of PIECE, G * PIECE
    apart, unstaged: ``_lane_state``). Runs of 16 bytes or less are
    stored straight from registers: one store instruction of the warp then covers whole columns.
    With STAGE, longer runs go through the lane's ``share`` of the warp's shared-memory ``block``
    and are written out in units of PER_COPY elements in order across the lanes (stored from
    registers, one instruction touches up to 32 lines; see ``launch_shape`` for when that costs)."""
    converted = cute.make_rmem_tensor(S.layout, share.element_type)
    converted.store((S.load() * factor).to(share.element_type))
    R = cute.size(S) // CH
    if cutlass.const_expr(CH * share.element_type.width <= 128 or not STAGE):
        cute.autovec_copy(converted, _lane_state(dst, dst_offset + lane_offset, R, K, CH, PIECE, G,
                                                 min(PIECE, PER_COPY)))
    else:
        cute.autovec_copy(converted, share)
        cute.arch.sync_warp()
        units = R * CH * 32 // PER_COPY
        for i in cutlass.range_constexpr((units + 31) // 32):
            unit = lane + 32 * i
            if unit < units:
                e = unit * PER_COPY
                cute.autovec_copy(_unit(block.iterator, _state_unit(e, K, CH, PAD), PER_COPY),
                                  _unit(dst, dst_offset + e, PER_COPY))
        cute.arch.sync_warp()  # the block is free again


@cute.jit
def _prep_index(t, vector, channel, VECTORS: cutlass.Constexpr[int], G: cutlass.Constexpr[int],
                CH: cutlass.Constexpr[int], PAD: cutlass.Constexpr[int]):
    """Where ``channel`` of prepared vector ``vector`` of token t sits in shared memory: per token
    VECTORS vectors, each G runs of CH channels (the state lanes' shares), each run followed by
    PAD elements (against bank conflicts)."""
    return (t * VECTORS + vector) * (G * (CH + PAD)) + (channel // CH) * (CH + PAD) + channel % CH


@cute.jit
def _prepared_run(prepared: cute.Tensor, t, vector, part: Int32,
                  VECTORS: cutlass.Constexpr[int], G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int],
                  PAD: cutlass.Constexpr[int]) -> list:
    """A state lane's CH channels (its ``part`` of G) of prepared vector ``vector`` of token t,
    in registers (t and vector may be runtime values)."""
    run = _registers(_view(prepared.iterator, _prep_index(t, vector, part * CH, VECTORS, G, CH, PAD), 1, 0, CH, 4))
    return [run[0, c] for c in range(CH)]


@cute.jit
def _channel_run(prepared: cute.Tensor, t, vector: cutlass.Constexpr[int], first, VEC: cutlass.Constexpr[int],
                 VECTORS: cutlass.Constexpr[int], G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int],
                 PAD: cutlass.Constexpr[int]) -> cute.Tensor:
    """Channels first .. first + VEC - 1 of prepared vector ``vector`` of token t (first a multiple
    of VEC, and CH is one: they lie in one run) as a [1, VEC] view, accessed as one vector where
    the padded runs keep it aligned (16 bytes at K = 128). The preparing warps' lanes each take
    VEC such channels: as VEC scalar accesses, four lanes of a warp hit each bank (ncu of the GDN
    deferred verify, H200, B = 64: 3.5-way store and 3.9-way load conflicts over the whole kernel;
    the vector accesses took its pending verify from 60.4 to 57.2 us)."""
    ALIGN = VEC if (CH + PAD) % VEC == 0 else 1
    return _view(prepared.iterator, _prep_index(t, vector, first, VECTORS, G, CH, PAD), 1, 0, VEC, ALIGN)


@cute.jit
def _prepared_values(prepared: cute.Tensor, t, vector: cutlass.Constexpr[int], first, VEC: cutlass.Constexpr[int],
                     VECTORS: cutlass.Constexpr[int], G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int],
                     PAD: cutlass.Constexpr[int]) -> list:
    """VEC channels from ``first`` of prepared vector ``vector`` of token t (``_channel_run``)."""
    run = _registers(_channel_run(prepared, t, vector, first, VEC, VECTORS, G, CH, PAD))
    return [run[0, c] for c in range(VEC)]


@cute.jit
def _store_prepared(prepared: cute.Tensor, t, vector: cutlass.Constexpr[int], first, values: list,
                    VECTORS: cutlass.Constexpr[int], G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int],
                    PAD: cutlass.Constexpr[int]):
    """``values`` into channels from ``first`` of prepared vector ``vector`` of token t (``_channel_run``)."""
    run = cute.make_rmem_tensor(cute.make_layout((1, len(values)), stride=(len(values), 1)), Float32)
    for c in cutlass.range_constexpr(len(values)):
        run[0, c] = values[c]
    cute.autovec_copy(run, _channel_run(prepared, t, vector, first, len(values), VECTORS, G, CH, PAD))


@cute.jit
def _token_decay(prepared: cute.Tensor, scalars: cute.Tensor, A: Float32, t, first, VEC: cutlass.Constexpr[int],
                 FAMILY: cutlass.Constexpr[int], DECAY_VECTOR: cutlass.Constexpr[int],
                 VECTORS: cutlass.Constexpr[int], G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int],
                 PAD: cutlass.Constexpr[int]) -> list:
    """Token t's decay factor exp(g_t): KDA's for VEC channels from ``first`` (prepared vector
    DECAY_VECTOR), else one scalar (GDN's prepared, Lightning's head constant A)."""
    if cutlass.const_expr(FAMILY == KDA):
        return _prepared_values(prepared, t, DECAY_VECTOR, first, VEC, VECTORS, G, CH, PAD)
    return [A if cutlass.const_expr(FAMILY == LIGHTNING) else scalars[2 * t + 1]]


@cute.jit
def _head_dot(x: list, y: list) -> Float32:
    """sum_c x[c] y[c] over the whole head: this lane's channels, then all 32 lanes."""
    partial = Float32(0.0)
    for c in cutlass.range_constexpr(len(x)):
        partial = partial + x[c] * y[c]
    return _butterfly(partial, 16)


@cute.jit
def _pair_coefficients(prepared: cute.Tensor, coefficients: cute.Tensor, scalars: cute.Tensor, warp: Int32,
                       lane: Int32, A: Float32, T: cutlass.Constexpr[int], WARPS: cutlass.Constexpr[int],
                       VEC: cutlass.Constexpr[int], FAMILY: cutlass.Constexpr[int], VECTORS: cutlass.Constexpr[int],
                       G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int], PAD: cutlass.Constexpr[int]):
    """The deferred verify's token couplings, once per CTA (warp t % WARPS takes token t), from the
    prepared k, q and decays: with D_ts = prod_{s < i <= t} exp(g_i) (per channel for KDA, <= 1)
        A_ts = sum_c k_t D_ts k_s  (s < t),   B_ts = sum_c q_t D_ts k_s  (s <= t)
    into ``coefficients`` [2, T, T], and the decayed Gamma_t k_t, Gamma_t q_t (Gamma_t = D_t,-1)
    into their prepared vectors (the last two). Products of decays, never exp(-G): nothing can
    overflow."""
    K_VECTOR, Q_VECTOR, DECAY_VECTOR, KD_VECTOR, QD_VECTOR = 0, 1, 2, VECTORS - 2, VECTORS - 1
    for t in cutlass.range_constexpr(T):
        if warp == t % WARPS:
            first = lane * VEC
            kt = _prepared_values(prepared, t, K_VECTOR, first, VEC, VECTORS, G, CH, PAD)
            qt = _prepared_values(prepared, t, Q_VECTOR, first, VEC, VECTORS, G, CH, PAD)
            decay = [Float32(1.0) for _ in range(VEC)]  # D_ts, s from t down to -1 (then Gamma_t)
            for s in cutlass.range_constexpr(t, -2, -1):
                if cutlass.const_expr(s < t):
                    gamma = _token_decay(prepared, scalars, A, s + 1, first, VEC, FAMILY, DECAY_VECTOR, VECTORS, G,
                                         CH, PAD)
                    decay = [decay[c] * gamma[c % len(gamma)] for c in range(VEC)]
                if cutlass.const_expr(s >= 0):
                    ks = _prepared_values(prepared, s, K_VECTOR, first, VEC, VECTORS, G, CH, PAD)
                    decayed = [decay[c] * ks[c] for c in range(VEC)]
                    if cutlass.const_expr(s < t and FAMILY != LIGHTNING):
                        a_ts = _head_dot(kt, decayed)
                        if lane == 0:
                            coefficients[0, t, s] = a_ts
                    b_ts = _head_dot(qt, decayed)
                    if lane == 0:
                        coefficients[1, t, s] = b_ts
            _store_prepared(prepared, t, KD_VECTOR, first, [decay[c] * kt[c] for c in range(VEC)], VECTORS, G, CH,
                            PAD)
            _store_prepared(prepared, t, QD_VECTOR, first, [decay[c] * qt[c] for c in range(VEC)], VECTORS, G, CH,
                            PAD)


@cute.jit
def _stage_token(prepared: cute.Tensor, scalars: cute.Tensor, t, prepared_token: tuple, lane: Int32,
                 VEC: cutlass.Constexpr[int], FAMILY: cutlass.Constexpr[int], VECTORS: cutlass.Constexpr[int],
                 G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int], PAD: cutlass.Constexpr[int]):
    """One token's ``_prepare`` result into shared memory: k as vector 0, q (when there is one) as
    vector 1, KDA's per-channel decay after them; beta and the scalar decay into ``scalars``."""
    kt, decay, b, qt = prepared_token
    decay_vector = 1 + int(len(qt) > 0)
    first = lane * VEC
    _store_prepared(prepared, t, 0, first, kt, VECTORS, G, CH, PAD)
    if cutlass.const_expr(len(qt) > 0):
        _store_prepared(prepared, t, 1, first, qt, VECTORS, G, CH, PAD)
    if cutlass.const_expr(FAMILY == KDA):
        _store_prepared(prepared, t, decay_vector, first, decay, VECTORS, G, CH, PAD)
    if lane == 0:
        scalars[2 * t] = b
        scalars[2 * t + 1] = decay[0]


@cute.jit
def _fold_factors(prepared: cute.Tensor, scalars: cute.Tensor, A: Float32, T: cutlass.Constexpr[int],
                  FAMILY: cutlass.Constexpr[int], DECAY_VECTOR: cutlass.Constexpr[int],
                  VECTORS: cutlass.Constexpr[int], G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int],
                  PAD: cutlass.Constexpr[int]):
    """A scalar decay folded over T tokens: (gamma, applied), T values each. The registers hold S'
    with S = gamma_t S' after token t; where the running product would fall below FOLD_FLOOR,
    applied[t] is that product (to be multiplied into S' before token t's update) and gamma restarts
    at 1, so that 1 / gamma_t never grows large. All ones for KDA's per-channel decay."""
    gamma = [Float32(1.0) for _ in range(T)]
    applied = [Float32(1.0) for _ in range(T)]
    if cutlass.const_expr(FAMILY != KDA):
        running = Float32(1.0)
        for t in cutlass.range_constexpr(T):
            candidate = running * _token_decay(prepared, scalars, A, t, 0, 1, FAMILY, DECAY_VECTOR, VECTORS, G, CH,
                                               PAD)[0]
            small = candidate < FOLD_FLOOR
            applied[t] = cutlass.select_(small, candidate, Float32(1.0))
            running = cutlass.select_(small, Float32(1.0), candidate)
            gamma[t] = running
    return gamma, applied


# The tensor-core commit's products of bfloat16 parts (u part, key part), largest first: with three
# parts each (``_bfloat16_parts``), the first six leave errors near 2^-24 of a term.
COMMIT_PRODUCTS = ((0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1), (1, 2), (2, 1))


def _commit_packing(TP: int) -> tuple[int, int]:
    """(GROUP, MMAS) of the tensor-core commit: the 16 k slots of an m16n8k16 product hold groups
    of GROUP token slots (4 for up to 4 pending tokens, else 8), group q being product
    COMMIT_PRODUCTS[q]; MMAS products per tile cover 8 (GROUP 4) or 6 (GROUP 8) of them."""
    return (4, 2) if TP <= 4 else (8, 3)


@cute.jit
def _commit_slot(part, e, v2: cutlass.Constexpr[int], j: cutlass.Constexpr[int], GROUP: cutlass.Constexpr[int]):
    """(product group q, token t) behind the k slot 2 p + e + 8 v2 of the commit's mma j, for lane
    part p (an A fragment's v0 or a B fragment's i % 2 is e)."""
    slot = 2 * part + e + 8 * v2 + 16 * j
    return slot // GROUP, slot % GROUP


@cute.jit
def _bfloat16_parts(x: Float32) -> list:
    """Three bfloat16 values (as float32) summing to x up to 2^-27 of it."""
    parts = []
    for _ in cutlass.range_constexpr(3):
        part = Float32(BFloat16(x))
        parts.append(part)
        x = x - part
    return parts


@cute.jit
def _commit_operand_index(consumer, nt, j, v2, e, MMAS: cutlass.Constexpr[int]):
    """Where the commit's B operand value of lane ``consumer``, column tile nt, mma j, slot
    (v2, e) sits (``_tensor_core_commit``): [column tiles][32 lanes][MMAS][v2][e], bfloat16."""
    return ((nt * 32 + consumer) * MMAS + j) * 4 + v2 * 2 + e


@cute.jit
def _decayed_pending_keys(prepared: cute.Tensor, scalars: cute.Tensor, operands: cute.Tensor, count: Int32,
                          thread: Int32, THREADS: cutlass.Constexpr[int], TP: cutlass.Constexpr[int],
                          K: cutlass.Constexpr[int], FAMILY: cutlass.Constexpr[int], VECTORS: cutlass.Constexpr[int],
                          G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int], PAD: cutlass.Constexpr[int],
                          TENSOR_CORES: cutlass.Constexpr[bool]):
    """The pending commit of ``count`` accepted tokens in closed form, shared by THREADS threads
    (this one is ``thread``), each on its own channels: with D_i = exp(g_i) (per channel for KDA,
    a scalar for GDN),
        S_count = Gamma S + sum_{s < count} (D_s' k_s) u_s^T,  Gamma = prod_{i < count} D_i,
        D_s' = prod_{s < i < count} D_i,
    so that the state takes one decay instead of one per token. Each token's k (vector 0) becomes
    D_s' k_s, or with TENSOR_CORES goes as the commit's mma B operand into ``operands``
    (``_tensor_core_commit``; zero for s >= count and for the padding token slots TP .. GROUP - 1);
    Gamma goes to KDA's token 0 decay (vector 1; a thread rewrites only its channels) or GDN's
    ``scalars[2 TP]``. Products of decays only (<= 1)."""
    VEC = max(K // THREADS, 1)
    if thread * VEC < K:
        channels = [thread * VEC + c for c in range(VEC)]
        after = [Float32(1.0) for _ in range(VEC if FAMILY == KDA else 1)]  # the decays after token t, to count - 1
        GROUP, MMAS = _commit_packing(TP)
        keys = [[Float32(0.0) for _ in range(VEC)] for _ in range(GROUP if TENSOR_CORES else 0)]
        for t in cutlass.range_constexpr(TP - 1, -1, -1):
            key = _prepared_values(prepared, t, 0, thread * VEC, VEC, VECTORS, G, CH, PAD)
            decay = _token_decay(prepared, scalars, Float32(1.0), t, thread * VEC, VEC, FAMILY, 1, VECTORS, G, CH, PAD)
            decayed = [key[c] * after[c % len(after)] for c in range(VEC)]
            if cutlass.const_expr(TENSOR_CORES):
                keys[t] = [cutlass.select_(t < count, decayed[c], Float32(0.0)) for c in range(VEC)]
            else:
                _store_prepared(prepared, t, 0, thread * VEC, decayed, VECTORS, G, CH, PAD)
            after = [cutlass.select_(t < count, after[c] * decay[c], after[c]) for c in range(len(after))]
        if cutlass.const_expr(TENSOR_CORES):
            # each token pair (e = 0, 1) of a consumer lane's slots as one 4-byte store
            for c in cutlass.range_constexpr(VEC):
                run = channels[c] // CH
                within = channels[c] % CH
                consumer_group = 2 * run + within % 2  # the tile column, read by the lanes of this group
                for pair in cutlass.range_constexpr(GROUP // 2):
                    parts = [_bfloat16_parts(keys[2 * pair + e][c]) for e in range(2)]
                    for p in cutlass.range_constexpr(4):
                        for j in cutlass.range_constexpr(MMAS):
                            for v2 in cutlass.range_constexpr(2):
                                q, t0 = _commit_slot(p, 0, v2, j, GROUP)
                                if cutlass.const_expr(t0 == 2 * pair and q < len(COMMIT_PRODUCTS)):
                                    values = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
                                    for e in cutlass.range_constexpr(2):
                                        values[e] = BFloat16(parts[e][COMMIT_PRODUCTS[q][1]])
                                    index = _commit_operand_index(consumer_group * 4 + p, within // 2, j, v2, 0, MMAS)
                                    cute.autovec_copy(values, _view(operands.iterator, index, 1, 0, 2, 2))
        if cutlass.const_expr(FAMILY == KDA):
            _store_prepared(prepared, 0, 1, thread * VEC, after, VECTORS, G, CH, PAD)
        elif thread == 0:
            scalars[2 * TP] = after[0]


@cute.jit
def _decay_state(S: cute.Tensor, prepared: cute.Tensor, t, applied: Float32, part: Int32,
                 FAMILY: cutlass.Constexpr[int], DECAY_VECTOR: cutlass.Constexpr[int], VECTORS: cutlass.Constexpr[int],
                 G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int], PAD: cutlass.Constexpr[int]):
    """Token t's decay on this lane's share of the state: the folded scalar's ``applied`` factor
    (``_fold_factors``; usually 1 and skipped), or KDA's per-channel decays."""
    R = cute.size(S) // CH
    if cutlass.const_expr(FAMILY != KDA):
        if applied < 1.0:
            for r in cutlass.range_constexpr(R):
                for c in cutlass.range_constexpr(CH):
                    S[r, c] = S[r, c] * applied
    else:
        channel_decay = _prepared_run(prepared, t, DECAY_VECTOR, part, VECTORS, G, CH, PAD)
        for r in cutlass.range_constexpr(R):
            for c in cutlass.range_constexpr(CH):
                S[r, c] = S[r, c] * channel_decay[c]


@cute.jit
def _add_update(S: cute.Tensor, u: list, key: list, gamma: Float32, FOLD: cutlass.Constexpr[bool]):
    """S += k u^T on this lane's share (its R columns' u, its CH channels of k); with a folded
    scalar decay the registers hold S' = S / gamma, so u is divided by gamma first."""
    R = cute.size(S) // len(key)
    unfolded = Float32(1.0) / gamma if cutlass.const_expr(FOLD) else Float32(1.0)
    for r in cutlass.range_constexpr(R):
        ur = u[r] * unfolded if cutlass.const_expr(FOLD) else u[r]
        for c in cutlass.range_constexpr(len(key)):
            S[r, c] = S[r, c] + ur * key[c]


@cute.jit
def _quad_transpose(dots: list, part: Int32) -> list:
    """Within each quad of lanes (the four lanes of an mma.sync row group): from dots[r][j], the
    quad's four columns r with this lane's two products n = 2 part + j, to the eight products
    n = 0..7 of column r = part. Two butterfly rounds of four shuffles: lanes part and part ^ 2
    trade the two columns they do not keep, then part and part ^ 1 the one."""
    upper = (part & 2) != 0
    halves = []  # columns 2 bit1(part) + i: this lane's n, then those of lane part ^ 2
    for i in cutlass.range_constexpr(2):
        keep = [cutlass.select_(upper, dots[2 + i][j], dots[i][j]) for j in range(2)]
        send = [cutlass.select_(upper, dots[i][j], dots[2 + i][j]) for j in range(2)]
        halves.append(keep + [cute.arch.shuffle_sync_bfly(x, offset=2) for x in send])
    odd = (part & 1) != 0
    keep = [cutlass.select_(odd, halves[1][e], halves[0][e]) for e in range(4)]
    send = [cutlass.select_(odd, halves[0][e], halves[1][e]) for e in range(4)]
    # the products of lanes part, part ^ 2, part ^ 1 and part ^ 3, two each
    pieces = keep + [cute.arch.shuffle_sync_bfly(x, offset=1) for x in send]
    ordered = []
    for source in cutlass.range_constexpr(4):
        which = source ^ part  # 0, 2, 1, 3 -> pieces 0, 1, 2, 3
        for j in cutlass.range_constexpr(2):
            ordered.append(cutlass.select_(which == 0, pieces[j], cutlass.select_(
                which == 2, pieces[2 + j], cutlass.select_(which == 1, pieces[4 + j], pieces[6 + j]))))
    return ordered


@cute.jit
def _tensor_core_dots(S: cute.Tensor, prepared: cute.Tensor, lane: Int32, T: cutlass.Constexpr[int],
                      DELTA: cutlass.Constexpr[bool], KD_VECTOR: cutlass.Constexpr[int],
                      QD_VECTOR: cutlass.Constexpr[int], VECTORS: cutlass.Constexpr[int], G: cutlass.Constexpr[int],
                      CH: cutlass.Constexpr[int], PAD: cutlass.Constexpr[int]):
    """The deferred verify's 2T dot products of its state columns with Gamma_t k_t and Gamma_t q_t
    on the tensor cores, for a bfloat16 pool (R = G = 4): (k_dots [T] or [], q_dots [T]) of this
    lane's column ``part`` (lane % 4, ``_writer_row``) of its group's four.

    The state S0 the verify reads is exactly bfloat16 (the pool's values, or the pending commit's
    result rounded to them), so a warp's [32 columns, K] block is an mma.sync A operand as it is
    (m16n8k16, float32 accumulation). The dots' vectors (n = t for Gamma_t k_t, T + t for
    Gamma_t q_t, up to 16) are the B operand, each split exactly into three bfloat16 parts (24
    significant bits, float32's): the products are those of float32 arithmetic. The K order of an
    mma tile is free as long as A and B agree, so lane part's k indices of tile kt are channels
    4 kt .. 4 kt + 3 of its own share, and S stays in the registers the loads filled (R x CH).
    Rows: a tile's row g (+ 8) is column 2 mt (+ 1) of group g (two tiles), so a lane's
    accumulators hold its group's four columns, two n each; ``_quad_transpose`` gathers a column's."""
    mma = cute.make_tiled_mma(MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
    thr = mma.get_slice(lane)
    group = lane // G
    part = lane % G
    TILES_K = CH // 4
    # A fragment element i = v0 + 2 v1 + 4 v2: tile row g + 8 v1, k index 2 part + v0 + 8 v2
    TILES_M = cute.size(S) // CH // 2
    state = []
    for mt in cutlass.range_constexpr(TILES_M):
        row = []
        for kt in cutlass.range_constexpr(TILES_K):
            fragment = mma.make_fragment_A(thr.partition_shape_A((16, 16)))
            for i in cutlass.range_constexpr(8):
                fragment[i] = BFloat16(S[2 * mt + (i >> 1) % 2, 4 * kt + 2 * (i >> 2) + i % 2])
            row.append(fragment)
        state.append(row)
    KEYS = T if DELTA else 0
    DOTS = KEYS + T
    dots = []
    for nt in cutlass.range_constexpr((DOTS + 7) // 8):
        n = nt * 8 + group  # this lane's B column
        is_key = n < KEYS
        token = cutlass.min(cutlass.select_(is_key, n, n - KEYS), Int32(T - 1))
        vector = cutlass.select_(is_key, Int32(KD_VECTOR), Int32(QD_VECTOR))
        run = _prepared_run(prepared, token, vector, part, VECTORS, G, CH, PAD)
        parts = [_bfloat16_parts(cutlass.select_(n < DOTS, run[c], Float32(0.0))) for c in range(CH)]
        accumulators = []
        for mt in cutlass.range_constexpr(TILES_M):
            accumulator = cute.make_rmem_tensor(thr.partition_shape_C((16, 8)), Float32)
            accumulator.fill(0.0)
            accumulators.append(accumulator)
        for which in cutlass.range_constexpr(3):
            for kt in cutlass.range_constexpr(TILES_K):
                # B fragment element i: k index 2 part + i % 2 + 8 (i // 2), channel 4 kt + i
                fragment = mma.make_fragment_B(thr.partition_shape_B((8, 16)))
                for i in cutlass.range_constexpr(4):
                    fragment[i] = BFloat16(parts[4 * kt + i][which])
                for mt in cutlass.range_constexpr(TILES_M):
                    cute.gemm(mma, accumulators[mt], state[mt][kt], fragment, accumulators[mt])
        # C fragment element i = j + 2 h: tile row g + 8 h (column 2 mt + h), n = 2 part + j
        dots = dots + _quad_transpose([[accumulators[r // 2][2 * (r % 2) + j] for j in range(2)]
                                       for r in range(2 * TILES_M)], part)
    return dots[:KEYS], dots[KEYS:DOTS]


@cute.jit
def _tensor_core_commit(S: cute.Tensor, operands: cute.Tensor, pending_values: list, prepared: cute.Tensor,
                        scalars: cute.Tensor, lane: Int32, TP: cutlass.Constexpr[int], FAMILY: cutlass.Constexpr[int],
                        VECTORS: cutlass.Constexpr[int], G: cutlass.Constexpr[int], CH: cutlass.Constexpr[int],
                        PAD: cutlass.Constexpr[int]):
    """The pending commit in closed form (``_decayed_pending_keys``) on the tensor cores, for a
    bfloat16 pool (R = G = 4): S = Gamma S + sum_s (D_s' k_s) u_s^T in place on this lane's
    bfloat16 share S [R, CH], each element rounded once, to what the pool then holds.

    mma.sync products per tile of the state (m16n8k16, float32 accumulation): the accumulator (C)
    starts as Gamma S, A holds the saved u (rows: the state columns), B the decayed keys (columns:
    channels). The C fragment of column tile nt holds channels 2 nt, 2 nt + 1 of the lane's run
    for its group's columns 2 mt, 2 mt + 1 (the rows of ``_tensor_core_dots``), so S goes in and
    out in place. u and the keys are each split into three bfloat16 parts; the k slots of the
    products hold groups of token slots, one group per product of parts (``_commit_packing``), so
    that up to four tokens take two mma per tile for float32 accuracy (GDN, B = 64, T = 4: 58.5
    us). Tried first: two parts each, three mma a tile (64.4 us), whose errors near 2^-16 of a
    term flipped enough roundings of the state to move a GDN verify's outputs 1.0e-4 from a
    separate commit's; tf32 operands (m16n8k8, two parts, three mma a tile): 78.2 us.
    ``pending_values`` [2][R]: this lane's columns' saved u of its two tokens (``_commit_slot``;
    B is zero from token TP and from the accepted count on)."""
    mma = cute.make_tiled_mma(MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
    thr = mma.get_slice(lane)
    part = lane % G
    GROUP, MMAS = _commit_packing(TP)
    TILES_M = cute.size(S) // CH // 2
    u_parts = [[_bfloat16_parts(x) for x in token] for token in pending_values]
    # A fragment element i = v0 + 2 v1 + 4 v2: row g + 8 v1 (column 2 mt + v1), k slot 2 p + v0 + 8 v2
    u_fragments = []
    for mt in cutlass.range_constexpr(TILES_M):
        per_mma = []
        for j in cutlass.range_constexpr(MMAS):
            fragment = mma.make_fragment_A(thr.partition_shape_A((16, 16)))
            for i in cutlass.range_constexpr(8):
                v0, v1, v2 = i % 2, (i >> 1) % 2, i >> 2
                value = u_parts[v0][2 * mt + v1]
                if cutlass.const_expr(GROUP == 4):
                    # lanes p < 2 take the even product groups, p >= 2 the odd ones
                    q_even = 2 * v2 + 4 * j
                    fragment[i] = BFloat16(cutlass.select_(part >= 2, value[COMMIT_PRODUCTS[q_even + 1][0]],
                                                           value[COMMIT_PRODUCTS[q_even][0]]))
                else:
                    q = v2 + 2 * j
                    fragment[i] = BFloat16(value[COMMIT_PRODUCTS[q][0]] if q < 6 else Float32(0.0))
            per_mma.append(fragment)
        u_fragments.append(per_mma)
    for nt in cutlass.range_constexpr(CH // 2):
        decay = [scalars[2 * TP]]
        if cutlass.const_expr(FAMILY == KDA):
            run = _registers(_view(prepared.iterator, _prep_index(0, 1, part * CH + 2 * nt, VECTORS, G, CH, PAD),
                                   1, 0, 2, 2))
            decay = [run[0, 0], run[0, 1]]
        keys = _raw_registers(_view(operands.iterator, _commit_operand_index(lane, nt, 0, 0, 0, MMAS), 1, 0,
                                    4 * MMAS, 8 if MMAS % 2 == 0 else 4))
        key_fragments = []
        for j in cutlass.range_constexpr(MMAS):
            # B fragment element i: k slot 2 p + i % 2 + 8 (i // 2), column g
            fragment = mma.make_fragment_B(thr.partition_shape_B((8, 16)))
            for i in cutlass.range_constexpr(4):
                fragment[i] = keys[0, 4 * j + i]
            key_fragments.append(fragment)
        for mt in cutlass.range_constexpr(TILES_M):
            # C fragment element i = e + 2 h: column 2 mt + h, channel 2 nt + e
            accumulator = cute.make_rmem_tensor(thr.partition_shape_C((16, 8)), Float32)
            for i in cutlass.range_constexpr(4):
                accumulator[i] = Float32(S[2 * mt + i // 2, 2 * nt + i % 2]) * decay[i % 2 % len(decay)]
            for j in cutlass.range_constexpr(MMAS):
                cute.gemm(mma, accumulator, u_fragments[mt][j], key_fragments[j], accumulator)
            for i in cutlass.range_constexpr(4):
                S[2 * mt + i // 2, 2 * nt + i % 2] = BFloat16(accumulator[i])


# ------------------------------------------------------------------------------------------------
# the kernel


@cute.kernel
def _recurrent_kernel(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor, o: cute.Tensor,
    saved_u: cute.Tensor, A_log: cute.Tensor, dt_bias: cute.Tensor,
    pending_k: cute.Tensor, pending_g: cute.Tensor, pending_u: cute.Tensor,
    pool: cute.Pointer, stride_pool: Int64, buffer: cute.Pointer, stride_buf_r: Int64, stride_buf_t: Int64,
    state_indices: cute.Tensor, num_accepted: cute.Tensor, buffer_rows: cute.Tensor,
    scale: Float32, lower_bound: Float32,
    T: cutlass.Constexpr[int], TP: cutlass.Constexpr[int], H: cutlass.Constexpr[int], HV: cutlass.Constexpr[int],
    K: cutlass.Constexpr[int], V: cutlass.Constexpr[int], R: cutlass.Constexpr[int], G: cutlass.Constexpr[int],
    OP: cutlass.Constexpr[int], FAMILY: cutlass.Constexpr[int], GATE: cutlass.Constexpr[int],
    HAS_DT_BIAS: cutlass.Constexpr[bool], QK_L2NORM: cutlass.Constexpr[bool], BETA_LOGITS: cutlass.Constexpr[bool],
    SAVED_U: cutlass.Constexpr[bool], VECTOR_POOL: cutlass.Constexpr[bool], WARPS: cutlass.Constexpr[int],
    STAGE: cutlass.Constexpr[bool], TENSOR_CORES: cutlass.Constexpr[bool],
):
    VEC = K // 32  # a lane's channels while preparing the tokens (32 lanes over K)
    CH = K // G  # a lane's channels of the state (G lanes over K)
    # A tensor-core verify's lane holds 16-byte pieces of its channels, G pieces apart, so that the
    # four lanes of a quad read whole sectors (H200, deferred verify + commit, bfloat16, B = 256:
    # GDN 266.6 -> 251.3 us, KDA 280.4 -> 270.6 against one run of CH per lane); else one run.
    PIECE = min(CH, 8) if TENSOR_CORES else CH
    COLS = R * (32 // G)  # state columns per warp
    DELTA = FAMILY != LIGHTNING
    FOLD = FAMILY != KDA  # a scalar decay: folded into per-token factors instead of scaling the state
    WITH_Q = OP != OP_COMMIT
    KNOWN_U = not DELTA or (OP == OP_COMMIT and SAVED_U)  # u needs no reduction: v (Lightning) or saved
    lane = cute.arch.thread_idx()[0] % 32
    c0 = _physical_channel(lane * VEC, G, CH, PIECE)  # the first of the channels this lane prepares
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    # a one-axis grid, the V-tile fastest: CTAs launched together read neighbouring pieces of a state
    TILES = V // (COLS * WARPS)
    cta, _, _ = cute.arch.block_idx()
    i_nh = cta // TILES
    i_vt = cta % TILES
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    group = lane // G
    part = lane % G
    v0 = (i_vt * WARPS + warp) * COLS  # first of this warp's columns
    col0 = v0 + group * R  # first of this lane's R columns
    writes, writer_row = _writer_row(part, R, G)

    # Every load that does not depend on the slot goes out first, so that its latency overlaps the
    # slot's and the state's instead of following them (decode at B = 1 is one chain of dependent
    # DRAM round trips): the tokens this warp prepares (t = warp, warp + WARPS, ...), and the
    # values of this lane's columns (v, or the saved u of a commit).
    TOKENS_PER_WARP = (T + WARPS - 1) // WARPS
    raw = [_token_inputs(q, k, g, beta, i_n, cutlass.min(warp + j * WARPS, Int32(T - 1)), i_h, i_hv, c0,
                         VEC, OP, FAMILY, SAVED_U) for j in range(TOKENS_PER_WARP)]
    COMMIT_FIRST = TP > 0  # a deferred verify that first commits the previous verify's accepted tokens
    PENDING_PER_WARP = (TP + WARPS - 1) // WARPS
    pending_raw = [_token_inputs(q, pending_k, pending_g, beta, i_n, cutlass.min(warp + j * WARPS, Int32(TP - 1)),
                                 i_h, i_hv, c0, VEC, OP_COMMIT, FAMILY, True) for j in range(PENDING_PER_WARP)]
    if cutlass.const_expr(TENSOR_CORES):
        # the commit's A operand: this lane's two tokens (``_commit_slot``)
        pending_values = [[Float32(pending_u[i_n, cutlass.min(_commit_slot(part, e, 0, 0, _commit_packing(TP)[0])[1],
                                                              Int32(TP - 1)), i_hv, col0 + r])
                           for r in range(R)] for e in range(2 if TP > 0 else 0)]
    else:
        pending_values = [[Float32(pending_u[i_n, t, i_hv, col0 + r]) for r in range(R)] for t in range(TP)]
    values_src = saved_u if cutlass.const_expr(OP == OP_COMMIT and SAVED_U) else v
    if cutlass.const_expr(OP == OP_DEFERRED):
        # a deferred verify's lane needs the one column whose sums it holds (``_scatter_sum``):
        # R - 1 fewer registers per token
        values = [[Float32(v[i_n, t, i_hv, col0 + writer_row])] for t in range(T)]
    else:
        values = [[Float32(values_src[i_n, t, i_hv, col0 + r]) for r in range(R)] for t in range(T)]
    A = Float32(0.0)
    if cutlass.const_expr(FAMILY == LIGHTNING):
        A = cute.exp(Float32(g[0, 0, i_hv, 0]), fastmath=True)  # g is the decay [HV], viewed as [1, 1, HV, 1]
    elif cutlass.const_expr(GATE != GATE_NONE):
        A = cute.exp(Float32(A_log[i_hv, 0]), fastmath=True)
    bias = [Float32(0.0) for _ in range(VEC)]
    if cutlass.const_expr(HAS_DT_BIAS):
        if cutlass.const_expr(FAMILY == KDA):
            bias = [Float32(dt_bias[i_hv, c0 + c]) for c in range(VEC)]
        else:
            bias = [Float32(dt_bias[i_hv, 0]) for _ in range(VEC)]
    if cutlass.const_expr(OP == OP_SLOTS):
        # vLLM's layout: the previous step accepted a tokens, so its state sits in column a - 1
        column = cutlass.min(cutlass.max(num_accepted[i_n] - 1, Int32(0)), Int32(state_indices.shape[1] - 1))
        slot = Int64(state_indices[i_n, column])
    else:
        slot = Int64(state_indices[i_n, 0])
    count = Int32(T)
    if cutlass.const_expr(OP == OP_COMMIT):
        count = num_accepted[i_n]

    # shared memory: the warps' state blocks, then the prepared tokens
    state_type = cute.make_tensor(pool, cute.make_layout(1)).element_type
    UNIT = 128 // state_type.width  # elements per 16 bytes
    PAD = _padding(CH, UNIT)
    COL_STRIDE = G * (CH + PAD)
    smem = SmemAllocator()
    # (without STAGE the state skips shared memory: a one-unit placeholder keeps the views uniform)
    staged = smem.allocate_tensor(state_type, cute.make_layout(WARPS * COLS * COL_STRIDE if STAGE else UNIT), 16)
    PREP_PAD = _padding(CH, 4)
    # per token: k, q, the per-channel decay (KDA), and for a deferred verify Gamma_t k, Gamma_t q
    DEFERRED = OP == OP_DEFERRED
    VECTORS = 1 + int(WITH_Q) + int(FAMILY == KDA) + 2 * int(DEFERRED)
    Q_VECTOR, DECAY_VECTOR, KD_VECTOR, QD_VECTOR = 1, 1 + int(WITH_Q), VECTORS - 2, VECTORS - 1
    prepared = smem.allocate_tensor(Float32, cute.make_layout(T * VECTORS * G * (CH + PREP_PAD)), 16)
    scalars = smem.allocate_tensor(Float32, cute.make_layout(2 * T), 16)  # beta, scalar decay per token
    coefficients = smem.allocate_tensor(Float32, cute.make_layout((2, T, T), stride=(T * T, T, 1)), 16)
    # the pending commit's tokens: k and KDA's per-channel decay, the scalar decay
    PENDING_VECTORS, PENDING_DECAY_VECTOR = 1 + int(FAMILY == KDA), 1
    pending_prepared = prepared
    pending_scalars = scalars
    if cutlass.const_expr(COMMIT_FIRST):
        pending_prepared = smem.allocate_tensor(Float32, cute.make_layout(TP * PENDING_VECTORS * G * (CH + PREP_PAD)),
                                                16)
        # (and GDN's Gamma, ``_decayed_pending_keys``)
        pending_scalars = smem.allocate_tensor(Float32, cute.make_layout(2 * TP + 1), 16)
    # the tensor-core commit's B operands (``_commit_operand_index``)
    OPERANDS = CH * 64 * _commit_packing(TP)[1] if TENSOR_CORES and COMMIT_FIRST else 8
    commit_operands = smem.allocate_tensor(BFloat16, cute.make_layout(OPERANDS), 16)

    head_offset = Int64((i_hv * V + v0) * K)  # this warp's block of COLS columns, contiguous
    lane_offset = group * R * K + part * PIECE  # where this lane's first run (piece) starts in the block
    warp_block = cute.make_tensor(staged.iterator + cute.assume(warp * (COLS * COL_STRIDE), divby=UNIT),
                                  cute.make_layout(COLS * COL_STRIDE))
    share = _view(warp_block.iterator, group * R * COL_STRIDE + part * (CH + PAD), R, COL_STRIDE, CH, min(CH, UNIT))
    per_copy = UNIT if VECTOR_POOL else 1
    if slot >= 0:
        block = slot * stride_pool + head_offset
        # this lane's share of the state in the pool, where an unstaged kernel loads and stores it
        lane_state = _lane_state(pool, block + lane_offset, R, K, CH, PIECE, G, min(PIECE, UNIT) if VECTOR_POOL else 1)
        if cutlass.const_expr(STAGE):
            # The warp's block of the state goes to shared memory, coalesced (units in order across
            # the lanes), as soon as the slot is known: by cp.async in 16-byte units when the pool's
            # slots are 16-byte aligned, else element-wise through registers. A lane's share is read
            # back after the tokens are prepared.
            units = COLS * K // per_copy
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), state_type,
                                       num_bits_per_copy=128)
            for i in cutlass.range_constexpr((units + 31) // 32):
                unit = lane + 32 * i
                if unit < units:
                    e = unit * per_copy
                    dst = _state_unit(e, K, CH, PAD)
                    if cutlass.const_expr(VECTOR_POOL):
                        # .cg: the state is streamed, never reread
                        cute.copy(atom, _unit(pool, block + e, per_copy), _unit(warp_block.iterator, dst, per_copy))
                    else:
                        warp_block[dst] = cute.make_tensor(pool + (block + e), cute.make_layout(1))[0]
            cute.arch.cp_async_commit_group()
        else:
            # straight into registers: a lane's runs are whole 16-byte units, and the L1 serves
            # the other halves of the sectors the warp's neighbouring loads touched
            # (a tensor-core verify keeps the pool's bfloat16: its products' A and C operands)
            S = (_raw_registers if cutlass.const_expr(TENSOR_CORES) else _registers)(lane_state)

        # Prepare the tokens once per CTA (norms, gates, beta) into shared memory, each vector laid
        # out as G runs of CH channels (the lanes' shares), padded against bank conflicts.
        for j in cutlass.range_constexpr(TOKENS_PER_WARP):
            t = warp + j * WARPS
            token = _prepare(raw[j], A, bias, lower_bound, scale, OP, FAMILY, GATE, QK_L2NORM, BETA_LOGITS)
            if t < T:
                _stage_token(prepared, scalars, t, token, lane, VEC, FAMILY, VECTORS, G, CH, PREP_PAD)
        for j in cutlass.range_constexpr(PENDING_PER_WARP):
            t = warp + j * WARPS
            token = _prepare(pending_raw[j], A, bias, lower_bound, scale, OP_COMMIT, FAMILY, GATE, QK_L2NORM, False)
            if t < TP:
                _stage_token(pending_prepared, pending_scalars, t, token, lane, VEC, FAMILY, PENDING_VECTORS, G, CH,
                             PREP_PAD)

        if cutlass.const_expr(DEFERRED):
            cute.arch.barrier()
            _pair_coefficients(prepared, coefficients, scalars, warp, lane, A, T, WARPS, VEC, FAMILY, VECTORS, G, CH,
                               PREP_PAD)
            if cutlass.const_expr(COMMIT_FIRST and (FAMILY == KDA or TENSOR_CORES)):
                # KDA's tensor-core closed form on every warp of the CTA, else on the last one (H200,
                # B = 64, T = 4 after T = 4: KDA 66.7 -> 58.9 us, GDN 58.5 -> 61.3 on every warp)
                CLOSED_FORM_WARPS = WARPS if FAMILY == KDA and TENSOR_CORES else 1
                if warp >= WARPS - CLOSED_FORM_WARPS:
                    _decayed_pending_keys(pending_prepared, pending_scalars, commit_operands, num_accepted[i_n],
                                          (warp - (WARPS - CLOSED_FORM_WARPS)) * 32 + lane, CLOSED_FORM_WARPS * 32,
                                          TP, K, FAMILY, PENDING_VECTORS, G, CH, PREP_PAD, TENSOR_CORES)
        buffer_row = Int64(0)
        if cutlass.const_expr(OP == OP_BUFFER):
            buffer_row = Int64(buffer_rows[i_n])
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        if cutlass.const_expr(STAGE):
            S = _registers(share)

        # The previous verify's accepted tokens, from their saved u (Lightning: v), as a commit does;
        # the state goes back to the slot as the pool holds it (rounded to its dtype), and the verify
        # below starts from exactly that.
        if cutlass.const_expr(COMMIT_FIRST and TENSOR_CORES):
            if num_accepted[i_n] > 0:
                _tensor_core_commit(S, commit_operands, pending_values, pending_prepared, pending_scalars, lane, TP,
                                    FAMILY, PENDING_VECTORS, G, CH, PREP_PAD)
                cute.autovec_copy(S, lane_state)
        elif cutlass.const_expr(COMMIT_FIRST):
            pending_count = num_accepted[i_n]
            pending_gamma, pending_applied = _fold_factors(pending_prepared, pending_scalars, A, TP, FAMILY,
                                                           PENDING_DECAY_VECTOR, PENDING_VECTORS, G, CH, PREP_PAD)
            if cutlass.const_expr(FAMILY == KDA):
                # closed form (``_decayed_pending_keys``): Gamma in token 0's decay, decayed keys
                if pending_count > 0:
                    _decay_state(S, pending_prepared, 0, Float32(1.0), part, FAMILY, PENDING_DECAY_VECTOR,
                                 PENDING_VECTORS, G, CH, PREP_PAD)
            for t in cutlass.range_constexpr(TP):
                if t < pending_count:
                    key = _prepared_run(pending_prepared, t, 0, part, PENDING_VECTORS, G, CH, PREP_PAD)
                    if cutlass.const_expr(FAMILY != KDA):
                        _decay_state(S, pending_prepared, t, pending_applied[t], part, FAMILY, PENDING_DECAY_VECTOR,
                                     PENDING_VECTORS, G, CH, PREP_PAD)
                    _add_update(S, pending_values[t], key, pending_gamma[t], FOLD)
            factor = cutlass.select_(pending_count > 0, _pick(pending_gamma, pending_count - 1), Float32(1.0))
            S.store((S.load() * factor).to(state_type).to(Float32))
            if pending_count > 0:
                _store_state(S, Float32(1.0), share, warp_block, pool, block, lane, lane_offset, K, CH, PAD, per_copy,
                             STAGE, PIECE, G)

        if cutlass.const_expr(DEFERRED):
            # No state is written: every output follows from 2T dot products with S0 and the
            # token couplings (``_pair_coefficients``), in the WY form of the recurrence:
            #   u_t = beta_t (v_t - Gamma_t k_t . S0 - sum_{s<t} A_ts u_s)
            #   o_t = Gamma_t q_t . S0 + sum_{s<=t} B_ts u_s
            # The dot products are independent (no token waits for the previous one's update).
            k_dots = []
            q_dots = []
            if cutlass.const_expr(TENSOR_CORES):
                k_dots, q_dots = _tensor_core_dots(S, prepared, lane, T, DELTA, KD_VECTOR, QD_VECTOR, VECTORS, G, CH,
                                                   PREP_PAD)
            else:
                for t in cutlass.range_constexpr(T):
                    if cutlass.const_expr(DELTA):
                        key = _prepared_run(prepared, t, KD_VECTOR, part, VECTORS, G, CH, PREP_PAD)
                        k_dots.append(_scatter_sum(_row_partials(S, key, R, CH), lane, G))
                    query = _prepared_run(prepared, t, QD_VECTOR, part, VECTORS, G, CH, PREP_PAD)
                    q_dots.append(_scatter_sum(_row_partials(S, query, R, CH), lane, G))
            us = []
            for t in cutlass.range_constexpr(T):
                u_t = values[t][0]
                if cutlass.const_expr(DELTA):
                    residual = u_t - k_dots[t]
                    for s_ in cutlass.range_constexpr(t):
                        residual = residual - coefficients[0, t, s_] * us[s_]
                    u_t = scalars[2 * t] * residual
                us.append(u_t)
                o_t = q_dots[t]
                for s_ in cutlass.range_constexpr(t + 1):
                    o_t = o_t + coefficients[1, t, s_] * us[s_]
                if writes:
                    o[i_n, t, i_hv, col0 + writer_row] = o_t.to(o.element_type)
                    if cutlass.const_expr(SAVED_U):
                        saved_u[i_n, t, i_hv, col0 + writer_row] = u_t
        else:
            # A scalar decay is folded: the registers hold S' with S = gamma_t S', gamma_t the product
            # of the decays so far, so a token costs no pass over the state for its decay. When the
            # product falls below FOLD_FLOOR it is applied (S' = S, gamma = 1) before 1 / gamma_t grows large.
            gamma, applied = _fold_factors(prepared, scalars, A, T, FAMILY, DECAY_VECTOR, VECTORS, G, CH, PREP_PAD)
            for t in cutlass.range_constexpr(T):
                if t < count:
                    key = _prepared_run(prepared, t, 0, part, VECTORS, G, CH, PREP_PAD)
                    _decay_state(S, prepared, t, applied[t], part, FAMILY, DECAY_VECTOR, VECTORS, G, CH, PREP_PAD)
                    # u: what the token writes into each column (v itself for Lightning, the saved u
                    # for a commit that has it)
                    u = values[t]
                    if cutlass.const_expr(not KNOWN_U):
                        predicted = _all_sum(_row_partials(S, key, R, CH), lane, G)
                        beta_t = scalars[2 * t]
                        u = [beta_t * (values[t][r] - gamma[t] * predicted[r]) for r in range(R)]
                    _add_update(S, u, key, gamma[t], FOLD)
                    # output
                    if cutlass.const_expr(WITH_Q):
                        query = _prepared_run(prepared, t, Q_VECTOR, part, VECTORS, G, CH, PREP_PAD)
                        total = _scatter_sum(_row_partials(S, query, R, CH), lane, G)
                        if writes:
                            o[i_n, t, i_hv, col0 + writer_row] = (gamma[t] * total).to(o.element_type)
                    # states the protocol keeps per token
                    if cutlass.const_expr(OP == OP_BUFFER):
                        _store_state(S, gamma[t], share, warp_block, buffer,
                                     buffer_row * stride_buf_r + t * stride_buf_t + head_offset, lane, lane_offset,
                                     K, CH, PAD, per_copy, STAGE, PIECE, G)
                    if cutlass.const_expr(OP == OP_SLOTS):
                        token_slot = Int64(state_indices[i_n, t])
                        if token_slot >= 0:
                            _store_state(S, gamma[t], share, warp_block, pool, token_slot * stride_pool + head_offset,
                                         lane, lane_offset, K, CH, PAD, per_copy, STAGE, PIECE, G)

        if cutlass.const_expr(OP == OP_DECODE or OP == OP_COMMIT):
            if count > 0:
                _store_state(S, _pick(gamma, count - 1), share, warp_block, pool, block, lane, lane_offset,
                             K, CH, PAD, per_copy, STAGE, PIECE, G)
    else:
        # padding: zero outputs (and zero saved u), no state traffic
        if lane < COLS:
            for t in cutlass.range_constexpr(T):
                if cutlass.const_expr(WITH_Q):
                    o[i_n, t, i_hv, v0 + lane] = Float32(0.0).to(o.element_type)
                if cutlass.const_expr(OP == OP_DEFERRED and SAVED_U):
                    saved_u[i_n, t, i_hv, v0 + lane] = Float32(0.0)


@cute.jit
def _launch(
    q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, g_ptr: cute.Pointer, beta_ptr: cute.Pointer,
    o_ptr: cute.Pointer, u_ptr: cute.Pointer, A_log_ptr: cute.Pointer, dt_bias_ptr: cute.Pointer,
    pool_ptr: cute.Pointer, buffer_ptr: cute.Pointer, indices_ptr: cute.Pointer, accepted_ptr: cute.Pointer,
    rows_ptr: cute.Pointer, pending_k_ptr: cute.Pointer, pending_g_ptr: cute.Pointer, pending_u_ptr: cute.Pointer,
    N: Int32, num_columns: Int32,
    sq_n: Int64, sq_t: Int64, sq_h: Int64, sk_n: Int64, sk_t: Int64, sk_h: Int64,
    sv_n: Int64, sv_t: Int64, sv_h: Int64, sg_n: Int64, sg_t: Int64, sg_h: Int64,
    sb_n: Int64, sb_t: Int64, sb_h: Int64, so_n: Int64, so_t: Int64, so_h: Int64,
    su_n: Int64, su_t: Int64, su_h: Int64, si_n: Int64, si_t: Int64,
    stride_pool: Int64, stride_buf_r: Int64, stride_buf_t: Int64,
    spk_n: Int64, spk_t: Int64, spk_h: Int64, spg_n: Int64, spg_t: Int64, spg_h: Int64,
    spu_n: Int64, spu_t: Int64, spu_h: Int64, scale: Float32, lower_bound: Float32,
    stream: cuda.CUstream,
    T: cutlass.Constexpr[int], TP: cutlass.Constexpr[int], H: cutlass.Constexpr[int], HV: cutlass.Constexpr[int],
    K: cutlass.Constexpr[int], V: cutlass.Constexpr[int], R: cutlass.Constexpr[int], G: cutlass.Constexpr[int],
    OP: cutlass.Constexpr[int], FAMILY: cutlass.Constexpr[int], GATE: cutlass.Constexpr[int],
    HAS_DT_BIAS: cutlass.Constexpr[bool], QK_L2NORM: cutlass.Constexpr[bool], BETA_LOGITS: cutlass.Constexpr[bool],
    SAVED_U: cutlass.Constexpr[bool], VECTOR_POOL: cutlass.Constexpr[bool], WARPS: cutlass.Constexpr[int],
    STAGE: cutlass.Constexpr[bool], TENSOR_CORES: cutlass.Constexpr[bool], MIN_CTAS: cutlass.Constexpr[int],
):
    """Views of the raw pointers (per-token tensors as [N, T, heads, D], D's stride 1 or, for a
    per-head scalar, 0; the pending commit's as [N, TP, heads, D]) and the launch."""
    def view(ptr, n, t, h, heads, D, last, tokens=T):
        return cute.make_tensor(ptr, cute.make_layout((N, tokens, heads, D), stride=(n, t, h, last)))

    GK = K if FAMILY == KDA else 1  # the gate's channels
    q = view(q_ptr, sq_n, sq_t, sq_h, H, K, 1)
    k = view(k_ptr, sk_n, sk_t, sk_h, H, K, 1)
    v = view(v_ptr, sv_n, sv_t, sv_h, HV, V, 1)
    g = view(g_ptr, sg_n, sg_t, sg_h, HV, GK, 1 if FAMILY == KDA else 0)
    beta = view(beta_ptr, sb_n, sb_t, sb_h, HV, 1, 0)
    o = view(o_ptr, so_n, so_t, so_h, HV, V, 1)
    saved_u = view(u_ptr, su_n, su_t, su_h, HV, V, 1)
    pending_tokens = max(TP, 1)  # (never read without a pending commit)
    pending_k = view(pending_k_ptr, spk_n, spk_t, spk_h, H, K, 1, pending_tokens)
    pending_g = view(pending_g_ptr, spg_n, spg_t, spg_h, HV, GK, 1 if FAMILY == KDA else 0, pending_tokens)
    pending_u = view(pending_u_ptr, spu_n, spu_t, spu_h, HV, V, 1, pending_tokens)
    A_log = cute.make_tensor(A_log_ptr, cute.make_layout((HV, 1), stride=(1, 0)))
    dt_bias = cute.make_tensor(dt_bias_ptr, cute.make_layout((HV, GK), stride=(GK, 1 if FAMILY == KDA else 0)))
    state_indices = cute.make_tensor(indices_ptr, cute.make_layout((N, num_columns), stride=(si_n, si_t)))
    num_accepted = cute.make_tensor(accepted_ptr, cute.make_layout((N,)))
    buffer_rows = cute.make_tensor(rows_ptr, cute.make_layout((N,)))
    columns_per_cta = R * (32 // G) * WARPS
    _recurrent_kernel(
        q, k, v, g, beta, o, saved_u, A_log, dt_bias, pending_k, pending_g, pending_u,
        pool_ptr, stride_pool, buffer_ptr, stride_buf_r, stride_buf_t,
        state_indices, num_accepted, buffer_rows, scale, lower_bound,
        T, TP, H, HV, K, V, R, G, OP, FAMILY, GATE, HAS_DT_BIAS, QK_L2NORM, BETA_LOGITS, SAVED_U, VECTOR_POOL, WARPS,
        STAGE, TENSOR_CORES,
    ).launch(grid=(N * HV * (V // columns_per_cta), 1, 1), block=(32 * WARPS, 1, 1), stream=stream,
             min_blocks_per_mp=MIN_CTAS)


# ------------------------------------------------------------------------------------------------
# host side (shape-only Python: safe inside CUDA-graph capture)

# the tensors behind ``_launch``'s pointer arguments, in order
_POINTERS = ("q", "k", "v", "g", "beta", "o", "saved_u", "A_log", "dt_bias", "pool", "buffer",
             "state_indices", "num_accepted", "buffer_rows", "pending_k", "pending_g", "pending_u")


def pointer(dtype: torch.dtype, address: int, vector: bool = False):
    """A CuTe DSL global-memory pointer of a torch dtype at ``address`` (0 for a tensor the kernel
    never reads), assumed 16-byte aligned when ``vector`` (16-byte accesses), else element aligned."""
    return make_ptr(DTYPES[dtype], address, AddressSpace.gmem, assumed_align=16 if vector else dtype.itemsize)


def compile_launcher(launcher, pointers: tuple, scalars: tuple, constexprs: dict) -> FastLaunch:
    """``launcher`` (a ``cute.jit`` function of pointer arguments, then scalars, then a stream)
    compiled for ``pointers`` ((torch dtype, 16-byte aligned) of each pointer argument), example
    ``scalars`` and ``constexprs``, called as ``launch(addresses, scalars, stream handle)``
    (``cute_launch.FastLaunch``; the DSL's own arguments are built here too, for its check)."""
    fake = [pointer(dtype, 1 << 20, vector) for dtype, vector in pointers]
    compiled = cute.compile(launcher, *fake, *scalars, make_fake_stream(), **constexprs)

    def dsl_args(addresses, scalars, stream):
        return [*(pointer(dtype, address, vector) for (dtype, vector), address in zip(pointers, addresses)),
                *scalars, cuda.CUstream(stream)]
    return FastLaunch(compiled, launcher, dsl_args)


def gate_kind(gate) -> int:
    """The GATE constexpr for a recipe's ``fused_gate``: GATE_NONE (None: prepared log decays),
    GATE_SAFE with a lower bound, else GATE_SOFTPLUS."""
    return GATE_NONE if gate is None else GATE_SAFE if gate.lower_bound is not None else GATE_SOFTPLUS


@functools.lru_cache(maxsize=None)
def _compiled(dtypes: tuple, constexprs: tuple) -> FastLaunch:
    """The compiled launcher for one configuration: ``dtypes`` of the ``_POINTERS`` (in order),
    ``constexprs`` the (name, value) pairs of ``_launch``'s compile-time arguments."""
    config = dict(constexprs)
    pointers = tuple((dtype, config["VECTOR_POOL"] and name in ("pool", "buffer"))
                     for name, dtype in zip(_POINTERS, dtypes))
    return compile_launcher(_launch, pointers, (1, 1, *(1,) * 35, 1.0, 0.0), config)


def launch_shape(op: str, N: int, HV: int, K: int, V: int, T: int, state_dtype: torch.dtype, family: str = "gdn",
                 commit_first: bool = False, tensor_cores: bool = False) -> tuple[int, int, int, bool, bool, int]:
    """(R, G, WARPS, STAGE, TENSOR_CORES, MIN_CTAS): a lane's state columns, the lanes sharing a
    column (each holds K / G of its channels), the warps of a CTA (R * 32 / G * WARPS columns per
    CTA, at most V), whether the state passes through shared memory (``_recurrent_kernel``),
    whether a deferred verify's dot products run on the tensor cores (``_tensor_core_dots``: R = G
    = 4; with ``commit_first``, the pending commit too: ``_tensor_core_commit``) where
    ``tensor_cores`` allows it, and the CTAs an SM must fit (ptxas caps the registers to fit them;
    0: no cap).

    Measured on an H200 (CUDA-graph replay, L2 flushed, K = V = 128, B = 64, T = 4, 2026-11-24;
    times in us for GDN / KDA / Lightning):
    - decode, float32 pool: R16 G32 W8 staged 75.1 / 76.4 / 138.7 (unstaged the same; R8 G32 W4
      76.1 / 77.9 / 150.0; one-warp CTAs R8 G32 W1 76.4 for GDN; R2 G4 W4 81.1); bfloat16: R8 G16
      W4 staged 42.1 for GDN (R16 G32 W8 46.6, R8 G32 W1 unstaged 41.6).
      Per layer of a 16-layer graph (2026-11-28, GDN, B = 64; the Triton decode dispatch runs: 38.5
      / 69.6): bfloat16 38.5-38.7 with R >= 4 at G = 16 or 32 (R4 G32 W4 42.9, R2 G16 W4 41.4);
      float32 R16 G32 W8 72.4, R8 G32 W4 staged 70.5, R4 G32 W4 staged 70.3.
    - deferred verify (WY form): R8 G16 W4 unstaged 54.9 / 59.4 / 86.7 float32 (staged 76.2 /
      81.0 / 128.2: 64 KB of shared memory per CTA cap the CTAs per SM), 46.4 for GDN bfloat16;
      R4 G8 W4 staged 63.5 / 68.5 / 101.0; R16 G32 W8 89.9 / 92.0 / 147.3. At B = 256 (GDN
      float32) R8 G16 W4 unstaged 182.0 against 212.9 for R4 G8 W4 staged. Two lanes per column
      (G = 32) pay for reductions, few (G = 4) for rereading k and q from shared memory.
    - commit, buffer and slots verify: float32 R8 G32 W4 staged (commit 79.0 / 82.0 / 154.7; R16
      G32 W8 85.9; buffer ~194-200 with every shape); bfloat16 R8 G16 W4 (commit 43.6 for GDN).
    - buffer / slots verify alone, bfloat16 (2026-11-27, B = 64 / 256, GDN, KDA, Lightning): R8
      G16 W4 staged: buffer 98.2 / 354.1, 113.6 / 412.3, 179.2 / 696.3; slots 102.2 / 403.4, 100.3 /
      409.9, 201.3 / 794.8. Unstaged: R4 G16 W4 buffer 94.2 / 350.0, 105.8 / 388.9; slots 98.5 /
      366.7, 98.8 / 371.4; R8 G16 W2 buffer 99.5 / 365.2, 99.5 / 362.6; slots 105.6 / 389.6, 98.4
      / 370.0; R8 G16 W4 buffer 106.4 / 387.2, 105.0 / 377.8, 180.0 / 693.7; slots 99.3 / 367.0,
      96.5 / 367.8, 183.7 / 712.0 (R16 G16 W4, R8 G16 W8, R8 G32 W4, R16 G32 W8 slower). Float32
      keeps R8 G32 W4 staged (unstaged the same, G16 shapes 15-40% slower).
    - a KDA deferred verify that commits a pending one first, bfloat16 pool (H100, 2026-11-25,
      B = 64, T = 4 after T = 4): R4 G8 W4 unstaged 80.1 us against 85.3 for R8 G16 W4 (W8 81.0,
      staged 90.8, others 99-110); with a float32 pool and for GDN R8 G16 W4 stays best (KDA
      122.6 against 125.3-149.0; GDN bfloat16 72.9 against 73.8-93.7).
    - the tensor-core deferred verify (bfloat16, T = 4 then a separate commit, B = 64 / 256, GDN):
      R4 G4 W4 75.4 / 251.4 us, W2 79.8 / 274.2, W1 85.7 / 310.1 (each CTA prepares the tokens
      again), R2 G4 W4 83.7 / 303.2, R2 G4 W8 83.2 / 289.3; with four CTAs an SM (128 registers)
      73.8 / 242.7, three 74.7 / 263.4. KDA with a pending commit: three CTAs 67.3 / 226.2, four
      118.2 / 429.6 (spills), uncapped 75.1 / 253.3; W2 90.4, W1 94.6 at B = 64.
    - with the pending commit on the tensor cores too (2026-11-27, T = 4 after T = 4, B = 64 /
      256, closed form on one warp): three CTAs an SM GDN 58.5 / 205.1, KDA 66.8 / 221.8 (58.9 /
      205.1 with KDA's closed form on all four warps); uncapped (194 and 213 registers, two CTAs)
      66.0 / 229.3, 70.2 / 239.5; four CTAs spill (a tf32 version: 91.4, 94.0 at B = 64).
    - a few sequences (fewer than 2048 heads): many small CTAs, state staged (its cp.async goes
      out right after the slot: one DRAM round trip less at B = 1); decode at B = 1 took 7.1 us
      with R2 G32 W4 against 7.5 with R1 (the first version of this kernel).
    """
    if tensor_cores and op == "deferred" and state_dtype == torch.bfloat16 and N * HV >= 2048 and K == 128 and V >= 32:
        # four CTAs an SM (128 registers); with a commit first near 200 uncapped (two CTAs), so
        # capped for three (at 128 it spills). K = 128 only: the heads measured and tested on a
        # GPU (the kernel takes K = 32 and 64 too, through ``shape``)
        return 4, 4, min(4, V // 32), False, True, 3 if commit_first else 4
    stage = True
    if N * HV < 2048:
        rows, lanes, warps = (1, 4, 4) if op == "deferred" else (2, 32, 4)
    elif op == "deferred":
        rows, lanes, warps, stage = 8, 16, 4, False
        if commit_first and family == "kda" and state_dtype != torch.float32:
            rows, lanes = 4, 8
    elif state_dtype != torch.float32:
        rows, lanes, warps = 8, 16, 4
        if op in ("buffer", "slots"):
            stage = False
            if family == "gdn":
                rows = 4
            elif family == "kda":
                warps = 2
    elif op == "decode":
        rows, lanes, warps = 16, 32, 8
    else:
        rows, lanes, warps = 8, 32, 4
    lanes = min(max(lanes, K // 64), K // 4)  # 4 to 64 channels of a column per lane
    while rows * (32 // lanes) * warps > V:
        if warps > 1:
            warps //= 2
        elif rows > 1:
            rows //= 2
        else:
            lanes *= 2
    rows = min(rows, lanes)  # a reduce-scatter of R sums needs R <= G lanes
    return rows, lanes, warps, stage, False, 0


def _vector_pool(*states: torch.Tensor | None) -> bool:
    """Whether every slot (and buffer entry) of these state tensors starts 16-byte aligned."""
    for x in states:
        if x is None:
            continue
        element = x.element_size()
        if x.data_ptr() % 16 or any((s * element) % 16 for s in x.stride()[:-3]):
            return False
    return True


def recurrent(recipe, q, k, v, g, beta, *, op, state_pool, state_indices, out=None, num_accepted_tokens=None,
              intermediate_states=None, intermediate_indices=None, saved_u=None, pending=None, shape=None):
    """Run the recipe's recurrence over T tokens of N sequences against the state pool.

    Arguments as for ``recurrent_triton.delta_rule_recurrent`` (Lightning: g is the decay [HV] and
    beta None); ``shape`` (R, G, WARPS, STAGE, TENSOR_CORES, MIN_CTAS) overrides ``launch_shape``
    (benchmark sweeps). K must be 32, 64, 128 or 256 and V a power of two from 16.

    ``pending`` (op "deferred" only): (k, g, u) of a previous deferred verify of TP tokens of the
    same N rows and slots, with the same recipe, committed before this verify in the same kernel
    (one read and one write of each state instead of a commit's read-modify-write and a verify's
    read). k [N, TP, H, K]; g as that verify's (Lightning: ignored, this call's decay is used); u
    its saved u (float32 [N, TP, HV, V]; Lightning: its v). ``num_accepted_tokens`` [N] then
    counts the pending tokens to commit (0..TP); the state each row's verify starts from is the
    committed one, as the pool holds it.
    """
    N, T, HV, V = v.shape
    H, K = k.shape[-2:]
    pending_k, pending_g, pending_u, TP = check_pending(op, pending, num_accepted_tokens, N, HV, V, recipe.delta_rule)
    check_protocol(op, state_pool=state_pool, state_indices=state_indices,
                   num_accepted_tokens=None if pending is not None else num_accepted_tokens,
                   intermediate_states=intermediate_states, intermediate_indices=intermediate_indices, T=T)
    check_saved_u(saved_u, op, (N, T, HV, V))
    family = FAMILIES.index(recipe.mode)
    gate = recipe.fused_gate
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    if family == KDA:
        g = unit_last(g)
    target = output_target(out)
    if family == LIGHTNING:
        g = g.contiguous()
        g_strides = (0, 0, 1)
    else:
        g_strides = strides3(g)
    A_log = None if gate is None else gate.A_log.contiguous()
    dt_bias = None if gate is None or gate.dt_bias is None else gate.dt_bias.contiguous()
    buffer = intermediate_states if op == "buffer" else None
    rows, lanes, warps, stage, tensor_cores, min_ctas = shape or launch_shape(
        op, N, HV, K, V, T, state_pool.dtype, family=recipe.mode, commit_first=TP > 0,
        tensor_cores=family != LIGHTNING and TP <= 8)
    if tensor_cores and ((rows, lanes, stage) != (4, 4, False) or op != "deferred" or family == LIGHTNING
                         or state_pool.dtype != torch.bfloat16 or K % 16 or K > 128 or TP > 8):
        raise ValueError("shape: the tensor-core deferred verify needs R = G = 4 unstaged, a delta rule, a bfloat16 "
                         f"pool, K a multiple of 16 up to 128 and at most 8 pending tokens; got {shape} for "
                         f"{recipe.mode}, {state_pool.dtype}, K = {K}, {TP} pending tokens")
    indices = state_indices if state_indices.dim() == 2 else state_indices[:, None]

    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, o=target, saved_u=saved_u, A_log=A_log, dt_bias=dt_bias,
                   pool=state_pool, buffer=buffer, state_indices=indices, num_accepted=num_accepted_tokens,
                   buffer_rows=intermediate_indices if op == "buffer" else None, pending_k=pending_k,
                   pending_g=pending_g if family != LIGHTNING else None, pending_u=pending_u)
    # an absent tensor is never read: a null pointer of a fixed dtype keeps the compile key small
    dtypes = tuple(torch.float32 if tensors[name] is None else tensors[name].dtype for name in _POINTERS)
    constexprs = (("T", T), ("TP", TP), ("H", H), ("HV", HV), ("K", K), ("V", V), ("R", rows), ("G", lanes),
                  ("OP", OPS.index(op)),
                  ("FAMILY", family),
                  ("GATE", gate_kind(gate)),
                  ("HAS_DT_BIAS", dt_bias is not None), ("QK_L2NORM", recipe.qk_l2norm),
                  ("BETA_LOGITS", recipe.beta_logits), ("SAVED_U", saved_u is not None),
                  ("VECTOR_POOL", _vector_pool(state_pool, buffer)), ("WARPS", warps),
                  ("STAGE", stage), ("TENSOR_CORES", tensor_cores), ("MIN_CTAS", min_ctas))
    compiled = _compiled(dtypes, constexprs)
    addresses = [0 if tensors[name] is None else tensors[name].data_ptr() for name in _POINTERS]
    buffer_strides = buffer.stride()[:2] if buffer is not None else (0, 0)
    scalars = [N, indices.shape[1],
               *strides3(q), *strides3(k), *strides3(v), *g_strides, *strides3(beta), *strides3(target),
               *strides3(saved_u), indices.stride(0), indices.stride(1),
               state_pool.stride(0), *buffer_strides,
               *strides3(pending_k), *(strides3(pending_g) if family != LIGHTNING else (0, 0, 0)),
               *strides3(pending_u),
               recipe.scale, gate.lower_bound if gate is not None and gate.lower_bound is not None else 0.0]
    with torch.cuda.device(v.device):
        compiled(addresses, scalars, torch.cuda.current_stream().cuda_stream)
    if target is not out:
        out.copy_(target)
    return out
