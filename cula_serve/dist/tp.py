"""Tensor parallelism: value heads (and their qk heads) sharded contiguously over the ranks.

Rank r of TP holds qk heads ``[r H / TP, (r + 1) H / TP)`` and value heads
``[r HV / TP, (r + 1) HV / TP)``. Contiguous shards keep grouped value heads intact: local value
head j still belongs to local qk head ``j // (HV / H)``. The recurrence of a head never looks at
another head, so a TP layer runs locally with no communication; the work here is allocating
local-head pools and checking that the caller's tensors really are this rank's shards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..pool import StatePool


@dataclass(frozen=True)
class HeadShard:
    """This rank's heads: qk heads ``[h_start, h_start + num_heads)``, value heads likewise."""

    rank: int
    world_size: int
    h_start: int
    num_heads: int
    hv_start: int
    num_v_heads: int


def head_shard(num_heads: int, num_v_heads: int, *, rank: int | None = None, world_size: int | None = None,
               group=None) -> HeadShard:
    """The shard of ``num_heads`` qk / ``num_v_heads`` value heads (model totals) on a TP rank.

    rank / world_size default to the group's (the default group when ``group`` is None).
    Raises ValueError when the heads do not divide evenly over the ranks.
    """
    if rank is None or world_size is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("rank, world_size: give them, or initialise torch.distributed")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if num_v_heads % num_heads:
        raise ValueError(f"num_v_heads: expected a multiple of num_heads={num_heads}, got {num_v_heads}")
    if num_heads % world_size:
        raise ValueError(f"num_heads: {num_heads} qk heads do not split over {world_size} tensor-parallel ranks")
    h, hv = num_heads // world_size, num_v_heads // world_size
    return HeadShard(rank=rank, world_size=world_size, h_start=rank * h, num_heads=h, hv_start=rank * hv,
                     num_v_heads=hv)


def shard_heads(x: torch.Tensor, shard: HeadShard, *, dim: int, value_heads: bool) -> torch.Tensor:
    """This rank's slice of a tensor holding all heads along ``dim`` (a view, nothing copied):
    value heads (v, g, beta, A_log, dt_bias, pools) or qk heads (q, k)."""
    start, size = (shard.hv_start, shard.num_v_heads) if value_heads else (shard.h_start, shard.num_heads)
    return x.narrow(dim, start, size)


def alloc_decode_state_pool(num_slots: int, shard: HeadShard, head_v_dim: int, head_k_dim: int, *,
                            num_layers: int = 1, dtype=torch.float32, device=None) -> StatePool:
    """A ``StatePool`` of this rank's value heads: each layer ``[P, HV / TP, V, K]``."""
    return StatePool(num_slots, shard.num_v_heads, head_v_dim, head_k_dim, num_layers=num_layers, dtype=dtype,
                     device=device)


def alloc_state_buffer(batch_size: int, shard: HeadShard, head_v_dim: int, head_k_dim: int, *,
                       dtype=torch.float32, device=None) -> torch.Tensor:
    """Dense zeroed states of this rank's heads, ``[N, HV / TP, V, K]`` (for ``initial_state=``)."""
    return torch.zeros(batch_size, shard.num_v_heads, head_v_dim, head_k_dim, dtype=dtype, device=device)


def check_local_heads(shard: HeadShard, q, v, *, state_pool=None, initial_state=None, A_log=None, dt_bias=None,
                      decay=None):
    """Raise ValueError naming the argument that does not hold exactly this rank's heads."""
    expect = (("q", q, -2, shard.num_heads), ("v", v, -2, shard.num_v_heads),
              ("state_pool", state_pool, 1, shard.num_v_heads), ("initial_state", initial_state, 1, shard.num_v_heads),
              ("A_log", A_log, 0, shard.num_v_heads), ("dt_bias", dt_bias, 0, shard.num_v_heads),
              ("decay", decay, 0, shard.num_v_heads))
    for name, x, dim, size in expect:
        if name == "dt_bias" and x is not None and x.dim() == 1 and x.shape[0] == size * q.shape[-1]:
            continue  # KDA's flat [HV * K] bias
        if x is not None and x.shape[dim] != size:
            total = size * shard.world_size
            raise ValueError(f"{name}: tensor-parallel rank {shard.rank} of {shard.world_size} holds {size} of {total} "
                             f"heads, but dim {dim} has {x.shape[dim]} (pass this rank's shard, see shard_heads)")
