"""Chunking shared by the chunked forms: the chunk size, padding, and decayed pairwise products."""
from __future__ import annotations

import torch

CHUNK_SIZE = 64


def pad_tokens(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Zero-pad the token dim (dim 1 of [B, T, HV, D]) up to a multiple of ``chunk_size``."""
    pad = (-x.shape[1]) % chunk_size
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x


def split_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, HV, D] with T a multiple of ``chunk_size`` -> [B, HV, T / chunk_size, chunk_size, D]."""
    B, T, HV, D = x.shape
    return x.reshape(B, T // chunk_size, chunk_size, HV, D).permute(0, 3, 1, 2, 4)


def pairwise_decayed(xs, y: torch.Tensor, G: torch.Tensor, block_elems: int = 1 << 23):
    """For each x in ``xs``: P[..., t, s] = sum_k x_t[k] y_s[k] exp(G_t[k] - G_s[k]) for s <= t,
    0 above the diagonal. Returns a tuple, one P per x.

    x, y: [..., C, K]; G: [..., C, K] or [..., C, 1] (scalar gate, the cheap path). The
    per-channel path forms a [C, C, K] decay per chunk (once for all xs), walking the leading
    dims in blocks of about ``block_elems`` elements to bound memory.
    """
    C = y.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=y.device).tril()

    def decay(Gb):
        diff = Gb[..., :, None, :] - Gb[..., None, :, :]  # [..., t, s, K or 1]
        return torch.where(causal[..., None], diff, diff.new_full((), float("-inf"))).exp()

    if G.shape[-1] == 1:
        d = decay(G)[..., 0]
        return tuple((x @ y.transpose(-1, -2)) * d for x in xs)
    lead = y.shape[:-2]
    flat = lambda t: t.expand(*lead, *t.shape[-2:]).reshape(-1, C, t.shape[-1])  # noqa: E731
    xs, y, G = [flat(x) for x in xs], flat(y), flat(G)
    step = max(1, block_elems // (C * C * y.shape[-1]))
    blocks = []
    for i in range(0, max(y.shape[0], 1), step):  # one (empty) block when there are no chunks
        yd = decay(G[i:i + step]) * y[i:i + step, None, :, :]  # [b, t, s, K]
        blocks.append([torch.einsum("btk,btsk->bts", x[i:i + step], yd) for x in xs])
    return tuple(torch.cat(parts).reshape(*lead, C, C) for parts in zip(*blocks))


