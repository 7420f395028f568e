"""Shared pieces of the GPU prefill tests (``test_triton_prefill_gpu``, ``test_cute_prefill_gpu``):
model-shaped inputs on the GPU, NaN-poisoned pools, varlen batches, and the CUDA-graph check.
The backend-beside-oracle run and the pool check are conftest's (``prefill_and_oracle``,
``assert_same_writes``), shared with the CPU tests."""
import torch

from cula_serve.inputs import MODE_SHAPES, random_inputs

from conftest import ORACLE, assert_close, assert_same_writes, prefill_and_oracle, prefill_call, to_float64

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


def assert_rows_past_2_31_elements(backend):
    """Lightning at 64 heads on a packed batch whose [T, HV, V] tensors pass 2^31 elements
    (262144 tokens, 4.3 GB each in bf16), where 32-bit offsets would wrap. A padding sequence
    first (its zero rows cross the boundary); then a long sequence that crosses it, whose tail
    must equal a rerun of that tail from the checkpoint taken before the boundary (same chunks,
    same state: bit-identical); then a short sequence past it, against the float64 oracle.
    ``backend``: the options of the backend's calls."""
    boundary = (1 << 31) // (SHAPES["lightning"]["HV"] * SHAPES["lightning"]["V"])
    tail = 192
    pad, long, short = boundary // 2 + 64, boundary // 2 + 64, 300
    prefix = long - tail  # a multiple of 64, ending below the boundary
    assert pad + prefix < boundary < pad + long and prefix % 64 == 0
    kw = inputs("lightning", pad + long + short, torch.bfloat16, seed=40)
    pool = poisoned_pool("lightning", torch.float32, [0, 1], seed=41, size=4)
    ckpt = torch.tensor([[-1], [2], [-1]], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(kw["v"], float("nan"))
    start = pool.clone()
    prefill_call("lightning", kw, out=out, state_pool=pool, checkpoint_every=prefix, checkpoint_indices=ckpt,
                 **varlen_call([pad, long, short], [-1, 0, 1], [True, True, True]), **backend)
    assert (out[:pad] == 0).all(), "padding rows past the boundary"

    rows = slice(pad + prefix, pad + long)
    rerun_pool = pool.clone()
    rerun_pool[0] = float("nan")
    rerun_out = torch.empty_like(out[rows])
    rerun = dict(kw, q=kw["q"][rows], k=kw["k"][rows], v=kw["v"][rows])
    prefill_call("lightning", rerun, out=rerun_out, state_pool=rerun_pool, **varlen_call([tail], [2], [True]),
                 **backend)
    assert torch.equal(rerun_out, out[rows]), "the long sequence's rows past the boundary"
    assert torch.equal(rerun_pool[2], pool[0]), "the long sequence's final state"

    rows = slice(pad + long, pad + long + short)
    last = dict(kw, q=kw["q"][rows], k=kw["k"][rows], v=kw["v"][rows])
    ref_pool = start[1:2].double()
    ref_o, _ = prefill_call("lightning", to_float64(last), state_pool=ref_pool, cu_seqlens=cu([short]),
                            state_indices=torch.zeros(1, dtype=torch.int32, device=DEVICE), **ORACLE)
    assert_close(out[rows], ref_o, 5e-3, "the sequence past the boundary")
    assert_close(pool[1], ref_pool[0], 5e-3, "its final state")
