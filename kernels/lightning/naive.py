"""Lightning attention, token by token: the oracle for this family.

Per value head ``hv`` with a constant log decay ``d_hv <= 0`` and the state S in R^{K x V}:

    S   = exp(d_hv) S + k_t v_t^T
    o_t = scale * S^T q_t
"""
from __future__ import annotations

import torch

from ..common.prep import expand_heads


def lightning_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    save_states: bool = False,
):
    """Run the recurrence over T tokens for B independent sequences.

    Args:
        q, k:  [B, T, H, K]; v: [B, T, HV, V]; decay: [HV] log decay per value head.
        initial_state: [B, HV, K, V] or None for zeros. One floating dtype for all (the compute dtype).

    Returns (o [B, T, HV, V], state [B, HV, K, V], states [B, T, HV, K, V] or None) as
    ``delta_rule_recurrence`` does.
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    a = decay.exp()[None, :, None, None]
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.clone()
    o = v.new_empty(B, T, HV, V)
    states = v.new_empty(B, T, HV, K, V) if save_states else None
    for t in range(T):
        S = a * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t])
        if save_states:
            states[:, t] = S
    return o, S, states
