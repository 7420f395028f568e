"""The gated delta rule, token by token: the oracle every backend is checked against.

Per value head ``hv`` (its qk head is ``hv // (HV // H)``), with the state S in R^{K x V}:

    S   = Diag(exp(g_t)) S              decay first; GDN: g_t scalar, KDA: g_t in R^K
    u   = beta_t * (v_t - S^T k_t)
    S   = S + k_t u^T
    o_t = scale * S^T q_t

GDN is this recurrence with the scalar gate broadcast over K; there is no second copy.
Inputs are already prepared (``kernels.common.prep.Recipe.prepare``: l2norm, gate, beta sigmoid).
"""
from __future__ import annotations

import torch

from ..common.prep import expand_heads


def delta_rule_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    save_states: bool = False,
):
    """Run the recurrence over T tokens for B independent sequences.

    Args:
        q, k:  [B, T, H, K] prepared queries / keys.
        v:     [B, T, HV, V].
        g:     [B, T, HV] (scalar gate) or [B, T, HV, K] (per-channel gate), log decay.
        beta:  [B, T, HV], in (0, 1).
        scale: output multiplier.
        initial_state: [B, HV, K, V] (K-first, the math's layout) or None for zeros.
        save_states: also return the state after every token.

    All tensors share one floating dtype, which is the compute dtype (float32 or float64).

    Returns:
        o:      [B, T, HV, V]
        state:  [B, HV, K, V], the state after the last token.
        states: [B, T, HV, K, V] when ``save_states``, else None.
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    if g.dim() == 3:
        g = g[..., None]  # scalar gate: broadcast over K
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.clone()
    o = v.new_empty(B, T, HV, V)
    states = v.new_empty(B, T, HV, K, V) if save_states else None
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        k_t = k[:, t]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t))
        S = S + k_t[..., :, None] * u[..., None, :]
        o[:, t] = scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t])
        if save_states:
            states[:, t] = S
    return o, S, states
