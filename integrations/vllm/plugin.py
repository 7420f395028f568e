"""The entry point vLLM calls in every process (group ``vllm.general_plugins``): ``register``.

It makes ``--attention-backend cula`` mean "linear-attention layers on cula-serve":

1. A new member ``CULA`` of vLLM's ``AttentionBackendEnum``, so the flag parses. vLLM sends its
   config to engine and worker processes by pickle, and a spawned process has not run this
   plugin when it unpickles; a plain enum member would be pickled as ``AttentionBackendEnum(value)``
   and fail there. The member is pickled as a call to ``backend_member("CULA")`` instead, which
   registers the plugin in the new process and returns the member.
2. Full-attention layers keep vLLM's choice: selecting an attention backend with ``CULA``
   selects as if no backend had been named (and first checks that the model has linear-attention
   layers cula serves). ``CULA`` itself names ``CulaFullAttentionGuard``, which refuses every
   configuration, so if that routing were ever bypassed vLLM would fail loudly rather than run
   full attention on something else.
3. The GDN, KDA and Lightning layers are replaced (vLLM's out-of-tree layer registry) by
   subclasses that run on cula-serve when ``CULA`` is selected and are vLLM's own layers
   otherwise. Their metadata backends come from the layers (``get_attn_backend``), so vLLM's
   mamba-backend registry is left as it is.

With a vLLM outside the supported range (``compat.SUPPORTED_VLLM_TEXT``) only the name is
registered, and resolving it raises the version error.
"""
from __future__ import annotations

import functools
import logging

from .compat import check_model_has_linear_attention, vllm_version_error

logger = logging.getLogger(__name__)

BACKEND_NAME = "CULA"
GUARD_PATH = "cula_serve.integrations.vllm.plugin.CulaFullAttentionGuard"
UNSUPPORTED_PATH = "cula_serve.integrations.vllm.unsupported.CulaUnsupportedVllm"

_registered = False


def register() -> None:
    """Register the ``cula`` attention backend name and the cula-serve GDN / KDA / Lightning layers.
    Safe to call more than once (vLLM does, per process)."""
    global _registered
    if _registered:
        return
    import vllm

    reason = vllm_version_error(vllm.__version__)
    if reason:
        logger.warning("cula-serve's vLLM plugin is disabled: %s", reason)
        _register_backend_name(UNSUPPORTED_PATH)
        _registered = True
        return
    _register_backend_name(GUARD_PATH)
    _route_full_attention()
    from .layers import register_layers

    register_layers()
    _registered = True


def backend_member(name: str = BACKEND_NAME):
    """``AttentionBackendEnum.CULA``, registering the plugin first if this process has not (how a
    pickled config restores the member in a spawned process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if name != BACKEND_NAME:
        raise ValueError(f"name: the cula plugin registers only {BACKEND_NAME!r}, got {name!r}")
    register()
    return AttentionBackendEnum[name]


def is_cula_selected(vllm_config) -> bool:
    """Whether ``vllm_config`` selects ``--attention-backend cula``."""
    attention_config = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention_config, "backend", None)
    return backend is not None and backend.name == BACKEND_NAME


def _reduce_member(name, protocol):
    return backend_member, (name,)


def _register_backend_name(class_path: str) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, class_path)
    member = AttentionBackendEnum[BACKEND_NAME]
    # Pickle by name through this module (see the module docstring); pickle looks the reducer up
    # on the object, so only this member is affected.
    member.__reduce_ex__ = functools.partial(_reduce_member, BACKEND_NAME)


def _route_full_attention() -> None:
    """Select full-attention backends for ``CULA`` exactly as for no selection."""
    from vllm.v1.attention import selector

    select = selector._cached_get_attn_backend
    if getattr(select, "cula_routed", False):
        return

    @functools.wraps(select)
    def routed(backend, *args, **kwargs):
        if backend is not None and backend.name == BACKEND_NAME:
            _check_model()
            backend = None
        return select(backend, *args, **kwargs)

    routed.cula_routed = True
    for name in ("cache_clear", "cache_info"):
        if hasattr(select, name):
            setattr(routed, name, getattr(select, name))
    selector._cached_get_attn_backend = routed


def _check_model() -> None:
    from vllm.config import get_current_vllm_config

    model_config = get_current_vllm_config().model_config
    if model_config is not None:
        check_model_has_linear_attention(model_config.hf_text_config, model_config.architectures)


try:
    from vllm.v1.attention.backend import AttentionBackend as _AttentionBackend
except ImportError:  # vLLM without this module: only the unsupported-version path runs
    _AttentionBackend = object


class CulaFullAttentionGuard(_AttentionBackend):
    """What ``AttentionBackendEnum.CULA`` names. cula-serve has no full-attention kernels: the
    plugin routes ``CULA`` to vLLM's automatic choice before any platform sees it, so a platform
    that validates this class means that routing was bypassed, and it is refused."""

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        return ["cula serves linear-attention layers only; full-attention layers should have been routed to "
                "vLLM's automatic backend selection by the cula plugin before this check, which did not "
                "happen"]
