"""The ``triton`` backend: portable Triton kernels for SM80+ GPUs, and for the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, small shapes, tests only).

    prefill  kernels/delta_rule/chunk_triton.py (gdn, kda), kernels/lightning/chunk_triton.py
    decode, verify, deferred commit
             kernels/delta_rule/recurrent_triton.py (gdn and kda: one kernel; KDA's
             deferred verify and commit first form its decays in a launch of their own),
             kernels/lightning/recurrent_triton.py
    buffer / slots commit
             a state copy kernel (``copy_committed_states``)

Shapes, dtypes, pool semantics and the three MTP protocols are those of the torch backend, the
reference. Decode, verify and commit never synchronise with the host and branch on shapes only,
so they can be captured in CUDA graphs. The kernels take the backend's inputs as they come
(strided views of a fused projection included; only tensors whose innermost dim is strided are
copied); the pool may be strided in its slot dim (paged engines), its [HV, V, K] dims must be
contiguous. Prefill takes one backend-specific keyword, ``segment_tokens`` (``prefill``).
"""
from __future__ import annotations

import torch

from ..common.pool_protocol import fuses_pending

try:
    import triton
    _IMPORT_ERROR = None
except ImportError as err:  # pragma: no cover - depends on the environment
    _IMPORT_ERROR = f"triton does not import ({err})"

NAME = "triton"
OPERATIONS = ("prefill", "decode", "verify", "commit")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)


def availability(device: torch.device) -> str | None:
    if _IMPORT_ERROR:
        return _IMPORT_ERROR
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"needs compute capability 8.0 or newer, {device} is {major}.{minor}"
        return None
    if device.type == "cpu":
        if triton.knobs.runtime.interpret:  # TRITON_INTERPRET, as triton parses it
            return None
        return "on the CPU only under Triton's interpreter (set TRITON_INTERPRET=1 before importing triton)"
    return f"no Triton kernels for {device.type} devices"


def head_dims_error(K: int, V: int) -> str | None:
    if K in HEAD_DIMS and V in HEAD_DIMS:
        return None
    return f"head dims K={K}, V={V}: the Triton kernels take powers of two from 16 to 256"


def _no_options(operation: str, kwargs: dict):
    if kwargs:
        raise TypeError(f"triton backend {operation}: unexpected keyword arguments {sorted(kwargs)}")


def _recurrent(recipe, q, k, v, g, beta, **pool_args):
    """The token-by-token kernel of the recipe's family; for Lightning g is the decay [HV]."""
    if recipe.delta_rule:
        from ..delta_rule.recurrent_triton import delta_rule_recurrent
        return delta_rule_recurrent(recipe, q, k, v, g, beta, **pool_args)
    from ..lightning.recurrent_triton import lightning_recurrent
    return lightning_recurrent(recipe, q, k, v, g, **pool_args)


def native_map_columns(recipe) -> bool:
    """Whether ``prefill`` takes ``map_columns`` itself (the delta rule's state kernel gives the
    map columns zero values without widening v or the intra-chunk workspace)."""
    return recipe.delta_rule


def prefill(recipe, q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices, has_initial_state,
            out, checkpoint_every=None, checkpoint_indices=None, map_columns=0, segment_tokens=None, **kwargs):
    """Chunked prefill of a packed varlen batch; arguments as for the torch backend's ``prefill``,
    plus ``map_columns`` for the delta rule (see ``delta_rule_prefill``) and ``segment_tokens``:
    None (the default) cuts long sequences into segments that run in parallel where the shapes
    would leave SMs idle, 0 never does, a multiple of 64 forces that length
    (``kernels.common.segments``)."""
    _no_options("prefill", kwargs)
    common = dict(cu_seqlens=cu_seqlens, state_pool=state_pool, state_indices=state_indices,
                  has_initial_state=has_initial_state, out=out, checkpoint_every=checkpoint_every,
                  checkpoint_indices=checkpoint_indices, segment_tokens=segment_tokens)
    if recipe.delta_rule:
        from ..delta_rule.chunk_triton import delta_rule_prefill
        return delta_rule_prefill(recipe, q, k, v, g, beta, map_columns=map_columns, **common)
    from ..lightning.chunk_triton import lightning_prefill
    return lightning_prefill(recipe, q, k, v, g, beta, **common)


def decode(recipe, q, k, v, g, beta, *, state_pool, state_indices, out, **kwargs):
    """One token per sequence, pool updated in place.

    q, k [N, H, K]; v [N, HV, V]; g [N, HV] (gdn) / [N, HV, K] (kda) / decay [HV] (lightning);
    beta [N, HV] or None (lightning); state_pool [P, HV, V, K]; state_indices int32 [N]
    (negative = padding: no read, no write, zero output); out [N, HV, V] in v's dtype.
    """
    _no_options("decode", kwargs)
    token = lambda x: None if x is None else x.unsqueeze(1)  # noqa: E731  ([N, ...] -> [N, 1, ...])
    _recurrent(recipe, token(q), token(k), token(v), token(g) if recipe.delta_rule else g, token(beta),
               op="decode", state_pool=state_pool, state_indices=state_indices, out=token(out))


def verify(recipe, q, k, v, g, beta, *, protocol, state_pool, state_indices, num_accepted_tokens,
           intermediate_states, intermediate_indices, out, **kwargs):
    """MTP verify of T tokens for N sequences; shapes and protocols as for the torch backend's
    ``verify``. The pool is read once per sequence; "buffer" writes T states per sequence to
    ``intermediate_states``, "slots" T states to the pool, "deferred" nothing.

    Returns what ``commit`` takes as ``saved``: for a deferred delta-rule verify the tokens' u
    (float32 [N, T, HV, V], allocated here, so capturable), otherwise None."""
    _no_options("verify", kwargs)
    saved = None
    if protocol == "deferred" and recipe.delta_rule:
        saved = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    _recurrent(recipe, q, k, v, g, beta, op=protocol, state_pool=state_pool, state_indices=state_indices,
               out=out, num_accepted_tokens=num_accepted_tokens if protocol == "slots" else None,
               intermediate_states=intermediate_states, intermediate_indices=intermediate_indices,
               **({} if saved is None else dict(saved_u=saved)))
    return saved


def fuses_commit(pending, recipe, g) -> bool:
    """Whether ``commit_verify`` runs this verify with ``pending`` in one kernel (GDN and KDA;
    Lightning's verify and commit stay two launches)."""
    return fuses_pending(pending, recipe, g, NAME, ("gdn", "kda"))


def commit_verify(recipe, q, k, v, g, beta, *, pending, num_accepted_tokens, state_pool, state_indices, out,
                  **kwargs):
    """The deferred commit of ``pending`` (``num_accepted_tokens`` [N] of its tokens, 0..its T)
    and the deferred verify of these T tokens from the committed states, in one kernel
    (``recurrent_triton.delta_rule_recurrent``'s ``pending``). Only where ``fuses_commit``.
    Returns the new u as ``verify`` does."""
    _no_options("verify", kwargs)
    from ..delta_rule.recurrent_triton import delta_rule_recurrent
    saved = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    delta_rule_recurrent(recipe, q, k, v, g, beta, op="deferred", state_pool=state_pool, state_indices=state_indices,
                         out=out, num_accepted_tokens=num_accepted_tokens, saved_u=saved,
                         pending=(pending.k, pending.g, pending.saved))
    return saved


def commit(recipe, *, protocol, state_pool, state_indices, num_accepted_tokens, intermediate_states,
           intermediate_indices, k, v, g, beta, saved=None, **kwargs):
    """Make the first num_accepted_tokens[n] verify tokens the state of sequence n; semantics as
    for the torch backend's ``commit``. "buffer" and "slots" copy one saved state per sequence;
    "deferred" replays the accepted tokens onto the slot in one read-modify-write, from the
    verify's ``saved`` u when given (delta rule: no reductions left, a streaming pass)."""
    _no_options("commit", kwargs)
    if protocol == "deferred":
        _recurrent(recipe, None, k, v, g, beta, op="commit", state_pool=state_pool,
                   state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
                   **({} if saved is None else dict(saved_u=saved)))
        return
    from ..delta_rule.recurrent_triton import copy_committed_states
    copy_committed_states(protocol, state_pool=state_pool, state_indices=state_indices,
                          num_accepted_tokens=num_accepted_tokens, intermediate_states=intermediate_states,
                          intermediate_indices=intermediate_indices)
