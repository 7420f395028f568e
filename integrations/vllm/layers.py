"""vLLM's GDN, KDA and Lightning layers with their recurrence on cula-serve.

``CulaQwenGatedDeltaNetAttention``, ``CulaKimiGatedDeltaNetAttention``,
``CulaBailingMoELinearAttention`` and ``CulaMiniMaxText01LinearAttention`` replace vLLM's
``QwenGatedDeltaNetAttention``, ``KimiGatedDeltaNetAttention``, ``BailingMoELinearAttention``
and ``MiniMaxText01LinearAttention`` through vLLM's out-of-tree layer registry, so every model
that builds those layers gets them. A layer built under a config that does not select
``--attention-backend cula`` is vLLM's layer, unchanged. Under tensor parallelism every layer
serves its rank's heads only (vLLM's local head counts, state pages and slope rates).

Under ``cula`` a layer keeps vLLM's projections, causal convolution kernels (``causal_conv1d_fn``
for prefill, ``causal_conv1d_update`` for decode and verify, on vLLM's convolution states) and
output norm, and hands the recurrence to cula-serve (``translate.run_delta_rule``) on its own
state pages. The GDN layer keeps vLLM's custom op ``vllm::qwen_gdn_attention_core`` (one of
vLLM's default splitting ops, so PIECEWISE graphs break around it and FULL graphs capture it);
vLLM's fused CUDA MTP path, which would bypass that op, is turned off. The KDA layer keeps its
``_forward`` an eager break of vLLM's breakable CUDA graphs, as in vLLM.

The Lightning layers keep vLLM's ``_forward`` (projections, activation, q/k norms, rotary
embedding, output gate, norm and projection, inside vLLM's custom op ``vllm::linear_attention``,
a default splitting op) and take over ``_decode_infer``, which vLLM's forward calls with the
whole batch's q, k, v under the plugin's metadata (``metadata.CulaLightningAttentionMetadata``);
it runs the batch's plan through ``translate.run_lightning``. The decay is minus vLLM's slope
rate of the rank's heads, and q arrives scaled as vLLM's kernels take it, so cula-serve's scale
is 1. vLLM's Lightning state pages ``[num_blocks, H, D, D]`` hold cula-serve's K-last states
(``translate`` says why that is sound): prefill, decode and verify all run on cula-serve, so do
not hand a cula-written state to vLLM's own Lightning kernels (a KV-transfer connector between
a cula and a non-cula instance would).

Prefix caching ('align' mode): the layer declares prefill checkpoints aligned to 64 tokens, and
writes the recurrent state (cula-serve ``checkpoint_indices``) and, for GDN and KDA, the
convolution state at each checkpoint vLLM plans, so the scheduler need not split prefills at
block boundaries.

Before CUDA-graph capture, the profile run (no metadata) warms cula-serve's decode, verify and
prefill kernels for the batch sizes vLLM will capture.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.linear.bailing_linear_attn import BailingMoELinearAttention
from vllm.model_executor.layers.mamba.linear.minimax_linear_attn import MiniMaxText01LinearAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops import causal_conv1d as conv_ops
from vllm.v1.kv_cache_interface import MambaSpec

import cula_serve
from cula_serve.api import CHECKPOINT_ALIGNMENT

from .compat import check_layer_supported
from .metadata import CulaGDNAttentionBackend, CulaLightningAttentionBackend
from .plugin import is_cula_selected
from .translate import (PREFILL, DeltaRuleInputs, LightningInputs, plan_linear_attention, run_delta_rule,
                        run_lightning, split_tokens, write_conv_checkpoints)


@dataclass(frozen=True)
class CulaLayerConfig:
    """How one layer runs on cula-serve: its family, local head counts and dims, and the
    cula-serve backend forced by ``--additional-config '{"cula_backend": ...}'`` (None: dispatch)."""

    mode: str
    num_qk_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    backend: str | None


def _cula_config(layer, vllm_config, mode: str, *, num_qk_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, input_dtype: torch.dtype | None = None) -> CulaLayerConfig | None:
    """The layer's cula-serve config when ``cula`` is selected (checked: raises ValueError naming
    the layer if cula-serve cannot serve it), else None. ``input_dtype``: the dtype of the q, k, v
    the layer hands cula-serve (default: the model's dtype)."""
    if not is_cula_selected(vllm_config):
        return None
    additional = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    backend = additional.get("cula_backend")
    device = vllm_config.device_config.device or torch.device(vllm_config.device_config.device_type)
    check_layer_supported(mode, layer=f"{type(layer).__name__} {layer.prefix}", head_k_dim=head_k_dim,
                          head_v_dim=head_v_dim, input_dtype=input_dtype or vllm_config.model_config.dtype,
                          state_dtype=layer.get_state_dtype()[-1], device=device, backend=backend)
    return CulaLayerConfig(mode, num_qk_heads, num_v_heads, head_k_dim, head_v_dim, backend)


def _batch_metadata(prefix: str):
    """This layer's metadata in the current forward pass; None in profile and dummy runs."""
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        return metadata.get(prefix)
    return None


def _plan(md):
    plan = getattr(md, "cula_plan", None)
    return plan if plan is not None else plan_linear_attention(md)


def _conv_states(layer) -> torch.Tensor:
    """vLLM's convolution states as the kernels take them: [num_blocks, dim, state_len]."""
    conv_state = layer.kv_cache[0]
    return conv_state if is_conv_state_dim_first() else conv_state.transpose(-1, -2)


def _conv_verify(x, conv_state, weight, bias, activation, md, out=None):
    """vLLM's causal convolution of the verify tokens (its speculative-decoding call)."""
    return conv_ops.causal_conv1d_update(
        x, conv_state, weight, bias, activation,
        conv_state_indices=md.spec_state_indices_tensor[:, 0][: md.num_spec_decodes],
        num_accepted_tokens=md.num_accepted_tokens, query_start_loc=md.spec_query_start_loc,
        max_query_len=md.spec_state_indices_tensor.size(-1), validate_data=False, out=out)


def _conv_prefill(x, conv_state, weight, bias, activation, md):
    """vLLM's causal convolution of the non-verify tokens of a batch with prefills."""
    return conv_ops.causal_conv1d_fn(
        x.transpose(0, 1), weight, bias, activation=activation, conv_states=conv_state,
        has_initial_state=md.has_initial_state, cache_indices=md.non_spec_state_indices_tensor,
        query_start_loc=md.non_spec_query_start_loc, metadata=md).transpose(0, 1)


def _conv_decode(x, conv_state, weight, bias, activation, md, out=None):
    """vLLM's causal convolution of a decode-only batch."""
    return conv_ops.causal_conv1d_update(
        x, conv_state, weight, bias, activation,
        conv_state_indices=md.non_spec_state_indices_tensor[: x.shape[0]], validate_data=True, out=out)


def _checkpoint_spec(spec, vllm_config):
    """The KV-cache spec with prefill checkpoints every CHECKPOINT_ALIGNMENT tokens ('align' mode)."""
    if isinstance(spec, MambaSpec) and vllm_config.cache_config.mamba_cache_mode == "align":
        return replace(spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=CHECKPOINT_ALIGNMENT)
    return spec


_warmed_up: set = set()


def _warmup_sizes(sizes) -> list[int]:
    """One batch size per compiled variant: Triton specialises integer arguments on being 1 and on
    divisibility by 16, not on their value, so one size of each kind compiles every variant the
    graph sizes will launch (and keeps the scratch states small)."""
    kinds = {}
    for size in sorted(set(sizes)):
        kinds.setdefault(1 if size == 1 else 16 if size % 16 == 0 else 0, size)
    return sorted(kinds.values())


def _warmup(layer, cfg: CulaLayerConfig, device: torch.device, dtype: torch.dtype, options: dict) -> None:
    """Compile cula-serve's kernels for this layer's shapes before vLLM captures CUDA graphs:
    decode for vLLM's graph batch sizes, verify (slots protocol) for the verify batch sizes they
    hold, and one prefill. ``dtype``: the q, k, v dtype; ``options``: the keyword arguments the
    layer's calls pass (gate parameters or decay, scale, backend). Once per distinct
    configuration; nothing to compile on the CPU."""
    if device.type != "cuda":
        return
    vllm_config = get_current_vllm_config()
    state_dtype = layer.get_state_dtype()[-1]
    # Triton compiles per dtype and shape, so tensors key by those.
    options_key = tuple(sorted((name, (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else value)
                               for name, value in options.items()))
    key = (cfg, str(device), dtype, state_dtype, options_key)
    if key in _warmed_up:
        return
    _warmed_up.add(key)
    num_spec = vllm_config.num_speculative_tokens
    tokens = 1 + num_spec
    capture = vllm_config.compilation_config.cudagraph_capture_sizes or [1]
    shape = dict(H=cfg.num_qk_heads, HV=cfg.num_v_heads, K=cfg.head_k_dim, V=cfg.head_v_dim)
    if num_spec:
        cula_serve.warmup(cfg.mode, **shape, batch_sizes=_warmup_sizes([max(1, s // tokens) for s in capture]),
                          verify_tokens=(tokens,), protocols=("slots",), state_dtype=state_dtype, dtype=dtype,
                          device=device, **options)
    cula_serve.warmup(cfg.mode, **shape, batch_sizes=_warmup_sizes(capture), state_dtype=state_dtype, dtype=dtype,
                      device=device, **options)
    T = CHECKPOINT_ALIGNMENT
    q = torch.zeros(T, cfg.num_qk_heads, cfg.head_k_dim, dtype=dtype, device=device)
    v = torch.zeros(T, cfg.num_v_heads, cfg.head_v_dim, dtype=dtype, device=device)
    gates = {}
    if cfg.mode != "lightning":
        g_shape = (T, cfg.num_v_heads) if cfg.mode == "gdn" else (T, cfg.num_v_heads, cfg.head_k_dim)
        gates = dict(g=torch.zeros(g_shape, device=device), beta=torch.zeros(T, cfg.num_v_heads, device=device))
    pool = torch.zeros(1, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim, dtype=state_dtype, device=device)
    PREFILL[cfg.mode](q, q, v, **gates, cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=device),
                      state_pool=pool, state_indices=torch.zeros(1, dtype=torch.int32, device=device), **options)


def _delta_rule_options(cfg: CulaLayerConfig, **gate) -> dict:
    """The options of a GDN / KDA layer's cula-serve calls, as ``translate.run_delta_rule`` passes them."""
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                backend=cfg.backend, **gate)


class _CulaSelected:
    """What a layer reports to vLLM's runner once ``cula`` is selected (``self.cula`` set): the
    cula metadata backend and, in prefix-caching 'align' mode, the checkpoint spec."""

    cula_backend = CulaGDNAttentionBackend

    def get_attn_backend(self):
        return self.cula_backend if self.cula is not None else super().get_attn_backend()

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        return _checkpoint_spec(spec, vllm_config) if self.cula is not None else spec


class CulaQwenGatedDeltaNetAttention(_CulaSelected, QwenGatedDeltaNetAttention):
    """vLLM's GDN layer (Qwen3-Next, Qwen3.5); its recurrence on cula-serve under ``cula``."""

    def __init__(self, config, vllm_config, prefix: str = "", **kwargs):
        super().__init__(config, vllm_config, prefix, **kwargs)
        tp = self.tp_size
        self.cula = _cula_config(self, vllm_config, "gdn", num_qk_heads=self.num_k_heads // tp,
                                 num_v_heads=self.num_v_heads // tp, head_k_dim=self.head_k_dim,
                                 head_v_dim=self.head_v_dim)
        if self.cula is not None:
            # Every platform and batch goes through vllm::qwen_gdn_attention_core -> _forward_core;
            # vLLM's fused MTP kernel would bypass it.
            self.enable_fused_gdn_spec_decode = False
            self._forward_method = self.forward_cuda

    def _split_qkv(self, x: torch.Tensor):
        key_dim = self.cula.num_qk_heads * self.head_k_dim
        q = x[:, :key_dim].unflatten(-1, (self.cula.num_qk_heads, self.head_k_dim))
        k = x[:, key_dim: 2 * key_dim].unflatten(-1, (self.cula.num_qk_heads, self.head_k_dim))
        v = x[:, 2 * key_dim:].unflatten(-1, (self.cula.num_v_heads, self.head_v_dim))
        return q, k, v

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        if self.cula is None:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        md = _batch_metadata(self.prefix)
        if md is None:
            _warmup(self, self.cula, mixed_qkv.device, mixed_qkv.dtype,
                    _delta_rule_options(self.cula, A_log=self.A_log, dt_bias=self.dt_bias))
            return
        plan = _plan(md)
        conv_state, ssm_state = _conv_states(self), self.kv_cache[1]
        weight = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        conv = (weight, self.conv1d.bias, self.activation)
        x_spec, x_rest = split_tokens(plan, mixed_qkv)
        a_spec, a_rest = split_tokens(plan, a)
        b_spec, b_rest = split_tokens(plan, b)
        spec = rest = None
        if x_spec is not None:
            spec = DeltaRuleInputs(*self._split_qkv(_conv_verify(x_spec, conv_state, *conv, md)), a_spec, b_spec)
        if x_rest is not None and (plan.decode is not None or plan.prefill is not None):
            if plan.prefill is not None:
                if plan.prefill.conv_checkpoints:
                    write_conv_checkpoints(plan.prefill, x_rest[plan.num_decode_tokens:], conv_state,
                                           self.conv_kernel_size)
                x_rest = _conv_prefill(x_rest, conv_state, *conv, md)
            else:
                x_rest = _conv_decode(x_rest, conv_state, *conv, md)
            rest = DeltaRuleInputs(*self._split_qkv(x_rest), a_rest, b_rest)
        run_delta_rule(plan, "gdn", spec, rest, ssm_state, core_attn_out, A_log=self.A_log, dt_bias=self.dt_bias,
                       backend=self.cula.backend)


class CulaKimiGatedDeltaNetAttention(_CulaSelected, KimiGatedDeltaNetAttention):
    """vLLM's KDA layer (Kimi-Linear); its recurrence on cula-serve under ``cula``."""

    def __init__(self, config, vllm_config, prefix: str = "", **kwargs):
        super().__init__(config, vllm_config, prefix, **kwargs)
        if self.use_full_rank_gate and is_cula_selected(vllm_config):
            raise ValueError(f"{type(self).__name__} {prefix}: the full-rank KDA gate (Kimi-K3) is not served by "
                             f"cula-serve's vLLM plugin; run this model without --attention-backend cula")
        self.cula = _cula_config(self, vllm_config, "kda", num_qk_heads=self.local_num_heads,
                                 num_v_heads=self.local_num_heads, head_k_dim=self.head_dim,
                                 head_v_dim=self.head_dim)

    def _split_qkv(self, x: torch.Tensor):
        return tuple(part.unflatten(-1, (self.local_num_heads, self.head_dim))
                     for part in x.split(self.local_projection_size, dim=-1))

    def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
        if self.cula is None:
            return super()._forward(mixed_qkv, g1, g2, beta, core_attn_out)
        return self._cula_forward(mixed_qkv, g1, g2, beta, core_attn_out)

    @eager_break_during_capture
    def _cula_forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
        """mixed_qkv [T, 3 * H * D]; g1 [1, T, H, D] raw gate; g2 [T, H, D] output gate; beta
        [1, T, H] raw logits; core_attn_out [1, T, H, D] (written, then normed with g2)."""
        md = _batch_metadata(self.prefix)
        gate = dict(A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.gate_lower_bound)
        if md is None:
            _warmup(self, self.cula, mixed_qkv.device, mixed_qkv.dtype, _delta_rule_options(self.cula, **gate))
            return
        plan = _plan(md)
        conv_state, recurrent_state = _conv_states(self), self.kv_cache[1]
        weight = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        x_spec, x_rest = split_tokens(plan, mixed_qkv)
        g_spec, g_rest = split_tokens(plan, g1[0])
        b_spec, b_rest = split_tokens(plan, beta[0])
        spec = rest = None
        if x_spec is not None:
            x_spec = _conv_verify(x_spec, conv_state, weight, self.conv1d.bias, "silu", md, out=torch.empty_like(x_spec))
            spec = DeltaRuleInputs(*self._split_qkv(x_spec), g_spec, b_spec)
        if x_rest is not None and (plan.decode is not None or plan.prefill is not None):
            if plan.prefill is not None:
                if plan.prefill.conv_checkpoints:
                    write_conv_checkpoints(plan.prefill, x_rest[plan.num_decode_tokens:], conv_state, self.conv_size)
                # q, k and v have their own convolution states and weights (vLLM convolves them
                # separately in prefill, so each comes out dense).
                qkv = [_conv_prefill(x, state, w, None, "silu", md).unflatten(-1, (self.local_num_heads, self.head_dim))
                       for x, state, w in zip(x_rest.split(self.local_projection_size, dim=-1),
                                              conv_state.split(self.local_projection_size, dim=-2),
                                              weight.split(self.local_projection_size, dim=0))]
            else:
                qkv = self._split_qkv(_conv_decode(x_rest, conv_state, weight, self.conv1d.bias, "silu", md,
                                                   out=torch.empty_like(x_rest)))
            rest = DeltaRuleInputs(*qkv, g_rest, b_rest)
        run_delta_rule(plan, "kda", spec, rest, recurrent_state, core_attn_out[0], backend=self.cula.backend, **gate)
        core_attn_out.copy_(self.o_norm(core_attn_out, g2))


class _CulaLightning(_CulaSelected):
    """The Lightning part of the cula layers below: vLLM's ``_forward`` runs as it is and hands
    the batch's q, k, v ([T, H, D] float32, q already scaled) to ``_decode_infer``, which runs the
    plan of ``metadata.CulaLightningAttentionMetadata`` on the layer's state pages."""

    cula_backend = CulaLightningAttentionBackend

    def _init_cula(self, vllm_config) -> None:
        self.cula = _cula_config(self, vllm_config, "lightning", num_qk_heads=self.tp_heads,
                                 num_v_heads=self.tp_heads, head_k_dim=self.head_dim, head_v_dim=self.head_dim,
                                 input_dtype=torch.float32)
        # vLLM's kernels decay the state by exp(-slope) per step: cula-serve's log decay is -slope,
        # for this rank's heads (tp_slope, [H / tp, 1, 1], on the device the model is built on).
        self.cula_decay = None if self.cula is None else -self.tp_slope.reshape(-1).to(torch.float32)

    def _cula_options(self) -> dict:
        return dict(decay=self.cula_decay, scale=1.0, backend=self.cula.backend)

    def _forward(self, hidden_states, output, positions):
        if self.cula is not None and _batch_metadata(self.prefix) is None:
            _warmup(self, self.cula, hidden_states.device, torch.float32, self._cula_options())
        return super()._forward(hidden_states, output, positions)

    def _decode_infer(self, q, k, v, kv_cache, state_indices_tensor, attn_metadata):
        """q, k, v [T, H, D] (every token of the batch); kv_cache: this layer's state pages
        [num_blocks, H, D, D]. Returns the attention output [T, H * D] in q's dtype, zero for
        padding tokens."""
        if self.cula is None:
            return super()._decode_infer(q, k, v, kv_cache, state_indices_tensor, attn_metadata)
        plan = getattr(attn_metadata, "cula_plan", None)
        if plan is None:
            raise RuntimeError(f"{type(self).__name__} {self.prefix}: expected the cula plugin's Lightning metadata "
                               f"(from {CulaLightningAttentionBackend.get_name()}), got {type(attn_metadata).__name__}")
        spec, rest = (None if part[0] is None else LightningInputs(*part)
                      for part in zip(*(split_tokens(plan, x) for x in (q, k, v))))
        hidden = q.new_zeros(plan.num_actual_tokens, self.tp_heads, self.head_dim)
        run_lightning(plan, spec, rest, kv_cache, hidden, **self._cula_options())
        return hidden.flatten(1)


class CulaBailingMoELinearAttention(_CulaLightning, BailingMoELinearAttention):
    """vLLM's Bailing Lightning layer (Ling / Ring 2.5, ``BailingMoeV2_5ForCausalLM``); its
    recurrence on cula-serve under ``cula``."""

    def __init__(self, config, vllm_config, prefix: str = "linear_attn"):
        super().__init__(config, vllm_config, prefix)
        self._init_cula(vllm_config)


class CulaMiniMaxText01LinearAttention(_CulaLightning, MiniMaxText01LinearAttention):
    """vLLM's MiniMax Lightning layer (no in-tree model uses it since vLLM 0.23; out-of-tree
    models may); its recurrence on cula-serve under ``cula``."""

    def __init__(self, config, vllm_config, prefix: str = "linear_attn"):
        super().__init__(config, vllm_config, prefix)
        self._init_cula(vllm_config)


LAYERS = {
    "QwenGatedDeltaNetAttention": CulaQwenGatedDeltaNetAttention,
    "KimiGatedDeltaNetAttention": CulaKimiGatedDeltaNetAttention,
    "BailingMoELinearAttention": CulaBailingMoELinearAttention,
    "MiniMaxText01LinearAttention": CulaMiniMaxText01LinearAttention,
}


def register_layers() -> None:
    """Put the cula layers in vLLM's out-of-tree layer registry (once per process)."""
    for name, layer_cls in LAYERS.items():
        registered = op_registry_oot.get(name)
        if registered is layer_cls:
            continue
        if registered is not None:
            raise RuntimeError(f"another plugin already replaces vLLM's {name} with {registered.__qualname__}; "
                               f"cula-serve cannot replace it too")
        PluggableLayer.register_oot(layer_cls, name=name)
