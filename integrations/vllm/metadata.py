"""The attention backend of cula-served GDN / KDA layers: vLLM's GDN backend whose metadata
builder also plans the batch for cula-serve, once per batch for all layers of the group.

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
        spec_query_lens = None
        if md.num_spec_decodes and md.uniform_spec_sequence_length is None:
            query_lens = common_attn_metadata.query_start_loc_cpu.diff()
            spec_query_lens = query_lens[md.spec_sequence_masks_cpu].tolist()
        plan = plan_linear_attention(
            md, spec_query_lens=spec_query_lens,
            decode_slots_out=self.cula_decode_slots
            if _shares_storage(md.non_spec_state_indices_tensor, self.non_spec_state_indices_tensor) else None,
            verify_slots_out=self.cula_verify_slots
            if _shares_storage(md.spec_state_indices_tensor, self.spec_state_indices_tensor) else None)
        return CulaGDNAttentionMetadata(**{f.name: getattr(md, f.name) for f in fields(md)}, cula_plan=plan)


class CulaGDNAttentionBackend(GDNAttentionBackend):
    """The mamba-type backend of cula-served GDN and KDA layers (their ``get_attn_backend``)."""

    @staticmethod
    def get_name() -> str:
        return "CULA_GDN"

    @staticmethod
    def get_builder_cls() -> type[CulaGDNAttentionMetadataBuilder]:
        return CulaGDNAttentionMetadataBuilder
