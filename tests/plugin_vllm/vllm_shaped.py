"""vLLM-shaped linear-attention batches, built without vLLM (for the translation tests on the CPU
and on the GPU, where vLLM is not installed).

``batch_metadata`` fills the fields of vLLM 0.32's ``GDNAttentionMetadata`` the way its builder
fills them for the batch kinds the plugin serves (the plugin plans GDN, KDA and Lightning layers
from that metadata); test_vllm_layers.py and test_vllm_lightning.py check the plugin against the
real builder. Modes: "gdn", "kda" (post-convolution inputs and raw gates) and "lightning" (q, k, v
with q scaled as vLLM's Lightning layers scale it, and the per-head decay). ``state_pages`` lays
out recurrent states as vLLM does: per block one page holding the convolution state first and the
recurrent state after it, so the state view has the page as its slot stride. ``oracle_row`` is
one row's float64 reference; ``fill_reads``, ``batch_inputs``, ``run_rows`` and ``check_rows`` run
and check a batch of rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from cula_serve import cula_gdn, cula_kda, cula_lightning
from cula_serve.inputs import minimax_decay
from cula_serve.integrations.vllm.translate import (DeltaRuleInputs, LightningInputs, run_delta_rule, run_lightning,
                                                    split_tokens)

from conftest import ORACLE, assert_close

NULL_BLOCK = 0


def state_pages(num_blocks: int, HV: int, V: int, K: int, dtype, *, conv_elems: int = 200, device="cpu"):
    """(pages int8 [num_blocks, page_bytes], state view [num_blocks, HV, V, K]) with the
    recurrent state after ``conv_elems`` elements of convolution state in each page, NaN-filled."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    state_bytes = HV * V * K * itemsize
    offset = conv_elems * itemsize
    page = offset + state_bytes + 64  # vLLM pads mamba pages up to the attention page size
    pages = torch.zeros(num_blocks, page, dtype=torch.int8, device=device)
    view = pages[:, offset: offset + state_bytes].view(dtype).view(num_blocks, HV, V, K)
    view.fill_(float("nan"))
    return pages, view


@dataclass
class Row:
    """One request row of a batch.

    kind: "decode", "prefill", "verify" or "pad" (CUDA-graph padding: the null block).
    blocks: its state blocks (one, or 1 + num_spec for verify rows).
    num_tokens: its query length; has_initial_state: prefill rows; num_accepted: verify rows.
    checkpoint: prefill rows: (offset, block) of a prefix-caching checkpoint, or None.
    """

    kind: str
    blocks: tuple = (NULL_BLOCK,)
    num_tokens: int = 1
    has_initial_state: bool = True
    num_accepted: int = 1
    checkpoint: tuple | None = None


def _qsl(lengths, device):
    qsl = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return qsl.to(device)


def batch_metadata(rows: list[Row], *, num_spec: int = 0, device="cpu", padded_tokens: int = 0):
    """vLLM's GDNAttentionMetadata fields for ``rows`` (in vLLM's batch order: decodes or verify
    rows first, then prefills, then padding rows). ``padded_tokens``: extra CUDA-graph padding
    tokens at the end of the batch."""
    lens = [0 if r.kind == "pad" else r.num_tokens for r in rows]
    verify = [r.kind == "verify" for r in rows]
    total = sum(lens)
    md = SimpleNamespace(num_actual_tokens=total + padded_tokens, checkpoint=None, has_initial_state=None,
                         chunk_indices=None, chunk_offsets=None, spec_sequence_masks=None,
                         spec_sequence_masks_cpu=None, spec_token_indx=None, non_spec_token_indx=None,
                         spec_state_indices_tensor=None, spec_query_start_loc=None, num_accepted_tokens=None,
                         uniform_spec_sequence_length=None, prefill_query_start_loc=None,
                         prefill_state_indices=None, prefill_has_initial_state=None,
                         non_spec_state_indices_tensor=None, non_spec_query_start_loc=None)
    prefill_rows = [r for r in rows if r.kind == "prefill"]
    if any(verify):
        spec_rows = [r for r in rows if r.kind == "verify"]
        rest = [r for r in rows if r.kind != "verify"]
        md.spec_sequence_masks_cpu = torch.tensor(verify)
        md.spec_sequence_masks = md.spec_sequence_masks_cpu.to(device)
        md.num_spec_decodes = len(spec_rows)
        md.num_spec_decode_tokens = sum(r.num_tokens for r in spec_rows)
        spec_lens = [r.num_tokens for r in spec_rows]
        md.uniform_spec_sequence_length = spec_lens[0] if len(set(spec_lens)) == 1 else None
        md.num_decodes = md.num_decode_tokens = 0
        md.num_prefills = len(prefill_rows)
        md.num_prefill_tokens = sum(r.num_tokens for r in prefill_rows)
        if md.num_prefills == 0:
            # vLLM's verify-only batch: padding rows stay in the index tensors (null block).
            md.spec_state_indices_tensor = torch.tensor(
                [list(r.blocks) if r.kind == "verify" else [NULL_BLOCK] * (1 + num_spec) for r in rows],
                dtype=torch.int32, device=device)
            md.spec_query_start_loc = _qsl(lens, device)
            md.num_accepted_tokens = torch.tensor([r.num_accepted for r in rows], dtype=torch.int32, device=device)
        else:
            md.spec_state_indices_tensor = torch.tensor([list(r.blocks) for r in spec_rows], dtype=torch.int32,
                                                        device=device)
            md.spec_query_start_loc = _qsl(spec_lens, device)
            md.num_accepted_tokens = torch.tensor([r.num_accepted for r in spec_rows], dtype=torch.int32,
                                                  device=device)
            mask = torch.repeat_interleave(md.spec_sequence_masks_cpu, torch.tensor(lens))
            index = torch.argsort(mask.to(torch.int8), stable=True)
            md.non_spec_token_indx = index[: total - md.num_spec_decode_tokens].to(torch.int32).to(device)
            md.spec_token_indx = index[total - md.num_spec_decode_tokens:].to(torch.int32).to(device)
            md.non_spec_state_indices_tensor = torch.tensor([r.blocks[0] for r in rest], dtype=torch.int32,
                                                            device=device)
            md.non_spec_query_start_loc = _qsl([0 if r.kind == "pad" else r.num_tokens for r in rest], device)
            md.prefill_query_start_loc = md.non_spec_query_start_loc
            md.prefill_state_indices = md.non_spec_state_indices_tensor
            md.has_initial_state = torch.tensor([r.has_initial_state for r in rest], device=device)
            md.prefill_has_initial_state = md.has_initial_state
            checkpoint_rows = rest
    else:
        md.num_spec_decodes = md.num_spec_decode_tokens = 0
        decodes = [r for r in rows if r.kind in ("decode", "pad")] if not prefill_rows else \
            [r for r in rows if r.kind == "decode"]
        md.num_decodes = len(decodes)  # vLLM counts padding rows of a decode-only batch as decodes
        md.num_decode_tokens = len(decodes)
        md.num_prefills = len(prefill_rows)
        md.num_prefill_tokens = sum(r.num_tokens for r in prefill_rows)
        md.non_spec_state_indices_tensor = torch.tensor([r.blocks[0] for r in rows], dtype=torch.int32, device=device)
        md.non_spec_query_start_loc = _qsl(lens, device)
        if prefill_rows:
            D = md.num_decodes
            md.has_initial_state = torch.tensor([r.kind != "prefill" or r.has_initial_state for r in rows],
                                                device=device)
            md.prefill_query_start_loc = md.non_spec_query_start_loc[D:] - md.num_decode_tokens
            md.prefill_state_indices = md.non_spec_state_indices_tensor[D:]
            md.prefill_has_initial_state = md.has_initial_state[D:]
        checkpoint_rows = rows
    if any(r.checkpoint for r in prefill_rows):
        offsets = [r.checkpoint[0] if r.checkpoint else 0 for r in checkpoint_rows]
        blocks = [r.checkpoint[1] if r.checkpoint else NULL_BLOCK for r in checkpoint_rows]
        md.checkpoint = SimpleNamespace(offsets=offsets,
                                        checkpoint_offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
                                        state_indices=torch.tensor(blocks, dtype=torch.int32, device=device))
    return md


def random_row_inputs(mode: str, n: int, *, H, HV, K, V, dtype, generator, device="cpu"):
    """Inputs of n tokens: q, k [n, H, K], v [n, HV, V] in ``dtype``; for gdn / kda (after the
    convolution) also the raw gate [n, HV] (gdn) / [n, HV, K] (kda) and raw beta logits [n, HV]
    in float32; lightning q is scaled by K ** -0.5 (vLLM's Lightning layers hand it so)."""
    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    if mode == "lightning":
        return ((rand(n, H, K) * K ** -0.5).to(dtype), rand(n, H, K).to(dtype), rand(n, HV, V).to(dtype))
    gate = rand(n, HV) if mode == "gdn" else rand(n, HV, K)
    return (rand(n, H, K).to(dtype), rand(n, H, K).to(dtype), rand(n, HV, V).to(dtype), gate, rand(n, HV))


def gate_parameters(mode: str, HV: int, K: int, generator, device="cpu", lower_bound=None):
    """The per-layer parameters of the mode's calls as a vLLM layer passes them: A_log [HV] and
    dt_bias ([HV] gdn, [HV * K] kda); lightning: the decay [HV] (minus MiniMax's slopes) and
    scale 1 (q comes scaled)."""
    if mode == "lightning":
        return dict(decay=minimax_decay(HV).to(device), scale=1.0)
    A_log = torch.empty(HV).uniform_(0, 1.5, generator=generator).to(device)
    dt_bias = 0.5 * torch.randn(HV if mode == "gdn" else HV * K, generator=generator).to(device)
    params = dict(A_log=A_log, dt_bias=dt_bias)
    if mode == "kda":
        params["lower_bound"] = lower_bound
    return params


def oracle_row(mode, inputs, initial_state, params, oracle):
    """Outputs [n, HV, V] and the states after each token ([n, HV, V, K]) of one row, float64.
    inputs: the row's ``random_row_inputs``; initial_state: [HV, V, K] or None (zeros)."""
    if mode == "lightning":
        prefill = cula_lightning
        common = dict(decay=params["decay"].double(), scale=params["scale"], output_final_state=True, **oracle)
    else:
        prefill = cula_gdn if mode == "gdn" else cula_kda
        extra = {} if mode == "gdn" else dict(lower_bound=params.get("lower_bound"))
        common = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      A_log=params["A_log"].double(), dt_bias=params["dt_bias"].double(), output_final_state=True,
                      **extra, **oracle)
    x = [t.double()[None] for t in inputs]
    init = None if initial_state is None else initial_state.double()[None]
    o, _ = prefill(*x, initial_state=init, **common)
    states = [prefill(*(t[:, : i + 1] for t in x), initial_state=init, **common)[1][0] for i in range(x[0].shape[1])]
    return o[0], torch.stack(states)


def fill_reads(rows, pool, generator):
    """Random states in the blocks the batch reads (a verify row reads column num_accepted - 1);
    returns {row index: that state in float64}."""
    reads = {}
    for i, r in enumerate(rows):
        if r.kind == "pad" or (r.kind == "prefill" and not r.has_initial_state):
            continue
        block = r.blocks[r.num_accepted - 1] if r.kind == "verify" else r.blocks[0]
        pool[block] = (0.5 * torch.randn(pool.shape[1:], generator=generator)).to(pool.dtype).to(pool.device)
        reads[i] = pool[block].double()
    return reads


def batch_inputs(mode, rows, num_tokens, shape, *, dtype, generator, device="cpu"):
    """Per-row inputs (``random_row_inputs``) and the packed batch of their tensors, padded with
    zero tokens to ``num_tokens``."""
    per_row = [random_row_inputs(mode, 0 if r.kind == "pad" else r.num_tokens, **shape, dtype=dtype,
                                 generator=generator, device=device) for r in rows]
    batch = [torch.cat([x[i] for x in per_row]) for i in range(len(per_row[0]))]
    batch = [torch.cat([t, t.new_zeros(num_tokens - t.shape[0], *t.shape[1:])]) for t in batch]
    return per_row, batch


def run_rows(plan, mode, batch, pool, out, params):
    """The plugin's path: split the packed batch by the plan and run the layer's recurrence."""
    inputs = LightningInputs if mode == "lightning" else DeltaRuleInputs
    spec, rest = zip(*(split_tokens(plan, t) for t in batch))
    spec = None if spec[0] is None else inputs(*spec)
    rest = None if rest[0] is None else inputs(*rest)
    if mode == "lightning":
        run_lightning(plan, spec, rest, pool, out, **params)
    else:
        run_delta_rule(plan, mode, spec, rest, pool, out, **params)


def check_rows(mode, rows, per_row, reads, out, pool, params, tol):
    """Outputs and written states (verify columns, final states, checkpoints) of every row
    against the float64 oracle (run where the tensors are); padding tokens zero; blocks no row
    owns still NaN."""
    position = 0
    for i, (r, x) in enumerate(zip(rows, per_row)):
        if r.kind == "pad":
            continue
        n = x[0].shape[0]
        o, states = oracle_row(mode, x, reads.get(i), params, ORACLE)
        assert_close(out[position: position + n], o, tol, f"{r.kind} row output")
        if r.kind == "verify":
            for t in range(n):
                assert_close(pool[r.blocks[t]], states[t], tol, f"verify state column {t}")
        else:
            assert_close(pool[r.blocks[0]], states[-1], tol, f"{r.kind} state")
        if r.checkpoint:
            offset, block = r.checkpoint
            assert_close(pool[block], states[offset - 1], tol, "checkpoint state")
        position += n
    assert torch.all(out[position:] == 0), "padding tokens get zero output"
    owned = {b for r in rows if r.kind != "pad" for b in r.blocks} | {r.checkpoint[1] for r in rows if r.checkpoint}
    for block in sorted(set(range(pool.shape[0])) - owned):
        assert torch.isnan(pool[block].float()).all(), f"block {block} was written"
