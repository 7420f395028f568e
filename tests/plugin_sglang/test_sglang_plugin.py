"""The plugin as SGLang loads it: the entry point, the flags, the hooks, the draft worker, and the
clear errors for configurations cula-serve does not serve (nothing written to the pool)."""
import argparse
import importlib.metadata
import types

import pytest

# the plugin API itself, not just a package named sglang
pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (.ci/sglang.sh installs it)")

import torch  # noqa: E402
from sglang.srt.arg_groups import overrides  # noqa: E402
from sglang.srt.configs import BailingHybridConfig, NemotronHConfig, Qwen3NextConfig  # noqa: E402
from sglang.srt.layers.attention import attention_registry  # noqa: E402
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend  # noqa: E402
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend  # noqa: E402
from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend  # noqa: E402
from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel  # noqa: E402
from sglang.srt.runtime_context import get_server_args  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.draft_utils import DraftBackendFactory  # noqa: E402

import harness  # noqa: E402
from cula_serve.integrations.sglang import backend as cula_backend  # noqa: E402
from cula_serve.integrations.sglang import plugin, translate  # noqa: E402
from cula_serve.integrations.sglang.kernels import CulaGDNKernel, CulaKDAKernel  # noqa: E402


def qwen3_next():
    return Qwen3NextConfig(num_hidden_layers=4, full_attention_interval=4, architectures=["Qwen3NextForCausalLM"])


@pytest.fixture
def configured(request):
    """``configured(**server_args)`` publishes a test configuration; restored after the test."""
    installed = []

    def publish(**fields):
        installed.append(harness.configuration(**fields))
        return get_server_args()

    yield publish
    for override in reversed(installed):
        override.restore()


def _runner(server_args, hf_config=None, state_dtype=torch.float32, **attrs):
    runner = harness.make_runner(harness.make_pool(state_dtype), server_args, hf_config)
    runner.model_config.linear_attn_registry_result = None
    runner.model_config.is_draft_model = False
    for name, value in attrs.items():
        setattr(runner, name, value)
    return runner


# ------------------------------------------------------------------------------------------------
# loading and flags


def test_entry_point_is_the_plugin_and_sglang_loaded_it():
    points = [p for p in importlib.metadata.entry_points(group="sglang.srt.plugins") if p.name == "cula"]
    assert len(points) == 1 and points[0].load() is plugin.register
    # harness imported sglang.srt.plugins.load_plugins() and ran it: registrations and hooks exist
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, LINEAR_ATTN_KERNEL_BACKEND_CHOICES
    assert "cula" in ATTENTION_BACKEND_CHOICES and "cula" in LINEAR_ATTN_KERNEL_BACKEND_CHOICES
    assert attention_registry.ATTENTION_BACKENDS["cula"] is plugin.create_cula_attention_backend
    assert attention_registry.attn_backend_wrapper.__wrapped__.__module__ == attention_registry.__name__
    assert overrides.supports_mamba_cache_extra_buffer.__wrapped__.__module__ == overrides.__name__
    plugin.register()  # idempotent


def _parse(*argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(["--model-path", "model", *argv])


def test_both_flags_parse():
    args = _parse("--attention-backend", "cula")
    assert args.attention_backend == "cula"
    args = _parse("--prefill-attention-backend", "cula", "--decode-attention-backend", "cula")
    assert (args.prefill_attention_backend, args.decode_attention_backend) == ("cula", "cula")
    args = _parse("--linear-attn-backend", "cula")
    assert args.linear_attn_backend == "cula"
    args = _parse("--linear-attn-prefill-backend", "cula", "--linear-attn-decode-backend", "cula",
                  "--linear-attn-verify-backend", "cula")
    assert (args.linear_attn_prefill_backend, args.linear_attn_decode_backend, args.linear_attn_verify_backend) == \
        ("cula", "cula", "cula")


def test_unknown_backend_names_are_still_refused():
    with pytest.raises(SystemExit):
        _parse("--attention-backend", "cula2")
    with pytest.raises(SystemExit):
        _parse("--linear-attn-verify-backend", "cula2")


# ------------------------------------------------------------------------------------------------
# what each flag builds


def test_attention_backend_cula_builds_the_cula_hybrid(configured):
    server_args = configured()
    runner = _runner(server_args, qwen3_next())
    full = harness.FullAttentionUnderTest(runner.req_to_token_pool)
    with harness.single_rank():
        built = attention_registry.attn_backend_wrapper(runner, full)
    assert isinstance(built, cula_backend.CulaHybridLinearAttnBackend)
    assert built.full_attn_backend is full
    assert isinstance(built.linear_attn_backend, cula_backend.CulaGDNAttnBackend)
    dispatcher = built.linear_attn_backend.kernel_dispatcher
    assert all(isinstance(x, CulaGDNKernel) for x in (dispatcher.decode_kernel, dispatcher.extend_kernel,
                                                      dispatcher.verify_kernel))
    assert dispatcher.verify_kernel.pending_verifies is built.linear_attn_backend.pending_verifies
    assert built.full_attn_layers == [3]


def test_draft_worker_gets_full_attention_only(configured):
    server_args = configured()
    runner = _runner(server_args, qwen3_next(), is_draft_worker=True)
    with harness.single_rank():
        built = attention_registry.attn_backend_wrapper(runner, harness.FullAttentionUnderTest(runner.req_to_token_pool))
    assert built.full_attn_layers == [0]
    # the draft's own backend table: "cula" resolves to SGLang's choice for hybrid-linear drafts
    factory = DraftBackendFactory.__new__(DraftBackendFactory)
    factory.draft_attn_backend = None
    factory.draft_model_runner = runner
    chosen = []
    table = {"hybrid_linear_attn": lambda: chosen.append("hybrid_linear_attn") or ("fa3", None)}
    assert factory._create_backend("decode_attention_backend", table, "EAGLE is not supported in {backend_type}") is None
    assert chosen == ["hybrid_linear_attn"]


@pytest.mark.parametrize("phase_flags, on", [
    (dict(linear_attn_backend="cula"), ("decode", "extend", "verify")),
    (dict(linear_attn_decode_backend="cula"), ("decode", "verify")),
    (dict(linear_attn_prefill_backend="cula"), ("extend",)),
    (dict(linear_attn_verify_backend="cula"), ("verify",)),
])
def test_linear_attn_backend_flags_swap_only_the_named_phases(configured, phase_flags, on):
    server_args = configured(attention_backend="triton", **phase_flags)
    runner = _runner(server_args, qwen3_next(), prefill_attention_backend_str="triton",
                     decode_attention_backend_str="triton")
    from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends
    runner.linear_attn_backends = resolve_linear_attn_backends()
    backend = GDNAttnBackend(runner)  # SGLang's own backend: only its kernels change
    dispatcher = backend.kernel_dispatcher
    for phase in ("decode", "extend", "verify"):
        kernel = getattr(dispatcher, f"{phase}_kernel")
        assert isinstance(kernel, CulaGDNKernel if phase in on else TritonGDNKernel), phase
        if phase in on:
            assert kernel.protocol == "buffer" and kernel.pending_verifies is None  # SGLang's stock commit
    assert dispatcher.supports_packed_decode is ("decode" not in on)


def test_kda_linear_attn_backend_cula_takes_the_safe_gate(configured):
    server_args = configured(attention_backend="triton", linear_attn_backend="cula")
    runner = _runner(server_args, prefill_attention_backend_str="triton", decode_attention_backend_str="triton")
    from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends
    runner.linear_attn_backends = resolve_linear_attn_backends()
    dispatcher = KDAAttnBackend(runner).kernel_dispatcher  # SGLang raises for "custom" KDA verify kernels
    assert isinstance(dispatcher.verify_kernel, CulaKDAKernel) and isinstance(dispatcher.extend_kernel, CulaKDAKernel)
    assert dispatcher.decode.__self__ is dispatcher.decode_kernel


def test_auto_radix_strategy_is_no_buffer_with_cula():
    hf_config = qwen3_next()
    view = types.SimpleNamespace(attention_backend="triton", prefill_attention_backend=None,
                                 decode_attention_backend=None, linear_attn_backend="triton")
    assert overrides.supports_mamba_cache_extra_buffer(view, hf_config) is True
    view.attention_backend = "cula"
    assert overrides.supports_mamba_cache_extra_buffer(view, hf_config) is False


def test_full_attention_default_on_cpu_and_override(monkeypatch):
    monkeypatch.delenv(plugin.FULL_ATTENTION_ENV, raising=False)
    assert plugin.default_full_attention_backend() == "triton"
    monkeypatch.setenv(plugin.FULL_ATTENTION_ENV, "torch_native")
    assert plugin.default_full_attention_backend() == "torch_native"
    monkeypatch.setenv(plugin.FULL_ATTENTION_ENV, "cula")
    with pytest.raises(ValueError, match=plugin.FULL_ATTENTION_ENV):
        plugin.default_full_attention_backend()


# ------------------------------------------------------------------------------------------------
# unsupported configurations: clear errors


@pytest.mark.parametrize("fields, message", [
    (dict(speculative_eagle_topk=2), "speculative-eagle-topk 1"),
    (dict(mamba_radix_cache_strategy="extra_buffer"), "no_buffer"),
    (dict(enable_linear_replayssm=True), "replayssm"),
])
def test_unsupported_server_configurations_fail_at_construction(configured, fields, message):
    server_args = configured(**fields)
    with pytest.raises(ValueError, match=message):
        cula_backend.CulaGDNAttnBackend(_runner(server_args))


def test_unsupported_state_dtype(configured):
    server_args = configured()
    with pytest.raises(ValueError, match="mamba-ssm-dtype float16"):
        cula_backend.CulaGDNAttnBackend(_runner(server_args, state_dtype=torch.float16))


def test_other_linear_layer_kinds_are_refused(configured):
    server_args = configured()
    runner = _runner(server_args, NemotronHConfig())  # Mamba2 layers
    with pytest.raises(ValueError, match="GDN, KDA and Lightning"):
        attention_registry.attn_backend_wrapper(runner, harness.FullAttentionUnderTest(runner.req_to_token_pool))


def test_lightning_refuses_mixed_phases(configured):
    server_args = configured(attention_backend="triton", linear_attn_decode_backend="cula")
    runner = _runner(server_args, BailingHybridConfig(use_kda=False), prefill_attention_backend_str="triton",
                     decode_attention_backend_str="triton")
    with pytest.raises(ValueError, match="K-last"):
        attention_registry.attn_backend_wrapper(runner, harness.FullAttentionUnderTest(runner.req_to_token_pool))


def test_verify_protocol_errors(monkeypatch):
    monkeypatch.setenv(translate.VERIFY_PROTOCOL_ENV, "slots")
    with pytest.raises(ValueError, match=translate.VERIFY_PROTOCOL_ENV):
        translate.verify_protocol_from_env()
    with pytest.raises(ValueError, match="--attention-backend cula"):
        CulaGDNKernel(protocol="deferred")  # the deferred commit needs the plugin's wrapper


def _verify_setup(configured, generator):
    server_args = configured()
    runner = _runner(server_args)
    backend = cula_backend.CulaGDNAttnBackend(runner)
    pool = runner.req_to_token_pool
    backend.init_forward_metadata(harness.verify_batch([1, 2]))
    layer_cache = pool.mamba2_layer_cache(harness.TEST_LAYER)
    layer_cache.temporal.normal_(generator=generator)
    layer_cache.intermediate_ssm.fill_(float("nan"))
    H, HV, K, V = (harness.SHAPE[x] for x in ("H", "HV", "K", "V"))
    n = 2 * harness.DRAFT_TOKENS
    layer = harness.layer("gdn", generator)
    call = dict(A_log=layer.A_log, dt_bias=layer.dt_bias, q=torch.randn(1, n, H, K), k=torch.randn(1, n, H, K),
                v=torch.randn(1, n, HV, V), a=torch.randn(n, HV), b=torch.randn(n, HV),
                ssm_states=layer_cache.temporal, cache_indices=backend.forward_metadata.mamba_cache_indices,
                query_start_loc=backend.forward_metadata.query_start_loc,
                intermediate_states_buffer=layer_cache.intermediate_ssm,
                intermediate_state_indices=backend.verify_intermediate_state_indices,
                cache_steps=harness.DRAFT_TOKENS, retrieve_parent_token=None)
    return backend, layer_cache, call


def test_tree_and_ragged_verify_are_refused_without_writing(configured, generator):
    backend, layer_cache, call = _verify_setup(configured, generator)
    before = layer_cache.temporal.clone()
    with pytest.raises(NotImplementedError, match="topk 1"):
        backend.kernel_dispatcher.target_verify(**{**call, "retrieve_parent_token": torch.zeros(2, 3, dtype=torch.int64)})
    ragged = {**call, "q": call["q"][:, :5], "k": call["k"][:, :5], "v": call["v"][:, :5], "a": call["a"][:5],
              "b": call["b"][:5]}
    with pytest.raises(ValueError, match="ragged"):
        backend.kernel_dispatcher.target_verify(**ragged)
    assert torch.equal(layer_cache.temporal, before)
    assert torch.isnan(layer_cache.intermediate_ssm).all()


def test_commit_without_a_captured_graph_is_an_error(configured, generator):
    backend, _, _ = _verify_setup(configured, generator)
    backend.init_cuda_graph_state(4, 4 * harness.DRAFT_TOKENS)
    with pytest.raises(RuntimeError, match="no CUDA graph was captured for batch size 2"):
        backend.init_forward_metadata_out_graph(harness.verify_batch([1, 2]))


def test_hybrid_wrapper_is_sglangs():
    assert issubclass(cula_backend.CulaHybridLinearAttnBackend, HybridLinearAttnBackend)
