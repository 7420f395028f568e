"""The vLLM plugin's registration against the real vLLM package: the entry point, parsing
``--attention-backend cula`` in a fresh process, the config surviving pickling into spawned
processes, routing of full-attention layers, which models it accepts, and clear errors for
configurations it refuses."""
import json
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.version", reason="needs the vllm package (.ci/vllm.sh installs it)")

import vllm_harness as harness  # noqa: E402
from vllm.config import AttentionConfig, CompilationConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # noqa: E402
from vllm.model_executor.layers.mamba.linear.bailing_linear_attn import BailingMoELinearAttention  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend, GDNAttentionMetadataBuilder  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from cula_serve.integrations.vllm import plugin  # noqa: E402
from cula_serve.integrations.vllm.compat import SUPPORTED_VLLM_TEXT, check_model_has_linear_attention  # noqa: E402
from cula_serve.integrations.vllm.layers import CulaQwenGatedDeltaNetAttention  # noqa: E402
from cula_serve.integrations.vllm.metadata import CulaGDNAttentionBackend  # noqa: E402

HARNESS_DIR = str(Path(harness.__file__).parent)
GDN = dict(H=2, HV=4, K=16, V=8)


def run_fresh(code: str, *args, cwd) -> subprocess.CompletedProcess:
    """Run ``code`` in a new Python process (outside the checkout, so only the installed
    distribution's metadata is seen); returns the finished process."""
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_loads_through_vllm():
    from importlib.metadata import entry_points

    from vllm.plugins import load_plugins_by_group

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "cula"]
    assert entry.value == "cula_serve.integrations.vllm.plugin:register"
    loaded = load_plugins_by_group("vllm.general_plugins")
    assert loaded["cula"] is plugin.register
    loaded["cula"]()  # vLLM calls it once per process, and may call it again
    loaded["cula"]()
    assert AttentionBackendEnum["CULA"].get_path() == plugin.GUARD_PATH


PARSE_AND_SPAWN = r"""
import concurrent.futures, json, multiprocessing, operator, pickle, sys
sys.path.insert(0, sys.argv[1])
import vllm_harness  # this CPU machine's platform; loads no plugin
from vllm.v1.attention.backends.registry import AttentionBackendEnum
before = "CULA" in AttentionBackendEnum.__members__
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.engine.arg_utils import AsyncEngineArgs
parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())  # vLLM loads its plugins here
args = parser.parse_args(["--model", sys.argv[2], "--attention-backend", "cula", "--skip-tokenizer-init",
                          "--max-model-len", "256", "--enforce-eager"])
config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
with open(sys.argv[3], "wb") as f:
    pickle.dump(config, f)
ctx = multiprocessing.get_context("spawn")
with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
    spawned = pool.submit(operator.attrgetter("attention_config.backend.name", "attention_config.backend.value"),
                          config).result()
print(json.dumps(dict(before=before, parsed=config.attention_config.backend.name, spawned=spawned)))
"""

UNPICKLE_ONLY = r"""
import json, pickle, sys
with open(sys.argv[1], "rb") as f:
    config = pickle.load(f)  # nothing of the plugin was imported or registered before this
from cula_serve.integrations.vllm.plugin import is_cula_selected
print(json.dumps(dict(name=config.attention_config.backend.name, selected=is_cula_selected(config))))
"""


def test_flag_parses_in_a_fresh_process_and_survives_spawn(tmp_path):
    model = harness.save_qwen3_next(tmp_path / "model", **GDN)
    pickled = tmp_path / "config.pkl"
    result = last_json(run_fresh(PARSE_AND_SPAWN, HARNESS_DIR, model, pickled, cwd=tmp_path))
    assert result == dict(before=False, parsed="CULA", spawned=["CULA", plugin.GUARD_PATH])
    result = last_json(run_fresh(UNPICKLE_ONLY, pickled, cwd=tmp_path))
    assert result == dict(name="CULA", selected=True)


def test_member_pickles_to_itself():
    member = AttentionBackendEnum.CULA
    assert pickle.loads(pickle.dumps(member)) is member
    config = AttentionConfig(backend="cula")
    assert config.backend is member and pickle.loads(pickle.dumps(config)).backend is member
    # Other members keep vLLM's own pickling.
    other = pickle.dumps(AttentionBackendEnum.FLASH_ATTN)
    assert b"cula_serve" not in other and pickle.loads(other) is AttentionBackendEnum.FLASH_ATTN


UNSUPPORTED_VERSION = r"""
import json, vllm
vllm.__version__ = "0.35.0"
from cula_serve.integrations.vllm import plugin
plugin.register()
from vllm.config import AttentionConfig
backend = AttentionConfig(backend="cula").backend
try:
    backend.get_class()  # what a platform does with a selected backend
    error = None
except Exception as err:
    error = f"{type(err).__name__}: {err}"
from vllm.model_executor.custom_op import op_registry_oot
print(json.dumps(dict(error=error, layers_replaced="QwenGatedDeltaNetAttention" in op_registry_oot)))
"""


def test_unsupported_vllm_version_is_refused_clearly(tmp_path):
    result = last_json(run_fresh(UNSUPPORTED_VERSION, cwd=tmp_path))
    assert result["error"].startswith("UnsupportedVllmVersionError")
    assert "0.35.0" in result["error"] and SUPPORTED_VLLM_TEXT in result["error"]
    assert result["layers_replaced"] is False


def test_full_attention_keeps_vllms_choice(tmp_path):
    from vllm.v1.attention.selector import get_attn_backend

    model = harness.save_qwen3_next(tmp_path, **GDN)
    chosen = {}
    for backend in ("cula", None):
        with set_current_vllm_config(harness.make_vllm_config(model, backend=backend)):
            chosen[backend] = get_attn_backend(16, torch.float32, None)
    assert chosen["cula"] is chosen[None]
    assert AttentionBackendEnum.CULA.get_class() is plugin.CulaFullAttentionGuard
    reasons = plugin.CulaFullAttentionGuard.validate_configuration(head_size=16, dtype=torch.float32)
    assert reasons and "linear-attention layers only" in reasons[0]


def test_model_without_linear_attention_is_refused(tmp_path):
    from transformers import LlamaConfig
    from vllm.v1.attention.selector import get_attn_backend

    LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                num_hidden_layers=1, vocab_size=128, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with set_current_vllm_config(harness.make_vllm_config(str(tmp_path))), \
            pytest.raises(ValueError, match="no linear-attention layer that cula-serve serves"):
        get_attn_backend(16, torch.float32, None)


def test_bailing_lightning_model_is_accepted(tmp_path):
    from vllm.v1.attention.selector import get_attn_backend

    model = harness.save_bailing_linear(tmp_path, H=4, D=16)
    vllm_config = harness.make_vllm_config(model)
    model_config = vllm_config.model_config
    assert check_model_has_linear_attention(model_config.hf_text_config, model_config.architectures) == {"lightning": 1}
    with set_current_vllm_config(vllm_config):
        chosen = get_attn_backend(16, torch.float32, None)
    with set_current_vllm_config(harness.make_vllm_config(model, backend=None)):
        assert chosen is get_attn_backend(16, torch.float32, None)
    # layer_group_size 1 (vLLM's default): every layer is full attention, nothing for cula to serve
    model_config.hf_text_config.layer_group_size = 1
    with pytest.raises(ValueError, match="no linear-attention layer that cula-serve serves"):
        check_model_has_linear_attention(model_config.hf_text_config, model_config.architectures)
    # MiniMax-style configs (an out-of-tree model on vLLM's MiniMax layer) mark Lightning layers 0
    minimax = SimpleNamespace(attn_type_list=[0, 1, 0, 0])
    assert check_model_has_linear_attention(minimax, ["MiniMaxText01ForCausalLM"]) == {"lightning": 3}


def test_fp16_lightning_state_is_refused(tmp_path, generator):
    model = harness.save_bailing_linear(tmp_path, H=4, D=16)
    vllm_config = harness.make_vllm_config(model, dtype="float16")
    with pytest.raises(ValueError, match="CulaBailingMoELinearAttention.*float16.*--mamba-cache-dtype"):
        harness.build_layer(BailingMoELinearAttention, vllm_config, "model.layers.0.self_attn", 4, generator,
                            init_weights=lambda layer, g: None)


def gdn_layer(tmp_path, generator, **config):
    """A bound GDN layer built under ``make_vllm_config(**config)``; returns (layer, vllm config)."""
    model = harness.save_qwen3_next(tmp_path, **{**GDN, **config.pop("shape", {})})
    vllm_config = harness.make_vllm_config(model, **config)
    layer = harness.build_layer(QwenGatedDeltaNetAttention, vllm_config, "model.layers.0.linear_attn", 4,
                                generator).layer
    return layer, vllm_config


def test_unsupported_head_dim_is_refused(tmp_path, generator):
    with pytest.raises(ValueError, match=r"K=96, V=96.*powers of two"):
        gdn_layer(tmp_path, generator, shape=dict(K=96, V=96), additional_config={"cula_backend": "triton"})


def test_fp16_state_is_refused(tmp_path, generator):
    with pytest.raises(ValueError, match="float32 or bfloat16.*float16"):
        gdn_layer(tmp_path, generator, ssm_dtype="float16")


def test_without_the_flag_the_layer_is_vllms(tmp_path, generator):
    layer, vllm_config = gdn_layer(tmp_path, generator, backend=None, num_spec=2, prefix_caching=True)
    assert type(layer) is CulaQwenGatedDeltaNetAttention and layer.cula is None
    assert layer.get_attn_backend() is GDNAttentionBackend
    assert layer.get_kv_cache_spec(vllm_config).prefill_checkpoint_alignment is None


def test_with_the_flag_the_layer_runs_through_vllms_splitting_op(tmp_path, generator):
    layer, _ = gdn_layer(tmp_path, generator, num_spec=2)
    assert layer.cula is not None and layer.cula.num_v_heads == GDN["HV"]
    assert layer.get_attn_backend() is CulaGDNAttentionBackend
    builder_cls = CulaGDNAttentionBackend.get_builder_cls()
    # The runner hands speculative-decoding arguments only to GDN builders, and takes FULL graphs
    # for uniform batches from this support level.
    assert issubclass(builder_cls, GDNAttentionMetadataBuilder)
    assert builder_cls._cudagraph_support == GDNAttentionMetadataBuilder._cudagraph_support
    # vLLM's fused MTP kernel would bypass the custom op that PIECEWISE graphs split at.
    assert layer.enable_fused_gdn_spec_decode is False
    assert "vllm::qwen_gdn_attention_core" in CompilationConfig._attention_ops
