"""Shared pieces of the GPU prefill tests (``test_triton_prefill_gpu``, ``test_cute_prefill_gpu``):
model-shaped inputs on the GPU, NaN-poisoned pools, varlen batches, and the CUDA-graph check.
The backend-beside-oracle run and the pool check are conftest's (``prefill_and_oracle``,
``assert_same_writes``), shared with the CPU tests."""
import torch

from cula_serve.inputs import MODE_SHAPES, random_inputs

from conftest import assert_close, assert_same_writes, prefill_and_oracle, prefill_call

DEVICE = torch.device("cuda")
SHAPES = MODE_SHAPES
POOL_SIZE = 16


def cu(lens):
    """int32 cu_seqlens of ``lens`` on the GPU."""
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def inputs(mode, T, dtype, seed, **kwargs):
    """Model-shaped (DESIGN section 1) random inputs of ``mode`` for T packed tokens."""
    return random_inputs(mode, (T,), **SHAPES[mode], dtype=dtype, device=DEVICE,
                         generator=torch.Generator().manual_seed(seed), **kwargs)


def poisoned_pool(mode, dtype, live_slots, seed, size=POOL_SIZE):
    """NaN everywhere but ``live_slots``, which hold random states."""
    s = SHAPES[mode]
    pool = torch.full((size, s["HV"], s["V"], s["K"]), float("nan"), dtype=dtype, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    for slot in live_slots:
        pool[slot] = (0.5 * torch.randn(*pool.shape[1:], generator=g, device=DEVICE)).to(dtype)
    return pool


def varlen_call(lens, slots, has_init):
    """cu_seqlens, state_indices and has_initial_state of a varlen batch, on the GPU."""
    return dict(cu_seqlens=cu(lens), state_indices=torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                has_initial_state=torch.tensor(has_init, device=DEVICE))


def assert_graph_replay_matches_eager(mode, backend, seed):
    """A prefill of ``mode`` on ``backend`` (the options of its calls) captured once in a CUDA
    graph (any host synchronisation would fail the capture), then replayed with new inputs,
    lengths and slots of the same token count, equals an eager call; the new padding row's
    outputs are zero."""
    T = 600
    static = inputs(mode, T, torch.bfloat16, seed=seed)
    cu_seqlens = cu([300, 200, 100])
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    pool = poisoned_pool(mode, torch.float32, range(POOL_SIZE), seed=seed + 1)
    out = torch.empty(T, *static["v"].shape[1:], dtype=torch.bfloat16, device=DEVICE)

    def prefill(pool, out):
        return prefill_call(mode, static, cu_seqlens=cu_seqlens, state_pool=pool, state_indices=slots, out=out,
                            **backend)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prefill(pool, out)  # compiles the kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefill(pool, out)

    fresh = inputs(mode, T, torch.bfloat16, seed=seed + 2)
    for key, val in fresh.items():
        if isinstance(val, torch.Tensor):
            static[key].copy_(val)
    cu_seqlens.copy_(cu([1, 598, 1]))
    slots.copy_(torch.tensor([7, -1, 3], dtype=torch.int32))
    eager_pool = pool.clone()
    graph.replay()
    eager_out = torch.empty_like(out)
    prefill(eager_pool, eager_out)
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out)
    assert torch.equal(pool.nan_to_num(), eager_pool.nan_to_num())
    assert (out[1:599] == 0).all()


def assert_checkpoints_match_oracle(mode, backend, every):
    """States after every ``every`` tokens land in their checkpoint slots as the oracle's do;
    -1 entries and checkpoints past a sequence's end are skipped, a padding row writes none.
    ``backend``: the options of the backend's calls."""
    lens, slots, has_init = [700, 129, 64, 40], [0, 1, -1, 2], [True, False, True, True]
    M = 11
    ckpt = torch.arange(3, 3 + 4 * M, dtype=torch.int32).reshape(4, M)
    ckpt[0, 1] = ckpt[0, 4] = ckpt[1, 0] = -1
    kw = inputs(mode, sum(lens), torch.bfloat16, seed=8)
    pool = poisoned_pool(mode, torch.float32, [0, 2], seed=9, size=3 + 4 * M)
    o, ref_o, ref_pool = prefill_and_oracle(mode, kw, pool, backend, checkpoint_every=every,
                                            checkpoint_indices=ckpt.to(DEVICE), **varlen_call(lens, slots, has_init))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)
