"""The triton backend's decode, verify and commit under Triton's interpreter, against the float64
oracle: every mode, both pool dtypes, GVA and MHA heads, several V-tiles, permuted and padded
(NaN-poisoned) slots, strided pools and inputs, the three MTP protocols with every accepted length,
the fused gates, decays whose products underflow float32. Shapes are small: the interpreter runs
each program in Python."""
import dataclasses
import os
import sys
import types

import pytest
import torch

# The interpreter is chosen when the kernels are defined, so this must come before triton and the
# kernel modules are imported. Only without a GPU: on a GPU machine the same pytest process may
# run tests/gpu, whose kernels must be compiled, not interpreted (there this module skips).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from cula_serve import cula_commit, cula_decode, cula_gdn, cula_lightning, cula_verify  # noqa: E402
from cula_serve.kernels.backends import triton_backend  # noqa: E402
from cula_serve.kernels.delta_rule import verify_wy_triton  # noqa: E402

from conftest import (ORACLE, assert_close, assert_untouched, gpu_faithful_interpreter, random_inputs,  # noqa: E402
                      relative_error, to_float64, tolerance)

if triton_backend.availability(torch.device("cpu")):
    pytest.skip("the triton backend needs TRITON_INTERPRET=1 on the CPU (set before triton was imported)",
                allow_module_level=True)

TRITON = dict(backend="triton")
MODES = ["gdn", "kda", "lightning"]
GVA = dict(H=2, HV=4, K=32, V=32)
MHA = dict(H=2, HV=2, K=16, V=64)  # two V-tiles of 32 columns per head
# 6 sequences over the first 10 slots: permuted, row 2 is padding; slots 1, 4, 6, 8, 9 are never
# used. Slots P.. are the slots protocol's scratch columns.
SLOTS = [5, 0, -1, 7, 2, 3]
UNUSED = [1, 4, 6, 8, 9]
PAD = 2
P = 10
POOL_SIZE = 32


@pytest.fixture(autouse=True)
def faithful_interpreter():
    """Every test here: bf16 and tf32 products computed as the GPU computes them. Deferred
    verifies and commits with 16-bit inputs run tensor-core products (GDN's and KDA's in
    ``verify_wy_triton``, Lightning's in ``verify_chunk_triton``), which the unpatched interpreter
    computes wrong."""
    with gpu_faithful_interpreter():
        yield


def _pool(shape, dtype, live_slots, generator, strided=False):
    """A NaN pool of POOL_SIZE slots with random states in ``live_slots``. ``strided``: the [:, 0]
    half of a [POOL_SIZE, 2, HV, V, K] tensor (vLLM-style pages). Returns (pool, base), so that
    the other half can be checked."""
    HV, V, K = shape["HV"], shape["V"], shape["K"]
    base = torch.full((POOL_SIZE, 2, HV, V, K) if strided else (POOL_SIZE, HV, V, K), float("nan"), dtype=dtype)
    pool = base[:, 0] if strided else base
    for slot in live_slots:
        pool[slot] = (0.5 * torch.randn(HV, V, K, generator=generator)).to(dtype)
    return pool, base


def _assert_same_writes(pool, ref_pool, tol, what="pool"):
    """The pool holds NaN exactly where the oracle's does (untouched slots) and the oracle's values elsewhere."""
    nan, ref_nan = torch.isnan(pool.float()), torch.isnan(ref_pool)
    assert torch.equal(nan, ref_nan), f"{what}: written where the oracle did not write, or the reverse"
    assert_close(pool[~nan], ref_pool[~ref_nan], tol, what)


def _split(kw):
    """random_inputs' dict -> (q, k, v, the remaining keyword arguments)."""
    rest = {k: v for k, v in kw.items() if k not in ("q", "k", "v")}
    return kw["q"], kw["k"], kw["v"], rest


def _token(rest, t):
    """``rest`` of ``_split`` with its per-token tensors ([N, T, ...]: g, beta) cut to token t."""
    return {key: val[:, t:t + 1] if isinstance(val, torch.Tensor) and val.dim() >= 3 else val
            for key, val in rest.items()}


# ------------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [GVA, MHA], ids=["gva", "mha-strided-pool"])
def test_decode_matches_oracle(mode, state_dtype, input_dtype, shape, generator):
    strided = shape is MHA
    pool, base = _pool(shape, state_dtype, [s for s in SLOTS if s >= 0], generator, strided)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    kw = random_inputs(mode, (len(SLOTS), 1), **shape, dtype=input_dtype, generator=generator)
    ref_pool = pool.double()
    q, k, v, rest = _split(kw)
    o, returned = cula_decode(q, k, v, pool, mode=mode, state_indices=slots, **rest, **TRITON)
    q, k, v, rest = _split(to_float64(kw))
    ref_o, _ = cula_decode(q, k, v, ref_pool, mode=mode, state_indices=slots, **rest, **ORACLE)
    tol = tolerance(input_dtype, state_dtype)
    assert returned is pool and o.dtype == input_dtype
    assert_close(o, ref_o, tol)
    assert (o[PAD] == 0).all()
    _assert_same_writes(pool, ref_pool, tol)
    assert_untouched(pool, UNUSED)
    if strided:
        assert torch.isnan(base[:, 1].float()).all(), "the other half of the strided pool was written"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("columns,shape", [(4, GVA), (8, GVA), (16, dict(GVA, K=128, V=64)),
                                           (32, dict(GVA, K=128, V=64))],
                         ids=["bv4", "bv8", "bv16_k128", "bv32_k128"])
def test_narrow_tiles_split_lanes_along_v(mode, columns, shape, monkeypatch, generator):
    """The GPU's V-tiles put lane groups along V and apply q's and k's l2norm and scale to the
    rows (``tile_split``), which the interpreter's default tiles never do with K = 32: 4 and 8
    columns (small batches), and 16 and 32 columns with K = 128 (B >= 64), where a deferred verify
    takes 8 lanes along K and a decode 16. Decode and a deferred verify + commit against the
    oracle."""
    from cula_serve.kernels.delta_rule import recurrent_triton
    monkeypatch.setattr(recurrent_triton, "block_v", lambda *shape, **op: (columns, 1))
    if mode == "lightning":
        from cula_serve.kernels.lightning import recurrent_triton as lightning_recurrent
        monkeypatch.setattr(lightning_recurrent, "block_v", lambda *shape, **op: (columns, 1))
    split = recurrent_triton.tile_split(shape["K"], columns, mode == "kda", "deferred")
    # 8 lanes x 4 channels along K (all of K = 32; at K = 128 the deferred verify's split), so 4 lane groups along V
    assert split["LV"] == (1 if mode == "kda" else 4) and split["NORM_ON_ROWS"] == (mode != "kda")
    T = 3
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    pool, _ = _pool(shape, torch.float32, [s for s in SLOTS if s >= 0], generator)
    ref_pool = pool.double()
    kw = random_inputs(mode, (len(SLOTS), T), **shape, generator=generator)
    q, k, v, rest = _split(kw)
    o, pending = cula_verify(q, k, v, pool, mode=mode, protocol="deferred", state_indices=slots, **rest, **TRITON)
    q64, k64, v64, rest64 = _split(to_float64(kw))
    ref_o, ref_pending = cula_verify(q64, k64, v64, ref_pool, mode=mode, protocol="deferred", state_indices=slots,
                                     **rest64, **ORACLE)
    tol = tolerance(torch.bfloat16, torch.float32)
    assert_close(o, ref_o, tol, "verify outputs")
    accepted = torch.tensor([3, 0, 2, 1, 3, 2], dtype=torch.int32)
    cula_commit(pending, accepted)
    cula_commit(ref_pending, accepted, algorithm="recurrent", compute_dtype=torch.float64)
    _assert_same_writes(pool, ref_pool, tol, "pool after commit")
    o, _ = cula_decode(q[:, :1], k[:, :1], v[:, :1], pool, mode=mode, state_indices=slots, **_token(rest, 0),
                       **TRITON)
    ref_o, _ = cula_decode(q64[:, :1], k64[:, :1], v64[:, :1], ref_pool, mode=mode, state_indices=slots,
                           **_token(rest64, 0), **ORACLE)
    assert_close(o, ref_o, tol, "decode outputs")
    _assert_same_writes(pool, ref_pool, tol, "pool after decode")


def test_decode_fp16_inputs_and_strided_views(generator):
    """fp16 q/k/v sliced from one fused projection (k even with strided head vectors), g and beta
    strided views, ``out`` with a strided last dim."""
    N, H, HV, K, V = 4, 2, 4, 32, 32
    slots = torch.tensor([3, 1, -1, 0], dtype=torch.int32)
    pool, _ = _pool(dict(HV=HV, V=V, K=K), torch.float32, [3, 1, 0], generator)
    fused = torch.randn(N, 1, 2 * H * K + HV * V + 2 * HV + 3, generator=generator).half()
    q = fused[..., :H * K].unflatten(-1, (H, K))
    k = fused[..., H * K:2 * H * K].unflatten(-1, (K, H)).transpose(-1, -2)  # strided head vectors
    v = fused[..., 2 * H * K:2 * H * K + HV * V].unflatten(-1, (HV, V))
    g = fused[..., -2 * HV - 3:-HV - 3].float()
    beta = fused[..., -HV - 3:-3].float()
    gates = dict(g=g, beta=beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 A_log=torch.rand(HV, generator=generator), dt_bias=torch.randn(HV, generator=generator),
                 use_beta_sigmoid_in_kernel=True)
    out = torch.full((N, 1, HV, V, 2), float("nan"), dtype=torch.float16)[..., 0]
    assert not q.is_contiguous() and k.stride(-1) != 1 and out.stride(-1) != 1
    ref_pool = pool.double()
    o, _ = cula_decode(q, k, v, pool, mode="gdn", state_indices=slots, out=out, **gates, **TRITON)
    ref_o, _ = cula_decode(q.double(), k.double(), v.double(), ref_pool, mode="gdn", state_indices=slots,
                           **to_float64(gates), **ORACLE)
    assert o is out
    assert_close(o, ref_o, 5e-3)
    assert (o[2] == 0).all()
    _assert_same_writes(pool, ref_pool, 5e-3)


@pytest.mark.parametrize("mode,gate", [
    ("gdn", "prepared"), ("gdn", "fused"), ("gdn", "fused_no_bias"),
    ("kda", "prepared"), ("kda", "fused"), ("kda", "fused_no_bias"), ("kda", "safe"), ("kda", "safe_no_bias"),
    ("lightning", "l2norm"), ("lightning", "no_l2norm"),
])
def test_gates_and_recipes(mode, gate, generator):
    """Every fused-gate variant (and the prepared gate), fp32 end to end: within 1e-5 of the oracle.
    Run as a deferred verify of 2 tokens plus its commit, so the gate acts on a multi-token path."""
    N, T = 3, 2
    kw = random_inputs(mode, (N, T), **GVA, dtype=torch.float32, fused_gate=gate != "prepared",
                       generator=generator)
    if gate.endswith("no_bias"):
        kw["dt_bias"] = None
    if gate.startswith("safe"):
        kw["lower_bound"] = -5.0
    if gate == "no_l2norm":
        kw["use_qk_l2norm_in_kernel"] = False
        kw["scale"] = 0.05
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    pool, _ = _pool(GVA, torch.float32, [2, 0], generator)
    ref_pool = pool.double()
    accepted = torch.tensor([1, 2, 2], dtype=torch.int32)
    q, k, v, rest = _split(kw)
    o, pending = cula_verify(q, k, v, pool, mode=mode, state_indices=slots, protocol="deferred", **rest, **TRITON)
    cula_commit(pending, accepted)
    q, k, v, rest = _split(to_float64(kw))
    ref_o, ref_pending = cula_verify(q, k, v, ref_pool, mode=mode, state_indices=slots, protocol="deferred",
                                     **rest, **ORACLE)
    cula_commit(ref_pending, accepted, algorithm="recurrent", compute_dtype=torch.float64)
    assert_close(o, ref_o, 1e-5)
    _assert_same_writes(pool, ref_pool, 1e-5)


# ------------------------------------------------------------------------------------------------
# verify and commit


def _protocol_call(protocol, pool, T):
    """(call, oracle_call, accepted): the pool-side arguments of a verify of SLOTS on ``pool`` for
    the backend under test and for the oracle, and the accepted counts of the commit that follows;
    the live rows cover every accepted length (0..T, slots 1..T)."""
    N = len(SLOTS)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    if protocol == "deferred":
        return dict(state_indices=slots), dict(state_indices=slots), torch.tensor([3, 0, 2, 4, 1, 2], dtype=torch.int32)
    if protocol == "buffer":
        # a spare token per row and a spare row (also the padding row's): both must stay NaN.
        # The oracle's buffer has exactly T tokens per row.
        buffer = torch.full((N + 1, T + 1, *pool.shape[1:]), float("nan"), dtype=pool.dtype)
        rows = torch.tensor([4, 0, 6, 1, 5, 2], dtype=torch.int32)
        call = dict(state_indices=slots, intermediate_states=buffer, intermediate_indices=rows)
        return (call, dict(call, intermediate_states=buffer[:, :T].double()),
                torch.tensor([3, 0, 2, 4, 1, 2], dtype=torch.int32))
    # slots: column t of row n receives the state after token t; the previous step accepted
    # prev[n] tokens, so the row's state is in column prev[n] - 1, its slot; the other columns are
    # scratch slots past P
    columns = torch.full((N, T), -1, dtype=torch.int32)
    scratch = iter(range(P, POOL_SIZE))
    prev = torch.tensor([1, 3, 2, 4, 2, 1], dtype=torch.int32)
    for n, slot in enumerate(SLOTS):
        if slot >= 0:
            for t in range(T):
                columns[n, t] = slot if t == prev[n] - 1 else next(scratch)
    columns[4, 3] = -1  # a live row whose last column is not written, nor copied by commit(4)
    call = dict(state_indices=columns, num_accepted_tokens=prev)
    return call, call, torch.tensor([4, 1, 2, 3, 4, 2], dtype=torch.int32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("protocol", ["buffer", "slots", "deferred"])
def test_verify_and_commit_match_oracle(mode, state_dtype, protocol, generator):
    """bf16 inputs; the bf16 pools are strided (vLLM pages)."""
    T = 4
    kw = random_inputs(mode, (len(SLOTS), T), **GVA, generator=generator)
    strided = state_dtype == torch.bfloat16
    pool, base = _pool(GVA, state_dtype, [s for s in SLOTS if s >= 0], generator, strided)
    call, ref_call, accepted = _protocol_call(protocol, pool, T)
    ref_pool = pool.double()
    before = pool.clone()
    q, k, v, rest = _split(kw)
    o, pending = cula_verify(q, k, v, pool, mode=mode, protocol=protocol, **call, **rest, **TRITON)
    q, k, v, rest = _split(to_float64(kw))
    ref_o, ref_pending = cula_verify(q, k, v, ref_pool, mode=mode, protocol=protocol, **ref_call, **rest, **ORACLE)
    tol = tolerance(torch.bfloat16, state_dtype)
    assert_close(o, ref_o, tol, "verify outputs")
    assert (o[PAD] == 0).all()
    if protocol == "slots":
        _assert_same_writes(pool, ref_pool, tol, "pool after verify")
    else:
        assert torch.equal(pool.nan_to_num(7.0), before.nan_to_num(7.0)), "verify wrote the pool"
    if protocol == "buffer":
        buffer = call["intermediate_states"]
        _assert_same_writes(buffer[:, :T], ref_call["intermediate_states"], tol, "intermediate states")
        assert torch.isnan(buffer[:, T].float()).all() and torch.isnan(buffer[6].float()).all()

    cula_commit(pending, accepted)
    cula_commit(ref_pending, accepted, algorithm="recurrent", compute_dtype=torch.float64)
    _assert_same_writes(pool, ref_pool, tol, "pool after commit")
    assert_untouched(pool, UNUSED)
    if strided:
        assert torch.isnan(base[:, 1].float()).all(), "the other half of the strided pool was written"


@pytest.mark.parametrize("mode", MODES)
def test_verify_equals_decode_steps(mode, generator):
    """Within the backend: T decode steps and a verify in each protocol give the same outputs,
    the same per-token states, and commit(a) the state after a steps (fp32 pool)."""
    T, N = 3, 4
    slots = torch.tensor([3, -1, 0, 2], dtype=torch.int32)
    live = [0, 2, 3]
    kw = random_inputs(mode, (N, T), **GVA, generator=generator)
    pool, _ = _pool(GVA, torch.float32, [3, 0, 2], generator)
    q, k, v, rest = _split(kw)

    work = pool.clone()
    outputs, states = [], []
    for t in range(T):
        o, _ = cula_decode(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], work, mode=mode, state_indices=slots,
                           **_token(rest, t), **TRITON)
        outputs.append(o)
        states.append(work[slots[live].long()].clone())
    steps_o = torch.cat(outputs, 1)

    def same(x, y, what):
        assert relative_error(x, y) <= 1e-5, what

    buffer = torch.zeros(N, T, *pool.shape[1:])
    o, _ = cula_verify(q, k, v, pool.clone(), mode=mode, protocol="buffer", state_indices=slots,
                       intermediate_states=buffer, **rest, **TRITON)
    same(o, steps_o, "buffer outputs")
    for t in range(T):
        same(buffer[live, t], states[t], f"buffer state {t}")

    columns = torch.tensor([[3, 4, 5], [-1, -1, -1], [0, 6, 7], [2, 8, 9]], dtype=torch.int32)
    slot_pool = torch.cat([pool, torch.zeros(6, *pool.shape[1:])])
    o, _ = cula_verify(q, k, v, slot_pool, mode=mode, protocol="slots", state_indices=columns,
                       num_accepted_tokens=torch.ones(N, dtype=torch.int32), **rest, **TRITON)
    same(o, steps_o, "slots outputs")
    for t in range(T):
        same(slot_pool[columns[live, t].long()], states[t], f"slots state {t}")

    for a in range(T + 1):
        work = pool.clone()
        o, pending = cula_verify(q, k, v, work, mode=mode, protocol="deferred", state_indices=slots, **rest, **TRITON)
        same(o, steps_o, "deferred outputs")
        cula_commit(pending, torch.full((N,), a, dtype=torch.int32))
        same(work[slots[live].long()], states[a - 1] if a else pool[slots[live].long()], f"commit({a})")


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_strong_decays_through_deferred_verify_pending_and_commit(mode, generator):
    """Log decays 30 below the drawn ones on tokens 1, 2 and 3 (in every channel for KDA): their
    products fall below float32's normal range within the verify. A deferred verify, one that
    commits it first (``pending=``) and the last commit, float32 inputs and pool, against the
    oracle at 1e-5, every accepted count 0..T across the rows. Guards the forms that factor decays
    out of the state (a folded scalar product, as the CuTe DSL kernel holds it; exp(-G) factors),
    which must apply them before they leave float32's range: a fold without that step failed here."""
    T = 4
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    live = slots[slots >= 0].long()
    accepted = [torch.tensor(counts, dtype=torch.int32) for counts in ([3, 0, 2, 4, 1, 2], [4, 2, 1, 0, 3, 2])]
    pool, _ = _pool(GVA, torch.float32, [s for s in SLOTS if s >= 0], generator)
    ref_pool = pool.double()
    pending = ref_pending = None
    for step in range(2):
        kw = random_inputs(mode, (len(SLOTS), T), **GVA, dtype=torch.float32, generator=generator, fused_gate=False)
        kw["g"][:, 1:4] -= 30.0
        q, k, v, rest = _split(kw)
        commit_first = {} if pending is None else dict(pending=pending, num_accepted_tokens=accepted[0])
        o, pending = cula_verify(q, k, v, pool, mode=mode, state_indices=slots, **commit_first, **rest, **TRITON)
        if ref_pending is not None:
            cula_commit(ref_pending, accepted[0], algorithm="recurrent", compute_dtype=torch.float64)
        q, k, v, rest = _split(to_float64(kw))
        ref_o, ref_pending = cula_verify(q, k, v, ref_pool, mode=mode, state_indices=slots, **rest, **ORACLE)
        assert_close(o, ref_o, 1e-5, f"step {step} outputs")
        assert_close(pool[live], ref_pool[live], 1e-5, f"step {step} states")
    cula_commit(pending, accepted[1])
    cula_commit(ref_pending, accepted[1], algorithm="recurrent", compute_dtype=torch.float64)
    _assert_same_writes(pool, ref_pool, 1e-5, "pool after the last commit")


@pytest.mark.parametrize("mode", ["gdn", "kda"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gates_of_masked_tokens_never_reach_the_pool(mode, state_dtype, generator):
    """NaN gates on the padding row and on the tokens past each row's accepted count, set after
    the deferred verify that read the clean ones: the commit, and a verify that commits it first
    (``pending=``), must leave the same pool and outputs as with the clean gates. KDA forms its
    decays for every token in a launch of their own (``channel_decays``), masked ones included;
    only the kernel's masked loads keep those out."""
    T = 4
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    accepted = torch.tensor([3, 0, 2, 4, 1, 2], dtype=torch.int32)
    masked = torch.arange(T)[None, :] >= accepted[:, None]
    masked[PAD] = True
    pool, _ = _pool(GVA, state_dtype, [s for s in SLOTS if s >= 0], generator)
    kw = random_inputs(mode, (len(SLOTS), T), **GVA, generator=generator)
    q, k, v, rest = _split(kw)
    results = {}
    for poisoned in (False, True):
        outcome = []
        for commit_first in (False, True):  # a separate commit, or the next verify's
            work = pool.clone()
            # the first verify's own gates (its PendingCommit keeps them), poisoned after it ran
            first = dict(rest, g=rest["g"].clone())
            _, pending = cula_verify(q, k, v, work, mode=mode, protocol="deferred", state_indices=slots, **first,
                                     **TRITON)
            if poisoned:
                first["g"][masked] = float("nan")
                assert torch.isnan(pending.g).any(), "the poison must reach what the commit reads"
            if commit_first:
                o, _ = cula_verify(q, k, v, work, mode=mode, state_indices=slots, pending=pending,
                                   num_accepted_tokens=accepted, **rest, **TRITON)
                outcome.append(o)
            else:
                cula_commit(pending, accepted)
            outcome.append(work)
        results[poisoned] = outcome
    for clean, dirty in zip(results[False], results[True]):
        assert torch.equal(clean.nan_to_num(7.0), dirty.nan_to_num(7.0))


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_deferred_commit_applies_the_verify_u(mode, generator):
    """A deferred delta-rule verify keeps every token's u = beta (v - S^T k) (zeros on padding
    rows) and its commit applies those instead of recomputing them: the same states as the
    commit that replays (a torch-backend commit ignores ``saved``), and a poisoned u reaches the
    pool, so the saved values are what the commit uses."""
    T = 4
    accepted = torch.tensor([3, 0, 2, 4, 1, 2], dtype=torch.int32)
    kw = random_inputs(mode, (len(SLOTS), T), **GVA, generator=generator)
    pool, _ = _pool(GVA, torch.float32, [s for s in SLOTS if s >= 0], generator)
    q, k, v, rest = _split(kw)
    slots = torch.tensor(SLOTS, dtype=torch.int32)

    def verify(work):
        return cula_verify(q, k, v, work, mode=mode, protocol="deferred", state_indices=slots, **rest, **TRITON)[1]

    from_u, replayed, poisoned = pool.clone(), pool.clone(), pool.clone()
    pending = verify(from_u)
    assert pending.saved is not None and pending.saved.shape == (len(SLOTS), T, GVA["HV"], GVA["V"])
    assert (pending.saved[PAD] == 0).all()
    cula_commit(pending, accepted)

    cula_commit(dataclasses.replace(verify(replayed), saved=None), accepted)
    assert torch.equal(from_u.nan_to_num(7.0), replayed.nan_to_num(7.0))

    torch_commit = pool.clone()
    cula_commit(verify(torch_commit), accepted, backend="torch")
    assert_close(torch_commit[[s for s in SLOTS if s >= 0]], from_u[[s for s in SLOTS if s >= 0]], 1e-5,
                 "torch commit of a triton verify")

    pending = verify(poisoned)
    pending.saved[0, 0] = float("nan")  # sequence 0 (slot 5) accepts 3 tokens, so u of token 0 is used
    cula_commit(pending, accepted)
    assert torch.isnan(poisoned[SLOTS[0]]).any()
    assert torch.equal(poisoned[SLOTS[3]], from_u[SLOTS[3]])


WY = dict(H=1, HV=2, K=64, V=64)  # GVA at the smallest head dims of the tensor-core verifies (their ``applies``)


WY_CASES = [("gdn", torch.bfloat16), ("gdn", torch.float32), ("kda", torch.bfloat16), ("kda", torch.float32)]
TYPE_IDS = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _record_ops(monkeypatch, module, launcher: str) -> list:
    """The ``op`` of every call of ``module.launcher`` from here on, in order (the call still runs)."""
    ops = []
    launch = getattr(module, launcher)
    monkeypatch.setattr(module, launcher, lambda *a, **kw: (ops.append(kw["op"]), launch(*a, **kw)))
    return ops


@pytest.mark.parametrize("mode,state_dtype", WY_CASES, ids=[f"{mode}-{TYPE_IDS[dtype]}-pool" for mode, dtype in WY_CASES])
@pytest.mark.parametrize("fused_gate", [True, False], ids=["fused-gate", "mild-gate"])
@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_wy_verify_with_pending_and_commit(mode, tokens, fused_gate, state_dtype, monkeypatch, generator):
    """GDN and KDA with bfloat16 inputs run their deferred verify, their verify with a pending
    commit and their commit in WY form (``verify_wy_triton``; the test fails if another kernel
    runs them); KDA's fused gates decay every token after the first strongly. A
    deferred verify on SLOTS (padding row, NaN in the unused slots; keys alike, beta near 1), a
    verify that commits it first with every accepted count 0..T across the rows, and the last
    commit: against the float64 oracle, and the verify with pending= against a separate commit and
    verify bit for bit (the same commit code, so the engine's two paths agree exactly)."""
    ops = _record_ops(monkeypatch, verify_wy_triton, "wy_recurrent")
    N = len(SLOTS)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    accepted = torch.arange(N, dtype=torch.int32) % (tokens + 1)
    first = random_inputs(mode, (N, tokens), **WY, fused_gate=fused_gate, generator=generator)
    second = random_inputs(mode, (N, tokens), **WY, fused_gate=fused_gate, generator=generator)
    if fused_gate:  # the same layer: the commit goes into the verify
        second.update(A_log=first["A_log"], dt_bias=first["dt_bias"])
    for kw in (first, second):
        # keys alike and beta near 1: with mild gates A's powers stay large and every factor of
        # (I + A)^-1 counts
        kw["k"] = kw["k"][:, :1] + 0.2 * kw["k"]
        kw["beta"] = kw["beta"] + 4.0 if fused_gate else 0.5 + 0.5 * kw["beta"]
        if mode == "kda" and fused_gate:
            # softplus about 30 after the first token: log decays far below LOG_DECAY_FLOOR, seven
            # of them in a row at T = 8 (the floored factors must stay finite)
            kw["g"][:, 1:] += 30.0
    pool, _ = _pool(WY, state_dtype, [s for s in SLOTS if s >= 0], generator)
    separate, ref_pool = pool.clone(), pool.double()
    tol = tolerance(torch.bfloat16, state_dtype)

    q, k, v, rest = _split(first)
    o, pending = cula_verify(q, k, v, pool, mode=mode, state_indices=slots, **rest, **TRITON)
    _, separate_pending = cula_verify(q, k, v, separate, mode=mode, state_indices=slots, **rest, **TRITON)
    q, k, v, rest = _split(to_float64(first))
    ref_o, ref_pending = cula_verify(q, k, v, ref_pool, mode=mode, state_indices=slots, **rest, **ORACLE)
    assert_close(o, ref_o, tol, "verify outputs")
    assert (o[PAD] == 0).all() and (pending.saved[PAD] == 0).all()

    q, k, v, rest = _split(second)
    o, pending = cula_verify(q, k, v, pool, mode=mode, state_indices=slots, pending=pending,
                             num_accepted_tokens=accepted, **rest, **TRITON)
    cula_commit(separate_pending, accepted)
    separate_o, _ = cula_verify(q, k, v, separate, mode=mode, state_indices=slots, **rest, **TRITON)
    cula_commit(ref_pending, accepted, algorithm="recurrent", compute_dtype=torch.float64)
    q, k, v, rest = _split(to_float64(second))
    ref_o, ref_pending = cula_verify(q, k, v, ref_pool, mode=mode, state_indices=slots, **rest, **ORACLE)
    assert_close(o, ref_o, tol, "outputs of the verify with pending=")
    assert (o[PAD] == 0).all()
    _assert_same_writes(pool, ref_pool, tol, "pool after the commit inside the verify")
    assert torch.equal(o, separate_o), "outputs against a separate commit and verify"
    assert torch.equal(pool.nan_to_num(7.0), separate.nan_to_num(7.0)), "pool against a separate commit"

    last = accepted.flip(0) % (tokens + 1)
    cula_commit(pending, last)
    cula_commit(ref_pending, last, algorithm="recurrent", compute_dtype=torch.float64)
    _assert_same_writes(pool, ref_pool, tol, "pool after the last commit")
    assert_untouched(pool, UNUSED)
    assert ops == ["deferred", "deferred", "deferred", "commit", "deferred", "commit"]


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16-pool", "fp32-pool"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no-l2norm"])
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_lightning_chunk_verify_and_commit(tokens, l2norm, state_dtype, monkeypatch, generator):
    """Lightning with bfloat16 inputs runs its deferred verify and its commit as tensor-core
    products (``verify_chunk_triton``; the test fails if another kernel runs them). On SLOTS
    (padding row, NaN in the unused slots), a strong decay on one head: the verify against the
    float64 oracle, a commit of every accepted count 0..T across the rows, then a second verify
    from the committed states."""
    from cula_serve.kernels.lightning import verify_chunk_triton
    ops = _record_ops(monkeypatch, verify_chunk_triton, "lightning_chunk")
    N = len(SLOTS)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    accepted = torch.arange(N, dtype=torch.int32) % (tokens + 1)
    pool, _ = _pool(WY, state_dtype, [s for s in SLOTS if s >= 0], generator)
    ref_pool = pool.double()
    tol = tolerance(torch.bfloat16, state_dtype)
    for step in range(2):
        kw = random_inputs("lightning", (N, tokens), **WY, generator=generator)
        kw["decay"] = torch.tensor([-0.05, -6.0])  # a^16 of the second head: 1e-42, past float32's normals
        if not l2norm:
            kw["use_qk_l2norm_in_kernel"] = False
            kw["scale"] = 0.05
        q, k, v, rest = _split(kw)
        o, pending = cula_verify(q, k, v, pool, mode="lightning", state_indices=slots, **rest, **TRITON)
        q, k, v, rest = _split(to_float64(kw))
        ref_o, ref_pending = cula_verify(q, k, v, ref_pool, mode="lightning", state_indices=slots, **rest, **ORACLE)
        assert_close(o, ref_o, tol, f"verify {step} outputs")
        assert (o[PAD] == 0).all()
        cula_commit(pending, accepted)
        cula_commit(ref_pending, accepted, algorithm="recurrent", compute_dtype=torch.float64)
        _assert_same_writes(pool, ref_pool, tol, f"pool after commit {step}")
        assert_untouched(pool, UNUSED)
        accepted = accepted.flip(0)
    assert ops == ["deferred", "commit"] * 2


def test_which_verifies_take_the_wy_form():
    """A float32 pool takes the WY form only with 16-bit inputs (its bfloat16 products would not
    hold float32 inputs to the 1e-5 tolerance), GDN and KDA alike."""
    gdn, kda = types.SimpleNamespace(mode="gdn"), types.SimpleNamespace(mode="kda")
    pool = torch.zeros(1, 1, 64, 64)
    shape = (torch.zeros(1, 4, 1, 64), 4, 0, 64, 64)  # saved u, T, TP, K, V
    assert verify_wy_triton.applies(gdn, "deferred", pool, *shape, torch.bfloat16, heads=1)
    assert not verify_wy_triton.applies(gdn, "deferred", pool, *shape, torch.float32, heads=1)
    assert verify_wy_triton.applies(gdn, "commit", pool.bfloat16(), *shape, torch.float32, heads=1)
    assert verify_wy_triton.applies(kda, "commit", pool.bfloat16(), *shape, torch.bfloat16, heads=1)
    assert verify_wy_triton.applies(kda, "commit", pool, *shape, torch.bfloat16, heads=1)
    assert not verify_wy_triton.applies(kda, "deferred", pool, *shape, torch.float32, heads=1)


# ------------------------------------------------------------------------------------------------
# backend interface


def test_availability_and_head_dims():
    assert triton_backend.availability(torch.device("cpu")) is None
    assert triton_backend.head_dims_error(128, 128) is None and triton_backend.head_dims_error(16, 256) is None
    assert "K=96" in triton_backend.head_dims_error(96, 128)
    assert triton_backend.head_dims_error(128, 512) is not None
    kw = random_inputs("gdn", (2, 1), H=1, HV=1, K=24, V=32)
    q, k, v, rest = _split(kw)
    with pytest.raises(ValueError, match="triton"):
        cula_decode(q, k, v, torch.zeros(2, 1, 32, 24), mode="gdn", **rest, **TRITON)


def test_unknown_keyword_and_bad_pool_layout_raise_before_writing(generator):
    kw = random_inputs("kda", (2, 1), **GVA, generator=generator)
    q, k, v, rest = _split(kw)
    pool, _ = _pool(GVA, torch.float32, [0, 1], generator)
    before = pool.clone()
    with pytest.raises(TypeError, match="unexpected keyword"):
        cula_decode(q, k, v, pool, mode="kda", **rest, algorithm="recurrent", **TRITON)
    # K not innermost: pool[slot, hv, v, k] with a transposed [K, V] storage
    transposed = pool.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match="state_pool"):
        cula_decode(q, k, v, transposed, mode="kda", **rest, **TRITON)
    assert torch.equal(pool.nan_to_num(7.0), before.nan_to_num(7.0))
    assert torch.equal(transposed.nan_to_num(7.0), before.nan_to_num(7.0))


@pytest.mark.parametrize("mode", ["gdn", "lightning"])
def test_prefill_dispatches_to_the_chunk_kernels(mode, monkeypatch):
    """prefill hands the backend's arguments unchanged to the family's chunked Triton kernel."""
    name, function = ((".delta_rule.chunk_triton", "delta_rule_prefill") if mode == "gdn"
                      else (".lightning.chunk_triton", "lightning_prefill"))
    calls = []
    fake = types.ModuleType("cula_serve.kernels" + name)
    setattr(fake, function, lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setitem(sys.modules, "cula_serve.kernels" + name, fake)
    kw = random_inputs(mode, (1, 5), **GVA)
    pool = torch.zeros(2, 4, 32, 32)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    prefill = cula_gdn if mode == "gdn" else cula_lightning
    prefill(**kw, cu_seqlens=cu, state_pool=pool, state_indices=torch.tensor([1, 0]), **TRITON)
    (args, kwargs), = calls
    assert args[0].mode == mode and args[1].shape == (5, 2, 32) and args[3].shape == (5, 4, 32)
    expected = ["checkpoint_every", "checkpoint_indices", "cu_seqlens", "has_initial_state", "out", "segment_tokens",
                "state_indices", "state_pool"]
    assert sorted(kwargs) == sorted(expected + (["map_columns"] if mode == "gdn" else []))
    assert kwargs["state_pool"] is pool and kwargs["state_indices"].dtype == torch.int32
    assert kwargs["segment_tokens"] is None  # the kernels decide from the shapes
    prefill(**kw, cu_seqlens=cu, state_pool=pool, state_indices=torch.tensor([1, 0]), segment_tokens=128, **TRITON)
    assert calls[-1][1]["segment_tokens"] == 128
    with pytest.raises(TypeError, match="unexpected keyword"):
        prefill(**kw, cu_seqlens=cu, state_pool=pool, state_indices=torch.tensor([1, 0]), chunk_size=64, **TRITON)


def test_warmup_compiles_every_bucket_without_error():
    from cula_serve import warmup

    calls = warmup("gdn", H=1, HV=2, K=16, V=16, batch_sizes=(1, 3), verify_tokens=(2,), device="cpu",
                   backend="triton", use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                   A_log=torch.zeros(2), dt_bias=torch.zeros(2), use_beta_sigmoid_in_kernel=True)
    assert calls == 2 * (1 + 2 * 3 + 2)  # decode; verify + commit per protocol; a verify with pending=
