"""The linear-attention backends of ``--attention-backend cula`` and their hybrid wrapper.

Each backend is SGLang's own backend for the family (convolution, projections split, metadata,
CUDA-graph state) with the recurrent core on cula-serve:

- ``CulaGDNAttnBackend`` / ``CulaKDAAttnBackend``: ``GDNAttnBackend`` / ``KDAAttnBackend`` whose
  kernel dispatcher runs ``CulaGDNKernel`` / ``CulaKDAKernel`` for decode, extend and verify.
- ``CulaLightningAttnBackend``: ``LightningAttentionBackend`` with extend, decode and verify
  through ``translate`` (SGLang's Lightning pool reused in K-last order, see ``translate``).
- ``CulaHybridLinearAttnBackend``: SGLang's ``HybridLinearAttnBackend`` whose post-verify commit
  (``update_mamba_state_after_mtp_verify``) commits the SSM states with ``cula_commit`` (buffer or
  deferred protocol) and the convolution windows with SGLang's own scatter.

CUDA graphs use SGLang's current API, inherited from ``MambaAttnBackendBase``:
``init_cuda_graph_state`` allocates static per-batch-size slot and ``query_start_loc`` buffers,
``init_forward_metadata_out_graph`` refreshes them in place before each capture / replay, and the
cula-serve decode / verify calls inside the graph read them (no host synchronisation, shape-only
branching). The overrides here add one thing: they tell ``PendingVerifies`` which captured
verify's pendings the next commit belongs to.
"""
from __future__ import annotations

import torch
from sglang.kernels.ops.mamba.mamba_state_scatter_triton import fused_conv_window_scatter_with_mask
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
from sglang.srt.layers.attention.linear.lightning_backend import LightningAttentionBackend
from sglang.srt.layers.attention.linear.utils import pp_spec_stable_rows_enabled
from sglang.srt.runtime_context import get_exec, get_memory

from . import translate
from .kernels import CulaGDNKernel, CulaKDAKernel

NAME = "cula"


def unsupported_configuration(backend) -> str | None:
    """Why SGLang's current configuration cannot run on cula-serve, or None. Read at backend
    construction, before any forward, so a bad launch fails with the reason."""
    mamba = get_exec().mamba
    if backend.topk > 1:
        return (f"speculative decoding with --speculative-eagle-topk {backend.topk}: cula-serve verifies a "
                "draft chain, use --speculative-eagle-topk 1")
    if getattr(mamba, "enable_mamba_extra_buffer", False) or getattr(mamba, "enable_mamba_extra_buffer_lazy", False):
        return ("--mamba-radix-cache-strategy extra_buffer: cula-serve does not write SGLang's per-chunk track "
                "states; use --mamba-radix-cache-strategy no_buffer (the default with cula) or --disable-radix-cache")
    if mamba.enable_linear_replayssm or mamba.enable_linear_replayssm_spec:
        return "--enable-linear-replayssm(-spec): SGLang's ReplaySSM rings are not cula-serve's; drop the flag"
    if get_exec().features.enable_mis:
        return "--enable-mis (multi-item scoring) is not supported by cula-serve"
    if get_memory().enable_unified_memory:
        return ("--enable-unified-memory: the unified pool maps virtual slots to physical ones where slot 0 "
                "may be live; cula-serve needs SGLang's static mamba pool")
    temporal = backend.req_to_token_pool.mamba_pool.mamba_cache.temporal
    if temporal.dtype not in (torch.float32, torch.bfloat16):
        return f"--mamba-ssm-dtype {str(temporal.dtype).replace('torch.', '')}: cula-serve pools are float32 or bfloat16"
    return None


class _CulaLinearBackendMixin:
    """What the three cula backends add to SGLang's: the configuration check, the verify
    protocol, and the bookkeeping of pending verifies per eager forward / captured graph."""

    def _init_cula(self):
        reason = unsupported_configuration(self)
        if reason:
            raise ValueError(f"--attention-backend cula: {reason}")
        self.verify_protocol = translate.verify_protocol_from_env()
        self.pending_verifies = translate.PendingVerifies()

    def init_forward_metadata(self, forward_batch):
        self.pending_verifies.begin_eager()
        super().init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if forward_batch.forward_mode.is_target_verify():
            if in_capture:
                self.pending_verifies.begin_capture(forward_batch.batch_size)
            else:
                self.pending_verifies.use_graph(forward_batch.batch_size)
        super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)


def route_kda_safe_gate_decode(dispatcher, kernel):
    """SGLang's ``KDAKernelDispatcher.decode`` refuses the safe gate (``lower_bound``) for any
    kernel that is not its ``TritonKDAKernel`` (an isinstance check); cula-serve fuses the safe gate,
    so the dispatcher's decode goes straight to the cula-serve kernel."""
    dispatcher.supports_packed_decode_safe_gate = False
    dispatcher.decode = kernel.decode


def _install_cula_kernel(dispatcher, kernel):
    """Every phase of SGLang's GDN / KDA kernel dispatcher on ``kernel``."""
    dispatcher.decode_kernel = dispatcher.extend_kernel = dispatcher.verify_kernel = kernel
    if hasattr(dispatcher, "tree_verify_kernel"):
        dispatcher.tree_verify_kernel = kernel  # refuses trees with a clear message
    if hasattr(dispatcher, "triton_kernel"):
        dispatcher.triton_kernel = kernel  # KDA's reroute target for one-token extends
    dispatcher.supports_packed_decode = False
    if hasattr(dispatcher, "supports_packed_decode_safe_gate"):
        route_kda_safe_gate_decode(dispatcher, kernel)
    if hasattr(dispatcher, "verify_kernel_is_flashinfer"):
        dispatcher.verify_kernel_is_flashinfer = False
    if hasattr(dispatcher, "prefill_backend"):
        from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend
        dispatcher.prefill_backend = LinearAttnKernelBackend.CUSTOM


class CulaGDNAttnBackend(_CulaLinearBackendMixin, GDNAttnBackend):
    """SGLang's GDN backend (Qwen3-Next, Qwen3.5 / 3.6) with every phase on cula-serve."""

    supports_mis = False

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self._init_cula()
        _install_cula_kernel(self.kernel_dispatcher, CulaGDNKernel(
            protocol=self.verify_protocol, pending_verifies=self.pending_verifies))


class CulaKDAAttnBackend(_CulaLinearBackendMixin, KDAAttnBackend):
    """SGLang's KDA backend (Kimi-Linear, GLM5-Next, Bailing with KDA) with every phase on cula-serve."""

    supports_mis = False
    supports_ragged_verify_graph = False  # cula-serve verifies T tokens per request

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self._init_cula()
        if self.accept_lens_pool is not None:
            raise ValueError("--attention-backend cula: the FlashInfer fused-accept verify "
                             "(--linear-attn-verify-backend flashinfer) replaces SGLang's commit; drop it")
        _install_cula_kernel(self.kernel_dispatcher, CulaKDAKernel(
            protocol=self.verify_protocol, pending_verifies=self.pending_verifies))
        self._fused_chain_verify_fn = None  # SGLang's fused conv + verify would bypass the kernel

    def supports_prefill_graph_extend(self) -> bool:
        return False  # SGLang's breakable prefill graph runs its Triton chain, not the dispatcher

    def _can_run_dspark_cutedsl_mtp(self, **kwargs) -> bool:
        return False  # a fused SGLang verify that would bypass the kernel


class CulaLightningAttnBackend(_CulaLinearBackendMixin, LightningAttentionBackend):
    """SGLang's Lightning backend (Ling / Bailing linear, MiniCPM hybrid) with extend, decode and
    verify on cula-serve. SGLang's Lightning pool is ``[size + 1, H, D, D]``; cula-serve keeps it
    in its own K-last order, so all three phases must run here (they do: this backend has no
    per-phase kernel choice)."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self._init_cula()
        translate.check_lightning_pool(self.req_to_token_pool.mamba_pool.mamba_cache.temporal[0])

    def _slope(self, layer_id):
        return self.tp_slope[layer_id]

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        layer_id = layer.layer_id if layer else kwargs["layer_id"]
        metadata = self.forward_metadata
        layer_cache = self.req_to_token_pool.mamba2_layer_cache(layer_id)
        heads, dim = layer.tp_q_head_num, layer.head_dim
        q, k, v = (x.reshape(-1, heads, dim) for x in (q, k, v))
        if forward_batch.forward_mode.is_target_verify():
            N = metadata.query_start_loc.shape[0] - 1
            o, pending = translate.lightning_verify(
                q, k, v, slope=self._slope(layer_id), scale=layer.scaling, ssm_states=layer_cache.temporal,
                cache_indices=metadata.mamba_cache_indices, query_start_loc=metadata.query_start_loc,
                cache_steps=forward_batch.spec_info.draft_token_num, protocol=self.verify_protocol,
                intermediate_states_buffer=getattr(layer_cache, "intermediate_ssm", None),
                intermediate_state_indices=torch.arange(N, dtype=torch.int32, device=q.device))
            self.pending_verifies.record(pending)
        else:
            if forward_batch.mamba_track_mask is not None:
                raise NotImplementedError("cula-serve Lightning extend does not write SGLang's track states; "
                                          "use --mamba-radix-cache-strategy no_buffer")
            N = metadata.query_start_loc.shape[0] - 1
            has_initial = metadata.has_initial_states
            if not isinstance(has_initial, torch.Tensor) or has_initial.shape[0] != N or has_initial.dtype != torch.bool:
                has_initial = None  # decode-shaped metadata: every row continues its slot
            o = translate.lightning_extend(
                q, k, v, slope=self._slope(layer_id), scale=layer.scaling, ssm_states=layer_cache.temporal,
                cache_indices=metadata.mamba_cache_indices[:N], query_start_loc=metadata.query_start_loc,
                has_initial_state=has_initial)
        return o.reshape(-1, heads * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        layer_id = layer.layer_id if layer else kwargs["layer_id"]
        layer_cache = self.req_to_token_pool.mamba2_layer_cache(layer_id)
        heads, dim = layer.tp_q_head_num, layer.head_dim
        q, k, v = (x.reshape(-1, heads, dim) for x in (q, k, v))
        o = translate.lightning_decode(q, k, v, slope=self._slope(layer_id), scale=layer.scaling,
                                       ssm_states=layer_cache.temporal,
                                       cache_indices=self.forward_metadata.mamba_cache_indices)
        return o.reshape(-1, heads * layer.v_head_dim)


CULA_LINEAR_BACKENDS = (CulaGDNAttnBackend, CulaKDAAttnBackend, CulaLightningAttnBackend)


class CulaHybridLinearAttnBackend(HybridLinearAttnBackend):
    """SGLang's hybrid wrapper (full-attention layers on the full backend, linear layers on a cula
    backend) with the MTP commit on cula-serve."""

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices,
                                            mamba_steps_to_track, model, req_pool_indices=None):
        """Commit the accepted states after a verify: every linear layer's SSM state through
        ``cula_commit`` (``last_correct_step_indices[n] + 1`` tokens kept by request n), then the
        convolution windows and side states with SGLang's scatter, as SGLang's own commit does."""
        if mamba_track_indices is not None:
            raise NotImplementedError("cula-serve: radix state tracking during MTP (extra_buffer) is not supported")
        linear = self.linear_attn_backend
        linear.pending_verifies.commit(last_correct_step_indices)

        request_number = last_correct_step_indices.shape[0]
        src_rows = None
        if pp_spec_stable_rows_enabled() and req_pool_indices is not None:
            src_rows = req_pool_indices[:request_number]
            slots = linear._translate_mamba_indices(linear.req_to_token_pool.get_mamba_indices(src_rows))
        else:
            slots = linear.forward_metadata.mamba_cache_indices[:request_number]
        caches = linear.req_to_token_pool.get_speculative_mamba2_params_all_layers()
        for conv, window in zip(caches.conv, caches.intermediate_conv_window):
            if conv.numel() == 0:
                continue
            if conv.is_cuda:
                fused_conv_window_scatter_with_mask(conv, window, slots, last_correct_step_indices, src_rows)
            else:
                self._scatter_speculative_state_with_mask(conv, window, slots, last_correct_step_indices, src_rows)
        self._update_ple_state_after_mtp_verify(slots, last_correct_step_indices, None, None, src_rows)
