"""The GPU backends' decode, verify and commit (triton, and cute where it is available) on a GPU at
the model shapes (DESIGN section 1):
against the float64 oracle at batch 1, 8 and 64 with permuted and padded (NaN-poisoned) slots,
every MTP protocol and accepted length, and under CUDA graphs: captured once with static buffers,
replayed with new inputs, indices and accepted counts, and compared with eager calls.

Run with ``pytest -m gpu tests/gpu``. The float64 oracle (the torch backend's recurrence) runs on
the same GPU: the math is the same as on the CPU and the model shapes are large for it there.
"""

import pytest
import torch

from cula_serve import api, cula_commit, cula_decode, cula_verify, dispatch
from cula_serve.inputs import MODE_SHAPES, random_inputs, relative_error, to_float64

from conftest import ORACLE, assert_close, skip_module_unless_gpu, tolerance

pytestmark = pytest.mark.gpu

skip_module_unless_gpu()

DEVICE = torch.device("cuda")
ORACLE_COMMIT = dict(algorithm="recurrent", compute_dtype=torch.float64)
SHAPES = MODE_SHAPES
MODES = ["gdn", "kda", "lightning"]
BATCHES = [1, 8, 64]
T = 4


@pytest.fixture(params=["triton", "cute"])
def backend(request):
    """The backend under test as call keywords; skipped where it cannot run."""
    module, reason = dispatch.backend_status(request.param, DEVICE)
    if module is None:
        pytest.skip(f"{request.param}: {reason}")
    return dict(backend=request.param)


def _generators(seed):
    return torch.Generator().manual_seed(seed), torch.Generator(device=DEVICE).manual_seed(seed)


def _slots(B, generator):
    """int32 [B] permuted slots of a pool of 2B + 3; for B > 1 every fifth row (2, 7, ...) is padding.
    Returns (slots, pool size)."""
    P = 2 * B + 3
    slots = torch.randperm(P, generator=generator)[:B].to(torch.int32)
    if B > 1:
        slots[2::5] = -1
    return slots.to(DEVICE), P


def _pool(P, shape, dtype, live_slots, generator):
    """A NaN pool [P, HV, V, K] on the GPU with random states in ``live_slots``."""
    pool = torch.full((P, shape["HV"], shape["V"], shape["K"]), float("nan"), dtype=dtype, device=DEVICE)
    live = live_slots[live_slots >= 0].long()
    pool[live] = (0.5 * torch.randn(len(live), *pool.shape[1:], generator=generator, device=DEVICE)).to(dtype)
    return pool


def _assert_same_writes(pool, ref_pool, tol, what="pool"):
    """NaN exactly where the reference has NaN (untouched slots), the reference's values elsewhere."""
    nan, ref_nan = torch.isnan(pool.float()), torch.isnan(ref_pool.float())
    assert torch.equal(nan, ref_nan), f"{what}: written where the reference did not write, or the reverse"
    assert_close(pool[~nan], ref_pool[~ref_nan], tol, what)


def _split(kw):
    return kw["q"], kw["k"], kw["v"], {key: val for key, val in kw.items() if key not in ("q", "k", "v")}


def _protocol_layout(protocol, B, T, generator):
    """(P, verify arguments, accepted) for B rows verifying T tokens: permuted slots with padding,
    the accepted counts cycling through every length (0..T; slots 1..T). For "slots" the previous
    step's accepted count varies per row and selects the read column."""
    slots, P = _slots(B, generator)
    accepted = (torch.arange(B, dtype=torch.int32) % (T + 1)).to(DEVICE)
    if protocol == "deferred":
        return P, dict(state_indices=slots), accepted
    if protocol == "buffer":
        rows = torch.randperm(B + 1, generator=generator)[:B].to(torch.int32).to(DEVICE)
        return P, dict(state_indices=slots, intermediate_indices=rows), accepted
    # slots: column prev[n] - 1 of row n holds its slot, the other columns scratch slots past P
    prev = (1 + torch.arange(B, dtype=torch.int32) % T)
    columns = P + torch.arange(B * T, dtype=torch.int32).reshape(B, T)
    columns[torch.arange(B), prev.long() - 1] = slots.cpu()
    columns[slots.cpu() < 0] = -1
    return P + B * T, dict(state_indices=columns.to(DEVICE), num_accepted_tokens=prev.to(DEVICE)), 1 + accepted % T


def _check_decode(mode, kw, pool, ref_pool, slots, backend, state_dtype):
    """One decode of ``kw`` on ``pool`` by ``backend`` against the float64 oracle on ``ref_pool``
    (the same states in float64): outputs, and the pool written exactly where the oracle's is.
    Returns the outputs."""
    q, k, v, rest = _split(kw)
    o, _ = cula_decode(q, k, v, pool, mode=mode, state_indices=slots, **rest, **backend)
    q, k, v, rest = _split(to_float64(kw))
    ref_o, _ = cula_decode(q, k, v, ref_pool, mode=mode, state_indices=slots, **rest, **ORACLE)
    tol = tolerance(torch.bfloat16, state_dtype)
    assert_close(o, ref_o, tol)
    _assert_same_writes(pool, ref_pool, tol)
    return o


def _read_slots(protocol, call):
    """The slot each row's initial state is read from."""
    indices = call["state_indices"]
    if protocol != "slots":
        return indices
    return indices.gather(1, call["num_accepted_tokens"].long()[:, None] - 1)[:, 0]


# ------------------------------------------------------------------------------------------------
# against the oracle


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_model_shapes(mode, B, state_dtype, backend):
    cpu_gen, gpu_gen = _generators(B)
    shape = SHAPES[mode]
    slots, P = _slots(B, cpu_gen)
    pool = _pool(P, shape, state_dtype, slots, gpu_gen)
    kw = random_inputs(mode, (B, 1), **shape, device=DEVICE, generator=cpu_gen)
    o = _check_decode(mode, kw, pool, pool.double(), slots, backend, state_dtype)
    assert (o[slots < 0] == 0).all()


def _paged(dense, page_pad):
    """``dense`` [P, ...] as a view into pages of one slot plus ``page_pad`` NaN floats each (an
    engine's strided pool). Returns (pool view, pages)."""
    slot_size = dense[0].numel()
    pages = torch.full((dense.shape[0], slot_size + page_pad), float("nan"), device=DEVICE)
    pool = pages[:, :slot_size].view(dense.shape)
    pool.copy_(dense)
    return pool, pages


def _check_verify_and_commit(mode, protocol, kw, backend, cpu_gen, gpu_gen, page_pad=None):
    """Verify of ``kw`` ([B, T] tokens, bf16) on a float32 pool by ``backend`` against the float64
    oracle: the outputs, what the verify writes, and the pool after a commit whose accepted counts
    cover every length. With ``page_pad`` the pool is paged (``_paged``) and its padding must stay
    NaN."""
    B, T = kw["v"].shape[:2]
    shape = SHAPES[mode]
    P, call, accepted = _protocol_layout(protocol, B, T, cpu_gen)
    pool = _pool(P, shape, torch.float32, _read_slots(protocol, call), gpu_gen)
    ref_pool, ref_call = pool.double(), dict(call)
    if page_pad is not None:
        pool, pages = _paged(pool, page_pad)
    if protocol == "buffer":
        call["intermediate_states"] = torch.full((B + 1, T, *pool.shape[1:]), float("nan"), device=DEVICE)
        ref_call["intermediate_states"] = call["intermediate_states"].double()
    q, k, v, rest = _split(kw)
    o, pending = cula_verify(q, k, v, pool, mode=mode, protocol=protocol, **call, **rest, **backend)
    q, k, v, rest = _split(to_float64(kw))
    ref_o, ref_pending = cula_verify(q, k, v, ref_pool, mode=mode, protocol=protocol, **ref_call, **rest, **ORACLE)
    tol = tolerance(torch.bfloat16, torch.float32)
    assert_close(o, ref_o, tol, "verify outputs")
    assert (o[_read_slots(protocol, call) < 0] == 0).all()
    _assert_same_writes(pool, ref_pool, tol, "pool after verify")
    if protocol == "buffer":
        _assert_same_writes(call["intermediate_states"], ref_call["intermediate_states"], tol, "intermediate states")
    cula_commit(pending, accepted)
    cula_commit(ref_pending, accepted, **ORACLE_COMMIT)
    _assert_same_writes(pool, ref_pool, tol, "pool after commit")
    if page_pad is not None:
        assert torch.isnan(pages[:, pool[0].numel():]).all(), "wrote into the padding between slots"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", ["buffer", "slots", "deferred"])
@pytest.mark.parametrize("B", BATCHES)
def test_verify_and_commit_model_shapes(mode, protocol, B, backend):
    cpu_gen, gpu_gen = _generators(100 + B)
    kw = random_inputs(mode, (B, T), **SHAPES[mode], device=DEVICE, generator=cpu_gen)
    _check_verify_and_commit(mode, protocol, kw, backend, cpu_gen, gpu_gen)


@pytest.mark.parametrize("mode", ["gdn", "kda"])
@pytest.mark.parametrize("protocol", ["buffer", "slots", "deferred"])
def test_verify_and_commit_strong_decays(mode, protocol, backend):
    """T = 8 (the longest verify) with prepared log decays near -25 on tokens 1, 2 and 5 (in every
    channel for KDA): the products of decays fall below 2^-60 within the verify (where a kernel
    that folds scalar decays into per-token factors must apply them to the state) and the token
    couplings of earlier tokens underflow."""
    B, tokens = 8, 8
    cpu_gen, gpu_gen = _generators(17)
    kw = random_inputs(mode, (B, tokens), **SHAPES[mode], device=DEVICE, generator=cpu_gen, fused_gate=False)
    strong = torch.zeros(tokens, dtype=torch.bool, device=DEVICE)
    strong[[1, 2, 5]] = True
    strong = strong.view(1, tokens, *([1] * (kw["g"].dim() - 2)))
    kw["g"] = torch.where(strong, kw["g"] - 25.0, kw["g"])
    _check_verify_and_commit(mode, protocol, kw, backend, cpu_gen, gpu_gen)


@pytest.mark.parametrize("mode, gate", [("gdn", "prepared"), ("kda", "prepared"), ("kda", "safe")])
def test_decode_gate_variants(mode, gate, backend):
    """The gates random_inputs does not draw: a prepared log decay with beta in (0, 1), and the
    safe gate lower_bound * sigmoid(A (a + dt_bias)) (KDA's option)."""
    B = 8
    cpu_gen, gpu_gen = _generators(3)
    shape = SHAPES[mode]
    slots, P = _slots(B, cpu_gen)
    pool = _pool(P, shape, torch.float32, slots, gpu_gen)
    kw = random_inputs(mode, (B, 1), **shape, device=DEVICE, generator=cpu_gen, fused_gate=gate == "safe")
    if gate == "safe":
        kw["lower_bound"] = -5.0
    _check_decode(mode, kw, pool, pool.double(), slots, backend, torch.float32)


@pytest.mark.parametrize("page_pad", [4, 1])
def test_decode_paged_pool(page_pad, backend):
    """A pool strided in its slot dim, as an engine's pages: slots padded by 4 floats (16-byte
    aligned) and by 1 (only 4-byte aligned; kernels that vectorise state loads must not)."""
    B, mode = 8, "gdn"
    cpu_gen, gpu_gen = _generators(5)
    shape = SHAPES[mode]
    slots, P = _slots(B, cpu_gen)
    dense = _pool(P, shape, torch.float32, slots, gpu_gen)
    pool, pages = _paged(dense, page_pad)
    kw = random_inputs(mode, (B, 1), **shape, device=DEVICE, generator=cpu_gen)
    _check_decode(mode, kw, pool, dense.double(), slots, backend, torch.float32)
    assert torch.isnan(pages[:, dense[0].numel():]).all(), "wrote into the padding between slots"


@pytest.mark.parametrize("page_pad", [4, 1])
@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_verify_and_commit_paged_pool(mode, page_pad, backend):
    """Deferred verify + commit at B = 64 on paged pools (kernels may pick other load and store
    paths at this size than at B = 8, vectorised or element-wise by the pages' alignment)."""
    cpu_gen, gpu_gen = _generators(23)
    kw = random_inputs(mode, (64, T), **SHAPES[mode], device=DEVICE, generator=cpu_gen)
    _check_verify_and_commit(mode, "deferred", kw, backend, cpu_gen, gpu_gen, page_pad=page_pad)


# ------------------------------------------------------------------------------------------------
# a deferred verify that commits the previous one first (pending=)


def _layer_inputs(mode, B, T, cpu_gen, like=None, **options):
    """[B, T] verify inputs; with ``like`` its layer parameters (A_log, dt_bias, decay): an engine
    passes the same ones every step."""
    kw = random_inputs(mode, (B, T), **SHAPES[mode], device=DEVICE, generator=cpu_gen, **options)
    if like is not None:
        kw.update({key: like[key] for key in ("A_log", "dt_bias", "decay") if key in like})
    return kw


def _no_separate_commit(monkeypatch, backend, mode):
    """A verify with pending= must commit inside its own kernel: on the cute backend, and on the
    Triton one for the delta rule (its Lightning verify and commit stay two launches)."""
    if backend["backend"] == "cute" or mode != "lightning":
        def separate_commit(*args, **kwargs):
            raise AssertionError(f"the {backend['backend']} backend ran a separate commit instead of its fused kernel")
        monkeypatch.setattr(api, "cula_commit", separate_commit)


SEPARATE_TOLERANCE = 1e-4  # a few roundings apart, far inside the oracle's tolerances


def _check_pending_step(mode, first, second, accepted, state_dtype, backend, monkeypatch, B, seed):
    """A deferred verify of ``first`` on permuted, padded slots, then a verify of ``second`` with
    pending= that commits ``accepted`` of it first; against the float64 oracle (separate verify,
    commit, verify) and against the same backend's separate calls."""
    cpu_gen, gpu_gen = _generators(seed)
    slots, P = _slots(B, cpu_gen)
    initial = _pool(P, SHAPES[mode], state_dtype, slots, gpu_gen)
    pool, separate, ref_pool = initial.clone(), initial.clone(), initial.double()
    q, k, v, rest = _split(first)
    _, pending = cula_verify(q, k, v, pool, mode=mode, state_indices=slots, **rest, **backend)
    q2, k2, v2, rest2 = _split(second)
    with monkeypatch.context() as patched:
        _no_separate_commit(patched, backend, mode)
        o, next_pending = cula_verify(q2, k2, v2, pool, mode=mode, pending=pending, num_accepted_tokens=accepted,
                                      **rest2, **backend)

    _, separate_pending = cula_verify(q, k, v, separate, mode=mode, state_indices=slots, **rest, **backend)
    cula_commit(separate_pending, accepted)
    separate_o, _ = cula_verify(q2, k2, v2, separate, mode=mode, state_indices=slots, **rest2, **backend)
    fq, fk, fv, frest = _split(to_float64(first))
    _, ref_pending = cula_verify(fq, fk, fv, ref_pool, mode=mode, state_indices=slots, **frest, **ORACLE)
    cula_commit(ref_pending, accepted, **ORACLE_COMMIT)
    fq, fk, fv, frest = _split(to_float64(second))
    ref_o, ref_pending = cula_verify(fq, fk, fv, ref_pool, mode=mode, state_indices=slots, **frest, **ORACLE)

    tol = tolerance(torch.bfloat16, state_dtype)
    assert_close(o, ref_o, tol, "verify outputs")
    assert (o[slots < 0] == 0).all()
    _assert_same_writes(pool, ref_pool, tol, "pool after the commit inside the verify")
    # the same math as the separate calls; the Triton kernel's commit runs on the verify's tile
    # layout (other reduction orders for the k norms), so equal up to rounding, not bit for bit
    assert_close(o, separate_o, SEPARATE_TOLERANCE, "outputs against a separate commit and verify")
    assert_close(pool[slots[slots >= 0].long()], separate[slots[slots >= 0].long()], SEPARATE_TOLERANCE,
                 "pool against a separate commit")
    # the new pending commits like any other
    last = accepted.roll(1) % (second["v"].shape[1] + 1)
    cula_commit(next_pending, last)
    cula_commit(ref_pending, last, **ORACLE_COMMIT)
    _assert_same_writes(pool, ref_pool, tol, "pool after the next commit")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_with_pending(mode, B, state_dtype, backend, monkeypatch):
    """Every accepted count 0..T of the pending verify across the rows; the second verify has
    another length (T + 2 on the cute kernel's other compile-time shape)."""
    cpu_gen = torch.Generator().manual_seed(400 + B)
    first = _layer_inputs(mode, B, T, cpu_gen)
    second = _layer_inputs(mode, B, T + 2, cpu_gen, like=first)
    accepted = (torch.arange(B, dtype=torch.int32) % (T + 1)).to(DEVICE)
    _check_pending_step(mode, first, second, accepted, state_dtype, backend, monkeypatch, B, 500 + B)


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_verify_with_pending_strong_decays(mode, backend, monkeypatch):
    """The pending verify is T = 8 with prepared log decays near -25 on tokens 1, 2 and 5: its
    commit inside the next verify must apply the folded decay where it underflows (as a commit does)."""
    B, tokens = 8, 8
    cpu_gen = torch.Generator().manual_seed(23)
    first = _layer_inputs(mode, B, tokens, cpu_gen, fused_gate=False)
    strong = torch.zeros(tokens, dtype=torch.bool, device=DEVICE)
    strong[[1, 2, 5]] = True
    first["g"] = torch.where(strong.view(1, tokens, *([1] * (first["g"].dim() - 2))), first["g"] - 25.0, first["g"])
    second = _layer_inputs(mode, B, T, cpu_gen, fused_gate=False)
    accepted = torch.tensor([8, 0, 3, 6, 2, 7, 1, 5], dtype=torch.int32, device=DEVICE)
    _check_pending_step(mode, first, second, accepted, torch.float32, backend, monkeypatch, B, 29)


@pytest.mark.parametrize("mode", ["gdn", "kda"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_deferred_verify_on_tensor_cores(mode, tokens, monkeypatch):
    """From 2048 heads a cute deferred verify of a bfloat16 pool takes its dot products with the
    state on the tensor cores (``recurrent_cute._tensor_core_dots``: one, a padded and two full
    mma column tiles for T = 1, 3, 8), and so does the commit of a pending verify inside the next
    one (``_tensor_core_commit``: token groups of 4 for T = 1, 3, padded slots, and of 8 for
    T = 8), here with prepared log decays near -25 on token 1 and every accepted count 0..T.
    Against the float64 oracle and the separate verify, commit, verify calls (through the next
    verify, which commits it first), and against the same kernel's reductions (both float32
    products of the same bfloat16 state) within a few roundings."""
    if dispatch.backend_status("cute", DEVICE)[0] is None:
        pytest.skip("cute backend unavailable")
    from cula_serve.kernels.delta_rule import recurrent_cute
    B, shape = 64, SHAPES[mode]
    assert recurrent_cute.launch_shape("deferred", B, shape["HV"], shape["K"], shape["V"], tokens, torch.bfloat16,
                                       tensor_cores=True)[4], "this shape should run on the tensor cores"
    cpu_gen = torch.Generator().manual_seed(31 + tokens)
    first = _layer_inputs(mode, B, tokens, cpu_gen, fused_gate=False)
    second = _layer_inputs(mode, B, tokens, cpu_gen, fused_gate=False)
    for kw in (first, second):
        if tokens > 1:
            kw["g"][:, 1] -= 25.0
    accepted = (torch.arange(B, dtype=torch.int32) % (tokens + 1)).to(DEVICE)
    backend = dict(backend="cute")
    _check_pending_step(mode, first, second, accepted, torch.bfloat16, backend, monkeypatch, B, 61 + tokens)

    slots, P = _slots(B, _generators(71)[0])
    pool = _pool(P, shape, torch.bfloat16, slots, _generators(71)[1])
    q, k, v, rest = _split(first)
    results = []
    for tensor_cores in (True, False):
        with monkeypatch.context() as patched:
            launch_shape = recurrent_cute.launch_shape
            patched.setattr(recurrent_cute, "launch_shape", lambda *args, **kwargs: launch_shape(
                *args, **{**kwargs, "tensor_cores": tensor_cores and kwargs["tensor_cores"]}))
            o, pending = cula_verify(q, k, v, pool, mode=mode, state_indices=slots, **rest, **backend)
        results.append((o, pending.saved))
    for mine, theirs, what in zip(*results, ("outputs", "saved u")):
        assert_close(mine, theirs, SEPARATE_TOLERANCE, f"tensor cores against reductions: {what}")


# ------------------------------------------------------------------------------------------------
# CUDA graphs: capture once, replay with new inputs


def _capture(fn):
    """Run ``fn`` once on a side stream (compiles its kernels), then capture it in a CUDA graph.
    Returns (graph, what the captured call returned)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def _refill(static: dict, new: dict):
    """Copy the tensors of ``new`` into the same-named static buffers."""
    for key, val in new.items():
        if isinstance(val, torch.Tensor):
            static[key].copy_(val)


def _graph_setup(mode, B, seed):
    """(CPU generator, head shape, slots [B] with padding, initial pool with every slot random, its
    working copy) for a capture test."""
    cpu_gen, gpu_gen = _generators(seed)
    shape = SHAPES[mode]
    slots, P = _slots(B, cpu_gen)
    initial = _pool(P, shape, torch.float32, torch.arange(P, device=DEVICE), gpu_gen)
    return cpu_gen, shape, slots, initial, initial.clone()


def _same(x, y, what):
    """Replay and eager call run the same kernels on the same data."""
    nan, ref_nan = torch.isnan(x.float()), torch.isnan(y.float())
    assert torch.equal(nan, ref_nan), f"{what}: NaN pattern differs from the eager call"
    assert relative_error(x[~nan], y[~ref_nan]) <= 1e-6, f"{what}: differs from the eager call"


@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_decode(mode, backend):
    B = 8
    cpu_gen, shape, slots, initial, pool = _graph_setup(mode, B, 7)
    static = random_inputs(mode, (B, 1), **shape, device=DEVICE, generator=cpu_gen)
    static["state_indices"] = slots.clone()
    out = torch.empty(B, 1, shape["HV"], shape["V"], dtype=torch.bfloat16, device=DEVICE)
    q, k, v, rest = _split(static)
    graph, _ = _capture(lambda: cula_decode(q, k, v, pool, mode=mode, out=out, **rest, **backend))

    for _ in range(2):
        new = random_inputs(mode, (B, 1), **shape, device=DEVICE, generator=cpu_gen)
        new["state_indices"], _ = _slots(B, cpu_gen)
        _refill(static, new)
        pool.copy_(initial)
        graph.replay()
        expected_pool = initial.clone()
        nq, nk, nv, nrest = _split(new)
        expected_o, _ = cula_decode(nq, nk, nv, expected_pool, mode=mode, **nrest, **backend)
        torch.cuda.synchronize()
        _same(out, expected_o, "decode outputs")
        _same(pool, expected_pool, "pool after decode")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("protocol", ["buffer", "slots", "deferred"])
def test_cuda_graph_verify_and_commit(mode, protocol, backend):
    """Verify and commit captured as two graphs (engines run the commit after sampling)."""
    B = 8
    cpu_gen, gpu_gen = _generators(11)
    shape = SHAPES[mode]
    P, layout, accepted = _protocol_layout(protocol, B, T, cpu_gen)
    initial = _pool(P, shape, torch.float32, torch.arange(P, device=DEVICE), gpu_gen)
    pool = initial.clone()
    static = random_inputs(mode, (B, T), **shape, device=DEVICE, generator=cpu_gen)
    static.update({key: val.clone() for key, val in layout.items()})
    static_accepted = accepted.clone()
    if protocol == "buffer":
        static["intermediate_states"] = torch.zeros(B + 1, T, *pool.shape[1:], device=DEVICE)
    out = torch.empty(B, T, shape["HV"], shape["V"], dtype=torch.bfloat16, device=DEVICE)
    q, k, v, rest = _split(static)
    graph_verify, (_, pending) = _capture(
        lambda: cula_verify(q, k, v, pool, mode=mode, protocol=protocol, out=out, **rest, **backend))
    graph_commit, _ = _capture(lambda: cula_commit(pending, static_accepted))

    for seed in range(2):
        new = random_inputs(mode, (B, T), **shape, device=DEVICE, generator=cpu_gen)
        _, new_layout, new_accepted = _protocol_layout(protocol, B, T, torch.Generator().manual_seed(seed))
        new.update(new_layout)
        _refill(static, new)
        static_accepted.copy_(new_accepted.roll(seed + 1))
        pool.copy_(initial)
        if protocol == "buffer":
            static["intermediate_states"].zero_()  # rows of padding are not written: start like the eager call
        graph_verify.replay()
        graph_commit.replay()

        expected_pool = initial.clone()
        if protocol == "buffer":
            new["intermediate_states"] = torch.zeros_like(static["intermediate_states"])
        nq, nk, nv, nrest = _split(new)
        expected_o, expected_pending = cula_verify(nq, nk, nv, expected_pool, mode=mode, protocol=protocol,
                                                   **nrest, **backend)
        cula_commit(expected_pending, new_accepted.roll(seed + 1))
        torch.cuda.synchronize()
        _same(out, expected_o, "verify outputs")
        _same(pool, expected_pool, "pool after commit")
        if protocol == "buffer":
            _same(static["intermediate_states"], new["intermediate_states"], "intermediate states")


@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_verify_with_pending(mode, backend):
    """The steady-state step captured once: verify with pending= over the pending verify's static
    tensors, replayed with new tokens and accepted counts, equal to the eager call."""
    B = 8
    cpu_gen, shape, slots, initial, pool = _graph_setup(mode, B, 13)
    first = random_inputs(mode, (B, T), **shape, device=DEVICE, generator=cpu_gen)
    q, k, v, rest = _split(first)
    _, pending = cula_verify(q, k, v, pool, mode=mode, state_indices=slots, **rest, **backend)
    static = random_inputs(mode, (B, T), **shape, device=DEVICE, generator=cpu_gen)
    static.update({key: first[key] for key in ("A_log", "dt_bias", "decay") if key in first})
    static_accepted = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    out = torch.empty(B, T, shape["HV"], shape["V"], dtype=torch.bfloat16, device=DEVICE)
    sq, sk, sv, srest = _split(static)
    graph, _ = _capture(lambda: cula_verify(sq, sk, sv, pool, mode=mode, pending=pending, out=out,
                                            num_accepted_tokens=static_accepted, **srest, **backend))
    for seed in range(2):
        new = random_inputs(mode, (B, T), **shape, device=DEVICE, generator=cpu_gen)
        new = {key: val for key, val in new.items() if key not in ("A_log", "dt_bias", "decay")}
        _refill(static, new)
        accepted = (torch.arange(B, dtype=torch.int32, device=DEVICE) + seed) % (T + 1)
        static_accepted.copy_(accepted)
        pool.copy_(initial)
        graph.replay()
        replayed_o, replayed_pool = out.clone(), pool.clone()
        pool.copy_(initial)
        expected_o, _ = cula_verify(sq, sk, sv, pool, mode=mode, pending=pending, num_accepted_tokens=accepted,
                                    **srest, **backend)
        torch.cuda.synchronize()
        _same(replayed_o, expected_o, "verify outputs")
        _same(replayed_pool, pool, "pool after the commit inside the verify")
