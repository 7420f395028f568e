"""Level 2: tensor and context parallelism on torch.distributed (NCCL on GPUs, gloo on CPUs).

Tensor parallelism (``tp.py``): heads sharded contiguously over ranks, pools holding local heads
only. ``cula_gdn_tp`` / ``cula_kda_tp`` / ``cula_lightning_tp`` check that the tensors are this
rank's shard and run locally: a head's recurrence never reads another head, so no communication.

Context parallelism (``cp.py``, planning in ``plan.py``): one packed varlen batch split over the
ranks of a group; every rank computes its segment's affine state map in parallel, one all-gather
exchanges them, each rank composes its prefix. ``cula_gdn_cp`` / ``cula_kda_cp`` /
``cula_lightning_cp``; the ``*_tp_cp`` variants take TP-sharded heads and a CP group.

Example (two ranks, one 131072-token sequence split in half)::

    plans = split_cu_seqlens_for_sp(cu_seqlens, world_size=2)        # same on every rank
    mine = plans[rank]
    sl = slice(mine.token_start, mine.token_end)
    o, _ = cula_gdn_cp(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], cu_seqlens=cu_seqlens,
                       state_pool=pool, state_indices=slots, **gate_options)
"""
from __future__ import annotations

from ..api import cula_gdn, cula_kda, cula_lightning
from .cp import context_parallel_prefill
from .plan import RankPlan, SequencePiece, split_cu_seqlens_for_sp
from .tp import (HeadShard, alloc_decode_state_pool, alloc_state_buffer, check_local_heads, head_shard,
                 shard_heads)


def _tp_checked(shard, q, v, kwargs, decay=None):
    check_local_heads(shard, q, v, state_pool=kwargs.get("state_pool"), initial_state=kwargs.get("initial_state"),
                      A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"), decay=decay)


def cula_gdn_tp(q, k, v, g, beta, *, shard: HeadShard, **kwargs):
    """``cula_gdn`` on this rank's heads (``shard`` from ``head_shard``); arguments as for cula_gdn."""
    _tp_checked(shard, q, v, kwargs)
    return cula_gdn(q, k, v, g, beta, **kwargs)


def cula_kda_tp(q, k, v, g, beta, *, shard: HeadShard, **kwargs):
    """``cula_kda`` on this rank's heads; arguments as for cula_kda."""
    _tp_checked(shard, q, v, kwargs)
    return cula_kda(q, k, v, g, beta, **kwargs)


def cula_lightning_tp(q, k, v, decay, *, shard: HeadShard, **kwargs):
    """``cula_lightning`` on this rank's heads; arguments as for cula_lightning."""
    _tp_checked(shard, q, v, kwargs, decay=decay)
    return cula_lightning(q, k, v, decay, **kwargs)


_CP_DOC = """

    Context parallel: q, k, v{extra} hold this rank's tokens of the global packed batch
    (``split_cu_seqlens_for_sp(cu_seqlens, world_size, placement=..., weights=...)[rank]``);
    ``cu_seqlens`` is the global [N + 1] offsets, ``state_pool`` / ``state_indices`` /
    ``has_initial_state`` as for the single-GPU call (slot numbering shared by all ranks).
    ``group``: the context-parallel process group. Other keywords as for the single-GPU call
    (no checkpoints, no dense initial_state). Returns (o [1, T_rank, HV, V], state_pool).
"""


def cula_gdn_cp(q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices, has_initial_state=None, group=None,
                placement="split", weights=None, out=None, **options):
    return context_parallel_prefill(cula_gdn, q, k, v, (g, beta), cu_seqlens=cu_seqlens, state_pool=state_pool,
                                    state_indices=state_indices, has_initial_state=has_initial_state, group=group,
                                    placement=placement, weights=weights, out=out, options=options)


def cula_kda_cp(q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices, has_initial_state=None, group=None,
                placement="split", weights=None, out=None, **options):
    return context_parallel_prefill(cula_kda, q, k, v, (g, beta), cu_seqlens=cu_seqlens, state_pool=state_pool,
                                    state_indices=state_indices, has_initial_state=has_initial_state, group=group,
                                    placement=placement, weights=weights, out=out, options=options)


def cula_lightning_cp(q, k, v, decay, *, cu_seqlens, state_pool, state_indices, has_initial_state=None,
                      group=None, placement="split", weights=None, out=None, **options):
    def lightning(q, k, v, **kw):
        return cula_lightning(q, k, v, decay, **kw)

    return context_parallel_prefill(lightning, q, k, v, (), cu_seqlens=cu_seqlens, state_pool=state_pool,
                                    state_indices=state_indices, has_initial_state=has_initial_state, group=group,
                                    placement=placement, weights=weights, out=out, options=options)


cula_gdn_cp.__doc__ = "GDN prefill with context parallelism." + _CP_DOC.format(extra=", g, beta")
cula_kda_cp.__doc__ = "KDA prefill with context parallelism." + _CP_DOC.format(extra=", g, beta")
cula_lightning_cp.__doc__ = "Lightning prefill with context parallelism." + _CP_DOC.format(extra="")


def cula_gdn_tp_cp(q, k, v, g, beta, *, shard: HeadShard, cp_group=None, **kwargs):
    """TP + CP: this rank's heads (``shard`` of the TP group) and tokens (of ``cp_group``)."""
    _tp_checked(shard, q, v, kwargs)
    return cula_gdn_cp(q, k, v, g, beta, group=cp_group, **kwargs)


def cula_kda_tp_cp(q, k, v, g, beta, *, shard: HeadShard, cp_group=None, **kwargs):
    """TP + CP for KDA; see ``cula_gdn_tp_cp``."""
    _tp_checked(shard, q, v, kwargs)
    return cula_kda_cp(q, k, v, g, beta, group=cp_group, **kwargs)


def cula_lightning_tp_cp(q, k, v, decay, *, shard: HeadShard, cp_group=None, **kwargs):
    """TP + CP for Lightning; see ``cula_gdn_tp_cp``."""
    _tp_checked(shard, q, v, kwargs, decay=decay)
    return cula_lightning_cp(q, k, v, decay, group=cp_group, **kwargs)


__all__ = [
    "HeadShard", "RankPlan", "SequencePiece", "alloc_decode_state_pool", "alloc_state_buffer", "cula_gdn_cp",
    "cula_gdn_tp", "cula_gdn_tp_cp", "cula_kda_cp", "cula_kda_tp", "cula_kda_tp_cp", "cula_lightning_cp",
    "cula_lightning_tp", "cula_lightning_tp_cp", "head_shard", "shard_heads", "split_cu_seqlens_for_sp",
]
