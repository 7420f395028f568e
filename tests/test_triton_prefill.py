"""The triton backend's chunked prefill (GDN, KDA, Lightning) under Triton's interpreter, against
the float64 oracle: lengths 0, 1, 63, 64, 65 and a few hundred in one varlen batch, many short
sequences, GVA and MHA heads, several V tiles, permuted and padded (NaN-poisoned) slots,
has_initial_state mixes, both pool dtypes, fp16 / bf16 / fp32 inputs, checkpoints, every fused
gate, strided inputs and pools, no pool at all, and gates strong enough to overflow a naive
exp(-G). Shapes are small: the interpreter runs each program in Python."""
import os

import pytest
import torch

# The interpreter is chosen when the kernels are defined, so this must come before triton and the
# kernel modules are imported. Only without a GPU: on a GPU machine the same pytest process may
# run tests/gpu, whose kernels must be compiled, not interpreted (there this module skips).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from cula_serve.kernels.backends import triton_backend  # noqa: E402
from cula_serve.kernels.common.varlen import chunk_indices  # noqa: E402
from cula_serve.kernels.delta_rule import chunk_triton  # noqa: E402
from cula_serve.kernels.delta_rule.chunk_triton import FACTOR_SPAN, _diag_block, _dot, _split_diag_block  # noqa: E402
from cula_serve.inputs import relative_error  # noqa: E402

from conftest import (ORACLE, PREFILL, assert_close, assert_same_writes, gpu_faithful_interpreter,  # noqa: E402
                      lightning_strided_views, prefill_and_oracle, prefill_call, random_inputs, to_float64, tolerance)

if triton_backend.availability(torch.device("cpu")):
    pytest.skip("the triton backend needs TRITON_INTERPRET=1 on the CPU (set before triton was imported)",
                allow_module_level=True)

TRITON = dict(backend="triton")
MODES = ["gdn", "kda", "lightning"]
GVA = dict(H=2, HV=4, K=32, V=32)
MHA = dict(H=2, HV=2, K=32, V=128)  # two V tiles of 64 in the state pass
# one varlen batch: 65, 1, (padding), 63, 64, 200 tokens; permuted slots, row 2 is padding
LENS = [65, 1, 7, 63, 64, 200]
SLOTS = [5, 0, -1, 7, 2, 3]
HAS_INIT = [True, False, True, True, False, True]
POOL_SIZE = 10


# ------------------------------------------------------------------------------------------------
# the interpreter, made to compute what the GPU computes


@pytest.fixture(scope="module", autouse=True)
def _faithful_interpreter():
    """This module's kernels run in ``conftest.gpu_faithful_interpreter``."""
    with gpu_faithful_interpreter():
        yield


# ------------------------------------------------------------------------------------------------
# helpers


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _run_both(mode, kw, pool, segment_tokens=None, out=None, **call):
    """``prefill_and_oracle`` on the triton backend (``segment_tokens`` goes to its call alone)."""
    return prefill_and_oracle(mode, kw, pool, dict(TRITON, segment_tokens=segment_tokens), out=out, **call)


def _pool(shape, dtype, live_slots, generator, size=POOL_SIZE):
    """NaN everywhere but ``live_slots``, which hold random states."""
    pool = torch.full((size, shape["HV"], shape["V"], shape["K"]), float("nan"), dtype=dtype)
    for slot in live_slots:
        pool[slot] = (0.5 * torch.randn(shape["HV"], shape["V"], shape["K"], generator=generator)).to(dtype)
    return pool


def _varlen_case(generator, shape=GVA, lens=LENS, slots=SLOTS, has_init=HAS_INIT, state_dtype=torch.float32):
    """(pool, call keywords): slots whose sequence starts from zeros hold NaN, so that reading
    them would show."""
    live = [s for s, h in zip(slots, has_init) if s >= 0 and h]
    pool = _pool(shape, state_dtype, live, generator)
    call = dict(cu_seqlens=_cu(lens), state_indices=torch.tensor(slots, dtype=torch.int32),
                has_initial_state=torch.tensor(has_init))
    return pool, call


# ------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_dtype,state_dtype", [
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)],
    ids=["bf16-fp32pool", "bf16-bf16pool", "fp32"])
def test_varlen_batch_matches_oracle(mode, input_dtype, state_dtype, generator):
    """Lengths 65, 1, 63, 64, 200 and a padding row in one packed batch; GVA heads; permuted
    slots; sequences without an initial state start from NaN slots; unused slots stay NaN."""
    kw = random_inputs(mode, (sum(LENS),), **GVA, dtype=input_dtype, generator=generator)
    pool, call = _varlen_case(generator, state_dtype=state_dtype)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **call)
    tol = tolerance(input_dtype, state_dtype)
    assert_close(o, ref_o, tol)
    pad = slice(sum(LENS[:2]), sum(LENS[:3]))
    assert (o[pad] == 0).all()
    assert_same_writes(pool, ref_pool, tol)


@pytest.mark.parametrize("mode", MODES)
def test_v_tiles_mha_fp16(mode, generator):
    """V = 128 (two V tiles in the state pass) with one value head per qk head, fp16 inputs."""
    lens, slots, has_init = [70, 64], [1, 0], [True, True]
    kw = random_inputs(mode, (sum(lens),), **MHA, dtype=torch.float16, generator=generator)
    pool, call = _varlen_case(generator, MHA, lens, slots, has_init)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **call)
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
def test_head_dim_256(mode, input_dtype, generator):
    """K = 256 (the largest head dim): the sequential kernels' narrowest V tiles
    (``sequential_config``)."""
    shape = dict(H=1, HV=1, K=256, V=64)
    lens, slots, has_init = [70, 1], [1, 0], [True, False]
    kw = random_inputs(mode, (sum(lens),), **shape, dtype=input_dtype, generator=generator)
    pool, call = _varlen_case(generator, shape, lens, slots, has_init)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **call)
    tol = tolerance(input_dtype, torch.float32)
    assert_close(o, ref_o, tol)
    assert_same_writes(pool, ref_pool, tol)


@pytest.mark.parametrize("mode", MODES)
def test_many_short_sequences(mode, generator):
    """24 sequences of 0 to 9 tokens (empty ones included: their slot gets the initial state, or
    zeros), float32 end to end."""
    lens = torch.randint(0, 10, (24,), generator=generator).tolist()
    lens[3] = 0
    slots = torch.randperm(POOL_SIZE * 3, generator=generator)[:24].tolist()
    has_init = (torch.rand(24, generator=generator) < 0.7).tolist()
    shape = dict(H=2, HV=2, K=32, V=32)
    kw = random_inputs(mode, (sum(lens),), **shape, dtype=torch.float32, generator=generator)
    live = [s for s, h in zip(slots, has_init) if h]
    pool = _pool(shape, torch.float32, live, generator, size=POOL_SIZE * 3)
    call = dict(cu_seqlens=_cu(lens), state_indices=torch.tensor(slots, dtype=torch.int32),
                has_initial_state=torch.tensor(has_init))
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **call)
    assert_close(o, ref_o, 1e-5)
    assert_same_writes(pool, ref_pool, 1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("every", [64, 128])
def test_checkpoints(mode, every, generator):
    """The state after each multiple of ``every`` tokens goes to its checkpoint slot; -1 entries,
    entries past the sequence's end and the padding row's entries write nothing."""
    lens, slots, has_init = [200, 129, 64, 40], [0, 1, -1, 2], [True, False, True, True]
    shape = dict(H=1, HV=2, K=32, V=32)
    ckpt = torch.tensor([[3, -1, 4, 9], [5, 6, 11, 12], [13, 14, 15, 16], [7, 8, -1, -1]], dtype=torch.int32)
    kw = random_inputs(mode, (sum(lens),), **shape, dtype=torch.float32, generator=generator)
    pool, call = _varlen_case(generator, shape, lens, slots, has_init)
    pool = torch.cat([pool, torch.full((7, *pool.shape[1:]), float("nan"))])  # room for slots 10..16
    o, ref_o, ref_pool = _run_both(mode, kw, pool, checkpoint_every=every, checkpoint_indices=ckpt, **call)
    assert_close(o, ref_o, 1e-5)
    assert_same_writes(pool, ref_pool, 1e-5)
    written = {3, 4, 5, 6} if every == 64 else {3, 5}
    assert all(not torch.isnan(pool[s]).any() for s in written)


@pytest.mark.parametrize("mode,gate", [
    ("gdn", "prepared"), ("gdn", "fused_no_bias"), ("kda", "prepared"), ("kda", "fused_no_bias"),
    ("kda", "safe"), ("kda", "safe_no_bias"), ("lightning", "l2norm")])
def test_gate_variants(mode, gate, generator):
    """Every gate recipe (the fused gate with dt_bias runs in the tests above), float32 end to end."""
    lens, slots, has_init = [70, 33], [1, 0], [True, False]
    shape = dict(H=1, HV=2, K=32, V=32)
    kw = random_inputs(mode, (sum(lens),), **shape, dtype=torch.float32, fused_gate=gate != "prepared",
                       generator=generator)
    if gate.endswith("no_bias"):
        kw["dt_bias"] = None
    if gate.startswith("safe"):
        kw["lower_bound"] = -5.0
    if gate == "l2norm":
        kw["use_qk_l2norm_in_kernel"] = True
    pool, call = _varlen_case(generator, shape, lens, slots, has_init)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **call)
    assert_close(o, ref_o, 1e-5)
    assert_same_writes(pool, ref_pool, 1e-5)


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_strong_decays_stay_finite_and_exact(mode, input_dtype, generator, monkeypatch):
    """Gates near -100 per token: a chunk's cumulative gate reaches the thousands, so exp(-G)
    would overflow float32 many times over; mixed with tokens of almost no decay, so float32
    differences of cumulative sums would lose the small ones. Float32 stays within 1e-5; bf16
    inputs (KDA's decays then come from differences of the chunk's G) within their tolerance.
    KDA's channels 16 to 31 decay weakly, and its exact diagonal blocks go in pieces of 16
    channels, which then split their pairs at different block sizes."""
    lens, slots = [130, 64], [0, 1]
    shape = dict(H=1, HV=2, K=32, V=32)
    kw = random_inputs(mode, (sum(lens),), **shape, dtype=input_dtype, generator=generator)
    kw["A_log"] = torch.tensor([4.0, 1.0])  # A = e^4 ~ 55: g = -55 softplus(.) reaches -100s
    if mode == "kda":
        kw["dt_bias"][:, 16:] -= 8.0  # softplus(a - 8) ~ e^(a - 8): a few hundredths per token
        monkeypatch.setattr(chunk_triton, "EXACT_DIAG_TILE", 16)
    pool, call = _varlen_case(generator, shape, lens, slots, [True, True])
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **call)
    assert torch.isfinite(o).all()
    tol = 1e-5 if input_dtype == torch.float32 else tolerance(input_dtype, torch.float32)
    assert_close(o, ref_o, tol)
    assert_same_writes(pool, ref_pool, tol)


@triton.jit
def _split_diag_block_kernel(q_ptr, k_ptr, l_ptr, A_ptr, P_ptr, BK: tl.constexpr, FACTOR_SPAN: tl.constexpr):
    rows = tl.arange(0, 16)
    tile = rows[:, None] * BK + tl.arange(0, BK)[None, :]
    ones = tl.full([16], 1.0, tl.float32)
    zeros = tl.zeros([16, 16], dtype=tl.float32)
    A, P = _diag_block(*_split_diag_block(tl.load(q_ptr + tile), tl.load(k_ptr + tile), ones, ones,
                                          tl.load(l_ptr + tile), zeros, zeros, "ieee", "ieee", FACTOR_SPAN))
    block = rows[:, None] * 16 + rows[None, :]
    tl.store(A_ptr + block, A)
    tl.store(P_ptr + block, P)


@pytest.mark.parametrize("gate", [0.5, 8.0, 15.0, 30.0, 200.0])
def test_split_diag_block_exact_at_every_span(gate, generator):
    """KDA's exact diagonal 16 x 16 block (for sub-chunks whose gates span FACTOR_SPAN or more)
    against float64 pairwise decays, with per-token gates of mean ``gate``: the halving stops at
    blocks of 8 rows (0.5), 4 (8), 2 (15, 30) or single rows (200). Entries whose decay underflows
    must come out (near) zero, not NaN or inf from e^+G."""
    K = 32
    l = (-2 * gate * torch.rand(16, K, generator=generator)).cumsum(0)
    q, k = torch.randn(16, K, generator=generator), torch.randn(16, K, generator=generator)
    A, P = torch.empty(16, 16), torch.empty(16, 16)
    _split_diag_block_kernel[(1,)](q, k, l, A, P, K, FACTOR_SPAN)
    decay = torch.exp((l.double()[:, None] - l.double()[None, :]).clamp(max=0))
    ref_A = torch.einsum("tk,sk,tsk->ts", k.double(), k.double(), decay).tril(-1)
    ref_P = torch.einsum("tk,sk,tsk->ts", q.double(), k.double(), decay).tril()
    assert (A.double() - ref_A).abs().max() < 1e-5
    assert (P.double() - ref_P).abs().max() < 1e-5


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr, PREC: tl.constexpr):
    offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(c_ptr + offs, _dot(tl.load(a_ptr + offs), tl.load(b_ptr + offs), PREC))


@pytest.mark.parametrize("split", ["a", "b"])
def test_dot_bf16x2_keeps_16_bits(split, generator):
    """``_dot(a, b, "bf16x2")``, one operand a bf16 tile and the other float32 (either side):
    the float32 operand keeps ~16 bits (error ~1e-5), where tf32 keeps 11 (~1e-3)."""
    N = 32
    exact = torch.randn(N, N, generator=generator).to(torch.bfloat16)
    wide = torch.randn(N, N, generator=generator)
    a, b = (wide, exact) if split == "a" else (exact, wide)
    ref = a.double() @ b.double()
    errors = {}
    for prec in ("bf16x2", "tf32"):
        c = torch.empty(N, N)
        _dot_kernel[(1,)](a if prec == "bf16x2" else a.float(), b if prec == "bf16x2" else b.float(), c, N, prec)
        errors[prec] = relative_error(c, ref)
    assert errors["bf16x2"] < 3e-5 < errors["tf32"], errors


def test_lightning_bf16_state_update_keeps_float32_accuracy(generator):
    """With bf16 inputs the only rounding in Lightning's state is its update K^T (decayed v): the
    raw k tile is exact in bf16 and the decayed v is split into two bf16 parts ("bf16x2"), so the
    final states match the oracle to ~1e-5 (tf32 operands left ~5e-4)."""
    kw = random_inputs("lightning", (sum(LENS),), **GVA, dtype=torch.bfloat16, generator=generator)
    pool, call = _varlen_case(generator)
    _, _, ref_pool = _run_both("lightning", kw, pool, **call)
    assert_same_writes(pool, ref_pool, 5e-5, "final states")


@pytest.mark.parametrize("mode", MODES)
def test_no_pool(mode, generator):
    """No state pool: every sequence starts from zeros and nothing is written."""
    lens = [65, 3]
    kw = random_inputs(mode, (sum(lens),), **GVA, dtype=torch.float32, generator=generator)
    o, ref_o, _ = _run_both(mode, kw, None, cu_seqlens=_cu(lens))
    assert_close(o, ref_o, 1e-5)


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_strided_inputs_pool_and_out(mode, generator):
    """q, k, v, g, beta sliced from one fused projection (k with strided head vectors), a pool
    strided in its slot dim (the [:, 0] half of paged storage), ``out`` with a strided last dim."""
    lens, H, HV, K, V = [70, 20], 2, 4, 32, 32
    T = sum(lens)
    gate_width = HV * K if mode == "kda" else HV
    fused = torch.randn(T, 2 * H * K + HV * V + gate_width + HV + 3, generator=generator).bfloat16()
    q = fused[:, :H * K].unflatten(-1, (H, K))
    k = fused[:, H * K:2 * H * K].unflatten(-1, (K, H)).transpose(-1, -2)
    v = fused[:, 2 * H * K:2 * H * K + HV * V].unflatten(-1, (HV, V))
    g = fused[:, 2 * H * K + HV * V:-HV - 3].float()
    g = g.unflatten(-1, (HV, K)) if mode == "kda" else g
    beta = fused[:, -HV - 3:-3].float()
    dt_bias = torch.randn(HV, K, generator=generator) if mode == "kda" else torch.randn(HV, generator=generator)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=torch.rand(HV, generator=generator), dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    base = torch.full((POOL_SIZE, 2, HV, V, K), float("nan"))
    pool = base[:, 0]
    pool[4] = torch.randn(HV, V, K, generator=generator)
    pool[1] = torch.randn(HV, V, K, generator=generator)
    out = torch.full((T, HV, V, 2), float("nan"), dtype=torch.bfloat16)[..., 0]
    assert not q.is_contiguous() and k.stride(-1) != 1 and out.stride(-1) != 1
    call = dict(cu_seqlens=_cu(lens), state_indices=torch.tensor([4, 1], dtype=torch.int32))
    o, ref_o, ref_pool = _run_both(mode, kw, pool, out=out, **call)
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)
    assert torch.isnan(base[:, 1]).all(), "the other half of the strided pool was written"


@pytest.mark.parametrize("aligned", [True, False], ids=["descriptors", "pointers"])
def test_lightning_strided_inputs_and_out(aligned, generator):
    """Lightning's q, k, v sliced from one fused projection and ``out`` a strided view, both ways
    its kernel moves rows: through descriptors (rows 16-byte aligned, last dims contiguous) and,
    when they cannot be built, through masked pointers (odd row stride, k with strided head
    vectors, ``out`` with a strided last dim)."""
    from cula_serve.kernels.common.tma import descriptor_ready

    lens, H, HV, K, V = [70, 20], 2, 4, 32, 32
    q, k, v, out = lightning_strided_views(sum(lens), H, HV, K, V, aligned, generator)
    assert descriptor_ready(q, k, v, out) == aligned and not q.is_contiguous() and not out.is_contiguous()
    kw = dict(q=q, k=k, v=v, decay=-torch.rand(HV, generator=generator), use_qk_l2norm_in_kernel=True)
    pool = torch.full((POOL_SIZE, HV, V, K), float("nan"))
    pool[4] = torch.randn(HV, V, K, generator=generator)
    pool[1] = torch.randn(HV, V, K, generator=generator)
    call = dict(cu_seqlens=_cu(lens), state_indices=torch.tensor([4, 1], dtype=torch.int32))
    o, ref_o, ref_pool = _run_both("lightning", kw, pool, out=out, **call)
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


def test_chunk_indices(generator):
    """The device-side chunk table: every chunk of every sequence once, in packed order, then -1."""
    lens = torch.randint(0, 200, (150,), generator=generator).tolist()
    lens[:4] = [0, 64, 65, 1]
    table = chunk_indices(_cu(lens), sum(lens), 64)
    expected = [[n, c] for n, length in enumerate(lens) for c in range(-(-length // 64))]
    assert table.shape == (sum(lens) // 64 + len(lens), 2)
    assert table[:len(expected)].tolist() == expected
    assert (table[len(expected):] == -1).all()


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_map_columns_carry_the_segment_map(mode, generator):
    """map_columns=K (context parallelism): started from [S0 | I] the state's last K columns end
    as the segment's map A^T and their outputs are q~; check both against the oracle run on v
    padded with zero columns, and that applying them to S0 reproduces the plain prefill."""
    shape = dict(H=2, HV=4, K=32, V=32)
    K, V, HV = shape["K"], shape["V"], shape["HV"]
    kw = random_inputs(mode, (1, 130), **shape, dtype=torch.float32, fused_gate=False, generator=generator)
    cu = torch.tensor([0, 130], dtype=torch.int32)
    widened = torch.zeros(1, HV, V + K, K)
    widened[0, :, :V] = 0.3 * torch.randn(HV, V, K, generator=generator)
    widened[0, :, V:] = torch.eye(K)
    o, final = PREFILL[mode](**kw, cu_seqlens=cu, initial_state=widened, output_final_state=True, map_columns=K,
                             **TRITON)
    padded = dict(to_float64(kw), v=torch.cat([kw["v"], torch.zeros(1, 130, HV, K)], -1).double())
    ref_o, ref_final = PREFILL[mode](**padded, cu_seqlens=cu, initial_state=widened.double(), output_final_state=True,
                                     **ORACLE)
    assert_close(o, ref_o, 1e-5)
    assert_close(final, ref_final, 1e-5, "final state and map")
    # the affine map: from a zero start plus the map applied to S0, as one plain prefill from S0
    zero_o, zero_final = PREFILL[mode](**kw, cu_seqlens=cu, initial_state=torch.zeros(1, HV, V, K),
                                       output_final_state=True, **TRITON)
    S0 = widened[:, :, :V].double()
    composed_o = zero_o.double() + torch.einsum("bthk,bhvk->bthv", o[..., V:].double(), S0)
    composed_final = zero_final.double() + S0 @ final[:, :, V:].double()
    assert_close(composed_o, ref_o[..., :V], 1e-5)
    assert_close(composed_final, ref_final[:, :, :V], 1e-5, "composed final state")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens", [64, 128])
def test_segments_match_oracle(mode, tokens, generator):
    """In-card context parallelism forced at small sizes (``segment_tokens``): sequences of 300,
    1, 0, 200 (padding) and 130 tokens cut into segments of 64 or 128 tokens (five, one, one
    empty, four and three segments), transitions computed in parallel and composed; permuted
    slots, two sequences without an initial state (the empty one's slot still gets zeros),
    checkpoints every 64 tokens that fall inside segments. float32 end to end, so the composition
    must be exact to 1e-5."""
    lens, slots, has_init = [300, 1, 0, 200, 130], [3, 0, 1, -1, 5], [True, False, False, True, True]
    shape = dict(H=1, HV=2, K=32, V=32)
    ckpt = torch.tensor([[10, 11, -1, 12], [-1, -1, -1, -1], [-1, -1, -1, -1], [13, 14, 15, 16], [17, -1, 18, 19]],
                        dtype=torch.int32)
    kw = random_inputs(mode, (sum(lens),), **shape, dtype=torch.float32, generator=generator)
    pool, call = _varlen_case(generator, shape, lens, slots, has_init)
    pool = torch.cat([pool, torch.full((10, *pool.shape[1:]), float("nan"))])  # room for slots 10..19
    o, ref_o, ref_pool = _run_both(mode, kw, pool, checkpoint_every=64, checkpoint_indices=ckpt,
                                   segment_tokens=tokens, **call)
    assert_close(o, ref_o, 1e-5)
    assert (o[301:501] == 0).all()
    assert_same_writes(pool, ref_pool, 1e-5)
    assert all(not torch.isnan(pool[s]).any() for s in (10, 11, 12, 17))


def test_lightning_composition_in_blocks_of_four(generator):
    """Lightning's composition loads four segments' final states per step
    (``_scalar_compose_kernel``): a 700-token sequence in 64-token segments (eleven: nine composed
    steps, two whole blocks of four and a partial one) next to a short one, against the oracle."""
    lens, slots, has_init = [700, 40], [2, 0], [True, False]
    shape = dict(H=1, HV=2, K=32, V=32)
    kw = random_inputs("lightning", (sum(lens),), **shape, dtype=torch.float32, generator=generator)
    pool, call = _varlen_case(generator, shape, lens, slots, has_init)
    o, ref_o, ref_pool = _run_both("lightning", kw, pool, segment_tokens=64, **call)
    assert_close(o, ref_o, 1e-5)
    assert_same_writes(pool, ref_pool, 1e-5)


@pytest.mark.parametrize("lens,slots,has_init,tokens", [
    ([300, 0, 1, 200, 130], [3, 1, 0, -1, 5], [True, False, False, True, True], 128),  # up to three segments
    ([200, 0, 1, 40, 130], [3, 1, 0, -1, 5], [True, False, False, True, False], 192),  # at most two: one launch
])
@pytest.mark.parametrize("state_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                   (torch.float32, torch.bfloat16)])
def test_one_pass_segments_join(state_dtype, out_dtype, lens, slots, has_init, tokens, generator, monkeypatch):
    """In-card segments as the CuTe DSL GDN prefill runs them, in one state pass: each segment on
    its own (value rows from the pool in a sequence's first segment, else from zeros; K map rows
    from the identity, ``map_columns``), here by the triton prefill; then ``join_segments`` writes
    the final states and adds q~ S (two launches, or one where no sequence has more than two
    segments). Against the oracle on the whole batch: an empty sequence (no initial state: its slot
    still gets zeros), one of one token, a padding one; permuted slots; out NaN-poisoned where no
    segment writes. bf16 outputs and carried queries, as the CuTe DSL kernel writes them, take the
    correction's bf16 products. The correction's tiles are shrunk to 2 x 16 rows and the final
    state's blocks to 16 x 16, so that a segment and a state span several programs."""
    from cula_serve.kernels.common import affine_output
    from cula_serve.kernels.common.segments import num_segment_ids

    shape = dict(H=1, HV=2, K=32, V=32)
    HV, K, V = shape["HV"], shape["K"], shape["V"]
    kw = random_inputs("gdn", (sum(lens),), **shape, dtype=torch.float32, generator=generator)
    pool, call = _varlen_case(generator, shape, lens, slots, has_init, state_dtype=state_dtype)
    ref_o, _ = prefill_call("gdn", to_float64(kw), state_pool=(ref_pool := pool.double()), **call, **ORACLE)
    cu = call["cu_seqlens"]
    transitions = torch.full((num_segment_ids(sum(lens), len(lens), tokens), HV, V + K, K), float("nan"))
    carried = torch.full((sum(lens), HV, K), float("nan"))
    out = torch.full((sum(lens), HV, V), float("nan"))
    sid = 0
    for n, (length, slot) in enumerate(zip(lens, slots)):
        count = max(1, -(-length // tokens))
        for j in range(count):
            rows = slice(cu[n] + j * tokens, cu[n] + min((j + 1) * tokens, length))
            part = {name: x[rows] if name in ("q", "k", "v", "g", "beta") else x for name, x in kw.items()}
            span = _cu([rows.stop - rows.start])
            if slot < 0:
                out[rows] = 0
            elif count == 1:  # a whole sequence: the plain prefill from and into its slot
                prefill_call("gdn", part, cu_seqlens=span, state_pool=pool, state_indices=torch.tensor([slot]),
                             has_initial_state=torch.tensor([has_init[n]]), out=out[rows], **TRITON)
            else:
                start = torch.zeros(1, HV, V + K, K)
                if j == 0 and has_init[n]:
                    start[0, :, :V] = pool[slot].float()
                start[0, :, V:] = torch.eye(K)
                o, final = prefill_call("gdn", part, cu_seqlens=span, initial_state=start, output_final_state=True,
                                        map_columns=K, **TRITON)
                out[rows], carried[rows], transitions[sid] = o[..., :V], o[..., V:], final[0]
            sid += 1
    carried, out = carried.to(out_dtype), out.to(out_dtype)  # as the CuTe DSL kernel leaves them, for bf16
    for name in ("SEGMENT_OUTPUT_LAUNCH", "FLOAT_SEGMENT_OUTPUT_LAUNCH", "TWO_SEGMENT_JOIN_LAUNCH"):
        monkeypatch.setattr(affine_output, name, dict(getattr(affine_output, name), BT=16, TILES=2))
    monkeypatch.setattr(affine_output, "TWO_SEGMENT_FINAL_BLOCK", dict(BV=16, BK=16))
    out_without_pool = out.clone()
    affine_output.join_segments(cu, call["state_indices"], transitions, carried, out, pool, tokens=tokens)
    tol = tolerance(out_dtype, state_dtype)
    assert_close(out, ref_o, tol)
    assert_same_writes(pool, ref_pool, tol)
    # without a pool (no final states kept) the outputs are the same
    affine_output.join_segments(cu, call["state_indices"], transitions, carried, out_without_pool, None,
                                tokens=tokens)
    assert torch.equal(out_without_pool, out)


@pytest.mark.parametrize("mode", MODES)
def test_segments_bf16_pool(mode, generator):
    """Segments with bf16 inputs and a bf16 pool (the composed states stay float32 in between)."""
    lens, slots, has_init = [260, 70], [2, 0], [True, True]
    kw = random_inputs(mode, (sum(lens),), **GVA, dtype=torch.bfloat16, generator=generator)
    pool, call = _varlen_case(generator, GVA, lens, slots, has_init, state_dtype=torch.bfloat16)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, segment_tokens=64, **call)
    tol = tolerance(torch.bfloat16, torch.bfloat16)
    assert_close(o, ref_o, tol)
    assert_same_writes(pool, ref_pool, tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens", [-64, 100, 1.5, True])
def test_segment_tokens_must_be_chunk_multiples(mode, tokens, generator):
    """A bad ``segment_tokens`` names the argument and writes neither the pool nor ``out``."""
    kw = random_inputs(mode, (70,), **GVA, dtype=torch.float32, generator=generator)
    pool = torch.full((2, GVA["HV"], GVA["V"], GVA["K"]), float("nan"))
    out = torch.full((70, GVA["HV"], GVA["V"]), float("nan"))
    with pytest.raises(ValueError, match="segment_tokens"):
        prefill_call(mode, kw, cu_seqlens=_cu([70]), state_pool=pool,
                     state_indices=torch.tensor([1], dtype=torch.int32), out=out, segment_tokens=tokens, **TRITON)
    assert torch.isnan(pool).all() and torch.isnan(out).all()


def test_segment_rule_follows_the_shapes():
    """Segments only where the unsegmented state pass leaves SMs idle and sequences are long
    (132 SMs, the H200's; value heads and V of the model shapes; each family's constants)."""
    from cula_serve.kernels.common.segments import segment_tokens
    from cula_serve.kernels.delta_rule import chunk_triton as delta
    from cula_serve.kernels.lightning import chunk_triton as lightning

    def rule(T, N, HV, family=delta, sms=132):
        return segment_tokens(T, N, HV, 128, sms, min_tokens=family.SEGMENT_MIN_TOKENS,
                              programs_per_sm=family.SEGMENT_PROGRAMS_PER_SM)

    assert rule(4 * 8192, 4, 32) == 0  # 256 programs already
    assert rule(2048, 1, 32) == 0  # too short to cut in four
    assert rule(8192, 1, 8) == 1024  # TP4 shard, 16 programs: 9 segments wanted, 1024 tokens the least
    assert rule(32768, 1, 32) == 10944  # 64 programs: 3 segments
    assert rule(32768, 1, 32, sms=0) == 0  # not a GPU
    assert rule(8192, 1, 16, lightning) == 512
    assert rule(32768, 1, 16, lightning) == 1984
    assert rule(4 * 8192, 4, 64, lightning) == 0


def test_one_pass_segment_rule():
    """The CuTe DSL GDN prefill's segments: 2 s - 1 CTAs per head in one wave of 132 SMs, each of
    512 tokens or more, only where the longest CTA gets 512 tokens shorter, never with checkpoints
    (asked for: an error naming ``segment_tokens``)."""
    from cula_serve.kernels.common.segments import one_pass_segment_tokens as rule

    assert rule(4 * 8192, 4, 32, 132) == 0  # 128 CTAs already
    assert rule(32768, 1, 32, 132) == 16384  # 2 segments: 96 CTAs
    assert rule(8192, 1, 8, 132) == 1024  # TP4 shard: 8 segments, 120 CTAs
    assert rule(2048, 1, 32, 132) == 1024  # 2 segments: 96 CTAs
    assert rule(2048, 2, 32, 132) == 0  # 64 CTAs: 2 segments each would take two waves
    assert rule(2048, 1, 8, 132) == 512  # 8 segments would be 256 tokens: 4 of 512
    assert rule(1024, 1, 8, 132) == 512
    assert rule(512, 1, 8, 132) == 0  # one segment of the least length
    assert rule(32768, 1, 32, 132, checkpoints=True) == 0
    assert rule(32768, 1, 32, 0) == 0  # not a GPU
    assert rule(2048, 1, 32, 132, requested=128) == 128
    with pytest.raises(ValueError, match="segment_tokens"):
        rule(2048, 1, 32, 132, checkpoints=True, requested=128)
    with pytest.raises(ValueError, match="segment_tokens"):
        rule(2048, 1, 32, 132, requested=100)
