"""The gated delta rule in chunked (WY) form, in torch: the algorithm the fast kernels implement.

Tokens are cut into chunks of C = 64. Inside a chunk, with the cumulative log gate
G_t = g_1 + ... + g_t (per channel for KDA) and the chunk's incoming state S0, unrolling the
recurrence of ``naive.py`` gives, for the pseudo-values u_t of each token,

    u_t + beta_t * sum_{s<t} A_ts u_s = beta_t * (v_t - S0^T (exp(G_t) * k_t))
    A_ts = sum_k k_t[k] k_s[k] exp(G_t[k] - G_s[k])                      (s < t)

a unit lower-triangular system M U = beta * (V - (exp(G) * K) S0), M = I + diag(beta) A. Its
solution splits into two parts that do not depend on S0 (the WY representation)

    W  = M^{-1} diag(beta) (exp(G) * K)        [C, K]
    U~ = M^{-1} diag(beta) V                   [C, V]
    U  = U~ - W S0

after which the chunk's outputs and outgoing state are plain matrix products

    O     = scale * ((exp(G) * Q) S0 + (Aqk masked to s <= t) U),   Aqk_ts = sum_k q_t k_s exp(G_t - G_s)
    S_out = exp(G_C) * S0 + (exp(G_C - G) * K)^T U

Only S0 -> S_out is sequential across chunks; everything else is parallel. The decay factors
exp(G_t - G_s) are formed pairwise (never exp(-G_s) alone), so nothing overflows however small
the gates are. GDN is the same code with the gate broadcast over K.
"""
from __future__ import annotations

import torch

from ..common.chunking import CHUNK_SIZE, pad_tokens, pairwise_decayed, split_chunks
from ..common.prep import expand_heads


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
):
    """Chunked form of ``naive.delta_rule_recurrence``; same arguments and meaning.

    Returns:
        o:            [B, T, HV, V]
        state:        [B, HV, K, V] after the last token
        chunk_states: [B, T // chunk_size, HV, K, V], the state after each complete chunk
                      (the checkpoints a prefix cache stores).
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    C = chunk_size
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    if g.dim() == 3:
        g = g[..., None]
    # padded tokens have g = 0 and beta = 0: the state passes through them unchanged
    q, k, v, g, beta = (split_chunks(pad_tokens(x, C), C) for x in (q, k, v, g, beta[..., None]))
    n_chunks = v.shape[2]
    G = g.cumsum(-2)

    # Everything that does not depend on the incoming state, for all chunks at once.
    A, Aqk = pairwise_decayed((k, q), k, G)
    A = A.tril(-1)
    M = torch.eye(C, dtype=A.dtype, device=A.device) + beta * A
    W = torch.linalg.solve_triangular(M, beta * (G.exp() * k), upper=False, unitriangular=True)
    U_tilde = torch.linalg.solve_triangular(M, beta * v, upper=False, unitriangular=True)
    q_decayed = G.exp() * q
    G_last = G[..., -1:, :]
    k_to_end = (G_last - G).exp() * k

    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.clone()
    o = v.new_empty(B, HV, n_chunks, C, V)
    chunk_states = []
    for n in range(n_chunks):
        U = U_tilde[:, :, n] - W[:, :, n] @ S
        o[:, :, n] = scale * (q_decayed[:, :, n] @ S + Aqk[:, :, n] @ U)
        S = G_last[:, :, n].exp().transpose(-1, -2) * S + k_to_end[:, :, n].transpose(-1, -2) @ U
        chunk_states.append(S)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n_chunks * C, HV, V)[:, :T]
    full = T // C
    chunk_states = torch.stack(chunk_states[:full], 1) if full else q.new_empty(B, 0, HV, K, V)
    return o, S, chunk_states
