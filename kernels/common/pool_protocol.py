"""The pool protocol of the token-by-token kernels (decode, MTP verify, commit): the checks and
argument plumbing every backend's recurrent kernels share, in plain Python.

What each op reads and writes is documented in ``kernels/delta_rule/recurrent_triton.py``; the
Triton and CuTe DSL kernels implement the same table.
"""
from __future__ import annotations

import torch

OPS = ("decode", "buffer", "slots", "deferred", "commit")  # an op's kernel code is its index


def check_state_layout(name: str, x: torch.Tensor, first_inner_dim: int):
    """Dims from ``first_inner_dim`` on must be contiguous ([.., HV, V, K] with unit K stride)."""
    expected = 1
    for dim in range(x.dim() - 1, first_inner_dim - 1, -1):
        if x.shape[dim] != 1 and x.stride(dim) != expected:
            raise ValueError(f"{name}: the [HV, V, K] dims must be contiguous (only the leading dims may be "
                             f"strided), got shape {list(x.shape)} with strides {list(x.stride())}")
        expected *= x.shape[dim]


def check_protocol(op: str, *, state_pool, state_indices, num_accepted_tokens, intermediate_states,
                   intermediate_indices, T: int):
    """Check the pool-side tensors of ``op`` for a call of T tokens (raises ValueError)."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    check_state_layout("state_pool", state_pool, 1)
    if op == "slots":
        if state_indices.dim() != 2 or state_indices.shape[1] < T:
            raise ValueError(f"state_indices: the slots protocol needs [N, T_cols >= {T}], "
                             f"got {list(state_indices.shape)}")
    elif state_indices.dim() != 1:
        raise ValueError(f"state_indices: expected [N], got {list(state_indices.shape)}")
    if (op in ("slots", "commit")) != (num_accepted_tokens is not None):
        raise ValueError(f"num_accepted_tokens: needed by the slots verify and the commit only (op={op!r})")
    if op == "buffer":
        if intermediate_states is None or intermediate_indices is None:
            raise ValueError("intermediate_states, intermediate_indices: required by the buffer protocol")
        check_state_layout("intermediate_states", intermediate_states, 2)
        if intermediate_states.shape[1] < T:
            raise ValueError(f"intermediate_states: room for {intermediate_states.shape[1]} tokens, need {T}")


def check_saved_u(saved_u: torch.Tensor | None, op: str, shape: tuple):
    """``saved_u``, the deferred verify's u handed to its commit: float32 ``shape`` = [N, T, HV, V]
    with unit last stride, for those two ops only."""
    if saved_u is None:
        return
    if op not in ("deferred", "commit"):
        raise ValueError(f"saved_u: only the deferred verify and its commit use it (op={op!r})")
    if saved_u.dtype != torch.float32 or tuple(saved_u.shape) != tuple(shape) or saved_u.stride(-1) != 1:
        raise ValueError(f"saved_u: expected float32 [N, T, HV, V] = {list(shape)} with unit last stride, "
                         f"got {saved_u.dtype} {list(saved_u.shape)} strides {list(saved_u.stride())}")


def check_pending(op: str, pending: tuple | None, num_accepted_tokens, N: int, HV: int, V: int, saved_u: bool):
    """A verify's pending commit as its kernels take it: ``pending`` is (k [N, TP, H, K], g, u) of a
    previous deferred verify of the same N rows, u its saved u (float32 [N, TP, HV, V], checked when
    ``saved_u``; Lightning's v otherwise), committed first for ``num_accepted_tokens`` [N] of its
    tokens. Returns (k, g, u, TP) with unit last strides, or (None, None, None, 0) without one."""
    if pending is None:
        return None, None, None, 0
    if op != "deferred":
        raise ValueError(f"pending: only a deferred verify commits a pending verify first (op={op!r})")
    k, g, u = (unit_last(x) for x in pending)
    TP = k.shape[1]
    if num_accepted_tokens is None or tuple(num_accepted_tokens.shape) != (N,):
        raise ValueError(f"num_accepted_tokens: a pending commit needs int32 [N={N}] accepted counts")
    if k.shape[0] != N or tuple(u.shape[:2]) != (N, TP):
        raise ValueError(f"pending: k and u must be [N={N}, TP, ...] alike, got {list(k.shape)} and {list(u.shape)}")
    if saved_u:
        check_saved_u(u, "commit", (N, TP, HV, V))
    return k, g, u, TP


def strides3(x: torch.Tensor | None) -> tuple[int, int, int]:
    """(n, t, head) strides of a per-token tensor [N, T, heads, ...]; zeros when absent."""
    return (0, 0, 0) if x is None else tuple(x.stride()[:3])


def unit_last(x: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels read head vectors ([K] or [V]) with unit stride; copy only when they are not."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def output_target(out: torch.Tensor | None) -> torch.Tensor | None:
    """Where a kernel writes the outputs: ``out`` itself unless its rows are strided, then a
    contiguous scratch tensor the caller copies back."""
    return out if out is None or out.stride(-1) == 1 else torch.empty(out.shape, dtype=out.dtype, device=out.device)


def _same_memory(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same tensor seen the same way (engines pass a layer's parameters anew every step)."""
    return (a is None) == (b is None) and (a is None or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype))


def fuses_pending(pending, recipe, g, backend: str, modes: tuple) -> bool:
    """Whether a verify of ``backend`` can commit ``pending`` (the API's PendingCommit of a
    deferred verify) inside its own kernel: the pending verify ran on this backend, in one of
    ``modes``, with the same recipe (the commit's gates are computed from this call's gate
    parameters, Lightning's from its decay ``g``) and kept its u (delta rule)."""
    ours, theirs = recipe.fused_gate, pending.recipe.fused_gate
    same_gate = (ours is None) == (theirs is None) and (ours is None or (
        _same_memory(ours.A_log, theirs.A_log) and _same_memory(ours.dt_bias, theirs.dt_bias)
        and ours.lower_bound == theirs.lower_bound))
    if recipe.mode == "lightning":
        same_gate = _same_memory(g, pending.g)
    return (pending.backend == backend and recipe.mode in modes and pending.recipe.mode == recipe.mode and same_gate
            and pending.recipe.qk_l2norm == recipe.qk_l2norm and (pending.saved is not None or not recipe.delta_rule))
