"""Prefill through the Level-1 API (torch backend, chunked float32) against the float64 oracle."""
import pytest
import torch

from cula_serve import cula_gdn, cula_kda, cula_lightning

from conftest import (ORACLE, SMALL, SMALL_MHA, assert_close, assert_untouched, oracle_pool, poisoned_pool,
                      random_inputs, to_float64, tolerance)

PREFILL = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}


def _cu(seqlens):
    return torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)


def _run_both(mode, kw, pool, **call):
    """The call under test on ``pool`` and the oracle on a float64 copy; returns both results."""
    ref_pool = oracle_pool(pool) if pool is not None else None
    o, final = PREFILL[mode](**kw, state_pool=pool, **call)
    ref_o, ref_final = PREFILL[mode](**to_float64(kw), state_pool=ref_pool, **call, **ORACLE)
    return o, final, ref_o, ref_final


@pytest.mark.parametrize("mode", ["gdn", "kda", "lightning"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [SMALL, SMALL_MHA], ids=["gva", "mha"])
def test_varlen_pool_padding_and_initial_state_mix(mode, state_dtype, shape, generator):
    """T not a multiple of 64, length-1 and exactly-64 sequences, permuted and padded indices,
    has_initial_state mixes; padded rows are zero and NaN-poisoned slots stay untouched."""
    seqlens = [65, 1, 130, 64, 63, 5]
    slots = torch.tensor([7, 2, -1, 0, 5, 3], dtype=torch.int32)
    has_initial_state = torch.tensor([True, True, True, False, True, False])
    kw = random_inputs(mode, (1, sum(seqlens)), **shape, generator=generator)
    pool = poisoned_pool(9, shape["HV"], shape["V"], shape["K"], state_dtype, [7, 2, 5], generator)
    o, final, ref_o, ref_final = _run_both(mode, kw, pool, cu_seqlens=_cu(seqlens), state_indices=slots,
                                           has_initial_state=has_initial_state)
    tol = tolerance(torch.bfloat16, state_dtype)
    assert final is pool
    assert_close(o, ref_o, tol)
    live = slots[slots >= 0].long()
    assert_close(pool[live], ref_final[live], tol, "final states")
    padded = slice(65 + 1, 65 + 1 + 130)
    assert (o[0, padded] == 0).all()
    assert_untouched(pool, [1, 4, 6, 8])


@pytest.mark.parametrize("mode", ["gdn", "kda", "lightning"])
def test_float32_path_is_exact(mode, generator):
    """fp32 inputs and pool: the chunked backend is within 1e-5 of the oracle."""
    seqlens = [100, 37]
    kw = random_inputs(mode, (1, 137), **SMALL, dtype=torch.float32, generator=generator)
    pool = poisoned_pool(2, 4, 8, 16, torch.float32, [0, 1], generator)
    o, _, ref_o, ref_final = _run_both(mode, kw, pool, cu_seqlens=_cu(seqlens),
                                       state_indices=torch.tensor([1, 0], dtype=torch.int32))
    assert_close(o, ref_o, 1e-5)
    assert_close(pool, ref_final, 1e-5, "final states")


@pytest.mark.parametrize("mode,gate", [(m, g) for m in ("gdn", "kda") for g in ("prepared", "fused", "fused_no_bias")]
                         + [("kda", "safe")])
def test_gate_options(mode, gate, generator):
    kw = random_inputs(mode, (1, 70), **SMALL, fused_gate=gate != "prepared", generator=generator)
    if gate == "fused_no_bias":
        kw["dt_bias"] = None
    if gate == "safe":
        kw["lower_bound"] = -5.0
    pool = poisoned_pool(1, 4, 8, 16, torch.float32, [0], generator)
    o, _, ref_o, ref_final = _run_both(mode, kw, pool, cu_seqlens=_cu([70]),
                                       state_indices=torch.tensor([0], dtype=torch.int32))
    assert_close(o, ref_o, 5e-3)
    assert_close(pool, ref_final, 5e-3, "final state")


def test_kda_flat_dt_bias_equals_2d(generator):
    kw = random_inputs("kda", (1, 9), **SMALL, generator=generator)
    o1, _ = cula_kda(**kw)
    kw["dt_bias"] = kw["dt_bias"].reshape(-1)
    o2, _ = cula_kda(**kw)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["gdn", "kda", "lightning"])
def test_many_short_sequences(mode, generator):
    seqlens = torch.randint(1, 9, (40,), generator=generator).tolist()
    kw = random_inputs(mode, (1, sum(seqlens)), **SMALL, generator=generator)
    pool = poisoned_pool(50, 4, 8, 16, torch.float32, range(0, 50, 2), generator)
    slots = torch.randperm(50, generator=generator)[:40].to(torch.int32)
    live_before = set(range(0, 50, 2))
    has_init = torch.tensor([int(s) in live_before for s in slots])
    o, _, ref_o, ref_final = _run_both(mode, kw, pool, cu_seqlens=_cu(seqlens), state_indices=slots,
                                       has_initial_state=has_init)
    assert_close(o, ref_o, 5e-3)
    assert_close(pool[slots.long()], ref_final[slots.long()], 5e-3, "final states")


@pytest.mark.parametrize("mode", ["gdn", "kda", "lightning"])
def test_dense_initial_state_and_layouts(mode, generator):
    """FLA-style dense states; [B, T, H, K] without cu_seqlens == packed [T, H, K] with it."""
    B, T = 3, 20
    kw = random_inputs(mode, (B, T), **SMALL, generator=generator)
    h0 = torch.randn(B, 4, 8, 16, generator=generator)
    o, final = PREFILL[mode](**kw, initial_state=h0, output_final_state=True)
    ref_o, ref_final = PREFILL[mode](**to_float64(kw), initial_state=h0.double(), output_final_state=True, **ORACLE)
    assert o.shape == (B, T, 4, 8) and final.shape == (B, 4, 8, 16) and final is not h0
    assert_close(o, ref_o, 5e-3)
    assert_close(final, ref_final, 5e-3, "final state")
    packed = {k: (v.reshape(B * T, *v.shape[2:]) if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[:2] == (B, T)
                  else v) for k, v in kw.items()}
    o_packed, final_packed = PREFILL[mode](**packed, cu_seqlens=_cu([T] * B), initial_state=h0,
                                           output_final_state=True)
    assert o_packed.shape == (B * T, 4, 8)
    torch.testing.assert_close(o_packed.reshape(B, T, 4, 8), o)
    torch.testing.assert_close(final_packed, final)
    o_none, final_none = PREFILL[mode](**kw)
    ref_none, _ = PREFILL[mode](**to_float64(kw), **ORACLE)
    assert final_none is None
    assert_close(o_none, ref_none, 5e-3)


def test_out_is_written_in_place(generator):
    kw = random_inputs("gdn", (1, 33), **SMALL, generator=generator)
    out = torch.full((1, 33, 4, 8), float("nan"), dtype=torch.bfloat16)
    o, _ = cula_gdn(**kw, out=out)
    assert o is out and torch.isfinite(out).all()


@pytest.mark.parametrize("mode", ["gdn", "kda", "lightning"])
@pytest.mark.parametrize("algorithm", ["chunk", "recurrent"])
def test_checkpoints(mode, algorithm, generator):
    """State after every 64 / 128 tokens lands in the given slots; -1 skips one."""
    seqlens = [200, 64, 30]
    kw = random_inputs(mode, (1, sum(seqlens)), **SMALL, generator=generator)
    for every in (64, 128):
        ckpt = torch.tensor([[3, -1, 4], [5, 6, 7], [8, 9, 10]], dtype=torch.int32)
        pool = poisoned_pool(11, 4, 8, 16, torch.float32, [0, 1, 2], generator)
        ref_pool = oracle_pool(pool)
        call = dict(cu_seqlens=_cu(seqlens), state_indices=torch.tensor([0, 1, 2], dtype=torch.int32),
                    checkpoint_every=every, checkpoint_indices=ckpt)
        PREFILL[mode](**kw, state_pool=pool, algorithm=algorithm, **call)
        # the oracle: prefix prefills from the same initial state, one per checkpoint
        for n, (length, start) in enumerate(zip(seqlens, [0, 200, 264])):
            for j in range(length // every):
                if ckpt[n, j] < 0:
                    continue
                end = start + (j + 1) * every
                prefix = {k: (v[:, start:end] if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == sum(seqlens)
                              else v) for k, v in to_float64(kw).items()}
                h0 = ref_pool[n][None]
                _, state = PREFILL[mode](**prefix, initial_state=h0, output_final_state=True, **ORACLE)
                assert_close(pool[ckpt[n, j]], state[0], 5e-3, f"checkpoint {n},{j}")
        written = {int(s) for s in ckpt[0, :200 // every]} | ({5} if every == 64 else set())
        assert_untouched(pool, sorted({3, 4, 5, 6, 7, 8, 9, 10} - written - {-1}))
