"""Context-parallel prefill: one packed varlen batch split over the ranks of a process group.

The math (DESIGN section 5). For one value head, a segment of a sequence maps the state it
receives affinely: ``S_out = A S_in + D`` (state S [K, V]; A [K, K] for the delta rule, a
multiple of the identity for Lightning; D the segment's final state from a zero start). Its
outputs are affine in S_in too: ``o_t = o0_t + S_in^T q~_t``, with o0 the outputs from a zero
start and ``q~_t = scale A_t^T q_t`` (A_t the map of the segment's first t tokens).

All of it comes out of ONE prefill of the segment with the state widened from V to V + K
columns: values ``[v | 0]`` and initial state ``[0 | I]`` (K-last: rows V.. of the state hold the
identity). The first V columns then give o0 and D; the last K give q~ (as outputs) and A (as the
final state). Any backend's prefill does it (``map_columns=K``: the Triton delta rule runs the
zero-value columns in its state kernel only; other backends get v padded with zeros).

Per call, on every rank (pieces from ``split_cu_seqlens_for_sp``; a rank's first piece may
continue a sequence begun on earlier ranks, its last may go on to later ones):
1. Pieces that start on this rank run one ordinary prefill from their pool states (a dense copy,
   so that a piece that goes on to later ranks does not write the pool).
2. A continuing first piece runs the widened prefill above: o0, q~, A, D.
3. One all-gather exchanges each rank's carry (A, D) for its last piece: the widened pass's map
   for a piece spanning the whole rank, (0, final state) for a piece that started here.
4. Each rank composes the carries of the ranks before it, ``S = S A_j + D_j`` (K-last), and
   finishes its continuing piece: ``o = o0 + S^T q~`` (one pass, ``correct_outputs``); the final
   state ``S A + D`` is written to the pool by the rank holding the sequence's last token.
No serial ring: every rank works in parallel, then exchanges one [HV, K, K + V] tensor.

Host work. Planning reads ``cu_seqlens`` (and ``state_indices`` / ``has_initial_state``) on the
host once per call: pass CPU tensors to avoid a device synchronisation. Prefill is not captured
in CUDA graphs, so this costs one small copy, not correctness.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.common.affine_output import correct_outputs
from .plan import RankPlan, split_cu_seqlens_for_sp


def _host_list(name, x, n, dtype):
    if x is None:
        return None
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] != n or x.dtype not in dtype:
        raise ValueError(f"{name}: expected a [{n}] tensor of {' / '.join(map(str, dtype))}, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
    return x.tolist()


def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialised (call torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(tensor: torch.Tensor, world_size: int, group) -> torch.Tensor:
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return torch.stack(gathered)


def context_parallel_prefill(prefill, q, k, v, token_args: tuple, *, cu_seqlens, state_pool, state_indices,
                             has_initial_state=None, group=None, placement="split", weights=None, out=None,
                             options: dict):
    """Run ``prefill`` (``cula_gdn`` / ``cula_kda`` / ``cula_lightning``) on this rank's tokens.

    Args:
        prefill: the Level-1 prefill function.
        q, k: [1, T_r, H, K]; v [1, T_r, HV, V]: this rank's tokens, ``plan.token_start`` to
            ``plan.token_end`` of the global packed batch (see ``split_cu_seqlens_for_sp``).
        token_args: per-token tensors passed positionally after v, each [1, T_r, ...] (g and beta;
            empty for Lightning).
        cu_seqlens: the GLOBAL int32/int64 [N + 1] offsets (identical on every rank).
        state_pool: [P, HV, V, K] float32 / bfloat16; every rank holds the same slot numbering.
            The rank holding a sequence's first token reads its slot; the rank holding its last
            token writes the final state there. Other ranks' pools are not touched.
        state_indices: int [N] (negative = padding: zero outputs, nothing read or written).
        has_initial_state: bool [N] or None.
        group: the context-parallel process group (None: the default group).
        placement, weights: as for ``split_cu_seqlens_for_sp``.
        out: optional [1, T_r, HV, V] output in v's dtype.
        options: keyword options for ``prefill`` (scale, gates, l2norm, backend, ...).

    Returns:
        (o [1, T_r, HV, V], state_pool).
    """
    rank, world_size = _group_info(group)
    for name in ("checkpoint_every", "checkpoint_indices", "initial_state", "output_final_state"):
        if options.get(name) not in (None, False):
            raise ValueError(f"{name}: not supported with context parallelism (use a state pool, no checkpoints)")
    if state_pool is None or state_indices is None:
        raise ValueError("state_pool, state_indices: context-parallel prefill reads and writes a state pool")
    plans = split_cu_seqlens_for_sp(cu_seqlens, world_size, placement=placement, weights=weights)
    plan: RankPlan = plans[rank]
    num_sequences = (cu_seqlens.shape[0] if isinstance(cu_seqlens, torch.Tensor) else len(cu_seqlens)) - 1
    slots = _host_list("state_indices", state_indices, num_sequences, (torch.int32, torch.int64))
    has_init = _host_list("has_initial_state", has_initial_state, num_sequences, (torch.bool,))
    for x, name in ((q, "q"), (k, "k"), (v, "v")) + tuple((t, f"token_args[{i}]") for i, t in enumerate(token_args)):
        if x.dim() < 3 or x.shape[0] != 1 or x.shape[1] != plan.num_tokens:
            raise ValueError(f"{name}: rank {rank} holds {plan.num_tokens} tokens of the packed batch, expected "
                             f"[1, {plan.num_tokens}, ...], got {list(x.shape)}")
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    device = v.device
    if out is None:
        out = torch.empty_like(v)

    def tokens(x, start, end):
        return x[:, start:end]

    def run(start, end, initial, local_cu, **extra):
        args = tuple(tokens(x, start, end) for x in (q, k, v, *token_args))
        return prefill(*args, cu_seqlens=local_cu, initial_state=initial, output_final_state=True, **options, **extra)

    pieces = plan.pieces
    continuing = pieces[0] if pieces and not pieces[0].first else None
    starting = pieces[1:] if continuing is not None else pieces
    carry_map = torch.zeros(HV, K, K, dtype=torch.float32, device=device)
    carry_state = torch.zeros(HV, V, K, dtype=torch.float32, device=device)

    # 1. pieces that start here, from their pool states (dense, so a piece going on to later
    #    ranks does not write the pool)
    if starting:
        lo = starting[0].start
        local_cu = torch.tensor([p.start - lo for p in starting] + [starting[-1].end - lo],
                                dtype=torch.int32, device=device)
        initial = torch.zeros(len(starting), HV, V, K, dtype=torch.float32, device=device)
        read = [i for i, p in enumerate(starting) if slots[p.sequence] >= 0 and (has_init is None or has_init[p.sequence])]
        if read:
            rows = torch.tensor(read, device=device)
            initial[rows] = state_pool[torch.tensor([slots[starting[i].sequence] for i in read], device=device)].float()
        _, final = run(lo, starting[-1].end, initial, local_cu, out=out[:, lo:starting[-1].end])
        written = [i for i, p in enumerate(starting) if p.last and slots[p.sequence] >= 0]
        if written:
            state_pool[torch.tensor([slots[starting[i].sequence] for i in written], device=device)] = \
                final[torch.tensor(written, device=device)].to(state_pool.dtype)
        if not starting[-1].last:
            carry_state = final[-1].float()

    # 2. a continuing first piece: the widened pass (values [v | 0], state [0 | I])
    if continuing is not None:
        s, e = continuing.start, continuing.end
        widened_state = torch.zeros(1, HV, V + K, K, dtype=torch.float32, device=device)
        widened_state[0, :, V:, :] = torch.eye(K, device=device)
        local_cu = torch.tensor([0, e - s], dtype=torch.int32, device=device)
        o_widened, final = run(s, e, widened_state, local_cu, map_columns=K)
        piece_map, piece_state = final[0, :, V:, :], final[0, :, :V, :]
        if not continuing.last:
            carry_map, carry_state = piece_map, piece_state

    # 3. one exchange of every rank's carry (skipped when no sequence spans two ranks: every rank
    #    sees the same plans, so they agree)
    if any(p.pieces and not p.pieces[0].first for p in plans):
        carries = _all_gather(torch.cat([carry_map, carry_state], dim=1), world_size, group)  # [R, HV, K + V, K]

    # 4. compose the carries of earlier ranks and finish the continuing piece
    if continuing is not None:
        n = continuing.sequence
        first_rank = next(r for r in range(rank) if any(p.sequence == n and p.first for p in plans[r].pieces))
        state = torch.zeros(HV, V, K, dtype=torch.float32, device=device)
        for j in range(first_rank, rank):
            state = state @ carries[j, :, :K, :] + carries[j, :, K:, :]
        if slots[n] < 0:
            out[:, s:e] = 0
        else:
            # o = o0 + S^T q~, in one pass over the widened outputs (kernels/common/affine_output.py)
            correct_outputs(o_widened[0], state, out[0, s:e])
            if continuing.last:
                state_pool[slots[n]] = (state @ piece_map + piece_state).to(state_pool.dtype)
    for p in starting:
        if slots[p.sequence] < 0:
            out[:, p.start:p.end] = 0
    return out, state_pool
