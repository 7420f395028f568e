"""The SGLang plugin's layer-level path on a GPU, without SGLang: ``cula_serve.integrations.sglang.
translate`` fed SGLang-shaped metadata (a ``MambaPool``-style ``[size + 1, HV, V, K]`` layer pool
with the reserved slot 0, int32 ``cache_indices`` with eager padding on slot 0 and CUDA-graph
padding -1, ``query_start_loc``, the ``[spec_size + 1, T, HV, V, K]`` intermediate buffer and
``last_correct_step_indices``) at the model shapes, against the float64 oracle. Then the same
decode and verify + commit captured in CUDA graphs with static buffers and replayed with new
inputs, slots and accepted lengths, as SGLang's graph runner does.

Run with ``pytest -m gpu tests/gpu/test_sglang_layer_gpu.py``.
"""
import pytest
import torch
import torch.nn.functional as F

from cula_serve import cula_decode, cula_gdn, cula_kda, cula_lightning
from cula_serve.inputs import MODE_SHAPES, minimax_decay

from conftest import ORACLE, assert_close, skip_module_unless_gpu, tolerance

pytestmark = pytest.mark.gpu

skip_module_unless_gpu()

from cula_serve.integrations.sglang import translate  # noqa: E402

DEVICE = torch.device("cuda")
MODES = ["gdn", "kda", "lightning"]
SIZE = 24  # slots 1..SIZE usable, slot 0 reserved, as in SGLang's MambaPool
T = 4  # draft tokens per request
# 8 request rows: row 2 is an eager padded row (slot 0), row 6 a CUDA-graph padded row (-1)
SLOTS = [17, 3, 0, 9, 22, 5, -1, 12]
LIVE = [n for n, s in enumerate(SLOTS) if s > 0]
LIVE_SLOTS = [SLOTS[n] for n in LIVE]
UNUSED = [s for s in range(SIZE + 1) if s not in LIVE_SLOTS]


def _gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _randn(*shape, generator, dtype=torch.float32):
    return torch.randn(*shape, generator=generator, device=DEVICE).to(dtype)


class Layer:
    """One linear-attention layer's parameters, as SGLang's RadixLinearAttention carries them."""

    def __init__(self, mode, generator):
        s = MODE_SHAPES[mode]
        self.mode, self.H, self.HV, self.K, self.V = mode, s["H"], s["HV"], s["K"], s["V"]
        self.A_log = torch.empty(self.HV, device=DEVICE).uniform_(0, 2.5, generator=generator)
        self.dt_bias = _randn(self.HV if mode == "gdn" else self.HV * self.K, generator=generator)
        self.lower_bound = -5.0 if mode == "kda" else None
        # Lightning: SGLang's per-layer slope; cula-serve's decay is -slope
        self.slope = -minimax_decay(self.HV).to(DEVICE)

    def oracle_gates(self):
        if self.mode == "lightning":
            return dict(decay=-self.slope.double())
        gates = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     A_log=self.A_log.double(), dt_bias=self.dt_bias.double())
        if self.mode == "kda":
            gates["lower_bound"] = self.lower_bound
        return gates

    def raw_gates(self, rows, generator):
        """SGLang's raw a, b for ``rows`` tokens (GDN a [rows, HV], KDA a [rows, HV * K])."""
        a = _randn(rows, self.HV if self.mode == "gdn" else self.HV * self.K, generator=generator)
        return a, _randn(rows, self.HV, generator=generator)


def _pool(layer, state_dtype, generator):
    pool = torch.full((SIZE + 1, layer.HV, layer.V, layer.K), float("nan"), device=DEVICE, dtype=state_dtype)
    pool[LIVE_SLOTS] = (0.5 * _randn(len(LIVE_SLOTS), layer.HV, layer.V, layer.K, generator=generator)).to(state_dtype)
    return pool


def _slots():
    return torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)


def _assert_untouched(pool):
    assert torch.isnan(pool[UNUSED].float()).all(), "a padding row or an unused slot was written"


def _step_oracle(layer, q, k, v, a, b, start):
    """Token by token over [N, T, ...] inputs of the live rows. Returns (outputs, states after each token)."""
    pool, outs, states = start.clone(), [], []
    n = len(LIVE)
    for t in range(q.shape[1]):
        gates = layer.oracle_gates()
        if layer.mode == "lightning":
            o, _ = cula_decode(*(x[LIVE, t:t + 1].double() for x in (q, k, v)), pool, mode="lightning",
                               state_indices=torch.arange(n, device=DEVICE), **gates, **ORACLE)
        else:
            o, _ = cula_decode(*(x[LIVE, t:t + 1].double() for x in (q, k, v)), pool, mode=layer.mode,
                               g=a[LIVE, t:t + 1].double(), beta=b[LIVE, t:t + 1].double(),
                               state_indices=torch.arange(n, device=DEVICE), **gates, **ORACLE)
        outs.append(o)
        states.append(pool.clone())
    return torch.cat(outs, 1), states


@pytest.mark.parametrize("mode", MODES)
def test_extend_from_sglang_metadata(mode):
    g = _gen(1)
    layer = Layer(mode, g)
    pool = _pool(layer, torch.float32, g)
    lens = [300, 1, 77, 64]
    rows = [0, 1, 3, 5]  # live rows only: extend batches carry no padding
    slots = torch.tensor([SLOTS[r] for r in rows], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 300, 301, 378, 442], dtype=torch.int32, device=DEVICE)
    Tt = sum(lens)
    H, HV, K, V = layer.H, layer.HV, layer.K, layer.V
    q, k = (_randn(1, Tt, H, K, generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = _randn(1, Tt, HV, V, generator=g, dtype=torch.bfloat16)
    ref_pool = pool[[SLOTS[r] for r in rows]].double().clone()
    idx = torch.arange(4, device=DEVICE)
    q64, k64, v64 = (x.double() for x in (q, k, v))
    if mode == "gdn":
        a, b = layer.raw_gates(Tt, g)
        gate = -torch.exp(layer.A_log) * F.softplus(a + layer.dt_bias)  # SGLang's fused_gdn_gating
        beta = torch.sigmoid(b)
        out = translate.gdn_extend(q, k, v, gate[None], beta[None], ssm_states=pool, cache_indices=slots,
                                   query_start_loc=qsl)
        ref, _ = cula_gdn(q64, k64, v64, gate[None].double(), beta[None].double(), cu_seqlens=qsl, state_pool=ref_pool,
                          state_indices=idx, use_qk_l2norm_in_kernel=True, **ORACLE)
    elif mode == "kda":
        a, b = layer.raw_gates(Tt, g)
        out = translate.kda_extend(q, k, v, a, b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                                   lower_bound=layer.lower_bound, ssm_states=pool, cache_indices=slots,
                                   query_start_loc=qsl)
        ref, _ = cula_kda(q64, k64, v64, a.view(1, Tt, HV, K).double(), b[None].double(), cu_seqlens=qsl,
                          state_pool=ref_pool, state_indices=idx, **layer.oracle_gates(), **ORACLE)
    else:
        has_initial = torch.tensor([True, False, True, True], device=DEVICE)
        out = translate.lightning_extend(q[0], k[0], v[0], slope=layer.slope, scale=K ** -0.5, ssm_states=pool,
                                         cache_indices=slots, query_start_loc=qsl, has_initial_state=has_initial)[None]
        ref, _ = cula_lightning(q64, k64, v64, -layer.slope.double(), scale=K ** -0.5, cu_seqlens=qsl,
                                state_pool=ref_pool, state_indices=idx, has_initial_state=has_initial, **ORACLE)
    tol = tolerance(torch.bfloat16, torch.float32)
    assert_close(out, ref, tol)
    assert_close(pool[[SLOTS[r] for r in rows]], ref_pool, tol, "final states")
    assert torch.isnan(pool[0]).all() and torch.isnan(pool[[s for s in UNUSED if s > 0]]).all()


def _decode(layer, q, k, v, a, b, pool, slots):
    """One SGLang decode call: q, k [1, N, H, K] (Lightning [N, H, D])."""
    if layer.mode == "lightning":
        return translate.lightning_decode(q, k, v, slope=layer.slope, scale=layer.K ** -0.5, ssm_states=pool,
                                          cache_indices=slots)
    return translate.delta_rule_decode(layer.mode, q, k, v, a, b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                                       ssm_states=pool, cache_indices=slots, lower_bound=layer.lower_bound)


def _decode_inputs(layer, generator):
    N = len(SLOTS)
    lead = (N,) if layer.mode == "lightning" else (1, N)
    q, k = (_randn(*lead, layer.H, layer.K, generator=generator, dtype=torch.bfloat16) for _ in range(2))
    v = _randn(*lead, layer.HV, layer.V, generator=generator, dtype=torch.bfloat16)
    a, b = layer.raw_gates(N, generator)
    return q, k, v, a, b


def _as_steps(layer, q, k, v, a, b, T_):
    """SGLang decode / verify inputs -> [N, T_, ...] per-token views for the oracle."""
    N = len(SLOTS)
    q, k, v = (x.reshape(N, T_, *x.shape[-2:]) for x in (q, k, v))
    if layer.mode == "lightning":
        return q, k, v, None, None
    a = a.reshape(N, T_, layer.HV) if layer.mode == "gdn" else a.reshape(N, T_, layer.HV, layer.K)
    return q, k, v, a, b.reshape(N, T_, layer.HV)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_decode_eager_and_in_a_cuda_graph(mode, state_dtype):
    g = _gen(2)
    layer = Layer(mode, g)
    tol = tolerance(torch.bfloat16, state_dtype)
    pool = _pool(layer, state_dtype, g)
    inputs = _decode_inputs(layer, g)
    start = pool[LIVE_SLOTS].double().clone()
    out = _decode(layer, *inputs, pool, _slots())
    ref_out, ref_states = _step_oracle(layer, *_as_steps(layer, *inputs, 1), start)
    out = out.reshape(len(SLOTS), layer.HV, layer.V)
    assert_close(out[LIVE], ref_out[:, 0], tol)
    assert (out[[2, 6]] == 0).all()
    assert_close(pool[LIVE_SLOTS], ref_states[0], tol, "states")
    _assert_untouched(pool)

    # CUDA graph: static inputs and slot buffer (SGLang's state_indices_list[bs - 1]) captured once
    static = [x.clone() for x in _decode_inputs(layer, g)]
    static_slots = _slots()
    graph_pool = _pool(layer, state_dtype, g)
    for _ in range(2):  # compile outside the capture
        _decode(layer, *static, graph_pool.clone(), static_slots)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _decode(layer, *static, graph_pool, static_slots)
    for replay in range(2):
        graph_pool.copy_(_pool(layer, state_dtype, g))
        fresh = _decode_inputs(layer, g)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        # the replay's slots: rows swapped, same padding positions
        perm = torch.tensor(SLOTS, dtype=torch.int32)
        perm[[0, 3]] = perm[[3, 0]]
        static_slots.copy_(perm.to(DEVICE))
        eager_pool = graph_pool.clone()
        eager_out = _decode(layer, *fresh, eager_pool, static_slots.clone())
        graph.replay()
        torch.testing.assert_close(static_out, eager_out, rtol=0, atol=0)
        torch.testing.assert_close(graph_pool, eager_pool, rtol=0, atol=0, equal_nan=True)


def _verify(layer, q, k, v, a, b, pool, slots, qsl, buffer, rows, protocol):
    if layer.mode == "lightning":
        return translate.lightning_verify(q, k, v, slope=layer.slope, scale=layer.K ** -0.5, ssm_states=pool,
                                          cache_indices=slots, query_start_loc=qsl, cache_steps=T, protocol=protocol,
                                          intermediate_states_buffer=buffer, intermediate_state_indices=rows)
    return translate.delta_rule_verify(layer.mode, q, k, v, a, b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                                       ssm_states=pool, cache_indices=slots, query_start_loc=qsl, cache_steps=T,
                                       protocol=protocol, intermediate_states_buffer=buffer,
                                       intermediate_state_indices=rows, lower_bound=layer.lower_bound)


def _verify_inputs(layer, generator):
    N = len(SLOTS)
    lead = (N * T,) if layer.mode == "lightning" else (1, N * T)
    q, k = (_randn(*lead, layer.H, layer.K, generator=generator, dtype=torch.bfloat16) for _ in range(2))
    v = _randn(*lead, layer.HV, layer.V, generator=generator, dtype=torch.bfloat16)
    a, b = layer.raw_gates(N * T, generator)
    return q, k, v, a, b


def _verify_metadata(layer, state_dtype):
    N = len(SLOTS)
    qsl = torch.arange(0, (N + 1) * T, T, dtype=torch.int32, device=DEVICE)
    buffer = torch.full((SIZE + 1, T, layer.HV, layer.V, layer.K), float("nan"), device=DEVICE, dtype=state_dtype)
    rows = torch.arange(SIZE + 1, dtype=torch.int32, device=DEVICE)  # SGLang: request row n owns buffer row n
    return qsl, buffer, rows


# per row: SGLang's last_correct_step_indices; padded rows carry -1
LAST_CORRECT = [3, 0, -1, 2, 1, 0, -1, 3]


@pytest.mark.parametrize("protocol", ["buffer", "deferred"])
@pytest.mark.parametrize("mode", MODES)
def test_verify_and_commit_eager(mode, protocol):
    g = _gen(3)
    layer = Layer(mode, g)
    tol = tolerance(torch.bfloat16, torch.float32)
    pool = _pool(layer, torch.float32, g)
    qsl, buffer, rows = _verify_metadata(layer, torch.float32)
    inputs = _verify_inputs(layer, g)
    start = pool[LIVE_SLOTS].double().clone()
    before = pool.clone()
    out, pending = _verify(layer, *inputs, pool, _slots(), qsl, buffer, rows, protocol)
    ref_out, ref_states = _step_oracle(layer, *_as_steps(layer, *inputs, T), start)
    out = out.reshape(len(SLOTS), T, layer.HV, layer.V)
    assert_close(out[LIVE], ref_out, tol, "verify outputs")
    assert (out[[2, 6]] == 0).all()
    torch.testing.assert_close(pool, before, rtol=0, atol=0, equal_nan=True)
    if protocol == "buffer":
        for t in range(T):
            assert_close(buffer[LIVE, t], ref_states[t], tol, f"buffer step {t}")
    else:
        assert torch.isnan(buffer).all()
    pendings = translate.PendingVerifies()
    pendings.begin_eager()
    pendings.record(pending)
    assert pendings.commit(torch.tensor(LAST_CORRECT, device=DEVICE)) == 1
    for i, n in enumerate(LIVE):
        kept = LAST_CORRECT[n] + 1
        assert_close(pool[SLOTS[n]], ref_states[kept - 1][i], tol, f"slot {SLOTS[n]} keeps {kept}")
    _assert_untouched(pool)


@pytest.mark.parametrize("protocol", ["buffer", "deferred"])
@pytest.mark.parametrize("mode", MODES)
def test_verify_and_commit_through_cuda_graph_replays(mode, protocol):
    """The verify of one layer captured per batch size with ``PendingVerifies.begin_capture``;
    each replay is followed by ``use_graph`` + ``commit`` outside the graph, as SGLang's graph
    runner and post-sampling commit do. Compared with the same steps run eagerly."""
    g = _gen(4)
    layer = Layer(mode, g)
    qsl, buffer, rows = _verify_metadata(layer, torch.float32)
    static = [x.clone() for x in _verify_inputs(layer, g)]
    static_slots = _slots()
    pool = _pool(layer, torch.float32, g)
    for _ in range(2):
        _verify(layer, *static, pool.clone(), static_slots, qsl, buffer.clone(), rows, protocol)
    torch.cuda.synchronize()
    pendings = translate.PendingVerifies()
    pendings.begin_capture(len(SLOTS))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, pending = _verify(layer, *static, pool, static_slots, qsl, buffer, rows, protocol)
        pendings.record(pending)
    assert len(pendings._graphs[len(SLOTS)]) == 1
    for replay in range(3):
        pool.copy_(_pool(layer, torch.float32, g))
        buffer.fill_(float("nan"))
        fresh = _verify_inputs(layer, g)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        perm = torch.tensor(SLOTS, dtype=torch.int32)
        perm[[0, 4]] = perm[[4, 0]] if replay % 2 else perm[[0, 4]]
        static_slots.copy_(perm.to(DEVICE))
        last_correct = torch.tensor(LAST_CORRECT[replay:] + LAST_CORRECT[:replay], device=DEVICE)
        last_correct[[2, 6]] = -1

        eager_pool, eager_buffer = pool.clone(), buffer.clone()
        eager_out, eager_pending = _verify(layer, *fresh, eager_pool, static_slots.clone(), qsl, eager_buffer, rows,
                                           protocol)
        translate.commit_verify(eager_pending, last_correct)

        graph.replay()
        pendings.use_graph(len(SLOTS))
        pendings.commit(last_correct)
        torch.testing.assert_close(static_out, eager_out, rtol=0, atol=0)
        torch.testing.assert_close(pool, eager_pool, rtol=0, atol=0, equal_nan=True)
        _assert_untouched(pool)
