"""What the vLLM plugin can serve, decided without importing vLLM: the vLLM versions it was
built against, whether a model has linear-attention layers it routes, and whether cula-serve has
a kernel for a layer's head dims and dtypes on its device. Each check raises an error that says
what was found and what is supported, before anything is allocated or written."""
from __future__ import annotations

import re

import torch

from cula_serve import dispatch
from cula_serve.api import _select

# The plugin subclasses vLLM internals (GDN metadata builder, the GDN, KDA and Lightning layers)
# and routes through its backend registry; these were read and tested against 0.32, and 0.33 has the same
# hook points. Keep in step with the ``vllm`` extra in pyproject.toml.
SUPPORTED_VLLM = ((0, 32), (0, 34))  # [lowest, first unsupported) as (major, minor)
SUPPORTED_VLLM_TEXT = ">=0.32,<0.34"

# Layer families the plugin routes, and the vLLM layer class that serves each in a model.
ROUTED_LAYERS = {
    "gdn": "QwenGatedDeltaNetAttention (Qwen3-Next, Qwen3.5)",
    "kda": "KimiGatedDeltaNetAttention (Kimi-Linear)",
    "lightning": "BailingMoELinearAttention (Ling / Ring 2.5, BailingMoeV2_5ForCausalLM), "
                 "MiniMaxText01LinearAttention (MiniMax Lightning, out-of-tree models)",
}

# Architectures whose Lightning layers are BailingMoELinearAttention; vLLM's model makes layer i
# a Lightning layer when (i + 1) % layer_group_size != 0.
BAILING_LIGHTNING_ARCHITECTURES = ("BailingMoeV2_5ForCausalLM",)

# Hybrid models whose linear-attention layers are their own classes, which the plugin does not
# route yet: refused by name rather than silently left on vLLM's kernels.
UNROUTED_ARCHITECTURES = {
    "OlmoHybridForCausalLM": "OLMo-hybrid GDN",
    "Glm5NextForCausalLM": "GLM-5-Next KDA",
}


class UnsupportedVllmVersionError(RuntimeError):
    """The installed vLLM is outside the range the plugin supports."""


def vllm_version_error(version: str) -> str | None:
    """None if ``version`` (vllm.__version__) is supported, else the reason."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None:
        return f"cannot read the vLLM version {version!r}; the cula plugin supports vllm{SUPPORTED_VLLM_TEXT}"
    found = (int(match.group(1)), int(match.group(2)))
    low, high = SUPPORTED_VLLM
    if low <= found < high:
        return None
    return (f"the cula plugin (cula-serve) supports vllm{SUPPORTED_VLLM_TEXT}, but vLLM {version} is "
            f"installed; install a supported vLLM (pip install 'cula-serve[vllm]') or drop "
            f"--attention-backend cula")


def check_vllm_version(version: str) -> None:
    """Raise UnsupportedVllmVersionError unless ``version`` is supported."""
    reason = vllm_version_error(version)
    if reason:
        raise UnsupportedVllmVersionError(reason)


def linear_attention_layers(hf_text_config, architectures=()) -> dict[str, int]:
    """The routed linear-attention layers a model declares: {family: count}.

    GDN models (Qwen3-Next, Qwen3.5) list ``layer_types`` with "linear_attention" entries;
    Kimi-Linear names its KDA layers in ``linear_attn_config["kda_layers"]``; Bailing 2.5
    (``architectures``) interleaves Lightning layers by ``layer_group_size`` (vLLM's default 1:
    none); MiniMax-style configs mark Lightning layers 0 in ``attn_type_list``.
    """
    found = {}
    layer_types = getattr(hf_text_config, "layer_types", None) or []
    gdn = sum(1 for t in layer_types if t == "linear_attention")
    if gdn:
        found["gdn"] = gdn
    linear_attn_config = getattr(hf_text_config, "linear_attn_config", None)
    if isinstance(linear_attn_config, dict) and linear_attn_config.get("kda_layers"):
        found["kda"] = len(linear_attn_config["kda_layers"])
    lightning = 0
    if any(a in BAILING_LIGHTNING_ARCHITECTURES for a in architectures or ()):
        group = getattr(hf_text_config, "layer_group_size", 1)
        if group > 0:
            lightning = sum(1 for i in range(hf_text_config.num_hidden_layers) if (i + 1) % group)
    else:
        lightning = sum(1 for t in getattr(hf_text_config, "attn_type_list", None) or [] if t == 0)
    if lightning:
        found["lightning"] = lightning
    return found


def check_model_has_linear_attention(hf_text_config, architectures) -> dict[str, int]:
    """Raise ValueError if the model has no linear-attention layer the plugin routes."""
    unrouted = [UNROUTED_ARCHITECTURES[a] for a in architectures or [] if a in UNROUTED_ARCHITECTURES]
    if unrouted:
        raise ValueError(f"--attention-backend cula: the {unrouted[0]} layers of {list(architectures)} are not "
                         f"routed by cula-serve's vLLM plugin yet; run this model without the flag")
    found = linear_attention_layers(hf_text_config, architectures)
    if found:
        return found
    routed = "; ".join(f"{family.upper()}: {where}" for family, where in ROUTED_LAYERS.items())
    raise ValueError(
        f"--attention-backend cula: the model (architectures {list(architectures or [])}) has no "
        f"linear-attention layer that cula-serve serves in vLLM ({routed}); its full-attention "
        f"layers would run on vLLM's own backend anyway, so drop the flag.")


def check_layer_supported(mode: str, *, layer: str, head_k_dim: int, head_v_dim: int,
                          input_dtype: torch.dtype, state_dtype: torch.dtype, device,
                          backend: str | None = None) -> str:
    """Check that cula-serve can serve a linear-attention layer on ``device``; return the name of
    the backend that will run its decode (the serving hot path).

    On a CUDA device the backend must be one that runs without host synchronisation (so decode
    and verify can be captured in CUDA graphs): the torch reference is refused there. ``backend``
    forces one by name (``--additional-config '{"cula_backend": "triton"}'``).
    """
    device = torch.device(device)
    if state_dtype not in (torch.float32, torch.bfloat16):
        # vLLM sizes Lightning states by --mamba-cache-dtype, delta-rule states by --mamba-ssm-cache-dtype
        flag = "--mamba-cache-dtype" if mode == "lightning" else "--mamba-ssm-cache-dtype"
        raise ValueError(
            f"{layer}: cula-serve keeps recurrent states in float32 or bfloat16, but vLLM allocated "
            f"{state_dtype} (set {flag} float32, or bfloat16)")
    chosen = {}
    for operation in ("prefill", "decode", "verify"):
        # On a GPU the torch reference is not a serving backend: look only at the others.
        names = [backend] if backend is not None else [
            name for name in dispatch.preference(operation, device) if device.type != "cuda" or name != "torch"]
        reasons = []
        for name in names:
            try:
                module = _select(operation, device, name, input_dtype=input_dtype, state_dtype=state_dtype,
                                 K=head_k_dim, V=head_v_dim)
            except (ValueError, dispatch.BackendUnavailableError) as err:
                reasons.append(str(err))
                continue
            if device.type == "cuda" and module.NAME == "torch":
                reasons.append("the torch reference synchronises the host, so it cannot be captured in CUDA graphs")
                continue
            chosen[operation] = module.NAME
            break
        else:
            raise ValueError(f"{layer}: cula-serve cannot serve {mode} {operation} with head dims "
                             f"K={head_k_dim}, V={head_v_dim}, {input_dtype} inputs and a {state_dtype} "
                             f"state on {device}: " + "; ".join(reasons or ["no backend"]))
    return chosen["decode"]
