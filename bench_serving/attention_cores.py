"""The attention core of ``python -m bench_serving offline``: cula-serve or FLA over one state pool.

Both run the same calls of an engine step on per-layer pools ``[P, HV, V, K]`` (K-last) with the
gates fused in the kernel (raw gate and beta projections, ``A_log`` / ``dt_bias``, qk l2norm):

    prefill(layer, inputs, cu_seqlens, cu_seqlens_cpu, slots)   packed varlen chunks, slots [N]
    decode(layer, inputs, rows)                                 inputs [B, 1, ...]
    verify(layer, inputs, rows) -> pending                      inputs [B, T, ...] (MTP)
    commit(layer, pending, rows)                                keep rows.accepted[n] tokens

``rows`` holds the static decode tensors of a batch bucket (``DecodeRows``); rows past the real
batch are padding (slot -1). Each core marks its work on the ``OpClock`` under the operation's
name (``prefill``, ``decode``, ``verify``, ``commit``); the caller marks the projections.

FLA has no paged pool: its kernels take dense initial states and return dense final states. The
FLA core therefore gathers the states of the batch from the pool before each call and scatters
the final states back after it (padding rows go to a scratch slot), and times those copies as
``state copy``, which counts in FLA's total: it is what an engine serving FLA's API has to do.
FLA has no MTP protocol either: its verify runs the T tokens from the gathered states without
writing any state, and its commit packs each row's accepted tokens (a varlen batch built on the
device) and replays them onto the gathered states, then scatters them back. That is the deferred
protocol written with FLA's public kernels; ``--protocol`` selects cula-serve's protocol only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cula_serve import cula_commit, cula_decode, cula_gdn, cula_kda, cula_lightning, cula_verify

CULA_PREFILL = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}


@dataclass
class DecodeRows:
    """Static per-bucket tensors of a decode / verify step (B rows, T tokens per row).

    slots: int32 [B] (decode, deferred, buffer) or [B, T] (slots protocol); -1 = padding.
    num_accepted: int32 [B], slots protocol: the column holding each row's current state, plus 1.
    accepted: int32 [B], tokens each row keeps at commit (0 for padding).
    intermediate: per layer [B, T, HV, V, K] (buffer protocol) or None.
    """

    slots: torch.Tensor
    num_accepted: torch.Tensor
    accepted: torch.Tensor
    intermediate: list | None = None


def _split_inputs(inputs: dict):
    qkv = {name: inputs[name] for name in ("q", "k", "v")}
    gates = {name: inputs[name] for name in ("g", "beta") if inputs.get(name) is not None}
    return qkv, gates


class CulaCore:
    """cula-serve's Level-1 API on the pool, dispatched to the best backend for the device
    (``CULA_BACKEND`` overrides), with MTP in the given protocol."""

    name = "cula"

    def __init__(self, mode: str, pools: list, options: list, clock, protocol: str = "deferred"):
        self.mode, self.pools, self.options, self.clock, self.protocol = mode, pools, options, clock, protocol

    def prefill(self, layer, inputs, cu_seqlens, cu_seqlens_cpu, slots):
        self.clock.mark("prefill")
        qkv, gates = _split_inputs(inputs)
        o, _ = CULA_PREFILL[self.mode](**qkv, **gates, cu_seqlens=cu_seqlens, state_pool=self.pools[layer],
                                       state_indices=slots, **self.options[layer])
        return o

    def decode(self, layer, inputs, rows: DecodeRows):
        self.clock.mark("decode")
        qkv, gates = _split_inputs(inputs)
        o, _ = cula_decode(**qkv, **gates, state_pool=self.pools[layer], mode=self.mode, state_indices=rows.slots,
                           **self.options[layer])
        return o

    def verify(self, layer, inputs, rows: DecodeRows):
        self.clock.mark("verify")
        qkv, gates = _split_inputs(inputs)
        extra = dict(state_indices=rows.slots)
        if self.protocol == "slots":
            extra["num_accepted_tokens"] = rows.num_accepted
        elif self.protocol == "buffer":
            extra["intermediate_states"] = rows.intermediate[layer]
        o, pending = cula_verify(**qkv, **gates, state_pool=self.pools[layer], mode=self.mode,
                                 protocol=self.protocol, **extra, **self.options[layer])
        return o, pending

    @property
    def needs_commit(self) -> bool:
        # vLLM's slots flow needs none: the next verify reads column num_accepted - 1
        return self.protocol != "slots"

    def commit(self, layer, pending, rows: DecodeRows):
        self.clock.mark("commit")
        cula_commit(pending, rows.accepted)


def fla_functions(mode: str):
    """(chunked prefill, fused recurrent) of FLA for ``mode``; raises ImportError without FLA."""
    if mode == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    if mode == "kda":
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        return chunk_kda, fused_recurrent_kda
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    return chunk_simple_gla, fused_recurrent_simple_gla


class FlaCore:
    """FLA's chunked prefill and fused recurrent kernels (K-last states, ``state_v_first=True``)
    around gathers and scatters of the pool's states; see the module docstring."""

    name = "fla"

    def __init__(self, mode: str, pools: list, options: list, clock, scratch_slot: int):
        self.mode, self.pools, self.clock = mode, pools, clock
        self.chunk, self.recurrent = fla_functions(mode)
        self.scratch = scratch_slot
        # FLA's names: the Lightning decay is simple GLA's g_gamma; the rest are the same keywords
        self.options = [({"g_gamma": o["decay"]} if mode == "lightning" else dict(o)) for o in options]

    def _args(self, inputs):
        if self.mode == "lightning":
            return (inputs["q"], inputs["k"], inputs["v"]), {}
        if self.mode == "kda":
            return (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"]), {}
        return (inputs["q"], inputs["k"], inputs["v"]), dict(g=inputs["g"], beta=inputs["beta"])

    def _gather(self, layer, index, label):
        self.clock.mark(label)
        # FLA's kernels take float32 initial states (chunk_kda asserts it)
        return self.pools[layer].index_select(0, index).float()

    def _scatter(self, layer, index, final, label):
        self.clock.mark(label)
        pool = self.pools[layer]
        pool.index_copy_(0, index, final.to(pool.dtype))

    def _rows_index(self, slots):
        return torch.where(slots >= 0, slots, self.scratch).long()

    def prefill(self, layer, inputs, cu_seqlens, cu_seqlens_cpu, slots):
        index = slots.long()
        initial = self._gather(layer, index, "state copy (prefill)")
        self.clock.mark("prefill")
        args, kw = self._args(inputs)
        o, final = self.chunk(*args, **kw, initial_state=initial, output_final_state=True, state_v_first=True,
                              cu_seqlens=cu_seqlens.long(), cu_seqlens_cpu=cu_seqlens_cpu, **self.options[layer])
        self._scatter(layer, index, final, "state copy (prefill)")
        return o

    def _recurrent(self, layer, inputs, slots, label, *, write_states=True, cu_seqlens=None):
        """FLA's fused recurrent kernel on the gathered states of ``slots``; with ``write_states``
        the final states are scattered back. Returns the outputs."""
        index = self._rows_index(slots)
        initial = self._gather(layer, index, "state copy (decode)")
        self.clock.mark(label)
        args, kw = self._args(inputs)
        o, final = self.recurrent(*args, **kw, initial_state=initial, output_final_state=write_states,
                                  state_v_first=True, cu_seqlens=cu_seqlens, **self.options[layer])
        if write_states:
            self._scatter(layer, index, final, "state copy (decode)")
        return o

    def decode(self, layer, inputs, rows: DecodeRows):
        return self._recurrent(layer, inputs, rows.slots, "decode")

    def verify(self, layer, inputs, rows: DecodeRows):
        return self._recurrent(layer, inputs, rows.slots, "verify", write_states=False), inputs

    needs_commit = True

    def commit(self, layer, inputs, rows: DecodeRows):
        self.clock.mark("commit")
        B, T = inputs["k"].shape[:2]
        accepted = rows.accepted.long()
        cu = torch.zeros(B + 1, dtype=torch.long, device=accepted.device)
        torch.cumsum(accepted, 0, out=cu[1:])
        # token t of row n goes to packed position cu[n] + t when accepted; the rest to the last
        # position, which lies past cu[B] whenever any token is dropped, so FLA never reads it
        t = torch.arange(T, device=accepted.device)
        dest = torch.where(t < accepted[:, None], cu[:-1, None] + t, B * T - 1).flatten()

        def packed(x):
            flat = x.reshape(B * T, *x.shape[2:])
            return torch.empty_like(flat).index_copy_(0, dest, flat).unsqueeze(0)

        replay = {name: packed(x) for name, x in inputs.items()}
        replay["q"] = replay["k"]  # the outputs of a commit are not used
        self._recurrent(layer, replay, rows.slots, "commit", cu_seqlens=cu)
