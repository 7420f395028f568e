"""Which tokens of a packed varlen batch each context-parallel rank holds.

``split_cu_seqlens_for_sp(cu_seqlens, world_size)`` turns the global ``cu_seqlens`` into one
``RankPlan`` per rank. Every rank computes the same plans from the same ``cu_seqlens``, so
decisions that must agree across ranks (who communicates, which ranks a sequence spans) need no
extra messages.

Placements:
- ``"split"`` (sequence-split): rank r holds the contiguous packed tokens
  ``[bounds[r], bounds[r + 1])``, bounds proportional to ``weights`` (equal by default) and
  rounded to multiples of 64 (the chunk size of the fast kernels) so that only the pieces at rank
  edges have partial chunks. A sequence may span several ranks.
- ``"complete"`` (sequence-complete): whole sequences only; each rank gets a contiguous run of
  sequences whose token count is as close as possible to its share. No communication is needed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.common.chunking import CHUNK_SIZE

PLACEMENTS = ("split", "complete")


@dataclass(frozen=True)
class SequencePiece:
    """The part of sequence ``sequence`` held by one rank: local tokens ``[start, end)``.

    first: the piece holds the sequence's first token (its initial state comes from the pool).
    last:  the piece holds the sequence's last token (its rank writes the final state).
    """

    sequence: int
    start: int
    end: int
    first: bool
    last: bool


@dataclass(frozen=True)
class RankPlan:
    """Rank ``rank`` holds global packed tokens ``[token_start, token_end)`` as ``pieces``."""

    rank: int
    token_start: int
    token_end: int
    pieces: tuple[SequencePiece, ...]

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    def local_cu_seqlens(self, device=None) -> torch.Tensor:
        """int32 [len(pieces) + 1]: offsets of the pieces in this rank's tokens."""
        offsets = [piece.start for piece in self.pieces] + [self.num_tokens]
        return torch.tensor(offsets, dtype=torch.int32, device=device)


def _host_offsets(cu_seqlens) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: expected an int32/int64 [N + 1] tensor, got {cu_seqlens.dtype} "
                             f"{list(cu_seqlens.shape)}")
        offsets = cu_seqlens.tolist()
    else:
        offsets = [int(x) for x in cu_seqlens]
    if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets starting at 0 with at least one sequence, "
                         f"got {offsets[:8]}{'...' if len(offsets) > 8 else ''}")
    return offsets


def _split_bounds(total: int, world_size: int, weights) -> list[int]:
    if weights is None:
        weights = [1.0] * world_size
    if len(weights) != world_size or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights: expected {world_size} non-negative shares with a positive sum, got {weights}")
    bounds, acc = [0], 0.0
    for w in weights[:-1]:
        acc += w
        # whole chunks, except that a rank after which no weight is left ends at the last token
        cut = total if acc >= sum(weights) else round(total * acc / sum(weights) / CHUNK_SIZE) * CHUNK_SIZE
        bounds.append(min(max(cut, bounds[-1]), total))
    return bounds + [total]


def _complete_bounds(offsets: list[int], world_size: int, weights) -> list[int]:
    ideal = _split_bounds(offsets[-1], world_size, weights)
    bounds = [0]
    for target in ideal[1:-1]:
        nearest = min(offsets, key=lambda o: (abs(o - target), o))
        bounds.append(max(nearest, bounds[-1]))
    return bounds + [offsets[-1]]


def split_cu_seqlens_for_sp(cu_seqlens, world_size: int, *, placement: str = "split",
                            weights=None) -> list[RankPlan]:
    """Plan context parallelism: the tokens and sequence pieces of every rank.

    Args:
        cu_seqlens: global offsets of the packed batch, int32/int64 [N + 1] (a CPU tensor or a
            list; a GPU tensor is copied to the host once).
        world_size: ranks in the context-parallel group.
        placement: "split" (sequences may span ranks) or "complete" (whole sequences per rank).
        weights: optional share of tokens per rank (e.g. more for rank 0, which never needs the
            map pass); equal by default.

    Returns:
        ``[RankPlan]`` of length world_size; a rank may hold no tokens.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: expected one of {PLACEMENTS}, got {placement!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    offsets = _host_offsets(cu_seqlens)
    bounds = (_split_bounds if placement == "split" else lambda t, w, s: _complete_bounds(offsets, w, s))(
        offsets[-1], world_size, weights)
    plans = []
    for rank in range(world_size):
        lo, hi = bounds[rank], bounds[rank + 1]
        pieces = []
        for n in range(len(offsets) - 1):
            s, e = max(offsets[n], lo), min(offsets[n + 1], hi)
            # an empty sequence belongs to the rank holding its offset (the last one at the end)
            empty_here = offsets[n] == offsets[n + 1] and (lo <= offsets[n] < hi or (
                offsets[n] == hi == offsets[-1] and rank == world_size - 1))
            if s < e or empty_here:
                pieces.append(SequencePiece(sequence=n, start=s - lo, end=e - lo,
                                            first=s == offsets[n], last=e == offsets[n + 1]))
        plans.append(RankPlan(rank=rank, token_start=lo, token_end=hi, pieces=tuple(pieces)))
    return plans
