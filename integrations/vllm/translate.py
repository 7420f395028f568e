"""vLLM's linear-attention batch metadata translated into cula-serve calls.

This module does not import vLLM: it reads vLLM's ``GDNAttentionMetadata`` by attribute, so it
runs, and is tested, where vLLM is not installed. That metadata describes the batches of every
layer the plugin serves: vLLM's GDN and KDA layers have it natively, and the plugin gives it to
the Lightning layers too (``metadata.CulaLightningAttentionMetadataBuilder`` says why).

vLLM conventions it translates (read from vLLM 0.32's ``gdn_attn.py`` and GDN/KDA/Lightning layers):

- State pages. Each layer's recurrent state is a view into the layer's pages, local heads under
  tensor parallelism: the slot stride is the page size, not ``HV * V * K``. cula-serve takes that
  view as its ``state_pool`` directly (no copy). GDN and KDA states are ``[num_blocks, HV, V, K]``
  (K-last, cula-serve's layout). Lightning states are ``[num_blocks, H, D, D]``, which vLLM's own
  Lightning kernels index K-first; with K == V the shape is the same, and under the plugin only
  cula-serve reads or writes them (prefill, decode and verify all run here, and vLLM itself only
  zeroes or copies whole states), so the same memory simply holds cula-serve's K-last states.
- Null block. Block 0 is vLLM's null block: padding rows of a batch (CUDA-graph padding, rows of
  other kinds) point at it. cula-serve marks padding with a negative slot, so every index is
  translated here, outside the kernels: ``idx <= 0 -> -1``.
- Token order. The runner puts short requests first: plain decodes (one token), then prefills;
  with speculative decoding, verify rows (``1 + num_spec`` tokens at most) are picked out of the
  batch by ``spec_token_indx`` and the others by ``non_spec_token_indx``.
- Verify (MTP) uses vLLM's slot protocol, which is cula-serve's ``protocol="slots"``: row n owns
  ``spec_state_indices[n, :]``, reads the column ``num_accepted_tokens[n] - 1`` and writes the
  state after token t to column t. A batch whose rows verify different numbers of tokens (ragged
  drafts) runs as one verify per row length.
- Prefill checkpoints (prefix caching, 'align' mode): per prefill row at most one checkpoint,
  ``checkpoint.offsets[row]`` tokens into the row, written to ``checkpoint.state_indices[row]``;
  that is cula-serve's ``checkpoint_every`` / ``checkpoint_indices``.

``plan_linear_attention`` turns one batch's metadata into a ``LinearAttentionPlan`` (once per
batch, in the metadata builder); ``run_delta_rule`` (GDN, KDA: post-convolution inputs) and
``run_lightning`` (q, k, v) run a layer's batch through cula-serve according to that plan. For
CUDA graphs the plan of a decode-only or uniform verify batch reads only tensors whose addresses
are fixed (``*_slots_out`` buffers the builder owns, vLLM's own persistent buffers), and the
runs then synchronise nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from cula_serve.api import CHECKPOINT_ALIGNMENT, cula_decode, cula_gdn, cula_kda, cula_lightning, cula_verify

NULL_BLOCK_ID = 0  # vllm.v1.attention.backends.utils.NULL_BLOCK_ID
MODES = ("gdn", "kda")  # the delta-rule families (run_delta_rule)
PREFILL = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}


def null_block_to_padding(state_indices: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM state indices (any shape, int32/int64) -> cula-serve slots: int32, the null block 0
    and anything negative become -1. Writes into ``out`` (int32, same shape) when given."""
    padding = state_indices.new_full((), -1)
    if out is None:
        return torch.where(state_indices > NULL_BLOCK_ID, state_indices, padding).to(torch.int32)
    if out.shape != state_indices.shape or out.dtype != torch.int32:
        raise ValueError(f"out: expected int32 {list(state_indices.shape)}, got {out.dtype} {list(out.shape)}")
    return torch.where(state_indices > NULL_BLOCK_ID, state_indices.to(torch.int32), padding.to(torch.int32), out=out)


@dataclass(frozen=True)
class DecodeStep:
    """Plain decodes: the first ``slots.shape[0]`` non-verify tokens, one per row.
    slots: int32 [N], -1 = padding row."""

    slots: torch.Tensor


@dataclass(frozen=True)
class VerifyStep:
    """Verify rows of one length in vLLM's slot protocol.

    slots: int32 [N, T_cols] (T_cols = 1 + num_spec >= num_tokens), -1 = padding row.
    num_accepted_tokens: int32 [N], tokens accepted by each row's previous step.
    num_tokens: T, the tokens of each row.
    token_index: None when these rows' tokens are the first N * T verify tokens, in order (a
        uniform batch); else int64 [N * T], the positions of their tokens among the verify tokens.
    """

    slots: torch.Tensor
    num_accepted_tokens: torch.Tensor
    num_tokens: int
    token_index: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillStep:
    """Prefills: the non-verify tokens after the decodes, packed varlen.

    cu_seqlens: int32 [P + 1] within the prefill tokens; num_tokens = cu_seqlens[-1].
    slots: int32 [P]; has_initial_state: bool [P].
    checkpoint_slots: int32 [P, M] or None: the state after (j + 1) * CHECKPOINT_ALIGNMENT tokens
        of row p goes to slot checkpoint_slots[p, j] when >= 0 (cula-serve's checkpoint_indices).
    conv_checkpoints: ((token_end, block), ...): for each checkpoint, its position within the
        prefill tokens (the state after the tokens before it) and vLLM's block for it, for writing
        the matching convolution state (``write_conv_checkpoints``).
    """

    cu_seqlens: torch.Tensor
    num_tokens: int
    slots: torch.Tensor
    has_initial_state: torch.Tensor
    checkpoint_slots: torch.Tensor | None = None
    conv_checkpoints: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class LinearAttentionPlan:
    """One batch of a linear-attention layer group, as cula-serve calls.

    num_actual_tokens: tokens of the batch that the layers read (vLLM's num_actual_tokens).
    spec_token_index, non_spec_token_index: int64 positions of the verify / other tokens in the
        batch when a batch mixes both; None otherwise (then the verify tokens, or the others,
        are the batch's first tokens).
    decode, prefill: the parts present in this batch (None if absent); verify: one step per
        row length (empty if no verify rows; one step for a uniform batch).
    """

    num_actual_tokens: int
    spec_token_index: torch.Tensor | None
    non_spec_token_index: torch.Tensor | None
    decode: DecodeStep | None
    verify: tuple[VerifyStep, ...]
    prefill: PrefillStep | None

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.decode is None else self.decode.slots.shape[0]


def _host_ints(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


def plan_linear_attention(md, *, spec_query_lens=None, decode_slots_out: torch.Tensor | None = None,
                          verify_slots_out: torch.Tensor | None = None) -> LinearAttentionPlan:
    """Translate vLLM's ``GDNAttentionMetadata`` ``md`` (GDN and KDA layers) into a plan.

    spec_query_lens: host ints [num_spec_decodes], the verify rows' query lengths; only read for a
        ragged verify batch (``md.uniform_spec_sequence_length is None``); taken from
        ``md.spec_query_start_loc`` when not given.
    decode_slots_out / verify_slots_out: int32 buffers of at least as many rows as vLLM's index
        tensors, that the translated slots are written into; pass the builder's persistent
        buffers when vLLM staged the batch for FULL CUDA graph replay, so the captured graph reads
        the new batch's slots. Rows past vLLM's real rows (its graph padding) become -1.
    """
    spec = md.spec_sequence_masks is not None
    mixed = spec and (md.num_prefills > 0 or md.num_decodes > 0)
    if spec and md.num_decodes > 0:
        raise ValueError("md: vLLM never mixes plain decodes with verify rows (it reclassifies them as prefills); "
                         f"got num_decodes={md.num_decodes}, num_spec_decodes={md.num_spec_decodes}")

    verify = ()
    if spec and md.num_spec_decodes > 0:
        rows = md.num_spec_decodes
        indices = md.spec_state_indices_tensor
        if verify_slots_out is not None:
            slots = null_block_to_padding(indices, out=verify_slots_out[: indices.shape[0], : indices.shape[1]])
        else:
            slots = null_block_to_padding(indices)
        slots = slots[:rows]
        accepted = md.num_accepted_tokens[:rows]
        if md.uniform_spec_sequence_length is not None:
            verify = (VerifyStep(slots, accepted, int(md.uniform_spec_sequence_length)),)
        else:
            if spec_query_lens is None:
                spec_query_lens = md.spec_query_start_loc[: rows + 1].diff().tolist()
            verify = _verify_by_length(slots, accepted, _host_ints(spec_query_lens)[:rows])

    decode = None
    if md.num_decodes > 0:
        indices = md.non_spec_state_indices_tensor
        if decode_slots_out is not None:
            slots = null_block_to_padding(indices, out=decode_slots_out[: indices.shape[0]])
        else:
            slots = null_block_to_padding(indices)
        decode = DecodeStep(slots[: md.num_decodes])

    prefill = None
    if md.num_prefills > 0:
        P = md.num_prefills
        cu_seqlens = md.prefill_query_start_loc[: P + 1].to(torch.int32)
        slots = null_block_to_padding(md.prefill_state_indices[:P])
        checkpoint_slots, conv_checkpoints = _prefill_checkpoints(md, P, first_row=0 if spec else md.num_decodes)
        prefill = PrefillStep(cu_seqlens, int(md.num_prefill_tokens), slots, md.prefill_has_initial_state[:P],
                              checkpoint_slots, conv_checkpoints)

    spec_index = non_spec_index = None
    if mixed:
        spec_index = md.spec_token_indx.long()
        non_spec_index = md.non_spec_token_indx.long()
    return LinearAttentionPlan(int(md.num_actual_tokens), spec_index, non_spec_index, decode, verify, prefill)


def _verify_by_length(slots, accepted, lens: list[int]) -> tuple[VerifyStep, ...]:
    """One VerifyStep per row length of a ragged verify batch (rows of length 0 are padding)."""
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    steps = []
    for T in sorted(set(lens) - {0}):
        rows = [r for r, n in enumerate(lens) if n == T]
        rows_t = torch.tensor(rows, dtype=torch.int64, device=slots.device)
        tokens = torch.tensor([starts[r] + t for r in rows for t in range(T)], dtype=torch.int64, device=slots.device)
        steps.append(VerifyStep(slots[rows_t], accepted[rows_t], T, tokens))
    return tuple(steps)


def _prefill_checkpoints(md, num_prefills: int, first_row: int):
    """vLLM's prefill checkpoints (``md.checkpoint``, rows = the non-verify rows) for the prefill
    rows ``first_row:first_row + num_prefills``: (cula-serve checkpoint slots, conv checkpoints)."""
    checkpoint = getattr(md, "checkpoint", None)
    if checkpoint is None:
        return None, ()
    offsets = checkpoint.offsets if checkpoint.offsets is not None else checkpoint.checkpoint_offsets.tolist()
    offsets = [int(o) for o in offsets[first_row: first_row + num_prefills]]
    if not any(offsets):
        return None, ()
    bad = [o for o in offsets if o % CHECKPOINT_ALIGNMENT]
    if bad:
        raise ValueError(f"md.checkpoint: prefill checkpoint offsets {bad} are not multiples of "
                         f"{CHECKPOINT_ALIGNMENT}, the alignment the layer declared")
    # Checkpoints are rare (at most one per block-aligned prefill row), so reading their
    # positions on the host here costs one small copy per such batch.
    blocks = checkpoint.state_indices[first_row: first_row + num_prefills]
    blocks_host = blocks.tolist()
    starts = md.prefill_query_start_loc[:num_prefills].tolist()
    rows = [p for p, o in enumerate(offsets) if o and blocks_host[p] > NULL_BLOCK_ID]
    if not rows:
        return None, ()
    device = blocks.device
    slots = torch.full((num_prefills, max(offsets) // CHECKPOINT_ALIGNMENT), -1, dtype=torch.int32, device=device)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    cols_t = torch.tensor([offsets[p] // CHECKPOINT_ALIGNMENT - 1 for p in rows], dtype=torch.int64, device=device)
    slots[rows_t, cols_t] = blocks[rows_t].to(torch.int32)
    conv = tuple((starts[p] + offsets[p], blocks_host[p]) for p in rows)
    return slots, conv


def write_conv_checkpoints(step: PrefillStep, x: torch.Tensor, conv_state: torch.Tensor, width: int) -> None:
    """Write the convolution state at each prefill checkpoint: vLLM keeps, per block, the last
    ``width - 1`` inputs of the causal convolution, oldest first.

    x: [num_prefill_tokens, dim] the prefill tokens' convolution inputs (before the convolution).
    conv_state: vLLM's [num_blocks, dim, state_len] view (state_len >= width - 1).
    """
    for token_end, block in step.conv_checkpoints:
        conv_state[block, :, : width - 1] = x[token_end - (width - 1): token_end].transpose(0, 1).to(conv_state.dtype)


class DeltaRuleInputs(NamedTuple):
    """Post-convolution inputs of a GDN / KDA layer, token-major, in vLLM's token order.

    q, k: [n, H, K]; v: [n, HV, V]; g: raw gate [n, HV] (gdn) or [n, HV, K] (kda); beta: raw
    beta logits [n, HV]. Strided views of the packed convolution output are fine.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def gates(self) -> dict:
        return dict(g=self.g, beta=self.beta)


class LightningInputs(NamedTuple):
    """Inputs of a Lightning layer, token-major, in vLLM's token order: q, k [n, H, K], v [n, H, V]
    (after vLLM's projections, activation, norms and rotary embedding; float32 in vLLM's layers).
    The decay is per head, not per token, so it is an option of ``run_lightning``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def gates(self) -> dict:
        return {}


def split_tokens(plan: LinearAttentionPlan, x: torch.Tensor):
    """(verify tokens, other tokens) of a token-major tensor in batch order; None for an absent part."""
    x = x[: plan.num_actual_tokens]
    if plan.spec_token_index is not None:
        return x.index_select(0, plan.spec_token_index), x.index_select(0, plan.non_spec_token_index)
    if plan.verify:
        return x, None
    return None, x


def run_delta_rule(plan: LinearAttentionPlan, mode: str, spec: DeltaRuleInputs | None,
                   non_spec: DeltaRuleInputs | None, state_pool: torch.Tensor, out: torch.Tensor, *,
                   A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None,
                   scale: float | None = None, backend: str | None = None) -> None:
    """Run one GDN / KDA layer's batch through cula-serve.

    mode: "gdn" or "kda". spec / non_spec: the verify tokens and the other tokens
        (``split_tokens`` of the batch), None where the plan has none.
    state_pool: the layer's recurrent states, vLLM's [num_blocks, HV, V, K] view (float32 or
        bfloat16), read and written in place.
    out: [>= num_actual_tokens, HV, V] in v's dtype, batch order; the rows of real tokens are
        written, padding tokens of a verify batch get zeros.
    A_log [HV], dt_bias ([HV] gdn, [HV * K] kda), lower_bound (kda safe gate): the layer's gate
        parameters; q, k are l2-normalised, g and beta are raw projections (the gate and
        sigmoid(beta) are applied inside cula-serve), as vLLM's GDN and KDA layers do.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    options = dict(scale=scale, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                   dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, backend=backend)
    if mode == "kda":
        options["lower_bound"] = lower_bound
    elif lower_bound is not None:
        raise ValueError("lower_bound: the safe gate is a KDA option")
    _run(plan, mode, spec, non_spec, state_pool, out, options)


def run_lightning(plan: LinearAttentionPlan, spec: LightningInputs | None, non_spec: LightningInputs | None,
                  state_pool: torch.Tensor, out: torch.Tensor, *, decay: torch.Tensor, scale: float | None = None,
                  backend: str | None = None) -> None:
    """Run one Lightning layer's batch through cula-serve: ``S = exp(decay[h]) S + k v^T``,
    ``o = scale * S^T q``.

    spec / non_spec: the verify tokens and the other tokens (``split_tokens``), None where absent.
    state_pool: the layer's states, vLLM's [num_blocks, H, D, D] view (float32 or bfloat16) holding
        cula-serve's K-last states (module docstring), read and written in place.
    out: [>= num_actual_tokens, H, D] in v's dtype, batch order, written as for ``run_delta_rule``.
    decay: float32 [H], the per-head log decay (<= 0): minus vLLM's slope rate of the layer's heads.
    scale: None means K ** -0.5; vLLM's Lightning layers scale q themselves (or not at all), so
        they pass 1.0.
    """
    _run(plan, "lightning", spec, non_spec, state_pool, out, dict(decay=decay, scale=scale, backend=backend))


def _run(plan: LinearAttentionPlan, mode: str, spec, non_spec, state_pool, out, options) -> None:
    """The cula-serve calls of one layer's batch: verify steps, then decodes and prefills.
    ``options``: the keyword arguments every call of ``mode`` takes (gate parameters or decay)."""
    mixed = plan.spec_token_index is not None
    o_spec = o_non_spec = None
    if plan.verify:
        if spec is None:
            raise ValueError("spec: the plan has verify rows, give their inputs")
        o_spec = out.new_empty(spec.v.shape) if mixed else out[: spec.v.shape[0]]
        for step in plan.verify:
            _verify(step, mode, spec, state_pool, o_spec, options)
        if len(plan.verify) == 1 and plan.verify[0].token_index is None:
            # Tokens past the uniform rows are CUDA-graph padding.
            used = plan.verify[0].slots.shape[0] * plan.verify[0].num_tokens
            o_spec[used:] = 0
    if plan.decode is not None or plan.prefill is not None:
        if non_spec is None:
            raise ValueError("non_spec: the plan has decode or prefill rows, give their inputs")
        o_non_spec = out.new_empty(non_spec.v.shape) if mixed else out[: non_spec.v.shape[0]]
        D = plan.num_decode_tokens
        if plan.decode is not None:
            part = _map(non_spec, lambda x: x[:D, None])
            cula_decode(part.q, part.k, part.v, state_pool, mode=mode, **part.gates(),
                        state_indices=plan.decode.slots, out=o_non_spec[:D, None], **options)
        if plan.prefill is not None:
            step = plan.prefill
            part = _map(non_spec, lambda x: x[D: D + step.num_tokens])
            checkpoints = {}
            if step.checkpoint_slots is not None:
                checkpoints = dict(checkpoint_every=CHECKPOINT_ALIGNMENT, checkpoint_indices=step.checkpoint_slots)
            PREFILL[mode](part.q, part.k, part.v, **part.gates(), cu_seqlens=step.cu_seqlens, state_pool=state_pool,
                          state_indices=step.slots, has_initial_state=step.has_initial_state,
                          out=o_non_spec[D: D + step.num_tokens], **checkpoints, **options)
    if mixed:
        out.index_copy_(0, plan.spec_token_index, o_spec)
        out.index_copy_(0, plan.non_spec_token_index, o_non_spec)


def _map(inputs, fn):
    """The same inputs tuple with ``fn`` applied to each of its per-token tensors."""
    return type(inputs)(*(fn(x) for x in inputs))


def _verify(step: VerifyStep, mode, spec, state_pool, out, options):
    N, T = step.slots.shape[0], step.num_tokens
    verify = dict(mode=mode, state_indices=step.slots, protocol="slots",
                  num_accepted_tokens=step.num_accepted_tokens, **options)
    if step.token_index is None:
        if spec.v.shape[0] < N * T:
            raise ValueError(f"spec: {N} verify rows of {T} tokens need {N * T} tokens, got {spec.v.shape[0]}")
        rows = _map(spec, lambda x: x[: N * T].unflatten(0, (N, T)))
        cula_verify(rows.q, rows.k, rows.v, state_pool, **rows.gates(), out=out[: N * T].unflatten(0, (N, T)),
                    **verify)
        return
    rows = _map(spec, lambda x: x.index_select(0, step.token_index).unflatten(0, (N, T)))
    o, _ = cula_verify(rows.q, rows.k, rows.v, state_pool, **rows.gates(), **verify)
    out.index_copy_(0, step.token_index, o.flatten(0, 1))
