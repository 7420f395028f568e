"""Device-side chunk indexing of a packed varlen batch, shared by the chunked Triton kernels.

A packed batch holds N sequences back to back, sequence n at tokens [cu_seqlens[n], cu_seqlens[n+1]).
Cut into chunks of C tokens, sequence n has ceil(len_n / C) chunks (its last one possibly
partial). Kernels that work on one chunk per program need, for a global chunk id i, the
sequence it belongs to and its index inside that sequence. The total number of chunks depends on
the data, so it cannot size a grid without a host synchronisation; instead the grid is sized by
the bound

    sum_n ceil(len_n / C) <= sum_n (floor(len_n / C) + 1) <= T // C + N

and ids past the real total are marked -1 (their programs exit at once).

``chunk_indices`` fills that table with one small Triton launch: no ``.item()``, no
``.tolist()``, no data-dependent host branching, so it is safe inside CUDA-graph capture and
never stalls the host. Chunk i belongs to sequence n when offset_n <= i < offset_n + chunks_n, with
offset_n = chunks_0 + ... + chunks_{n-1}; each program walks the sequences in blocks, keeps the
running offset, and matches its block of chunk ids against every sequence of the block at once.
The work is O((T / C + N) * N / BLOCK) per launch, which stays in the microseconds for the few
thousand sequences a serving batch holds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_CHUNKS = 64
SEQ_BLOCK = tl.constexpr(64)  # sequences read per step of the walks below


@triton.jit
def piece_counts(cu_seqlens, n0, num_seqs, size, AT_LEAST_ONE: tl.constexpr = False):
    """Sequences n0 .. n0 + SEQ_BLOCK - 1 (those < num_seqs): their indices and how many pieces of
    ``size`` tokens each is cut into (0 past the end). An empty sequence has no pieces, or one
    with AT_LEAST_ONE (segments: its program still writes its slot)."""
    n = n0 + tl.arange(0, SEQ_BLOCK)
    live = n < num_seqs
    length = tl.load(cu_seqlens + n + 1, mask=live, other=0) - tl.load(cu_seqlens + n, mask=live, other=0)
    count = (length + size - 1) // size
    if AT_LEAST_ONE:
        count = tl.where(live, tl.maximum(count, 1), 0)
    return n, count


@triton.jit
def locate_pieces(cu_seqlens, num_seqs, ids, size, AT_LEAST_ONE: tl.constexpr = False):
    """For global ids [B] of the pieces of ``size`` tokens of a packed batch (packed order: the
    pieces of sequence 0 first), the sequence holding each and its index there ([B] each; -1 for
    ids past the last piece). Walks the sequences in blocks, keeping the running piece offset,
    and matches the ids against every sequence of a block at once. AT_LEAST_ONE: as for
    ``piece_counts``."""
    seq = tl.zeros(ids.shape, dtype=tl.int32)
    local = tl.zeros(ids.shape, dtype=tl.int32)
    found = tl.zeros(ids.shape, dtype=tl.int32)
    offset = 0  # pieces of the sequences before the current block
    for n0 in range(0, num_seqs, SEQ_BLOCK):
        n, count = piece_counts(cu_seqlens, n0, num_seqs, size, AT_LEAST_ONE)
        first = offset + tl.cumsum(count, 0) - count  # global id of each sequence's first piece
        hit = (first[None, :] <= ids[:, None]) & (ids[:, None] < (first + count)[None, :])
        seq += tl.sum(tl.where(hit, n[None, :], 0), 1)
        local += tl.sum(tl.where(hit, ids[:, None] - first[None, :], 0), 1)
        found += tl.sum(hit.to(tl.int32), 1)
        offset += tl.sum(count, 0)
    return tl.where(found > 0, seq, -1), tl.where(found > 0, local, -1)


@triton.jit
def _chunk_index_kernel(cu_seqlens, out, N, NUM_IDS, C: tl.constexpr, BLOCK_CHUNKS: tl.constexpr):
    ids = tl.program_id(0) * BLOCK_CHUNKS + tl.arange(0, BLOCK_CHUNKS)
    seq, local = locate_pieces(cu_seqlens, N, ids, C)
    keep = ids < NUM_IDS
    tl.store(out + ids * 2, seq, mask=keep)
    tl.store(out + ids * 2 + 1, local, mask=keep)


def max_chunks(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Upper bound on the chunks of ``num_seqs`` packed sequences of ``num_tokens`` tokens in all."""
    return num_tokens // chunk_size + num_seqs


def chunk_indices(cu_seqlens: torch.Tensor, num_tokens: int, chunk_size: int) -> torch.Tensor:
    """Per global chunk id, (sequence, chunk within the sequence); -1 rows past the last chunk.

    cu_seqlens: int32 [N + 1] on the device (non-decreasing, starts at 0, ends at ``num_tokens``).
    Returns int32 [num_tokens // chunk_size + N, 2]. Chunk ids follow the packed order: the
    chunks of sequence 0 first, then those of sequence 1, and so on; empty sequences have none.
    """
    N = cu_seqlens.shape[0] - 1
    num_ids = max_chunks(num_tokens, N, chunk_size)
    out = torch.empty(num_ids, 2, dtype=torch.int32, device=cu_seqlens.device)
    grid = (triton.cdiv(num_ids, _BLOCK_CHUNKS),)
    _chunk_index_kernel[grid](cu_seqlens, out, N, num_ids, C=chunk_size, BLOCK_CHUNKS=_BLOCK_CHUNKS)
    return out
