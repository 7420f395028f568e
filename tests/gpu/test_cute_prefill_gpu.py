"""The cute backend's Lightning prefill (``kernels/lightning/chunk_cute.py``: bf16, K = V = 128)
on a Hopper GPU against the float64 oracle: lengths 1, 63, 64, 65, a few hundred and a thousand
in one varlen batch with a padding row, permuted NaN-poisoned slots and has_initial_state mixes,
with and without qk l2norm; both pool dtypes; a sequence of several thousand tokens (final states
near float32); many short and empty sequences; checkpoints; grouped value heads; no pool and
dense initial states; strided views of a fused projection; a capture in a CUDA graph replayed
with new inputs; a packed batch past 2^31 elements; and which calls automatic dispatch gives it.

Run with ``pytest -m gpu tests/gpu``; skipped where the cute backend is unavailable.
"""
import pytest
import torch

from cula_serve import cula_lightning, dispatch
from cula_serve.inputs import random_inputs

from conftest import (ORACLE, assert_close, assert_same_writes, lightning_strided_views, prefill_and_oracle,
                      prefill_call, skip_module_unless_gpu, to_float64, tolerance)

pytestmark = pytest.mark.gpu

skip_module_unless_gpu()

from prefill_checks import (DEVICE, SHAPES, assert_checkpoints_match_oracle,  # noqa: E402
                            assert_graph_replay_matches_eager, assert_rows_past_2_31_elements, cu, inputs,
                            poisoned_pool, varlen_call)

_module, _reason = dispatch.backend_status("cute", DEVICE)
if _module is None:
    pytest.skip(f"cute backend: {_reason}", allow_module_level=True)

CUTE = dict(backend="cute")
MODE = "lightning"
# one varlen batch: permuted slots, row 3 is padding, rows 1 and 5 start from zeros (NaN slots)
LENS = [1, 63, 64, 17, 65, 300, 1000]
SLOTS = [9, 2, 11, -1, 0, 5, 7]
HAS_INIT = [True, False, True, True, True, False, True]


def _run(kw, pool, **options):
    """``prefill_and_oracle`` on the cute backend."""
    return prefill_and_oracle(MODE, kw, pool, CUTE, **options)


def _live(slots, has_init):
    return [s for s, h in zip(slots, has_init) if s >= 0 and h]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32pool", "bf16pool"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["raw", "l2norm"])
def test_varlen_model_shapes(state_dtype, l2norm):
    kw = inputs(MODE, sum(LENS), torch.bfloat16, seed=1)
    kw["use_qk_l2norm_in_kernel"] = l2norm
    pool = poisoned_pool(MODE, state_dtype, _live(SLOTS, HAS_INIT), seed=2)
    o, ref_o, ref_pool = _run(kw, pool, **varlen_call(LENS, SLOTS, HAS_INIT))
    tol = tolerance(torch.bfloat16, state_dtype)
    assert_close(o, ref_o, tol)
    assert (o[sum(LENS[:3]):sum(LENS[:4])] == 0).all()
    assert_same_writes(pool, ref_pool, tol)


def test_long_sequence_keeps_float32_states():
    """One sequence of several thousand tokens next to a short one: outputs at the bf16
    tolerance, final states near float32 (the state update keeps 16 bits of the decayed v)."""
    lens, slots, has_init = [4133, 5, 700], [3, 1, 6], [True, False, True]
    kw = inputs(MODE, sum(lens), torch.bfloat16, seed=3)
    pool = poisoned_pool(MODE, torch.float32, [3, 6], seed=4)
    o, ref_o, ref_pool = _run(kw, pool, **varlen_call(lens, slots, has_init))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-5, "final states")


def test_many_short_and_empty_sequences():
    """256 sequences of 0 to 40 tokens: every CTA ends inside its first chunk, or has none."""
    gen = torch.Generator().manual_seed(5)
    N = 256
    lens = torch.randint(0, 41, (N,), generator=gen).tolist()
    lens[:3] = [0, 40, 0]
    slots = torch.randperm(N + 64, generator=gen)[:N]
    slots[::7] = -1
    has_init = torch.rand(N, generator=gen) < 0.8
    kw = inputs(MODE, sum(lens), torch.bfloat16, seed=6)
    pool = poisoned_pool(MODE, torch.float32, slots[(slots >= 0) & has_init].tolist(), seed=7, size=N + 64)
    o, ref_o, ref_pool = _run(kw, pool, **varlen_call(lens, slots.tolist(), has_init.tolist()))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


@pytest.mark.parametrize("every", [64, 128])
def test_checkpoints(every):
    assert_checkpoints_match_oracle(MODE, CUTE, every)


@pytest.mark.parametrize("H", [16, 1])
def test_grouped_value_heads(H):
    """64 value heads reading H qk heads (value head hv reads qk head hv // (64 // H))."""
    lens, slots, has_init = [300, 77, 1], [2, 0, 1], [True, False, True]
    s = SHAPES[MODE]
    kw = random_inputs(MODE, (sum(lens),), H=H, HV=s["HV"], K=s["K"], V=s["V"], dtype=torch.bfloat16,
                       device=DEVICE, generator=torch.Generator().manual_seed(10 + H))
    kw["use_qk_l2norm_in_kernel"] = True
    pool = poisoned_pool(MODE, torch.float32, [2, 1], seed=11)
    o, ref_o, ref_pool = _run(kw, pool, **varlen_call(lens, slots, has_init))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


def test_no_pool_and_dense_states():
    """Without a pool (outputs only), and FLA-style dense initial / final states."""
    lens = [200, 1, 64]
    kw = inputs(MODE, sum(lens), torch.bfloat16, seed=12)
    o, ref_o, _ = _run(kw, None, cu_seqlens=cu(lens))
    assert_close(o, ref_o, 5e-3)
    s = SHAPES[MODE]
    initial = torch.randn(len(lens), s["HV"], s["V"], s["K"], generator=torch.Generator(DEVICE).manual_seed(13),
                          device=DEVICE)
    o, final = prefill_call(MODE, kw, cu_seqlens=cu(lens), initial_state=initial, output_final_state=True, **CUTE)
    ref_o, ref_final = prefill_call(MODE, to_float64(kw), cu_seqlens=cu(lens), initial_state=initial.double(),
                                    output_final_state=True, **ORACLE)
    assert_close(o, ref_o, 5e-3)
    assert_close(final, ref_final, 5e-3, "final states")


def test_strided_inputs_and_out():
    """q, k, v sliced from one fused projection (16-byte aligned rows) into a strided ``out``;
    an empty sequence among them."""
    lens, slots = [333, 0, 20, 700], [4, 3, 1, 6]
    s = SHAPES[MODE]
    gen = torch.Generator(device=DEVICE).manual_seed(14)
    q, k, v, out = lightning_strided_views(sum(lens), s["H"], s["HV"], s["K"], s["V"], True, gen, DEVICE)
    kw = dict(q=q, k=k, v=v, decay=-torch.rand(s["HV"], generator=gen, device=DEVICE), use_qk_l2norm_in_kernel=True)
    pool = poisoned_pool(MODE, torch.float32, slots, seed=15)
    o, ref_o, ref_pool = _run(kw, pool, out=out, **varlen_call(lens, slots, [True] * len(lens)))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


def test_cuda_graph_prefill():
    """Captured once, replayed with new inputs, lengths and slots: equals an eager call."""
    assert_graph_replay_matches_eager(MODE, CUTE, seed=16)


def _picked(monkeypatch, **call_args):
    """The backend automatic dispatch runs a Lightning prefill on: "cute" if its prefill was called."""
    from cula_serve.kernels.backends import cute_backend

    calls = []
    original = cute_backend.prefill
    monkeypatch.setattr(cute_backend, "prefill", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    cula_lightning(**call_args)
    return "cute" if calls else "other"


def test_automatic_dispatch(monkeypatch):
    """bf16 rows at K = V = 128 run on the CuTe DSL kernel; float32 inputs, unaligned rows,
    other head dims, and batches that Triton cuts into segments where this kernel would fill few
    SMs (one long sequence at 16 heads) go to the triton backend; a named cute backend refuses
    what it cannot run and writes nothing."""
    s = SHAPES[MODE]
    gen = torch.Generator(device=DEVICE).manual_seed(19)

    def args(T, HV=s["HV"], K=s["K"], dtype=torch.bfloat16, N=4):
        q, k = (torch.randn(T, HV, K, generator=gen, device=DEVICE).to(dtype) for _ in range(2))
        v = torch.randn(T, HV, K, generator=gen, device=DEVICE).to(dtype)
        lens = [T // N] * N
        pool = torch.zeros(N, HV, K, K, device=DEVICE)
        return dict(q=q, k=k, v=v, decay=-torch.rand(HV, generator=gen, device=DEVICE), cu_seqlens=cu(lens),
                    state_pool=pool, state_indices=torch.arange(N, dtype=torch.int32, device=DEVICE))

    assert _picked(monkeypatch, **args(1024)) == "cute"
    assert _picked(monkeypatch, **args(1024, dtype=torch.float32)) == "other"
    assert _picked(monkeypatch, **args(1024, K=64)) == "other"
    assert _picked(monkeypatch, **args(8192, HV=16, N=1)) == "other"  # a TP4 shard: Triton's segments
    assert _picked(monkeypatch, **args(8192, N=1)) == "cute"  # 64 CTAs: faster than Triton's segments
    unaligned = args(1024)
    unaligned["q"] = torch.randn(1024, s["HV"], s["K"] + 1, device=DEVICE).bfloat16()[..., 1:]
    assert _picked(monkeypatch, **unaligned) == "other"

    fp32 = args(256, dtype=torch.float32)
    fp32["state_pool"].fill_(float("nan"))
    with pytest.raises(ValueError, match="bf16"):
        cula_lightning(**fp32, backend="cute")
    assert torch.isnan(fp32["state_pool"]).all()


def test_rows_past_2_31_elements():
    """Offsets of a packed batch past 2^31 elements: 64-bit (``assert_rows_past_2_31_elements``)."""
    assert_rows_past_2_31_elements(CUTE)
