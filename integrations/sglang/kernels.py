"""cula-serve as SGLang linear-attention kernels (``LinearAttnKernelBase``) for GDN and KDA.

SGLang's ``GDNAttnBackend`` / ``KDAAttnBackend`` run the convolution, the q/k/v split and (GDN
extend) the gating, then call a kernel object per phase through their kernel dispatchers. These
classes are such kernel objects: each call goes through ``translate`` to the Level-1 API with
SGLang's own arguments (pool tensors, slot ids, ``query_start_loc``, intermediate-state buffer).
"""
from __future__ import annotations

from typing import Optional

from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

from . import translate


def _refuse_state_tracking(kwargs):
    """Radix-cache state tracking (extra_buffer) asks the extend kernel for chunk-boundary states;
    the plugin refuses that strategy at startup, so reaching here is a wiring error."""
    if kwargs.get("track_state") is not None or kwargs.get("return_intermediate_states"):
        raise NotImplementedError(
            "cula-serve extend does not produce SGLang's per-chunk track states; run with "
            "--mamba-radix-cache-strategy no_buffer (or --disable-radix-cache)")
    if kwargs.get("num_state_checkpoints"):
        raise NotImplementedError("cula-serve extend does not write SGLang's FlashInfer state checkpoints")


def _refuse_tree_verify(retrieve_parent_token):
    if retrieve_parent_token is not None:
        raise NotImplementedError(
            "cula-serve verifies a draft chain, not a tree: use --speculative-eagle-topk 1")


def _refuse_replayssm(kwargs):
    if kwargs.get("cache_ring") or kwargs.get("replayssm_d") is not None:
        raise NotImplementedError("cula-serve does not serve SGLang's ReplaySSM rings; "
                                  "drop --enable-linear-replayssm / --enable-linear-replayssm-spec")


class _CulaDeltaRuleKernel(LinearAttnKernelBase):
    """Shared by GDN and KDA; ``MODE`` picks the family.

    ``pending_verifies``: where target verifies record their ``PendingCommit`` for the plugin's
    commit (``--attention-backend cula``); None when SGLang's stock commit reads the
    intermediate buffer instead (``--linear-attn-*-backend cula``), which needs protocol "buffer".
    """

    MODE = ""
    supports_packed_decode = False  # SGLang then hands decode() split q / k / v
    supports_strided_target_verify_qkv = True

    def __init__(self, *, protocol: str = "buffer", pending_verifies: Optional[translate.PendingVerifies] = None,
                 backend: Optional[str] = None):
        if protocol not in translate.VERIFY_PROTOCOLS:
            raise ValueError(f"protocol: expected one of {translate.VERIFY_PROTOCOLS}, got {protocol!r}")
        if protocol == "deferred" and pending_verifies is None:
            raise ValueError("protocol='deferred' needs the plugin's commit: launch with --attention-backend cula")
        self.protocol = protocol
        self.pending_verifies = pending_verifies
        self.backend = backend

    def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
               lower_bound=None, **kwargs):
        _refuse_replayssm(kwargs)
        return translate.delta_rule_decode(self.MODE, q, k, v, a, b, A_log=A_log, dt_bias=dt_bias,
                                           ssm_states=ssm_states, cache_indices=cache_indices,
                                           lower_bound=lower_bound, backend=self.backend)

    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
                      intermediate_states_buffer=None, intermediate_state_indices=None, cache_steps=None,
                      retrieve_parent_token=None, lower_bound=None, **kwargs):
        _refuse_tree_verify(retrieve_parent_token)
        _refuse_replayssm(kwargs)
        if kwargs.get("fused_accept_state_indices") is not None:
            raise NotImplementedError("cula-serve does not take SGLang's fused-accept verify rows")
        o, pending = translate.delta_rule_verify(
            self.MODE, q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
            cache_indices=cache_indices, query_start_loc=query_start_loc, cache_steps=cache_steps,
            protocol=self.protocol, intermediate_states_buffer=intermediate_states_buffer,
            intermediate_state_indices=intermediate_state_indices, lower_bound=lower_bound, backend=self.backend)
        if self.pending_verifies is not None:
            self.pending_verifies.record(pending)
        return o


class CulaGDNKernel(_CulaDeltaRuleKernel):
    """GDN on cula-serve. SGLang's GDN extend returns ``(o, last_state, h)``; the state is updated
    in place, so ``last_state`` and the per-chunk states ``h`` (only read for radix tracking,
    refused) are None."""

    MODE = "gdn"

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, inplace_update=True,
               output=None, **kwargs):
        if not inplace_update:
            raise NotImplementedError("cula-serve GDN extend always writes the pool (multi-item scoring "
                                      "is not supported: drop --enable-mis)")
        _refuse_state_tracking(kwargs)
        o = translate.gdn_extend(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                                 query_start_loc=query_start_loc, output=output, backend=self.backend)
        return o, None, None


class CulaKDAKernel(_CulaDeltaRuleKernel):
    """KDA on cula-serve: the gate (``A_log``, ``dt_bias``, safe-gate ``lower_bound``) and beta
    sigmoid are fused in the kernel, as SGLang's Triton KDA extend does with ``beta_is_raw``."""

    MODE = "kda"
    supports_safe_gate_verify = True

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log=None,
               dt_bias=None, lower_bound=None, beta_is_raw=False, **kwargs):
        if A_log is None or not beta_is_raw:
            raise ValueError("cula-serve KDA extend takes the raw gate and beta logits (A_log given, "
                             "beta_is_raw=True), as SGLang's KDAAttnBackend passes them")
        _refuse_state_tracking(kwargs)
        if kwargs.get("is_spec_decode"):
            # draft-extend must leave the pool untouched for rollback; SGLang's MTP drafts for the
            # hybrid models it serves are full-attention only, so this is never reached there.
            raise NotImplementedError("cula-serve KDA extend writes the pool; draft-extend rollback is not supported")
        return translate.kda_extend(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                    ssm_states=ssm_states, cache_indices=cache_indices,
                                    query_start_loc=query_start_loc, backend=self.backend)
