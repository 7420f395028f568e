"""The attention backends of cula-served layers: vLLM's GDN backend whose metadata builder also
plans the batch for cula-serve, once per batch for all layers of the group (GDN and KDA layers:
``CulaGDNAttentionBackend``; Lightning layers: ``CulaLightningAttentionBackend``, the same
builder with the plan handed over in the metadata type vLLM's Lightning layers take).

The builder is a subclass of vLLM's ``GDNAttentionMetadataBuilder``, so the model runner hands it
the speculative-decoding arguments (it checks ``isinstance``) and vLLM's CUDA-graph support
(``UNIFORM_BATCH``: FULL graphs for decode-only and uniform verify batches, PIECEWISE for the
rest) and persistent buffers stay as they are. When vLLM stages a batch into those persistent
buffers for FULL graph replay, the translated slots go to buffers of this builder, whose
addresses are fixed too, so a captured graph reads each new batch's slots.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from vllm.v1.attention.backends.gdn_attn import (GDNAttentionBackend, GDNAttentionMetadata,
                                                 GDNAttentionMetadataBuilder)
from vllm.v1.attention.backends.linear_attn import LinearAttentionMetadata

from .translate import LinearAttentionPlan, plan_linear_attention


@dataclass
class CulaGDNAttentionMetadata(GDNAttentionMetadata):
    """vLLM's GDN metadata plus the batch's cula-serve plan."""

    cula_plan: LinearAttentionPlan | None = None


def _shares_storage(view: torch.Tensor | None, buffer: torch.Tensor) -> bool:
    return view is not None and view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


class CulaGDNAttentionMetadataBuilder(GDNAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Same shapes as vLLM's persistent index buffers; hold the translated slots.
        self.cula_decode_slots = torch.full_like(self.non_spec_state_indices_tensor, -1)
        self.cula_verify_slots = torch.full_like(self.spec_state_indices_tensor, -1)

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False) -> CulaGDNAttentionMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens=num_accepted_tokens,
                           num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu, fast_build=fast_build)
        return CulaGDNAttentionMetadata(**{f.name: getattr(md, f.name) for f in fields(md)},
                                        cula_plan=self.plan(md, common_attn_metadata))

    def plan(self, md: GDNAttentionMetadata, common_attn_metadata) -> LinearAttentionPlan:
        """The cula-serve plan of the batch that vLLM's builder described as ``md``."""
        spec_query_lens = None
        if md.num_spec_decodes and md.uniform_spec_sequence_length is None:
            query_lens = common_attn_metadata.query_start_loc_cpu.diff()
            spec_query_lens = query_lens[md.spec_sequence_masks_cpu].tolist()
        return plan_linear_attention(
            md, spec_query_lens=spec_query_lens,
            decode_slots_out=self.cula_decode_slots
            if _shares_storage(md.non_spec_state_indices_tensor, self.non_spec_state_indices_tensor) else None,
            verify_slots_out=self.cula_verify_slots
            if _shares_storage(md.spec_state_indices_tensor, self.spec_state_indices_tensor) else None)


class CulaGDNAttentionBackend(GDNAttentionBackend):
    """The mamba-type backend of cula-served GDN and KDA layers (their ``get_attn_backend``)."""

    @staticmethod
    def get_name() -> str:
        return "CULA_GDN"

    @staticmethod
    def get_builder_cls() -> type[CulaGDNAttentionMetadataBuilder]:
        return CulaGDNAttentionMetadataBuilder


@dataclass
class CulaLightningAttentionMetadata(LinearAttentionMetadata):
    """What a cula-served Lightning layer receives: vLLM's Lightning metadata type carrying the
    batch's cula-serve plan.

    vLLM's Lightning layers (``BailingMoELinearAttention``, ``MiniMaxText01LinearAttention``) run
    their projections, norms and rotary embedding in ``_forward`` and then hand q, k, v to
    ``_decode_infer`` when ``num_prefills == 0``. This metadata therefore says no prefills and
    ``num_decode_tokens`` = every token of the batch (``num_prefill_tokens + num_decode_tokens`` is
    the token count those layers project), so vLLM's own ``_forward`` hands the whole batch to the
    plugin's ``_decode_infer``, which runs ``cula_plan`` (decodes, prefills and verifies alike).
    vLLM's per-prefill state zeroing is then skipped too; ``has_initial_state`` in the plan does
    that job. The counts of the batch are those of ``cula_plan``.
    """

    cula_plan: LinearAttentionPlan | None = None


class CulaLightningAttentionMetadataBuilder(CulaGDNAttentionMetadataBuilder):
    """The metadata builder of cula-served Lightning layers: vLLM's GDN builder and plan.

    vLLM's own Lightning builder (``BailingLinearAttentionMetadataBuilder``) is not used, because
    its batches would put wrong states in the pool: with speculative decoding it counts every row
    of up to 1 + num_spec tokens as a verify row, so a new prompt that short starts from whatever
    the recycled state block holds and its final state lands in column n - 1 while the next step
    reads column 0; without, it runs a one-token first chunk of a new request as a decode of that
    recycled state; and vLLM's model runner V2 does not pass it the speculative-decoding
    arguments. The GDN builder classifies rows by their draft tokens, runs first chunks as
    prefills without an initial state, gets the MTP arguments from both model runners, plans
    prefix-caching checkpoints, and keeps the persistent buffers that FULL CUDA graphs replay
    from; none of that is specific to the delta rule.
    """

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False) -> CulaLightningAttentionMetadata:
        md = GDNAttentionMetadataBuilder.build(
            self, common_prefix_len, common_attn_metadata, num_accepted_tokens=num_accepted_tokens,
            num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu, fast_build=fast_build)
        plan = self.plan(md, common_attn_metadata)
        return CulaLightningAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=common_attn_metadata.num_reqs,
            num_decode_tokens=plan.num_actual_tokens, query_start_loc=common_attn_metadata.query_start_loc,
            seq_lens=common_attn_metadata.seq_lens, state_indices_tensor=None, cula_plan=plan)


class CulaLightningAttentionBackend(CulaGDNAttentionBackend):
    """The mamba-type backend of cula-served Lightning layers (their ``get_attn_backend``)."""

    @staticmethod
    def get_name() -> str:
        return "CULA_LIGHTNING"

    @staticmethod
    def get_builder_cls() -> type[CulaLightningAttentionMetadataBuilder]:
        return CulaLightningAttentionMetadataBuilder
