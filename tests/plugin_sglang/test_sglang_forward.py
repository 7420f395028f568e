"""ForwardBatch-shaped extend, decode and target verify through the cula backends built on the real
SGLang classes, on the CPU, against the float64 oracle (DESIGN section 7 tolerances).

GDN / KDA: SGLang's metadata (``init_forward_metadata`` on a real ``ForwardBatch`` and
``HybridReqToTokenPool``) feeds the backend's kernel dispatcher with the post-convolution q / k / v
SGLang's forward passes it; the convolution itself is SGLang's and is not run here. Lightning: the
backend's whole ``forward_extend`` / ``forward_decode``. The pool is NaN except the live slots, so a
write to the reserved slot 0 (eager padded rows), to an unused slot or to another layer shows up.
Commit: ``update_mamba_state_after_mtp_verify`` of the cula hybrid wrapper, with per-request
accepted lengths, for both MTP protocols.
"""
import pytest

# the plugin API itself, not just a package named sglang
pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (.ci/sglang.sh installs it)")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import harness  # noqa: E402
from conftest import ORACLE, assert_close, assert_untouched, tolerance  # noqa: E402
from cula_serve import cula_decode, cula_gdn, cula_kda, cula_lightning  # noqa: E402

H, HV, K, V = (harness.SHAPE[x] for x in ("H", "HV", "K", "V"))
LIVE_ROWS = [1, 2, 3]
LIVE_SLOTS = [harness.ROW_SLOTS[r] for r in LIVE_ROWS]  # [5, 2, 7]
UNUSED_SLOTS = [s for s in range(harness.POOL_SIZE + 1) if s not in LIVE_SLOTS]  # includes reserved slot 0
T = harness.DRAFT_TOKENS
TOL = tolerance(torch.bfloat16, torch.float32)


@pytest.fixture
def env(monkeypatch, request):
    """(backend class name) -> (backend, pool, layer pool index, server args); restores SGLang's config."""
    overrides = []

    def build(cls_name, protocol="buffer", state_dtype=torch.float32, hf_config=None):
        from cula_serve.integrations.sglang import backend as cula_backend

        monkeypatch.setenv("CULA_SGLANG_VERIFY_PROTOCOL", protocol)
        override = harness.configuration()
        overrides.append(override)
        server_args = get_server_args()
        pool = harness.make_pool(state_dtype)
        runner = harness.make_runner(pool, server_args, hf_config)
        with harness.single_rank():
            backend = getattr(cula_backend, cls_name)(runner)
        return backend, pool

    yield build
    for override in reversed(overrides):
        override.restore()


def get_server_args():
    from sglang.srt.runtime_context import get_server_args as published
    return published()


def _poison(pool, generator):
    """NaN everywhere (every layer, every slot, the speculative buffers) except random states in
    the live slots of the test layer. Returns the test layer's pool index."""
    cache = pool.mamba_pool.mamba_cache
    idx = pool.mamba2_layer_index(harness.TEST_LAYER)
    cache.temporal.fill_(float("nan"))
    cache.intermediate_ssm.fill_(float("nan"))
    for slot in LIVE_SLOTS:
        cache.temporal[idx, slot] = (0.5 * torch.randn(HV, V, K, generator=generator)).to(cache.temporal.dtype)
    return idx


def _bf16(*shape, generator):
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


def _gdn_gate(layer, a, b):
    """SGLang's fused_gdn_gating: the prepared gate and beta GDN extend receives."""
    g = -torch.exp(layer.A_log.float()) * F.softplus(a.float() + layer.dt_bias.float())
    return g, torch.sigmoid(b.float())


def _oracle_gates(mode, layer):
    options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   A_log=layer.A_log.double(), dt_bias=layer.dt_bias.double())
    if mode == "kda":
        options["lower_bound"] = layer.lower_bound
    return options


def _dense(pool_tensor, slots):
    return pool_tensor[torch.tensor(slots)].double().clone()


# ------------------------------------------------------------------------------------------------
# GDN / KDA


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_delta_rule_extend_reaches_cula_with_sglang_slots(env, mode, generator):
    backend, pool = env("CulaGDNAttnBackend" if mode == "gdn" else "CulaKDAAttnBackend")
    idx = _poison(pool, generator)
    ssm = pool.mamba2_layer_cache(harness.TEST_LAYER).temporal
    before = ssm.clone()
    layer = harness.layer(mode, generator)
    lens, prefix = [5, 1, 7], [2, 0, 3]
    batch = harness.extend_batch(LIVE_ROWS, lens, prefix)
    backend.init_forward_metadata(batch)
    md = backend.forward_metadata
    assert md.mamba_cache_indices.tolist() == LIVE_SLOTS
    Tt = sum(lens)
    q, k, v = _bf16(1, Tt, H, K, generator=generator), _bf16(1, Tt, H, K, generator=generator), _bf16(1, Tt, HV, V, generator=generator)
    a = torch.randn(Tt, HV, generator=generator) if mode == "gdn" else torch.randn(1, Tt, HV, K, generator=generator)
    b = torch.randn(Tt, HV, generator=generator)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    ref_pool = _dense(ssm, LIVE_SLOTS)
    q64, k64, v64 = (x.double() for x in (q, k, v))
    if mode == "gdn":
        g, beta = _gdn_gate(layer, a, b)
        out, last_state, h = backend.kernel_dispatcher.extend(
            q=q, k=k, v=v, g=g[None], beta=beta[None], ssm_states=ssm, cache_indices=md.mamba_cache_indices,
            query_start_loc=md.query_start_loc, state_checkpoint_cu_starts=None, num_state_checkpoints=0,
            state_checkpoint_every_n_tokens=0, output=None, layer_id=layer.layer_id,
            extend_prefix_lens=batch.extend_prefix_lens, track_state=None, track_chunk_idx=None)
        assert last_state is None and h is None
        ref, _ = cula_gdn(q64, k64, v64, g[None].double(), beta[None].double(), cu_seqlens=cu, state_pool=ref_pool,
                          state_indices=torch.arange(3), use_qk_l2norm_in_kernel=True, **ORACLE)
    else:
        out = backend.kernel_dispatcher.extend(
            q=q, k=k, v=v, g=a, beta=b[None], ssm_states=ssm, cache_indices=md.mamba_cache_indices,
            query_start_loc=md.query_start_loc, A_log=layer.A_log, dt_bias=layer.dt_bias,
            lower_bound=layer.lower_bound, beta_is_raw=True, extend_seq_lens_cpu=lens,
            extend_prefix_lens=batch.extend_prefix_lens, layer_id=layer.layer_id, is_spec_decode=False,
            return_intermediate_states=False, track_ssm_h_src=None, track_state=None, track_chunk_idx=None,
            state_checkpoint_cu_starts=None, num_state_checkpoints=0, state_checkpoint_every_n_tokens=0,
            state_checkpoint_indices=None, track_ssm_h_batch_src=None)
        ref, _ = cula_kda(q64, k64, v64, a.double(), b[None].double(), cu_seqlens=cu, state_pool=ref_pool,
                          state_indices=torch.arange(3), **_oracle_gates("kda", layer), **ORACLE)
    assert out.shape == (1, Tt, HV, V)
    assert_close(out, ref, TOL)
    assert_close(ssm[LIVE_SLOTS], ref_pool, TOL, "final states")
    assert_untouched(ssm, UNUSED_SLOTS)
    other = 1 - idx
    assert torch.isnan(pool.mamba_pool.mamba_cache.temporal[other]).all(), "another layer's pool was written"
    assert torch.equal(before[UNUSED_SLOTS].isnan(), ssm[UNUSED_SLOTS].isnan())


def _decode_inputs(mode, B, generator):
    q, k, v = _bf16(1, B, H, K, generator=generator), _bf16(1, B, H, K, generator=generator), _bf16(1, B, HV, V, generator=generator)
    a = torch.randn(B, HV, generator=generator) if mode == "gdn" else torch.randn(B, HV * K, generator=generator)
    return q, k, v, a, torch.randn(B, HV, generator=generator)


def _oracle_steps(mode, layer, q, k, v, a, b, start_pool, rows):
    """Token-by-token oracle for the request rows ``rows`` of [1, B * T, ...] verify inputs (T per
    request). Returns (outputs [len(rows), T, HV, V], states after each token [T, len(rows), HV, V, K])."""
    n = len(rows)
    pool = start_pool.clone()
    qs, ks, vs = (x.view(-1, T, *x.shape[2:])[rows].double() for x in (q, k, v))
    gs = a.view(-1, T, HV) if mode == "gdn" else a.view(-1, T, HV, K)
    bs = b.view(-1, T, HV)
    outs, states = [], []
    for t in range(T):
        o, _ = cula_decode(qs[:, t:t + 1], ks[:, t:t + 1], vs[:, t:t + 1], pool, mode=mode,
                           g=gs[rows][:, t:t + 1].double(), beta=bs[rows][:, t:t + 1].double(),
                           state_indices=torch.arange(n), **_oracle_gates(mode, layer), **ORACLE)
        outs.append(o)
        states.append(pool.clone())
    return torch.cat(outs, 1), states


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_delta_rule_decode_skips_sglang_padding_rows(env, mode, generator):
    backend, pool = env("CulaGDNAttnBackend" if mode == "gdn" else "CulaKDAAttnBackend")
    _poison(pool, generator)
    ssm = pool.mamba2_layer_cache(harness.TEST_LAYER).temporal
    layer = harness.layer(mode, generator)
    rows = [0, 1, 2, 3]  # row 0: an eager padded row on SGLang's reserved slot 0
    backend.init_forward_metadata(harness.decode_batch(rows))
    md = backend.forward_metadata
    assert md.mamba_cache_indices.tolist() == [0] + LIVE_SLOTS
    q, k, v, a, b = _decode_inputs(mode, 4, generator)
    ref_pool = _dense(ssm, LIVE_SLOTS)
    extra = {"lower_bound": layer.lower_bound} if mode == "kda" else {}
    out = backend.kernel_dispatcher.decode(q=q, k=k, v=v, a=a, b=b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                                           ssm_states=ssm, cache_indices=md.mamba_cache_indices,
                                           query_start_loc=md.query_start_loc, **extra)
    g = a.view(4, 1, HV) if mode == "gdn" else a.view(4, 1, HV, K)
    ref, _ = cula_decode(q[0, 1:, None].double(), k[0, 1:, None].double(), v[0, 1:, None].double(), ref_pool,
                         mode=mode, g=g[1:].double(), beta=b[1:, None].double(), state_indices=torch.arange(3),
                         **_oracle_gates(mode, layer), **ORACLE)
    assert out.shape == (1, 4, HV, V)
    assert (out[0, 0] == 0).all(), "padding row produced output"
    assert_close(out[0, 1:], ref[:, 0], TOL)
    assert_close(ssm[LIVE_SLOTS], ref_pool, TOL, "states")
    assert_untouched(ssm, UNUSED_SLOTS)  # slot 0 included: padded rows never write it


def test_decode_through_cuda_graph_static_buffers(env, generator):
    """SGLang's CUDA-graph metadata path (``init_cuda_graph_state`` + ``out_graph``) on the CPU:
    the static per-batch-size slot buffer, refreshed in place with graph padding (-1), feeds the
    same decode; the padded row is skipped."""
    backend, pool = env("CulaGDNAttnBackend")
    _poison(pool, generator)
    ssm = pool.mamba2_layer_cache(harness.TEST_LAYER).temporal
    layer = harness.layer("gdn", generator)
    backend.init_cuda_graph_state(4, 4 * T)
    batch = harness.decode_batch([1, 2, 3, 0])
    batch.num_padding = 1  # the last row pads the batch up to the captured size 4
    backend.init_forward_metadata_out_graph(batch)
    md = backend.forward_metadata
    assert md.mamba_cache_indices is backend.state_indices_list[3]
    assert md.mamba_cache_indices.tolist() == LIVE_SLOTS + [-1]
    q, k, v, a, b = _decode_inputs("gdn", 4, generator)
    ref_pool = _dense(ssm, LIVE_SLOTS)
    out = backend.kernel_dispatcher.decode(q=q, k=k, v=v, a=a, b=b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                                           ssm_states=ssm, cache_indices=md.mamba_cache_indices,
                                           query_start_loc=md.query_start_loc)
    ref, _ = cula_decode(q[0, :3, None].double(), k[0, :3, None].double(), v[0, :3, None].double(), ref_pool,
                         mode="gdn", g=a[:3, None].double(), beta=b[:3, None].double(), state_indices=torch.arange(3),
                         **_oracle_gates("gdn", layer), **ORACLE)
    assert_close(out[0, :3], ref[:, 0], TOL)
    assert (out[0, 3] == 0).all()
    assert_close(ssm[LIVE_SLOTS], ref_pool, TOL, "states")
    assert_untouched(ssm, UNUSED_SLOTS)


@pytest.mark.parametrize("protocol", ["buffer", "deferred"])
@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_delta_rule_verify_and_commit_keep_exactly_the_accepted_state(env, mode, protocol, generator):
    backend, pool = env("CulaGDNAttnBackend" if mode == "gdn" else "CulaKDAAttnBackend", protocol)
    idx = _poison(pool, generator)
    cache = pool.mamba_pool.mamba_cache
    layer_cache = pool.mamba2_layer_cache(harness.TEST_LAYER)
    ssm, buffer = layer_cache.temporal, layer_cache.intermediate_ssm
    layer = harness.layer(mode, generator)
    rows = [0, 1, 2, 3]
    backend.init_forward_metadata(harness.verify_batch(rows))
    md = backend.forward_metadata
    assert md.query_start_loc.tolist() == [0, T, 2 * T, 3 * T, 4 * T]
    B = len(rows)
    q, k, v = _bf16(1, B * T, H, K, generator=generator), _bf16(1, B * T, H, K, generator=generator), _bf16(1, B * T, HV, V, generator=generator)
    a = torch.randn(B * T, HV, generator=generator) if mode == "gdn" else torch.randn(B * T, HV * K, generator=generator)
    b = torch.randn(B * T, HV, generator=generator)
    pool_before = ssm.clone()
    extra = {"lower_bound": layer.lower_bound} if mode == "kda" else {"stable_rows": False}
    out = backend.kernel_dispatcher.target_verify(
        A_log=layer.A_log, dt_bias=layer.dt_bias, q=q, k=k, v=v, a=a, b=b, ssm_states=ssm,
        cache_indices=md.mamba_cache_indices, query_start_loc=md.query_start_loc,
        intermediate_states_buffer=buffer, intermediate_state_indices=backend.verify_intermediate_state_indices,
        cache_steps=T, retrieve_parent_token=None, **extra)
    ref_out, ref_states = _oracle_steps(mode, layer, q, k, v, a, b, _dense(ssm, LIVE_SLOTS), LIVE_ROWS)
    assert out.shape == (1, B * T, HV, V)
    out = out.view(B, T, HV, V)
    assert_close(out[1:], ref_out, TOL, "verify outputs")
    assert (out[0] == 0).all(), "padding row produced output"
    assert torch.equal(ssm.nan_to_num(7.0), pool_before.nan_to_num(7.0)), "verify wrote the pool"
    if protocol == "buffer":  # SGLang's rows: request row n writes buffer row n
        for t in range(T):
            assert_close(buffer[LIVE_ROWS, t], ref_states[t], TOL, f"intermediate state {t}")
        assert torch.isnan(buffer[0]).all() and torch.isnan(buffer[len(rows):]).all()
    else:
        assert torch.isnan(buffer).all(), "the deferred protocol wrote the intermediate buffer"

    # SGLang's conv windows for the commit, as its verify convolution would have left them
    window = cache.intermediate_conv_window[0]
    window[idx].copy_(torch.randn(window[idx].shape, generator=generator))
    conv = cache.conv[0]
    conv.fill_(float("nan"))
    last_correct = torch.tensor([-1, 2, 0, 1])  # row 0 is padding; rows 1..3 keep 3, 1, 2 tokens
    wrapper = harness.hybrid(backend, pool)
    wrapper.update_mamba_state_after_mtp_verify(last_correct, None, None, None)
    for n, row in enumerate(LIVE_ROWS):
        kept = int(last_correct[row]) + 1
        assert_close(ssm[LIVE_SLOTS[n]], ref_states[kept - 1][n], TOL, f"slot {LIVE_SLOTS[n]} after keeping {kept}")
        torch.testing.assert_close(conv[idx, LIVE_SLOTS[n]], window[idx, row, kept - 1])
    assert_untouched(ssm, UNUSED_SLOTS)
    assert torch.isnan(conv[idx, UNUSED_SLOTS]).all(), "conv windows written outside the accepted slots"


# ------------------------------------------------------------------------------------------------
# Lightning: the backend's whole forward


def _lightning(env, protocol="buffer"):
    from sglang.srt.layers.radix_attention import RadixAttention

    backend, pool = env("CulaLightningAttnBackend", protocol)
    layer = RadixAttention(HV, K, K ** -0.5, HV, harness.TEST_LAYER)
    return backend, pool, layer, backend.tp_slope[harness.TEST_LAYER].reshape(-1).double()


def test_lightning_extend_and_decode(env, generator):
    backend, pool, layer, slope = _lightning(env)
    _poison(pool, generator)
    ssm = pool.mamba2_layer_cache(harness.TEST_LAYER).temporal
    lens, prefix = [4, 9, 1], [3, 0, 2]
    batch = harness.extend_batch(LIVE_ROWS, lens, prefix)
    backend.init_forward_metadata(batch)
    Tt = sum(lens)
    q, k, v = (_bf16(Tt, HV * K, generator=generator) for _ in range(3))
    ref_pool = _dense(ssm, LIVE_SLOTS)
    out = backend.forward_extend(q, k, v, layer, batch)
    # SGLang's has_initial_states = extend_prefix_lens > 0: row 2 starts from zero
    ref, _ = cula_lightning(*(x.view(1, Tt, HV, K).double() for x in (q, k, v)), -slope, scale=K ** -0.5,
                            cu_seqlens=torch.tensor([0, 4, 13, 14]), state_pool=ref_pool, state_indices=torch.arange(3),
                            has_initial_state=torch.tensor([True, False, True]), **ORACLE)
    assert out.shape == (Tt, HV * V)
    assert_close(out.view(1, Tt, HV, V), ref, TOL)
    assert_close(ssm[LIVE_SLOTS], ref_pool, TOL, "states after extend")
    assert_untouched(ssm, UNUSED_SLOTS)

    batch = harness.decode_batch([0, 1, 2, 3])
    backend.init_forward_metadata(batch)
    q, k, v = (_bf16(4, HV * K, generator=generator) for _ in range(3))
    out = backend.forward_decode(q, k, v, layer, batch)
    ref, _ = cula_decode(*(x[1:].view(3, 1, HV, K).double() for x in (q, k, v)), ref_pool, mode="lightning",
                         decay=-slope, scale=K ** -0.5, state_indices=torch.arange(3), **ORACLE)
    assert (out[0] == 0).all()
    assert_close(out[1:].view(3, HV, V), ref[:, 0], TOL)
    assert_close(ssm[LIVE_SLOTS], ref_pool, TOL, "states after decode")
    assert_untouched(ssm, UNUSED_SLOTS)


@pytest.mark.parametrize("protocol", ["buffer", "deferred"])
def test_lightning_verify_and_commit(env, protocol, generator):
    backend, pool, layer, slope = _lightning(env, protocol)
    _poison(pool, generator)
    layer_cache = pool.mamba2_layer_cache(harness.TEST_LAYER)
    ssm = layer_cache.temporal
    rows = [0, 1, 2, 3]
    batch = harness.verify_batch(rows)
    backend.init_forward_metadata(batch)
    q, k, v = (_bf16(len(rows) * T, HV * K, generator=generator) for _ in range(3))
    start = _dense(ssm, LIVE_SLOTS)
    out = backend.forward_extend(q, k, v, layer, batch).view(len(rows), T, HV, V)
    ref_pool, outs, states = start.clone(), [], []
    for t in range(T):
        o, _ = cula_decode(*(x.view(len(rows), T, HV, K)[1:, t:t + 1].double() for x in (q, k, v)), ref_pool,
                           mode="lightning", decay=-slope, scale=K ** -0.5, state_indices=torch.arange(3), **ORACLE)
        outs.append(o)
        states.append(ref_pool.clone())
    assert_close(out[1:], torch.cat(outs, 1), TOL, "verify outputs")
    assert (out[0] == 0).all()
    assert_close(ssm[LIVE_SLOTS], start, 0.0, "verify wrote the pool")
    harness.hybrid(backend, pool).update_mamba_state_after_mtp_verify(torch.tensor([-1, 0, 2, 1]), None, None, None)
    for n, kept in enumerate([1, 3, 2]):
        assert_close(ssm[LIVE_SLOTS[n]], states[kept - 1][n], TOL, f"slot {LIVE_SLOTS[n]} after keeping {kept}")
    assert_untouched(ssm, UNUSED_SLOTS)
