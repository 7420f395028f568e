"""Building blocks for testing the vLLM plugin against the real vLLM package on the CPU.

Import this only after ``pytest.importorskip("vllm.version")``. On import it makes vLLM's current
platform a CPU platform that takes vLLM's CUDA code path: the vLLM wheel is a CUDA build, so its
own CPU platform would call CPU C++ ops the wheel does not contain, and with no platform at all
vLLM cannot build a config. Under this platform vLLM's Triton kernels (the causal convolution)
run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is
imported), the layers take their ``forward_cuda`` path, and full attention resolves to vLLM's
CPU attention backend. vLLM's own tests patch the platform the same way. vLLM turns its Triton
kernels off when Triton has no active GPU driver, except where CUDA_VISIBLE_DEVICES is set and
empty (a GPU-less rank of a distributed job); that is set here, which is true of this process.

Configs are built the way vLLM's CPU tests build them: a ``VllmConfig`` from a tiny Hugging Face
config saved to a folder, ``CommonAttentionMetadata`` for a batch described by sequence and query
lengths, and the layer backend's metadata builder's ``build`` on the CPU. Layers are built as a
model builds them, with random weights loaded through vLLM's weight loaders (which shard them
under tensor parallelism), over NaN-filled state pages laid out as vLLM lays them out.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import vllm.platforms  # noqa: E402
from vllm.platforms.interface import Platform, PlatformEnum  # noqa: E402


class CpuCudaPathPlatform(Platform):
    """vLLM's CUDA code path on the CPU (Triton kernels in Triton's interpreter)."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    @classmethod
    def current_device(cls):
        return torch.device("cpu")

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return 1  # vLLM's Triton norms size their row blocks by it

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if selected_backend is not None:
            return selected_backend.get_path()
        return "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


if vllm.platforms._current_platform is None:
    vllm.platforms._current_platform = CpuCudaPathPlatform()

# vLLM's Triton prefill convolution swaps launch arguments inside its grid function, which Triton's
# interpreter does not support; take vLLM's own CPU implementation of it, the function vLLM itself
# binds there on its CPU platform. Decode and verify keep vLLM's Triton convolution (interpreted).
from vllm.model_executor.layers.mamba.ops import causal_conv1d as conv_ops  # noqa: E402
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu  # noqa: E402

conv_ops.causal_conv1d_fn = causal_conv1d_fn_cpu

from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig,  # noqa: E402
                         VllmConfig, set_current_vllm_config)
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

BLOCK_SIZE = 16


def save_qwen3_next(folder, *, H: int, HV: int, K: int, V: int, conv_width: int = 4) -> str:
    """A tiny Qwen3-Next config (one GDN layer, one full-attention layer) in ``folder``."""
    from transformers import Qwen3NextConfig

    Qwen3NextConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, vocab_size=128, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=H, linear_num_value_heads=HV, linear_key_head_dim=K, linear_value_head_dim=V,
        linear_conv_kernel_dim=conv_width, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, architectures=["Qwen3NextForCausalLM"],
    ).save_pretrained(folder)
    return str(folder)


def save_kimi_linear(folder, *, H: int, D: int, conv_width: int = 4, lower_bound: float | None = None) -> str:
    """A tiny Kimi-Linear config (one KDA layer, one MLA layer) in ``folder``."""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    linear = dict(num_heads=H, head_dim=D, short_conv_kernel_size=conv_width, kda_layers=[1], full_attn_layers=[2])
    if lower_bound is not None:
        linear["gate_lower_bound"] = lower_bound
    KimiLinearConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        num_hidden_layers=2, vocab_size=128, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, linear_attn_config=linear, architectures=["KimiLinearForCausalLM"],
    ).save_pretrained(folder)
    return str(folder)


def save_bailing_linear(folder, *, H: int, D: int, hidden_size: int = 64, group_norm_size: int = 2) -> str:
    """A tiny Bailing 2.5 config (BailingMoeV2_5ForCausalLM: layer 0 Lightning, layer 1 MLA) in
    ``folder``, with the Lightning layer's options that vLLM's layer reads: q/k RMS norms, partial
    rotary embedding, grouped output norm (``group_norm_size`` groups, a multiple of the tensor
    parallel size). Saved as a Llama config carrying the extra fields, since the real one is
    remote code."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=hidden_size, intermediate_size=128, num_attention_heads=H, num_key_value_heads=H, head_dim=D,
        num_hidden_layers=2, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
        architectures=["BailingMoeV2_5ForCausalLM"], layer_group_size=2, group_norm_size=group_norm_size,
        use_qk_norm=True, linear_silu=False, partial_rotary_factor=0.5, rope_theta=10000.0, use_bias=False,
        use_qkv_bias=False, num_experts=1,
    ).save_pretrained(folder)
    return str(folder)


def make_vllm_config(model_dir: str, *, backend: str | None = "cula", dtype="float32", num_spec: int = 0,
                     prefix_caching: bool = False, ssm_dtype: str | None = None, mamba_dtype: str | None = None,
                     full_cuda_graph: bool = False, additional_config: dict | None = None) -> VllmConfig:
    """A VllmConfig for the model in ``model_dir`` with ``--attention-backend backend``.
    ssm_dtype / mamba_dtype: ``--mamba-ssm-cache-dtype`` (GDN, KDA states) / ``--mamba-cache-dtype``
    (convolution and Lightning states)."""
    from vllm.config import AttentionConfig

    model_config = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype=dtype,
                               max_model_len=512, seed=0)
    cache_kwargs = dict(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    if ssm_dtype is not None:
        cache_kwargs["mamba_ssm_cache_dtype"] = ssm_dtype
    if mamba_dtype is not None:
        cache_kwargs["mamba_cache_dtype"] = mamba_dtype
    config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(**cache_kwargs),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512,
                                         is_encoder_decoder=False),
        attention_config=AttentionConfig(backend=backend),
        additional_config=additional_config or {},
    )
    if num_spec:
        config.speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec)
    if full_cuda_graph:
        config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    if prefix_caching:
        # Resolved by the engine when it sizes the KV cache; the checkpoint planner needs them.
        config.cache_config.hash_block_size = BLOCK_SIZE
        config.cache_config.cache_hit_alignment_tokens = 64
    return config


_distributed = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(vllm_config: VllmConfig, *, world_size: int = 1, rank: int = 0, port: int | None = None) -> None:
    """vLLM's distributed state over gloo, tensor parallel over all ``world_size`` ranks, once per
    process (vLLM's layers ask for it): by default one rank; a tensor-parallel test starts one
    process per rank, each calling this with its rank and the same ``port`` first."""
    global _distributed
    if _distributed:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    port = free_port() if port is None else port
    os.environ.setdefault("LOCAL_RANK", str(rank))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(world_size, 1)
    _distributed = True


@dataclass
class BoundLayer:
    """A vLLM linear-attention layer with its state pages.

    pages: the raw int8 [num_blocks, page_bytes] memory vLLM would allocate; conv_state and
    ssm_state: the layer's views of it after ``bind_kv_cache`` (ssm_state: the recurrent state,
    [num_blocks, HV, V, K] for GDN / KDA and [num_blocks, H, D, D] for Lightning, with the page
    stride), NaN everywhere at the start.
    """

    layer: torch.nn.Module
    vllm_config: VllmConfig
    pages: torch.Tensor

    @property
    def conv_state(self) -> torch.Tensor:
        return self.layer.kv_cache[0]

    @property
    def ssm_state(self) -> torch.Tensor:
        return self.layer.kv_cache[-1]


def random_delta_rule_weights(layer, generator) -> None:
    """Random convolution and gate weights of a GDN / KDA layer (what its core reads)."""
    w = layer.conv1d.weight
    w.copy_(0.5 * torch.randn(w.shape, generator=generator).to(w.dtype))
    layer.A_log.copy_(torch.empty(layer.A_log.shape).uniform_(0, 1.5, generator=generator))
    layer.dt_bias.copy_(0.5 * torch.randn(layer.dt_bias.shape, generator=generator))


def random_weights(layer, generator) -> dict[str, torch.Tensor]:
    """Random weights for every parameter of ``layer`` as a checkpoint holds them (the layer is
    built with tensor parallel size 1): matrices ~ N(0, 1 / fan_in), vectors (norm weights) ~ 1 +
    N(0, 0.1^2)."""
    weights = {}
    for name, param in layer.named_parameters():
        x = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        weights[name] = x * param.shape[-1] ** -0.5 if param.dim() > 1 else 1 + 0.1 * x
    return weights


def load_weights(layer, weights: dict[str, torch.Tensor]) -> None:
    """Load checkpoint-shaped ``weights`` into ``layer`` through each parameter's vLLM weight
    loader, which takes this rank's shard under tensor parallelism."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(layer.named_parameters())
    if set(params) != set(weights):
        raise ValueError(f"weights: expected {sorted(params)}, got {sorted(weights)}")
    for name, param in params.items():
        getattr(param, "weight_loader", default_weight_loader)(param, weights[name].to(param.dtype))


def build_layer(layer_cls, vllm_config: VllmConfig, prefix: str, num_blocks: int, generator, *,
                init_weights=random_delta_rule_weights, page_padding: int = 64) -> BoundLayer:
    """Construct ``layer_cls`` as a model would (vLLM swaps in the plugin's class), give it weights
    (``init_weights(layer, generator)``), and bind NaN-filled pages laid out as vLLM lays them out:
    the states packed at the start of each page, the page ``page_padding`` bytes longer (vLLM pads
    mamba pages up to the attention page size), so the state views are page-strided."""
    init_distributed(vllm_config)
    vllm_config.compilation_config.static_forward_context.pop(prefix, None)
    with set_current_vllm_config(vllm_config):
        layer = layer_cls(vllm_config.model_config.hf_config, vllm_config, prefix=prefix)
    with torch.no_grad():
        init_weights(layer, generator)
    spec = layer.get_kv_cache_spec(vllm_config)
    page_bytes = spec.page_size_bytes + page_padding
    pages = torch.zeros(num_blocks, page_bytes, dtype=torch.int8)
    layer.bind_kv_cache(pages.view(num_blocks, 1, 1, page_bytes))
    for state in layer.kv_cache:
        state.fill_(float("nan"))
    return BoundLayer(layer, vllm_config, pages)


@dataclass
class Request:
    """One request's blocks and its tokens: ``committed`` are accepted, ``pending`` are the last
    verify's tokens, of which the next step accepts a prefix (what a token is, is the test's)."""

    blocks: list
    committed: list = field(default_factory=list)
    pending: list = field(default_factory=list)

    @property
    def length(self):
        return len(self.committed)


def check_row_outputs(out, rows, oracle, tol, first_token=0):
    """Outputs of a batch's rows (``(request, new tokens, _)`` or None) against ``oracle(tokens)``
    -> (o, final): a row's tokens are the request's committed tokens plus the new ones, its
    outputs the last ``len(new)``. Tokens past the rows (padding) must be zero."""
    from conftest import assert_close

    position = first_token
    for row in rows:
        if row is None:
            continue
        request, new, _ = row
        o, _ = oracle(request.committed + new)
        assert_close(out[position: position + len(new)], o[-len(new):], tol, f"output of a {len(new)}-token row")
        position += len(new)
    assert torch.all(out[position:] == 0), "padding tokens must get zero output"


def batch_metadata(rows, *, num_tokens=None) -> CommonAttentionMetadata:
    """vLLM's CommonAttentionMetadata of a batch of ``rows`` in vLLM's order: (request, number of
    new tokens, is_prefilling) per row, None for a CUDA-graph padding row (no tokens, null block)."""
    seq_lens, query_lens, table, flags = [], [], [], []
    width = max(len(row[0].blocks) for row in rows if row is not None)
    for row in rows:
        request, new, prefilling = row if row is not None else (Request([]), 0, False)
        seq_lens.append(request.length + new)
        query_lens.append(new)
        table.append(request.blocks + [0] * (width - len(request.blocks)))
        flags.append(prefilling)
    return common_metadata(seq_lens, query_lens, table, is_prefilling=flags, num_tokens=num_tokens)


def build_batch(builder, rows, *, draft_tokens=None, accepted=None, num_tokens=None):
    """vLLM's metadata of a batch of ``rows`` ((request, new tokens, is_prefilling), None for a
    CUDA-graph padding row) from ``builder``, with the MTP arguments when ``draft_tokens`` is given
    (``accepted``: the previous step's accepted counts). Returns (common metadata, built metadata)."""
    common = batch_metadata([row and (row[0], len(row[1]), row[2]) for row in rows], num_tokens=num_tokens)
    kwargs = {}
    if draft_tokens is not None:
        kwargs = dict(num_decode_draft_tokens_cpu=torch.tensor(draft_tokens, dtype=torch.int32),
                      num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
    return common, builder.build(0, common, **kwargs)


def common_metadata(seq_lens, query_lens, block_table, *, is_prefilling=None, num_tokens=None):
    """vLLM's CommonAttentionMetadata for one batch (on the CPU).

    seq_lens, query_lens: per row (a padding row has 0 and 0); block_table: int rows of block ids;
    is_prefilling: per row, default: rows whose query is the whole sequence; num_tokens: the
    (padded) token count, default the sum of query_lens.
    """
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    if is_prefilling is None:
        is_prefilling = [q > 1 or (q == s and q > 0) for s, q in zip(seq_lens, query_lens)]
    tokens = int(qsl[-1]) if num_tokens is None else num_tokens
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=len(seq_lens),
        num_actual_tokens=tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64), is_prefilling=torch.tensor(is_prefilling),
        seq_lens_cpu_upper_bound=seq.clone())


def metadata_builder(bound: BoundLayer, prefix: str):
    """The metadata builder of the layer's backend (what the model runner would build)."""
    backend = bound.layer.get_attn_backend()
    spec = bound.layer.get_kv_cache_spec(bound.vllm_config)
    with set_current_vllm_config(bound.vllm_config):
        return backend.get_builder_cls()(spec, [prefix], bound.vllm_config, torch.device("cpu"))
