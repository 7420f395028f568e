import pytest
import torch

from cula_serve import StatePool, cula_gdn, k_first_to_k_last, k_last_to_k_first

from conftest import random_inputs


def test_alloc_zeroes_every_layer_and_free_returns_slots():
    pool = StatePool(4, num_heads=2, head_v_dim=3, head_k_dim=5, num_layers=2)
    assert pool.layer(0).shape == (4, 2, 3, 5) and pool.dtype == torch.float32 and len(pool.tensors) == 2
    for t in pool.tensors:
        t.fill_(7.0)
    slots = pool.alloc(3)
    assert slots.dtype == torch.int32 and slots.tolist() == [0, 1, 2] and pool.num_free == 1
    for t in pool.tensors:
        assert (t[slots.long()] == 0).all() and (t[3] == 7.0).all()
    pool.free(slots[1:2])
    assert pool.num_free == 2
    assert pool.alloc(1).tolist() == [1]
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.alloc(3)


def test_free_rejects_unknown_and_double_free():
    pool = StatePool(3, 1, 2, 2, dtype=torch.bfloat16)
    slots = pool.alloc(2)
    pool.free(slots[:1])
    with pytest.raises(ValueError, match="slots"):
        pool.free(slots[:1])
    with pytest.raises(ValueError, match="slots"):
        pool.free([2])
    assert pool.num_free == 2


def test_constructor_checks():
    with pytest.raises(TypeError, match="dtype"):
        StatePool(2, 1, 2, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="num_slots"):
        StatePool(0, 1, 2, 2)
    with pytest.raises(TypeError, match="num_heads"):
        StatePool(2, 1.5, 2, 2)


def test_wrap_engine_memory_with_padded_pages():
    """vLLM-style pages: the state is a strided view into a larger buffer; nothing is copied."""
    pages = torch.zeros(6, 2, 4, 8, 8)
    state = pages[:, 1]
    pool = StatePool.wrap([state])
    assert pool.layer(0).data_ptr() == state.data_ptr() and pool.num_slots == 6
    slots = pool.alloc(2)
    kw = random_inputs("gdn", (1, 10), H=2, HV=4, K=8, V=8)
    cula_gdn(**kw, cu_seqlens=torch.tensor([0, 4, 10]), state_pool=pool.layer(0), state_indices=slots)
    assert pages[:2, 1].abs().sum() > 0 and (pages[:, 0] == 0).all() and (pages[2:] == 0).all()
    with pytest.raises(ValueError, match="tensors"):
        StatePool.wrap([torch.zeros(2, 1, 2, 2), torch.zeros(3, 1, 2, 2)])


def test_layout_helpers_round_trip():
    states = torch.randn(3, 2, 5, 7)  # [.., K, V]
    k_last = k_first_to_k_last(states)
    assert k_last.shape == (3, 2, 7, 5) and k_last.is_contiguous()
    assert k_last[1, 0, 4, 2] == states[1, 0, 2, 4]
    assert torch.equal(k_last_to_k_first(k_last), states)
