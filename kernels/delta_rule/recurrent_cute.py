"""Decode, MTP verify (three protocols) and commit in CuTe DSL for SM90: GDN, KDA and Lightning.

The math is that of the Triton kernels, token by token in float32 (``naive.py`` and
``kernels/lightning/naive.py`` are the oracles). Per value head ``hv`` (qk head ``hv // (HV // H)``):

    delta rule (GDN: scalar g_t, KDA: per-channel g_t):
        S = Diag(exp(g_t)) S;   u = beta_t * (v_t - S^T k_t);   S = S + k_t u^T;   o_t = scale * S^T q_t
    Lightning (constant log decay d_hv, no delta rule):
        S = exp(d_hv) S + k_t v_t^T;                                               o_t = scale * S^T q_t

with the call's ``Recipe`` fused into the loads (qk l2norm, the gate from the raw projection, beta's
sigmoid). One kernel serves the three families (constexpr ``FAMILY``) and every op of the pool
protocol (constexpr ``OP``; the table of what each op reads and writes is in
``recurrent_triton.py``). The deferred verify can save every token's u for its commit
(``saved_u``), which then applies ``S = Diag(exp(g_t)) S + k_t u_t^T`` without reductions.

Thread mapping. The state is K-last (``pool[slot, hv, v, :]`` is column v of S, K contiguous).
A warp owns R consecutive columns v of one (sequence, value head); its lane l owns channels
``l * K/32 .. (l + 1) * K/32 - 1`` of each, so one column is one coalesced row of the pool and a
lane's share is a single vector load (16 bytes for float32 and K = 128). A CTA is WARPS warps on
consecutive columns; the grid is (N * HV, V / (R * WARPS)). The R x K/32 floats stay in registers
for all T tokens: every state element is read once and written once per call.

Reductions. Each token reduces every column over K (``S^T k``, ``S^T q``): R sums, each spread
over the 32 lanes. A butterfly per column costs 5 R shuffles. Instead the R partial sums are
reduce-scattered (``_scatter_sum``): at each of log2(R) rounds a lane keeps half of its values and
adds its partner's copy of that half, one shuffle per kept value (R - 1 in all), then 5 - log2(R)
butterfly rounds finish a single value, the full sum of one column (``_writer_row``). The
output needs nothing more (that lane writes it); u is needed by every lane, R more shuffles
(``_all_sum``). For R = 8: 9 and 17 shuffles instead of 40.

Latency. Decode of a few sequences is a chain of dependent DRAM round trips: the slot index, the
state, the store. The token inputs (q, k, v, gate, beta) do not depend on the slot, so they are
loaded first (two tokens ahead) and token 0 is normalised before the branch on the slot; the
state is staged through shared memory by cp.async, issued as soon as the slot is known. (With a
plain register load ptxas placed the state load after the gate's arithmetic, i.e. after the
inputs had arrived: one more round trip, 1 us at B = 1 on an H200.)

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
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import AddressSpace, make_fake_stream, make_ptr
from cutlass.memory.smem import SmemAllocator
import cuda.bindings.driver as cuda

from ..common.pool_protocol import OPS, check_protocol, check_saved_u, output_target, strides3, unit_last

OP_DECODE, OP_BUFFER, OP_SLOTS, OP_DEFERRED, OP_COMMIT = range(len(OPS))
FAMILIES = ("gdn", "kda", "lightning")
GDN, KDA, LIGHTNING = range(len(FAMILIES))
GATE_NONE, GATE_SOFTPLUS, GATE_SAFE = range(3)  # prepared log decay; -A softplus(a + b); lb sigmoid(A (a + b))

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default: x above it is returned as is
DTYPES = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
          torch.int32: cutlass.Int32}


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
def _row_partials(S: cute.Tensor, x: list, R: cutlass.Constexpr[int], VEC: cutlass.Constexpr[int]) -> list:
    """This lane's part of every column's dot product with the K-vector x: R partial sums."""
    partial = []
    for r in cutlass.range_constexpr(R):
        acc = Float32(0.0)
        for c in cutlass.range_constexpr(VEC):
            acc = acc + S[r, c] * x[c]
        partial.append(acc)
    return partial


@cute.jit
def _scatter_sum(values: list, lane: Int32) -> Float32:
    """Reduce-scatter R = len(values) per-lane partial sums (R a power of two <= 32): returns the
    sum over all 32 lanes of ``values[row]``, row = ``_writer_row(lane, R)[1]``."""
    offset = 16
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


def _scattered_lane(row: int, R: int) -> int:
    """The lowest lane that holds column ``row``'s sum after ``_scatter_sum`` of R values: bit
    s of the lane (from 4 down) is bit log2(R) - 1 - (4 - s) of the row."""
    lane, offset, half = 0, 16, R // 2
    while half >= 1:
        if row & half:
            lane |= offset
        offset //= 2
        half //= 2
    return lane


@cute.jit
def _all_sum(values: list, lane: Int32) -> list:
    """The R column sums of ``_scatter_sum``, every one on every lane (R more shuffles)."""
    R = len(values)
    mine = _scatter_sum(values, lane)
    return [cute.arch.shuffle_sync(mine, _scattered_lane(r, R)) for r in range(R)]


@cute.jit
def _writer_row(lane: Int32, R: cutlass.Constexpr[int]):
    """(whether this lane writes a column sum after ``_scatter_sum``, which column)."""
    spread = 32 // R  # lanes holding each sum
    row = Int32(0)
    half = R // 2
    offset = 16
    while cutlass.const_expr(half >= 1):
        row = row + cutlass.select_((lane & offset) != 0, Int32(half), Int32(0))
        half = half // 2
        offset = offset // 2
    return lane % spread == 0, row


@cute.jit
def _pick(values: list, index: Int32) -> Float32:
    """values[index] for a runtime index (a select chain over the R registers)."""
    picked = values[0]
    for r in cutlass.range_constexpr(1, len(values)):
        picked = cutlass.select_(index == r, values[r], picked)
    return picked


@cute.jit
def _softplus(x: Float32) -> Float32:
    return cutlass.select_(x > SOFTPLUS_THRESHOLD, x,
                           cute.log(1.0 + cute.exp(cutlass.min(x, Float32(SOFTPLUS_THRESHOLD)), fastmath=True), fastmath=True))


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
def _token_inputs(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
                  saved_u: cute.Tensor, i_n: Int32, t: int, i_h: Int32, i_hv: Int32, c0: Int32, v0: Int32,
                  R: cutlass.Constexpr[int], VEC: cutlass.Constexpr[int], OP: cutlass.Constexpr[int],
                  FAMILY: cutlass.Constexpr[int], SAVED_U: cutlass.Constexpr[bool]):
    """One token's loads for this lane, in float32: (k [VEC], q [VEC] or [] for a commit,
    v [R] or the saved u [R], the gate input [VEC] (KDA) / [1] (GDN) / [], beta [1] or [])."""
    kk = [Float32(k[i_n, t, i_h, c0 + c]) for c in range(VEC)]
    qq = []
    if cutlass.const_expr(OP != OP_COMMIT):
        qq = [Float32(q[i_n, t, i_h, c0 + c]) for c in range(VEC)]
    if cutlass.const_expr(OP == OP_COMMIT and SAVED_U):
        vv = [Float32(saved_u[i_n, t, i_hv, v0 + r]) for r in range(R)]
    else:
        vv = [Float32(v[i_n, t, i_hv, v0 + r]) for r in range(R)]
    gg = []
    if cutlass.const_expr(FAMILY == KDA):
        gg = [Float32(g[i_n, t, i_hv, c0 + c]) for c in range(VEC)]
    if cutlass.const_expr(FAMILY == GDN):
        gg = [Float32(g[i_n, t, i_hv, 0])]
    bb = []
    if cutlass.const_expr(FAMILY != LIGHTNING and not (OP == OP_COMMIT and SAVED_U)):
        bb = [Float32(beta[i_n, t, i_hv, 0])]
    return kk, qq, vv, gg, bb


@cute.jit
def _prepare(inputs: tuple, A: Float32, bias: list, lower_bound: Float32, scale: Float32,
             OP: cutlass.Constexpr[int], FAMILY: cutlass.Constexpr[int], GATE: cutlass.Constexpr[int],
             QK_L2NORM: cutlass.Constexpr[bool], BETA_LOGITS: cutlass.Constexpr[bool]):
    """A token's ``_token_inputs`` made ready for the update, with no use of the state: (k [VEC]
    normalised, the decay factor(s) exp(g) [VEC] (KDA) or [1], beta, q [VEC] normalised and
    scaled or [] for a commit). Lightning's decay is the head's, exp(d_hv) = A."""
    k_raw, q_raw, v_raw, g_raw, b_raw = inputs
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


@cute.jit
def _state_view(ptr: cute.Pointer, offset: Int64, R: cutlass.Constexpr[int], VEC: cutlass.Constexpr[int],
                K: cutlass.Constexpr[int], VECTOR: cutlass.Constexpr[bool]) -> cute.Tensor:
    """A lane's [R, VEC] share of a state at element ``offset``: R columns, VEC channels each."""
    if cutlass.const_expr(VECTOR):
        offset = cute.assume(offset, divby=VEC)
    return cute.make_tensor(ptr + offset, cute.make_layout((R, VEC), stride=(K, 1)))


def _copy_units(x: cute.Tensor, per_copy: int) -> cute.Tensor:
    """An [R, VEC] share as ((per_copy), (VEC / per_copy, R)): a copy atom of ``per_copy``
    elements takes its vector in the first mode."""
    R, VEC = x.shape
    return cute.make_tensor(x.iterator, cute.make_layout(
        (per_copy, (VEC // per_copy, R)), stride=(1, (per_copy * x.stride[1], x.stride[0]))))


@cute.jit
def _store_state(state: cute.Tensor, dst: cute.Tensor):
    """The float32 register share ``state`` into ``dst`` (a ``_state_view``), in dst's dtype."""
    staged = cute.make_rmem_tensor(state.layout, dst.element_type)
    staged.store(state.load().to(dst.element_type))
    cute.autovec_copy(staged, dst)


# ------------------------------------------------------------------------------------------------
# the kernel


@cute.kernel
def _recurrent_kernel(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor, o: cute.Tensor,
    saved_u: cute.Tensor, A_log: cute.Tensor, dt_bias: cute.Tensor,
    pool: cute.Pointer, stride_pool: Int64, buffer: cute.Pointer, stride_buf_r: Int64, stride_buf_t: Int64,
    state_indices: cute.Tensor, num_accepted: cute.Tensor, buffer_rows: cute.Tensor,
    scale: Float32, lower_bound: Float32,
    T: cutlass.Constexpr[int], H: cutlass.Constexpr[int], HV: cutlass.Constexpr[int], K: cutlass.Constexpr[int],
    V: cutlass.Constexpr[int], R: cutlass.Constexpr[int], OP: cutlass.Constexpr[int],
    FAMILY: cutlass.Constexpr[int], GATE: cutlass.Constexpr[int], HAS_DT_BIAS: cutlass.Constexpr[bool],
    QK_L2NORM: cutlass.Constexpr[bool], BETA_LOGITS: cutlass.Constexpr[bool], SAVED_U: cutlass.Constexpr[bool],
    VECTOR_POOL: cutlass.Constexpr[bool], WARPS: cutlass.Constexpr[int],
):
    VEC = K // 32
    DELTA = FAMILY != LIGHTNING
    lane = cute.arch.thread_idx()[0] % 32
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    i_nh, i_vt, _ = cute.arch.block_idx()
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    v0 = (i_vt * WARPS + warp) * R  # first of this warp's R columns
    c0 = lane * VEC  # first of this lane's channels
    writes, writer_row = _writer_row(lane, R)

    # Every token's inputs are independent of the state: their loads are issued first (up to
    # PREFETCH tokens ahead), so that their latency overlaps the slot and state loads instead of
    # following them (decode at B = 1 is one chain of dependent DRAM round trips).
    PREFETCH = 2
    ahead = [_token_inputs(q, k, v, g, beta, saved_u, i_n, t, i_h, i_hv, c0, v0, R, VEC, OP, FAMILY, SAVED_U)
             for t in range(min(T, PREFETCH))]
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
    head_offset = Int64((i_hv * V + v0) * K + c0)
    # Token 0 is prepared (norms, gate) before the branch on the slot: its loads are then issued
    # with the slot's, not sunk into the branch behind the state load.
    token0 = _prepare(ahead[0], A, bias, lower_bound, scale, OP, FAMILY, GATE, QK_L2NORM, BETA_LOGITS)

    if slot >= 0:
        # The state goes through shared memory by cp.async: issued as soon as the slot is known
        # and awaited only when the first token needs it. A plain load into registers was
        # scheduled by ptxas after the gate's arithmetic, which waits for the token's inputs:
        # two DRAM round trips in a row instead of one.
        src = _state_view(pool, slot * stride_pool + head_offset, R, VEC, K, VECTOR_POOL)
        staged = SmemAllocator().allocate_tensor(
            src.element_type, cute.make_layout((WARPS, 32, R, VEC), stride=(R * 32 * VEC, VEC, 32 * VEC, 1)), 16)
        mine = staged[warp, lane, None, None]
        per_copy = VEC if VECTOR_POOL else 1
        bits = src.element_type.width * per_copy
        # 16-byte copies may skip L1 (.cg): the state is streamed, never reread
        cache = cpasync.LoadCacheMode.GLOBAL if bits == 128 else cpasync.LoadCacheMode.ALWAYS
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cache), src.element_type, num_bits_per_copy=bits)
        cute.copy(atom, _copy_units(src, per_copy), _copy_units(mine, per_copy))
        cute.arch.cp_async_commit_group()

        buffer_row = Int64(0)
        if cutlass.const_expr(OP == OP_BUFFER):
            buffer_row = Int64(buffer_rows[i_n])

        cute.arch.cp_async_wait_group(0)
        loaded = cute.make_rmem_tensor(src.layout, src.element_type)
        cute.autovec_copy(mine, loaded)
        S = cute.make_rmem_tensor(loaded.layout, Float32)
        S.store(loaded.load().to(Float32))
        queue = list(ahead)
        for t in cutlass.range_constexpr(T):
            v_raw = queue[t][2]
            if cutlass.const_expr(t + PREFETCH < T):
                queue.append(_token_inputs(q, k, v, g, beta, saved_u, i_n, t + PREFETCH, i_h, i_hv, c0, v0, R, VEC,
                                           OP, FAMILY, SAVED_U))
            if t < count:
                kt, decay, b, qt = token0
                if cutlass.const_expr(t > 0):
                    kt, decay, b, qt = _prepare(queue[t], A, bias, lower_bound, scale, OP, FAMILY, GATE, QK_L2NORM,
                                                BETA_LOGITS)
                for r in cutlass.range_constexpr(R):
                    for c in cutlass.range_constexpr(VEC):
                        S[r, c] = S[r, c] * decay[c % len(decay)]
                # u: what the token writes into each column (v itself for Lightning, the saved u
                # for a commit that has it)
                u = v_raw
                if cutlass.const_expr(DELTA and not (OP == OP_COMMIT and SAVED_U)):
                    predicted = _all_sum(_row_partials(S, kt, R, VEC), lane)
                    u = [b * (v_raw[r] - predicted[r]) for r in range(R)]
                    if cutlass.const_expr(OP == OP_DEFERRED and SAVED_U):
                        if lane < R:
                            saved_u[i_n, t, i_hv, v0 + lane] = _pick(u, lane)
                for r in cutlass.range_constexpr(R):
                    for c in cutlass.range_constexpr(VEC):
                        S[r, c] = S[r, c] + u[r] * kt[c]
                # output
                if cutlass.const_expr(OP != OP_COMMIT):
                    total = _scatter_sum(_row_partials(S, qt, R, VEC), lane)
                    if writes:
                        o[i_n, t, i_hv, v0 + writer_row] = total.to(o.element_type)
                # states the protocol keeps per token
                if cutlass.const_expr(OP == OP_BUFFER):
                    _store_state(S, _state_view(buffer, buffer_row * stride_buf_r + t * stride_buf_t + head_offset,
                                                R, VEC, K, VECTOR_POOL))
                if cutlass.const_expr(OP == OP_SLOTS):
                    token_slot = Int64(state_indices[i_n, t])
                    if token_slot >= 0:
                        _store_state(S, _state_view(pool, token_slot * stride_pool + head_offset, R, VEC, K,
                                                    VECTOR_POOL))

        if cutlass.const_expr(OP == OP_DECODE or OP == OP_COMMIT):
            if count > 0:
                _store_state(S, src)
    else:
        # padding: zero outputs (and zero saved u), no state traffic
        if lane < R:
            for t in cutlass.range_constexpr(T):
                if cutlass.const_expr(OP != OP_COMMIT):
                    o[i_n, t, i_hv, v0 + lane] = Float32(0.0).to(o.element_type)
                if cutlass.const_expr(OP == OP_DEFERRED and SAVED_U):
                    saved_u[i_n, t, i_hv, v0 + lane] = Float32(0.0)


@cute.jit
def _launch(
    q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, g_ptr: cute.Pointer, beta_ptr: cute.Pointer,
    o_ptr: cute.Pointer, u_ptr: cute.Pointer, A_log_ptr: cute.Pointer, dt_bias_ptr: cute.Pointer,
    pool_ptr: cute.Pointer, buffer_ptr: cute.Pointer, indices_ptr: cute.Pointer, accepted_ptr: cute.Pointer,
    rows_ptr: cute.Pointer, N: Int32, num_columns: Int32,
    sq_n: Int64, sq_t: Int64, sq_h: Int64, sk_n: Int64, sk_t: Int64, sk_h: Int64,
    sv_n: Int64, sv_t: Int64, sv_h: Int64, sg_n: Int64, sg_t: Int64, sg_h: Int64,
    sb_n: Int64, sb_t: Int64, sb_h: Int64, so_n: Int64, so_t: Int64, so_h: Int64,
    su_n: Int64, su_t: Int64, su_h: Int64, si_n: Int64, si_t: Int64,
    stride_pool: Int64, stride_buf_r: Int64, stride_buf_t: Int64, scale: Float32, lower_bound: Float32,
    stream: cuda.CUstream,
    T: cutlass.Constexpr[int], H: cutlass.Constexpr[int], HV: cutlass.Constexpr[int], K: cutlass.Constexpr[int],
    V: cutlass.Constexpr[int], R: cutlass.Constexpr[int], OP: cutlass.Constexpr[int],
    FAMILY: cutlass.Constexpr[int], GATE: cutlass.Constexpr[int], HAS_DT_BIAS: cutlass.Constexpr[bool],
    QK_L2NORM: cutlass.Constexpr[bool], BETA_LOGITS: cutlass.Constexpr[bool], SAVED_U: cutlass.Constexpr[bool],
    VECTOR_POOL: cutlass.Constexpr[bool], WARPS: cutlass.Constexpr[int],
):
    """Views of the raw pointers (per-token tensors as [N, T, heads, D], D's stride 1 or, for a
    per-head scalar, 0) and the launch."""
    def view(ptr, n, t, h, heads, D, last):
        return cute.make_tensor(ptr, cute.make_layout((N, T, heads, D), stride=(n, t, h, last)))

    GK = K if FAMILY == KDA else 1  # the gate's channels
    q = view(q_ptr, sq_n, sq_t, sq_h, H, K, 1)
    k = view(k_ptr, sk_n, sk_t, sk_h, H, K, 1)
    v = view(v_ptr, sv_n, sv_t, sv_h, HV, V, 1)
    g = view(g_ptr, sg_n, sg_t, sg_h, HV, GK, 1 if FAMILY == KDA else 0)
    beta = view(beta_ptr, sb_n, sb_t, sb_h, HV, 1, 0)
    o = view(o_ptr, so_n, so_t, so_h, HV, V, 1)
    saved_u = view(u_ptr, su_n, su_t, su_h, HV, V, 1)
    A_log = cute.make_tensor(A_log_ptr, cute.make_layout((HV, 1), stride=(1, 0)))
    dt_bias = cute.make_tensor(dt_bias_ptr, cute.make_layout((HV, GK), stride=(GK, 1 if FAMILY == KDA else 0)))
    state_indices = cute.make_tensor(indices_ptr, cute.make_layout((N, num_columns), stride=(si_n, si_t)))
    num_accepted = cute.make_tensor(accepted_ptr, cute.make_layout((N,)))
    buffer_rows = cute.make_tensor(rows_ptr, cute.make_layout((N,)))
    _recurrent_kernel(
        q, k, v, g, beta, o, saved_u, A_log, dt_bias, pool_ptr, stride_pool, buffer_ptr, stride_buf_r, stride_buf_t,
        state_indices, num_accepted, buffer_rows, scale, lower_bound,
        T, H, HV, K, V, R, OP, FAMILY, GATE, HAS_DT_BIAS, QK_L2NORM, BETA_LOGITS, SAVED_U, VECTOR_POOL, WARPS,
    ).launch(grid=(N * HV, V // (R * WARPS), 1), block=(32 * WARPS, 1, 1), stream=stream)


# ------------------------------------------------------------------------------------------------
# host side (shape-only Python: safe inside CUDA-graph capture)

# the tensors behind ``_launch``'s pointer arguments, in order
_POINTERS = ("q", "k", "v", "g", "beta", "o", "saved_u", "A_log", "dt_bias", "pool", "buffer",
             "state_indices", "num_accepted", "buffer_rows")


def _pointer(dtype: torch.dtype, address: int, vector: bool = False):
    element = dtype.itemsize
    return make_ptr(DTYPES[dtype], address, AddressSpace.gmem, assumed_align=16 if vector else element)


@functools.lru_cache(maxsize=None)
def _compiled(dtypes: tuple, constexprs: tuple):
    """The compiled launcher for one configuration: ``dtypes`` of the ``_POINTERS`` (in order),
    ``constexprs`` the (name, value) pairs of ``_launch``'s compile-time arguments."""
    config = dict(constexprs)
    vector = config["VECTOR_POOL"]
    fake = [_pointer(dt, 1 << 20, vector and name in ("pool", "buffer")) for name, dt in zip(_POINTERS, dtypes)]
    scalars = [1, 1] + [1] * 26 + [1.0, 0.0]
    return cute.compile(_launch, *fake, *scalars, make_fake_stream(), **config)


def launch_shape(N: int, HV: int, V: int, T: int, state_dtype: torch.dtype) -> tuple[int, int]:
    """(R, WARPS): the state columns a warp owns and the warps of a CTA (R * WARPS <= V).

    Measured on an H200 (GDN 16/32 heads, CUDA-graph replay, L2 flushed), decode:
    float32 pool at B = 256: R16 W8 3.94 TB/s against R8 W4 3.71 (B = 64: 3.64 against 3.48);
    bfloat16 pool: R16 W4 best at B = 256 (3.51), R8 W2 at B = 64 (3.18; R16 W8 2.72); a few
    sequences: R2 W4 (B = 1: 7.1 us against 7.5 with R1). A verify (T > 1) keeps R8 W4 for its
    registers (R x K / 32 floats of state per lane for all T tokens)."""
    heads = N * HV
    if T > 1:
        rows, warps = (8, 4) if heads * V // 8 >= 16384 else (2, 4)
    elif heads < 2048:
        rows, warps = 2, 4
    elif state_dtype == torch.float32:
        rows, warps = 16, 8
    else:
        rows, warps = (16, 4) if heads >= 8192 else (8, 2)
    while rows * warps > V:
        if rows > 1:
            rows //= 2
        else:
            warps //= 2
    return rows, warps


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
              intermediate_states=None, intermediate_indices=None, saved_u=None, rows=None, warps=None):
    """Run the recipe's recurrence over T tokens of N sequences against the state pool.

    Arguments as for ``recurrent_triton.delta_rule_recurrent`` (Lightning: g is the decay [HV] and
    beta None); ``rows`` and ``warps`` override ``launch_shape`` (benchmark sweeps). K must be
    32, 64, 128 or 256 and V a power of two from 16 (``launch_shape`` keeps R * WARPS <= V).
    """
    N, T, HV, V = v.shape
    H, K = k.shape[-2:]
    check_protocol(op, state_pool=state_pool, state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
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
    default_rows, default_warps = launch_shape(N, HV, V, T, state_pool.dtype)
    rows, warps = rows or default_rows, warps or default_warps
    indices = state_indices if state_indices.dim() == 2 else state_indices[:, None]

    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, o=target, saved_u=saved_u, A_log=A_log, dt_bias=dt_bias,
                   pool=state_pool, buffer=buffer, state_indices=indices, num_accepted=num_accepted_tokens,
                   buffer_rows=intermediate_indices if op == "buffer" else None)
    # an absent tensor is never read: a null pointer of a fixed dtype keeps the compile key small
    dtypes = tuple(torch.float32 if tensors[name] is None else tensors[name].dtype for name in _POINTERS)
    constexprs = (("T", T), ("H", H), ("HV", HV), ("K", K), ("V", V), ("R", rows), ("OP", OPS.index(op)),
                  ("FAMILY", family),
                  ("GATE", GATE_NONE if gate is None else GATE_SAFE if gate.lower_bound is not None else GATE_SOFTPLUS),
                  ("HAS_DT_BIAS", dt_bias is not None), ("QK_L2NORM", recipe.qk_l2norm),
                  ("BETA_LOGITS", recipe.beta_logits), ("SAVED_U", saved_u is not None),
                  ("VECTOR_POOL", _vector_pool(state_pool, buffer)), ("WARPS", warps))
    compiled = _compiled(dtypes, constexprs)
    vector = dict(constexprs)["VECTOR_POOL"]
    pointers = [_pointer(dt, 0 if tensors[name] is None else tensors[name].data_ptr(),
                         vector and name in ("pool", "buffer")) for name, dt in zip(_POINTERS, dtypes)]
    buffer_strides = buffer.stride()[:2] if buffer is not None else (0, 0)
    with torch.cuda.device(v.device):
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        compiled(*pointers, N, indices.shape[1],
                 *strides3(q), *strides3(k), *strides3(v), *g_strides, *strides3(beta), *strides3(target),
                 *strides3(saved_u), indices.stride(0), indices.stride(1),
                 state_pool.stride(0), *buffer_strides,
                 recipe.scale, gate.lower_bound if gate is not None and gate.lower_bound is not None else 0.0,
                 stream)
    if target is not out:
        out.copy_(target)
    return out
