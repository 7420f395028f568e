"""Level 2 (cula_serve.dist): the context-parallel plan, tensor-parallel shards, and context
parallelism over gloo with 2 and 4 CPU processes against the float64 oracle."""
import pytest
import torch
import torch.multiprocessing as mp

from cula_serve import StatePool, cula_gdn, cula_kda
from cula_serve.dist import (alloc_decode_state_pool, alloc_state_buffer, cula_gdn_cp, cula_gdn_tp, cula_gdn_tp_cp,
                             cula_kda_tp, head_shard, shard_heads, split_cu_seqlens_for_sp)

from conftest import ORACLE, SMALL, assert_close, random_inputs, to_float64
import dist_cases


@pytest.mark.parametrize("placement", ["split", "complete"])
@pytest.mark.parametrize("seqlens, world_size", [([300, 17, 0, 900, 1], 4), ([1], 3), ([64] * 5, 2), ([5000], 8)])
def test_plan_covers_every_token_once(placement, seqlens, world_size):
    cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist())
    plans = split_cu_seqlens_for_sp(cu, world_size, placement=placement)
    assert [p.rank for p in plans] == list(range(world_size))
    assert plans[0].token_start == 0 and plans[-1].token_end == cu[-1]
    seen = {n: [] for n in range(len(seqlens))}
    for a, b in zip(plans, plans[1:]):
        assert a.token_end == b.token_start
    for plan in plans:
        local = plan.local_cu_seqlens().tolist()
        assert local[0] == 0 and local[-1] == plan.num_tokens
        for piece, lo, hi in zip(plan.pieces, local, local[1:]):
            assert (piece.start, piece.end) == (lo, hi)
            seen[piece.sequence].append((plan.token_start + piece.start, plan.token_start + piece.end,
                                         piece.first, piece.last))
    for n, parts in seen.items():
        assert len(parts) >= 1, f"sequence {n} is on no rank"
        assert parts[0][0] == cu[n] and parts[-1][1] == cu[n + 1]
        assert parts[0][2] and parts[-1][3] and not any(p[2] for p in parts[1:]) and not any(p[3] for p in parts[:-1])
        if placement == "complete":
            assert len(parts) == 1, f"sequence {n} was split with placement='complete'"


def test_plan_split_bounds_are_chunk_aligned_and_weighted():
    plans = split_cu_seqlens_for_sp([0, 10000], 4, weights=[2, 1, 1, 0])
    assert [p.token_start for p in plans] == [0, 4992, 7488, 10000]
    assert plans[3].pieces == ()


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="placement"):
        split_cu_seqlens_for_sp([0, 8], 2, placement="ring")
    with pytest.raises(ValueError, match="cu_seqlens"):
        split_cu_seqlens_for_sp([0, 8, 4], 2)
    with pytest.raises(ValueError, match="weights"):
        split_cu_seqlens_for_sp([0, 8], 2, weights=[1])


@pytest.mark.parametrize("mode, fn", [("gdn", cula_gdn_tp), ("kda", cula_kda_tp)])
def test_tensor_parallel_shards_equal_the_full_layer(mode, fn, generator):
    """Running each TP rank's shard reproduces the full layer's heads, pool included."""
    H, HV, K, V = 4, 8, 16, 8
    kw = random_inputs(mode, (1, 40), H=H, HV=HV, K=K, V=V, dtype=torch.float32, generator=generator)
    full = torch.randn(3, HV, V, K, generator=generator)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    cu = torch.tensor([0, 25, 40], dtype=torch.int32)
    single = {"gdn": cula_gdn, "kda": cula_kda}[mode]
    ref_pool = full.double().clone()
    ref_o, _ = single(**to_float64(kw), cu_seqlens=cu, state_pool=ref_pool, state_indices=slots, **ORACLE)
    for rank in range(2):
        shard = head_shard(H, HV, rank=rank, world_size=2)
        local = {}
        for key, x in kw.items():
            if key in ("q", "k"):
                local[key] = shard_heads(x, shard, dim=2, value_heads=False)
            elif key in ("v", "g", "beta"):
                local[key] = shard_heads(x, shard, dim=2, value_heads=True)
            elif key in ("A_log", "dt_bias"):
                local[key] = shard_heads(x, shard, dim=0, value_heads=True)
            else:
                local[key] = x
        pool = alloc_decode_state_pool(3, shard, V, K)
        layer = pool.layer(0)
        layer.copy_(shard_heads(full, shard, dim=1, value_heads=True))
        o, _ = fn(**local, shard=shard, cu_seqlens=cu, state_pool=layer, state_indices=slots, backend="torch")
        heads = slice(shard.hv_start, shard.hv_start + shard.num_v_heads)
        assert_close(o, ref_o[:, :, heads], 1e-5)
        assert_close(layer, ref_pool[:, heads], 1e-5, "final states")


def test_tensor_parallel_rejects_unsharded_tensors(generator):
    shard = head_shard(16, 32, rank=1, world_size=4)
    assert (shard.h_start, shard.num_heads, shard.hv_start, shard.num_v_heads) == (4, 4, 8, 8)
    assert alloc_state_buffer(2, shard, 8, 16).shape == (2, 8, 8, 16)
    kw = random_inputs("gdn", (1, 8), H=16, HV=32, K=16, V=8, dtype=torch.float32, generator=generator)
    with pytest.raises(ValueError, match="q: tensor-parallel rank 1 of 4 holds 4 of 16 heads"):
        cula_gdn_tp(**kw, shard=shard)
    with pytest.raises(ValueError, match="v: tensor-parallel rank 1 of 4 holds 8 of 32 heads"):
        cula_gdn_tp_cp(**dict(kw, q=kw["q"][:, :, :4], k=kw["k"][:, :, :4]), shard=shard, cu_seqlens=[0, 8],
                       state_pool=None, state_indices=None)
    with pytest.raises(ValueError, match="num_heads: 16 qk heads do not split over 3"):
        head_shard(16, 32, rank=0, world_size=3)
    assert isinstance(alloc_decode_state_pool(4, shard, 8, 16), StatePool)


def test_context_parallel_needs_an_initialised_group(generator):
    kw = random_inputs("gdn", (1, 8), **SMALL, dtype=torch.float32, generator=generator)
    pool = torch.zeros(2, SMALL["HV"], SMALL["V"], SMALL["K"])
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        cula_gdn_cp(**kw, cu_seqlens=torch.tensor([0, 8]), state_pool=pool,
                    state_indices=torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_over_gloo_matches_the_oracle(world_size, tmp_path):
    """Sequences spanning 2 to 4 ranks (middle ranks compose maps), padding, has_initial_state
    mixes, bf16 inputs and pools, weighted split and sequence-complete placement."""
    mp.spawn(dist_cases.worker, args=(world_size, str(tmp_path / "init"), "cpu", SMALL, "torch"),
             nprocs=world_size, join=True)
