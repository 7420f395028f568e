"""Lightning attention in chunked form, in torch: the algorithm the fast kernels implement.

With a constant log decay d per head, inside a chunk of C tokens (positions t = 1..C) and the
incoming state S0:

    O     = scale * ((exp(t d) * Q) S0 + (Q K^T * exp((t - s) d), masked to s <= t) V)
    S_out = exp(C d) S0 + (exp((C - s) d) * K)^T V

It is the delta-rule chunk with the cumulative gate G_t = t d, and it shares that file's
pairwise-decay helper.

Lightning has no delta rule, so no triangular solve: each chunk is three matrix products.
"""
from __future__ import annotations

import torch

from ..common.chunking import CHUNK_SIZE, pad_tokens, pairwise_decayed, split_chunks
from ..common.prep import expand_heads


def lightning_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
):
    """Chunked form of ``naive.lightning_recurrence``; same arguments.

    Returns (o [B, T, HV, V], state [B, HV, K, V], chunk_states [B, T // C, HV, K, V]).
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    C = chunk_size
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    # zero keys and values add nothing, and padded tokens do not decay (g = 0)
    g = decay.expand(B, T, HV)[..., None]
    q, k, v, g = (split_chunks(pad_tokens(x, C), C) for x in (q, k, v, g))
    n_chunks = v.shape[2]
    G = g.cumsum(-2)  # [B, HV, n, C, 1]
    (Aqk,) = pairwise_decayed((q,), k, G)
    q_decayed = G.exp() * q
    G_last = G[..., -1:, :]
    k_to_end = (G_last - G).exp() * k

    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.clone()
    o = v.new_empty(B, HV, n_chunks, C, V)
    chunk_states = []
    for n in range(n_chunks):
        o[:, :, n] = scale * (q_decayed[:, :, n] @ S + Aqk[:, :, n] @ v[:, :, n])
        S = G_last[:, :, n].exp() * S + k_to_end[:, :, n].transpose(-1, -2) @ v[:, :, n]
        chunk_states.append(S)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n_chunks * C, HV, V)[:, :T]
    full = T // C
    chunk_states = torch.stack(chunk_states[:full], 1) if full else q.new_empty(B, 0, HV, K, V)
    return o, S, chunk_states
