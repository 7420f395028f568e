"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``cula``): ``register()``.

SGLang calls ``register()`` through ``sglang.srt.plugins.load_plugins()`` in every process
(launcher, scheduler, workers) before the server arguments are parsed, then applies the hooks
registered here. It adds two ways to use cula-serve:

``--attention-backend cula`` (also ``--prefill-attention-backend`` / ``--decode-attention-backend``)
    Full-attention layers run on SGLang's usual backend for the GPU (fa3 on Hopper, triton on
    Blackwell, flashinfer or triton elsewhere; ``CULA_SGLANG_FULL_ATTENTION_BACKEND`` overrides),
    GDN / KDA / Lightning layers on cula-serve for extend, decode and target verify, with the
    MTP commit on ``cula_commit`` (``CULA_SGLANG_VERIFY_PROTOCOL=buffer|deferred``).
``--linear-attn-backend cula`` (and ``--linear-attn-{prefill,decode,verify}-backend cula``)
    Only the GDN / KDA kernels of the chosen phases; SGLang's backend, wrapper and commit stay.
    Lightning has no per-phase kernels in SGLang: any of these flags moves all its phases.

Hooks, and the SGLang 0.5.23 behaviour each one works around:
- ``attention_registry.attn_backend_wrapper`` (AROUND): builds the cula hybrid backend. The stock
  wrapper would pick SGLang's linear backends and, for hybrid GDN on Blackwell, assert that the
  backend name is in an allow-list without "cula".
- ``GDNKernelDispatcher.__init__`` / ``KDAKernelDispatcher.__init__`` (AROUND): SGLang turns an
  unknown kernel name into ``CUSTOM`` and then rejects it; the hook builds the dispatcher for
  triton and swaps the cula-serve kernel into the phases named "cula".
- ``arg_groups.overrides.supports_mamba_cache_extra_buffer`` (AROUND): with ``--attention-backend
  cula`` the ``auto`` radix strategy resolves to ``no_buffer`` (cula-serve does not write SGLang's
  track states), as SGLang already does for any non-triton ``--linear-attn-backend``.
- ``speculative.draft_utils.DraftBackendFactory._create_backend`` (AROUND): the draft worker's
  backend table has no "cula"; the MTP draft of these hybrids is full-attention only, so "cula"
  maps to SGLang's own choice for hybrid-linear drafts (``hybrid_linear_attn``).
- ``--linear-attn-verify-backend`` builds its choices as a new list at import time, out of reach of
  ``add_linear_attn_kernel_backend_choices``; ``register()`` appends "cula" to that list.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import typing

import torch

from . import translate

logger = logging.getLogger(__name__)

NAME = "cula"
FULL_ATTENTION_ENV = "CULA_SGLANG_FULL_ATTENTION_BACKEND"
LINEAR_FLAGS = ("linear_attn_backend", "linear_attn_prefill_backend", "linear_attn_decode_backend",
                "linear_attn_verify_backend")

_registered = False


# ------------------------------------------------------------------------------------------------
# which parts run on cula-serve


def default_full_attention_backend() -> str:
    """SGLang's full-attention backend behind ``--attention-backend cula`` on this machine."""
    name = os.environ.get(FULL_ATTENTION_ENV)
    if name:
        if name == NAME:
            raise ValueError(f"{FULL_ATTENTION_ENV}: names the full-attention backend under cula; 'cula' is not one")
        return name
    if torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability()
        if major == 9:
            return "fa3"
        if major >= 10:
            return "triton"  # in SGLang's Blackwell allow-list for hybrid GDN models
        if importlib.util.find_spec("flashinfer") is not None:
            return "flashinfer"
    return "triton"


def cula_attention_selected(runner) -> bool:
    """``--attention-backend cula`` (or the prefill / decode split of it) on this runner."""
    return NAME in (getattr(runner, "prefill_attention_backend_str", None),
                    getattr(runner, "decode_attention_backend_str", None))


def cula_kernel_phases() -> dict:
    """{"prefill", "decode", "verify"} -> whether ``--linear-attn-*-backend`` puts that phase of the
    GDN / KDA kernels on cula-serve. Unset verify follows decode when decode is cula."""
    from sglang.srt.runtime_context import get_exec

    mamba = get_exec().mamba
    base = mamba.linear_attn_backend
    decode = (mamba.linear_attn_decode_backend or base) == NAME
    prefill = (mamba.linear_attn_prefill_backend or base) == NAME
    verify = mamba.linear_attn_verify_backend == NAME or (mamba.linear_attn_verify_backend is None and decode)
    return {"prefill": prefill, "decode": decode, "verify": verify}


# ------------------------------------------------------------------------------------------------
# --attention-backend cula


def create_cula_attention_backend(runner):
    """Factory registered as attention backend "cula": the full-attention backend it stands for.
    The linear layers are attached by the ``attn_backend_wrapper`` hook."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    name = default_full_attention_backend()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend cula: full-attention backend {name!r} is not registered "
                         f"(set {FULL_ATTENTION_ENV} to one of {sorted(k for k in ATTENTION_BACKENDS if k != NAME)})")
    logger.info("cula-serve: full-attention layers on SGLang's %r backend", name)
    return ATTENTION_BACKENDS[name](runner)


def build_cula_hybrid_backend(runner, full_attn_backend):
    """``HybridLinearAttnBackend`` with the model's linear layers on cula-serve, or None when the
    model has no linear-attention layers (then "cula" is just the full-attention backend)."""
    from sglang.srt.configs.hybrid_arch import (hybrid_gdn_config, hybrid_kda_config, hybrid_lightning_config,
                                                mambaish_config)
    from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends

    from .backend import (CulaGDNAttnBackend, CulaHybridLinearAttnBackend, CulaKDAAttnBackend,
                          CulaLightningAttnBackend)

    model_config = runner.model_config
    cfg = mambaish_config(model_config)
    if cfg is None:
        return None
    if getattr(runner, "use_mla_backend", False) and hybrid_gdn_config(model_config) is not None:
        raise ValueError("--attention-backend cula: hybrid GDN models need a non-MLA full-attention backend")
    runner.linear_attn_backends = resolve_linear_attn_backends(prefill_default=None)
    if hybrid_gdn_config(model_config) is not None:
        linear = CulaGDNAttnBackend(runner)
    elif hybrid_kda_config(model_config) is not None:
        linear = CulaKDAAttnBackend(runner)
    elif hybrid_lightning_config(model_config) is not None:
        linear = CulaLightningAttnBackend(runner)
    else:
        arch = (getattr(model_config.hf_config, "architectures", None) or [type(model_config.hf_config).__name__])[0]
        raise ValueError(f"--attention-backend cula serves GDN, KDA and Lightning layers; {arch} has linear "
                         "layers of another kind (Mamba2, short convolutions): pick another --attention-backend")
    # SGLang's convention: the MTP draft of these hybrids is full attention only.
    full_attn_layers = [0] if runner.is_draft_worker else cfg.full_attention_layer_ids
    logger.info("cula-serve: %s for the linear-attention layers", type(linear).__name__)
    return CulaHybridLinearAttnBackend(full_attn_backend, linear, full_attn_layers)


def _attn_backend_wrapper_hook(original, runner, full_attn_backend):
    from sglang.srt.configs.hybrid_arch import hybrid_lightning_config

    if cula_attention_selected(runner):
        hybrid = build_cula_hybrid_backend(runner, full_attn_backend)
        return full_attn_backend if hybrid is None else hybrid
    phases = cula_kernel_phases()
    if any(phases.values()) and hybrid_lightning_config(runner.model_config) is not None:
        if not all(phases.values()):
            raise ValueError(f"--linear-attn-*-backend cula: {translate.LIGHTNING_MIXED_PHASES}; "
                             f"got cula for {[p for p, on in phases.items() if on]} only")
        return build_cula_hybrid_backend(runner, full_attn_backend)
    return original(runner, full_attn_backend)


# ------------------------------------------------------------------------------------------------
# --linear-attn-*-backend cula


def _dispatcher_init_hook(kernel_class):
    def hook(original, self, decode_backend, prefill_backend, verify_backend=None):
        from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

        phases = cula_kernel_phases()
        if not any(phases.values()):
            return original(self, decode_backend, prefill_backend, verify_backend)
        triton = LinearAttnKernelBackend.TRITON
        # SGLang keeps unknown names only as CUSTOM: build the dispatcher on triton for those
        # phases, then put the cula-serve kernel in them.
        original(self, triton if phases["decode"] else decode_backend,
                 triton if phases["prefill"] else prefill_backend,
                 triton if phases["verify"] else verify_backend)
        kernel = kernel_class(protocol="buffer")  # SGLang's stock commit reads the buffer
        if phases["decode"]:
            self.decode_kernel = kernel
            self.supports_packed_decode = False
            if hasattr(self, "supports_packed_decode_safe_gate"):
                from .backend import route_kda_safe_gate_decode
                route_kda_safe_gate_decode(self, kernel)
        if phases["prefill"]:
            self.extend_kernel = kernel
            if hasattr(self, "prefill_backend"):
                self.prefill_backend = LinearAttnKernelBackend.CUSTOM
        if phases["verify"]:
            self.verify_kernel = kernel
            if hasattr(self, "verify_kernel_is_flashinfer"):
                self.verify_kernel_is_flashinfer = False
        logger.info("cula-serve kernels for %s: %s", type(self).__name__,
                    ", ".join(p for p, on in phases.items() if on))
    return hook


# ------------------------------------------------------------------------------------------------
# server-argument resolution and the draft worker


def _extra_buffer_hook(original, view, hf_config):
    names = (getattr(view, "attention_backend", None), getattr(view, "prefill_attention_backend", None),
             getattr(view, "decode_attention_backend", None))
    if NAME in names:
        return False
    return original(view, hf_config)


def _draft_backend_hook(original, self, backend_name, backend_map, error_template, stamps_children=False):
    if NAME not in backend_map and "hybrid_linear_attn" in backend_map:
        backend_map = {**backend_map, NAME: backend_map["hybrid_linear_attn"]}
    return original(self, backend_name, backend_map, error_template, stamps_children)


def _add_verify_choice():
    """Append "cula" to ``--linear-attn-verify-backend``'s own choices list (see module doc)."""
    from sglang.srt.arg_groups.arg_utils import Arg
    from sglang.srt.arg_groups.fields.exec_ import ExecMamba
    from sglang.srt.server_args import ServerArgs

    # ServerArgs carries its own copy of the field's annotation (the CLI is built from it) when
    # it was created before this runs; extend both.
    for owner in (ExecMamba, ServerArgs):
        hint = typing.get_type_hints(owner, include_extras=True)["linear_attn_verify_backend"]
        for meta in getattr(hint, "__metadata__", ()):
            if isinstance(meta, Arg) and meta.choices is not None and NAME not in meta.choices:
                meta.choices.append(NAME)


def register():
    """The plugin entry function. Idempotent."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import (ATTENTION_BACKEND_CHOICES, LINEAR_ATTN_KERNEL_BACKEND_CHOICES,
                                               add_attention_backend_choices,
                                               add_linear_attn_kernel_backend_choices)
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .kernels import CulaGDNKernel, CulaKDAKernel

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    if NAME not in LINEAR_ATTN_KERNEL_BACKEND_CHOICES:
        add_linear_attn_kernel_backend_choices([NAME])
    _add_verify_choice()
    register_attention_backend(NAME)(create_cula_attention_backend)

    around = HookType.AROUND
    HookRegistry.register("sglang.srt.layers.attention.attention_registry.attn_backend_wrapper",
                          _attn_backend_wrapper_hook, around)
    HookRegistry.register("sglang.srt.layers.attention.linear.gdn_backend.GDNKernelDispatcher.__init__",
                          _dispatcher_init_hook(CulaGDNKernel), around)
    HookRegistry.register("sglang.srt.layers.attention.linear.kda_backend.KDAKernelDispatcher.__init__",
                          _dispatcher_init_hook(CulaKDAKernel), around)
    HookRegistry.register("sglang.srt.arg_groups.overrides.supports_mamba_cache_extra_buffer",
                          _extra_buffer_hook, around)
    HookRegistry.register("sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend",
                          _draft_backend_hook, around)
    _registered = True
