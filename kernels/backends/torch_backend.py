"""The ``torch`` backend: the reference every other backend is checked against.

Runs anywhere torch runs (it is the CPU serving path) in float32, or float64 for the oracle. It
reads and writes the state pool exactly as the fast kernels must (DESIGN sections 3 and 4), so
its pool handling is the executable specification of slots, padding and the MTP protocols.

Backend-specific keyword arguments (forwarded through the Level-1 API's ``**kwargs``):
    algorithm:     "chunk" (default for prefill; the WY form of ``chunk_torch.py``) or
                   "recurrent" (token by token, ``naive.py``: the oracle).
    compute_dtype: torch.float32 (default) or torch.float64.

Unlike the GPU backends it synchronises with the host (Python loops over sequences).
"""
from __future__ import annotations

import torch

from ..common.prep import Recipe
from ..delta_rule.chunk_torch import CHUNK_SIZE, delta_rule_chunked
from ..delta_rule.naive import delta_rule_recurrence
from ..lightning.chunk_torch import lightning_chunked
from ..lightning.naive import lightning_recurrence

NAME = "torch"
OPERATIONS = ("prefill", "decode", "verify", "commit")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
ALGORITHMS = ("chunk", "recurrent")


def availability(device: torch.device) -> str | None:
    return None


def head_dims_error(K: int, V: int) -> str | None:
    return None


def _options(kwargs, default_algorithm):
    algorithm = kwargs.pop("algorithm", default_algorithm)
    compute_dtype = kwargs.pop("compute_dtype", torch.float32)
    if kwargs:
        raise TypeError(f"torch backend: unexpected keyword arguments {sorted(kwargs)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype: expected torch.float32 or torch.float64, got {compute_dtype}")
    return algorithm, compute_dtype


def _run(recipe: Recipe, q, k, v, g, beta, initial_state, *, algorithm, dtype, save_states=False):
    """Run B sequences of equal length T. q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV(, K)]
    or [HV] (lightning); beta [B, T, HV] or None; initial_state [B, HV, K, V] (K-first) or None.
    Returns (o, final_state, saved) where saved is the per-token states (recurrent with
    ``save_states``) or the per-chunk states (chunk)."""
    q, k, g, beta = recipe.prepare(q, k, g, beta, dtype)
    v = v.to(dtype)
    if initial_state is not None:
        initial_state = initial_state.to(dtype)
    if recipe.delta_rule:
        if algorithm == "chunk":
            return delta_rule_chunked(q, k, v, g, beta, recipe.scale, initial_state)
        return delta_rule_recurrence(q, k, v, g, beta, recipe.scale, initial_state, save_states)
    if algorithm == "chunk":
        return lightning_chunked(q, k, v, g, recipe.scale, initial_state)
    return lightning_recurrence(q, k, v, g, recipe.scale, initial_state, save_states)


def _read_states(pool, slots, dtype, live=None):
    """pool[slots] as K-first [N, HV, K, V] in ``dtype``; rows that are not live read as zeros."""
    live = slots >= 0 if live is None else live
    states = pool[slots.clamp(min=0).long()].to(dtype).transpose(-1, -2)
    return torch.where(live[:, None, None, None], states, states.new_zeros(()))


def _write_states(pool, slots, states, live=None):
    """pool[slots[n]] = states[n] (K-first [N, HV, K, V]) for the live rows, rounded to the pool dtype."""
    live = slots >= 0 if live is None else live
    pool[slots[live].long()] = states[live].transpose(-1, -2).to(pool.dtype)


def native_map_columns(recipe) -> bool:
    """The reference takes no ``map_columns``: the API widens v with zero columns instead."""
    return False


def prefill(recipe, q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices, has_initial_state,
            out, checkpoint_every=None, checkpoint_indices=None, **kwargs):
    """Chunked prefill of a packed varlen batch.

    q, k [T, H, K]; v [T, HV, V]; g [T, HV] (gdn), [T, HV, K] (kda) or [HV] (lightning decay);
    beta [T, HV] or None (lightning); cu_seqlens int32 [N + 1]; state_pool [P, HV, V, K] or None
    (zero initial states, nothing written); state_indices int32 [N] (negative = padding: no read,
    no write, zero output); has_initial_state bool [N] or None (all True); out [T, HV, V];
    checkpoint_indices int32 [N, M]: the state after (j + 1) * checkpoint_every tokens of
    sequence n goes to pool slot checkpoint_indices[n, j] when that is >= 0.
    """
    algorithm, dtype = _options(kwargs, "chunk")
    bounds = cu_seqlens.tolist()
    slots = state_indices.tolist() if state_indices is not None else [None] * (len(bounds) - 1)
    has_init = has_initial_state.tolist() if has_initial_state is not None else [True] * len(slots)
    ckpt = checkpoint_indices.tolist() if checkpoint_every else None
    per_token_gate = recipe.delta_rule
    for n, slot in enumerate(slots):
        bos, eos = bounds[n], bounds[n + 1]
        if slot is not None and slot < 0:
            out[bos:eos] = 0
            continue
        S0 = None
        if state_pool is not None and has_init[n]:
            S0 = state_pool[slot].to(dtype).transpose(-1, -2)[None]
        seg = slice(bos, eos)
        o, S, saved = _run(recipe, q[None, seg], k[None, seg], v[None, seg],
                           g[None, seg] if per_token_gate else g, beta[None, seg] if beta is not None else None,
                           S0, algorithm=algorithm, dtype=dtype,
                           save_states=bool(checkpoint_every))
        out[seg] = o[0].to(out.dtype)
        if state_pool is None:
            continue
        state_pool[slot] = S[0].transpose(-1, -2).to(state_pool.dtype)
        if checkpoint_every:
            for j, ckpt_slot in enumerate(ckpt[n][: (eos - bos) // checkpoint_every]):
                if ckpt_slot < 0:
                    continue
                if algorithm == "chunk":
                    state = saved[0, (j + 1) * checkpoint_every // CHUNK_SIZE - 1]
                else:
                    state = saved[0, (j + 1) * checkpoint_every - 1]
                state_pool[ckpt_slot] = state.transpose(-1, -2).to(state_pool.dtype)


def decode(recipe, q, k, v, g, beta, *, state_pool, state_indices, out, **kwargs):
    """One token per sequence, pool updated in place.

    q, k [N, H, K]; v [N, HV, V]; g [N, HV] / [N, HV, K] / [HV]; beta [N, HV] or None;
    state_pool [P, HV, V, K]; state_indices int32 [N] (negative = padding); out [N, HV, V].
    """
    _, dtype = _options(kwargs, "recurrent")
    S0 = _read_states(state_pool, state_indices, dtype)
    o, S, _ = _run(recipe, q[:, None], k[:, None], v[:, None], g[:, None] if recipe.delta_rule else g,
                   beta[:, None] if beta is not None else None, S0, algorithm="recurrent", dtype=dtype)
    live = state_indices >= 0
    out.copy_(torch.where(live[:, None, None], o[:, 0], o.new_zeros(())))
    _write_states(state_pool, state_indices, S, live)


def verify(recipe, q, k, v, g, beta, *, protocol, state_pool, state_indices, num_accepted_tokens,
           intermediate_states, intermediate_indices, out, **kwargs):
    """MTP verify of T tokens for N sequences; outputs for every token.

    q, k [N, T, H, K]; v [N, T, HV, V]; g [N, T, HV(, K)] or [HV]; beta [N, T, HV] or None;
    out [N, T, HV, V]. By protocol:
      "buffer":   read pool[state_indices[n]] (int32 [N]); write the state after token t to
                  intermediate_states[intermediate_indices[n], t] ([R, T, HV, V, K]); pool untouched.
      "slots":    state_indices int32 [N, T]; read column num_accepted_tokens[n] - 1, write the
                  state after token t to column t (negative entries are not written).
      "deferred": read pool[state_indices[n]]; write nothing (``commit`` replays).
    A row whose read slot is negative is padding: zero output, nothing written.
    """
    _, dtype = _options(kwargs, "recurrent")
    N, T = v.shape[:2]
    if protocol == "slots":
        column = (num_accepted_tokens.long() - 1).clamp(0, state_indices.shape[1] - 1)
        read = state_indices.gather(1, column[:, None])[:, 0]
    else:
        read = state_indices
    live = read >= 0
    S0 = _read_states(state_pool, read, dtype, live)
    o, _, states = _run(recipe, q, k, v, g, beta, S0, algorithm="recurrent", dtype=dtype,
                        save_states=protocol != "deferred")
    out.copy_(torch.where(live[:, None, None, None], o, o.new_zeros(())))
    if protocol == "buffer":
        rows = intermediate_indices[live].long()
        intermediate_states[rows, :T] = states[live].transpose(-1, -2).to(intermediate_states.dtype)
    elif protocol == "slots":
        for t in range(T):
            column = state_indices[:, t]
            _write_states(state_pool, column, states[:, t], live & (column >= 0))


def commit(recipe, *, protocol, state_pool, state_indices, num_accepted_tokens,
           intermediate_states, intermediate_indices, k, v, g, beta, saved=None, **kwargs):
    """Make the first num_accepted_tokens[n] tokens of a verify the state of sequence n.

    num_accepted_tokens int32 [N], 0..T; 0 leaves the slot as it was. By protocol:
      "buffer":   pool[state_indices[n]] = intermediate_states[intermediate_indices[n], a - 1].
      "slots":    pool[state_indices[n, 0]] = pool[state_indices[n, a - 1]] (so the next verify
                  may pass num_accepted_tokens = 1).
      "deferred": replay tokens 0..a-1 of (k, v, g, beta) onto pool[state_indices[n]], in place.
    Padding rows (negative slot) are untouched. ``saved`` (another backend's verify
    intermediates) is not used: the reference always replays.
    """
    _, dtype = _options(kwargs, "recurrent")
    accepted = num_accepted_tokens.long()
    if protocol == "slots":
        slots = state_indices[:, 0]
        source = state_indices.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
        live = (slots >= 0) & (source >= 0) & (accepted > 1)
        _write_states(state_pool, slots, _read_states(state_pool, source, dtype, live), live)
        return
    live = (state_indices >= 0) & (accepted > 0)
    if protocol == "buffer":
        rows = intermediate_indices.long().clamp(min=0)
        T = intermediate_states.shape[1]
        chosen = intermediate_states[rows, (accepted - 1).clamp(0, T - 1)]
        _write_states(state_pool, state_indices, chosen.to(dtype).transpose(-1, -2), live)
        return
    # deferred: replay the tokens and keep the state after the last accepted one
    N, T = v.shape[:2]
    S0 = _read_states(state_pool, state_indices, dtype, live)
    q = torch.zeros_like(k)
    _, _, states = _run(recipe, q, k, v, g, beta, S0, algorithm="recurrent", dtype=dtype,
                        save_states=True)
    final = states[torch.arange(N, device=v.device), (accepted - 1).clamp(0, T - 1)]
    _write_states(state_pool, state_indices, final, live)
