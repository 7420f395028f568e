"""The triton backend's chunked prefill on a GPU at the model shapes (DESIGN section 1: GDN 16 qk /
32 value heads, KDA 32 heads, Lightning 64 heads, K = V = 128) against the float64 oracle:
lengths 1, 63, 64, 65, a few hundred and a thousand in one varlen batch with a padding row,
permuted NaN-poisoned slots and has_initial_state mixes; a sequence of several thousand tokens;
many short sequences; both pool dtypes; float32 inputs at 1e-5; checkpoints; every gate recipe;
strided inputs and pools; a prefill captured in a CUDA graph (which fails on any host
synchronisation) replayed with new inputs; and a Lightning batch past 2^31 elements.

Run with ``pytest -m gpu tests/gpu``. The float64 oracle (the torch backend's recurrence) runs on
the same GPU, token by token.
"""

import pytest
import torch

from cula_serve.inputs import random_inputs

from conftest import (assert_close, assert_same_writes, lightning_strided_views, prefill_and_oracle,
                      skip_module_unless_gpu, tolerance)

pytestmark = pytest.mark.gpu

skip_module_unless_gpu()

from prefill_checks import (DEVICE, POOL_SIZE, SHAPES, assert_checkpoints_match_oracle,  # noqa: E402
                            assert_graph_replay_matches_eager, assert_rows_past_2_31_elements, cu, inputs,
                            poisoned_pool, varlen_call)

TRITON = dict(backend="triton")
MODES = ["gdn", "kda", "lightning"]
DTYPES = [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]
DTYPE_IDS = ["bf16-fp32pool", "bf16-bf16pool", "fp32"]
# one varlen batch: permuted slots, row 3 is padding, rows 1 and 5 start from zeros (NaN slots)
LENS = [1, 63, 64, 17, 65, 300, 1000]
SLOTS = [9, 2, 11, -1, 0, 5, 7]
HAS_INIT = [True, False, True, True, True, False, True]


def _run_both(mode, kw, pool, segment_tokens=None, out=None, **options):
    """``run_both`` on the triton backend (``segment_tokens`` goes to its call alone)."""
    return prefill_and_oracle(mode, kw, pool, dict(TRITON, segment_tokens=segment_tokens), out=out, **options)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_dtype,state_dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_model_shapes(mode, input_dtype, state_dtype):
    kw = inputs(mode, sum(LENS), input_dtype, seed=1)
    pool = poisoned_pool(mode, state_dtype, [s for s, h in zip(SLOTS, HAS_INIT) if s >= 0 and h], seed=2)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **varlen_call(LENS, SLOTS, HAS_INIT))
    tol = tolerance(input_dtype, state_dtype)
    assert_close(o, ref_o, tol)
    assert (o[sum(LENS[:3]):sum(LENS[:4])] == 0).all()
    assert_same_writes(pool, ref_pool, tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("K,V", [(256, 128), (256, 256), (64, 64)], ids=["k256", "k256v256", "k64"])
def test_head_dims(mode, input_dtype, K, V):
    """Head dims off the model shapes pick other V tiles, warps and stages (``sequential_config``);
    K = 256 with 8 warps and 16-wide V tiles, or with one stage for Lightning, compiled to wrong
    code in Triton 3.6 on sm_90. fp16 inputs run only here on the GPU."""
    lens, slots, has_init = [300, 1, 700, 64], [3, 0, 1, 2], [True, False, True, True]
    shape = dict(H=2, HV=4, K=K, V=V)
    kw = random_inputs(mode, (sum(lens),), **shape, dtype=input_dtype, device=DEVICE,
                       generator=torch.Generator().manual_seed(K + V))
    pool = torch.full((5, 4, V, K), float("nan"), device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    for slot in (3, 1, 2):
        pool[slot] = 0.5 * torch.randn(4, V, K, generator=g, device=DEVICE)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **varlen_call(lens, slots, has_init))
    tol = tolerance(input_dtype, torch.float32)
    assert_close(o, ref_o, tol)
    assert_same_writes(pool, ref_pool, tol)


@pytest.mark.parametrize("segment_tokens", [None, 512], ids=["whole", "segments"])
def test_lightning_bf16_state_update_keeps_float32_accuracy(segment_tokens):
    """bf16 inputs: Lightning's state update (the raw k tile times the decayed v in two bf16
    parts) is the only rounding in its states, so the final states match the oracle to ~1e-5
    (tf32 operands left ~5e-4). Model shapes, one long sequence among short ones."""
    lens, slots, has_init = [4133, 5, 700], [3, 1, 6], [True, False, True]
    kw = inputs("lightning", sum(lens), torch.bfloat16, seed=12)
    pool = poisoned_pool("lightning", torch.float32, [3, 6], seed=13)
    _, _, ref_pool = _run_both("lightning", kw, pool, segment_tokens=segment_tokens,
                               **varlen_call(lens, slots, has_init))
    assert_same_writes(pool, ref_pool, 5e-5, "final states")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_dtype,state_dtype", DTYPES, ids=DTYPE_IDS)
def test_long_sequence(mode, input_dtype, state_dtype):
    """One sequence of several thousand tokens next to a short one."""
    lens, slots, has_init = [4133, 5], [3, 1], [True, True]
    kw = inputs(mode, sum(lens), input_dtype, seed=3)
    pool = poisoned_pool(mode, state_dtype, slots, seed=4)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **varlen_call(lens, slots, has_init))
    tol = tolerance(input_dtype, state_dtype)
    assert_close(o, ref_o, tol)
    assert_same_writes(pool, ref_pool, tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_dtype,state_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens", [None, 512], ids=["auto", "512"])
def test_segments(mode, input_dtype, state_dtype, tokens):
    """In-card context parallelism (``segment_tokens``): sequences of 4133, 5, 2000 (padding),
    1500 (from zeros) and 700 tokens at the model shapes, cut into segments chosen from the
    shapes (auto: these few sequences leave SMs idle) or of 512 tokens; checkpoints every 128
    tokens land inside segments; the composed states and outputs against the oracle."""
    lens, slots, has_init = [4133, 5, 2000, 1500, 700], [3, 1, -1, 6, 0], [True, True, True, False, True]
    M = 33
    ckpt = torch.full((len(lens), M), -1, dtype=torch.int32)
    ckpt[0] = torch.arange(7, 7 + M)
    ckpt[4, :5] = torch.arange(40, 45)
    ckpt[0, 3] = -1
    kw = inputs(mode, sum(lens), input_dtype, seed=30)
    pool = poisoned_pool(mode, state_dtype, [3, 1, 0], seed=31, size=7 + M + 5)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, checkpoint_every=128, checkpoint_indices=ckpt.to(DEVICE),
                                   segment_tokens=tokens, **varlen_call(lens, slots, has_init))
    tol = tolerance(input_dtype, state_dtype)
    assert_close(o, ref_o, tol)
    assert (o[sum(lens[:2]):sum(lens[:3])] == 0).all()
    assert_same_writes(pool, ref_pool, tol)


@pytest.mark.parametrize("mode", MODES)
def test_many_short_sequences(mode):
    """256 sequences of 0 to 40 tokens, bf16 inputs."""
    gen = torch.Generator().manual_seed(5)
    N = 256
    lens = torch.randint(0, 41, (N,), generator=gen).tolist()
    slots = torch.randperm(N + 64, generator=gen)[:N]
    slots[::7] = -1
    has_init = torch.rand(N, generator=gen) < 0.8
    kw = inputs(mode, sum(lens), torch.bfloat16, seed=6)
    pool = poisoned_pool(mode, torch.float32, slots[(slots >= 0) & has_init].tolist(), seed=7, size=N + 64)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **varlen_call(lens, slots.tolist(), has_init.tolist()))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("every", [64, 128])
def test_checkpoints(mode, every):
    assert_checkpoints_match_oracle(mode, TRITON, every)


@pytest.mark.parametrize("mode,gate", [
    ("gdn", "prepared"), ("gdn", "fused"), ("gdn", "fused_no_bias"),
    ("kda", "prepared"), ("kda", "fused"), ("kda", "fused_no_bias"), ("kda", "safe"), ("kda", "safe_no_bias"),
    ("lightning", "l2norm"), ("lightning", "no_l2norm")])
def test_gate_variants_fp32(mode, gate):
    lens, slots, has_init = [300, 64, 1], [2, 0, 1], [True, False, True]
    kw = inputs(mode, sum(lens), torch.float32, seed=10, fused_gate=gate != "prepared")
    if gate.endswith("no_bias"):
        kw["dt_bias"] = None
    if gate.startswith("safe"):
        kw["lower_bound"] = -5.0
    if gate == "l2norm":
        kw["use_qk_l2norm_in_kernel"] = True
    pool = poisoned_pool(mode, torch.float32, [2, 1], seed=11)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **varlen_call(lens, slots, has_init))
    assert_close(o, ref_o, 1e-5)
    assert_same_writes(pool, ref_pool, 1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_no_pool(mode):
    lens = [200, 1, 64]
    kw = inputs(mode, sum(lens), torch.bfloat16, seed=12)
    o, ref_o, _ = _run_both(mode, kw, None, cu_seqlens=cu(lens))
    assert_close(o, ref_o, 5e-3)


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_strided_inputs_and_pool(mode):
    """q, k, v, g, beta sliced from one fused projection; a pool strided in its slot dim."""
    lens, slots = [333, 20], [4, 1]
    s = SHAPES[mode]
    H, HV, K, V = s["H"], s["HV"], s["K"], s["V"]
    T = sum(lens)
    gen = torch.Generator(device=DEVICE).manual_seed(13)
    gate_width = HV * K if mode == "kda" else HV
    fused = torch.randn(T, 2 * H * K + HV * V + gate_width + HV + 3, generator=gen, device=DEVICE).bfloat16()
    q = fused[:, :H * K].unflatten(-1, (H, K))
    k = fused[:, H * K:2 * H * K].unflatten(-1, (H, K))
    v = fused[:, 2 * H * K:2 * H * K + HV * V].unflatten(-1, (HV, V))
    g = fused[:, 2 * H * K + HV * V:-HV - 3].float()
    g = g.unflatten(-1, (HV, K)) if mode == "kda" else g
    beta = fused[:, -HV - 3:-3].float()
    dt_bias = torch.randn(*((HV, K) if mode == "kda" else (HV,)), generator=gen, device=DEVICE)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=torch.rand(HV, generator=gen, device=DEVICE), dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    base = torch.full((POOL_SIZE, 2, HV, V, K), float("nan"), device=DEVICE)
    pool = base[:, 0]
    pool[slots] = torch.randn(len(slots), HV, V, K, generator=gen, device=DEVICE)
    o, ref_o, ref_pool = _run_both(mode, kw, pool, **varlen_call(lens, slots, [True, True]))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)
    assert torch.isnan(base[:, 1]).all(), "the other half of the strided pool was written"


@pytest.mark.parametrize("aligned", [True, False], ids=["descriptors", "pointers"])
def test_lightning_strided_inputs_and_out(aligned):
    """Lightning's q, k, v sliced from one fused projection into a strided ``out``: through
    descriptors (rows 16-byte aligned: TMA on sm_90) and through masked pointers
    (``lightning_strided_views``); an empty sequence among them."""
    from cula_serve.kernels.common.tma import descriptor_ready

    lens, slots = [333, 0, 20, 700], [4, 3, 1, 6]
    s = SHAPES["lightning"]
    gen = torch.Generator(device=DEVICE).manual_seed(14)
    q, k, v, out = lightning_strided_views(sum(lens), s["H"], s["HV"], s["K"], s["V"], aligned, gen, DEVICE)
    assert descriptor_ready(q, k, v, out) == aligned
    kw = dict(q=q, k=k, v=v, decay=-torch.rand(s["HV"], generator=gen, device=DEVICE), use_qk_l2norm_in_kernel=True)
    pool = poisoned_pool("lightning", torch.float32, slots, seed=15)
    batch = varlen_call(lens, slots, [True] * len(lens))
    o, ref_o, ref_pool = _run_both("lightning", kw, pool, out=out, **batch)
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens", [0, 256], ids=["whole", "segments"])
def test_cuda_graph_prefill(mode, tokens):
    """Captured once, replayed with new inputs, lengths and slots: equals an eager call. With
    segments of 256 tokens the replay's lengths give a sequence the capture's split differently."""
    assert_graph_replay_matches_eager(mode, dict(TRITON, segment_tokens=tokens), seed=14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_context_parallel_output_correction(dtype):
    """``correct_outputs`` (o = o0 + q~ S over a widened prefill's rows) against float64, into a
    strided output view, with a ragged last token tile; columns around the view stay untouched."""
    from cula_serve.kernels.common.affine_output import correct_outputs

    L, HV, K, V = 1000, 6, 128, 64
    generator = torch.Generator(DEVICE).manual_seed(3)
    widened = torch.randn(L, HV, V + K, generator=generator, device=DEVICE).to(dtype)
    state = torch.randn(HV, V, K, generator=generator, device=DEVICE)
    out_full = torch.full((L, HV, V + 8), float("nan"), dtype=dtype, device=DEVICE)
    out = correct_outputs(widened, state, out_full[..., :V])
    w = widened.double()
    expected = w[..., :V] + torch.einsum("lhk,hvk->lhv", w[..., V:], state.double())
    assert_close(out.double(), expected, tolerance(dtype, torch.float32))
    assert torch.isnan(out_full[..., V:]).all()


@pytest.mark.parametrize("tokens", [1024, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_segment_output_correction(dtype, tokens):
    """``correct_segment_outputs`` (in-card segments: out += q~ S on every segment that continues
    a live sequence) against float64, with a ragged segment and a padding row, in both launches
    (bf16 q~: two bf16 products; float32: tf32x3) and both tilings of the bf16 one (short and
    long segments)."""
    from cula_serve.kernels.common.affine_output import correct_segment_outputs
    from cula_serve.kernels.common.segments import num_segment_ids

    HV, K = 8, 128
    # the padding row spans two segments
    lens, slots = [2500 * tokens // 1024, 1300 * tokens // 1024, 296 * tokens // 1024], [4, -1, 2]
    T = sum(lens)
    cu_seqlens = torch.tensor([0, lens[0], lens[0] + lens[1], T], dtype=torch.int32, device=DEVICE)
    state_indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    generator = torch.Generator(DEVICE).manual_seed(4)
    initial = torch.randn(num_segment_ids(T, len(lens), tokens), HV, K, K, generator=generator, device=DEVICE)
    carried = torch.randn(T, HV, K, generator=generator, device=DEVICE).to(dtype)
    out = torch.randn(T, HV, K, generator=generator, device=DEVICE).to(dtype)
    expected = out.double()
    segment_id = 0
    for bos, length, slot in zip(cu_seqlens.tolist(), lens, slots):
        for j in range(-(-length // tokens)):
            rows = slice(bos + j * tokens, bos + min((j + 1) * tokens, length))
            if j and slot >= 0:
                expected[rows] += torch.einsum("thk,hvk->thv", carried[rows].double(), initial[segment_id].double())
            segment_id += 1
    correct_segment_outputs(cu_seqlens, state_indices, carried, initial, out, tokens=tokens)
    assert_close(out.double(), expected, tolerance(dtype, torch.float32))


@pytest.mark.parametrize("tokens", [1024, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_segment_join(dtype, tokens):
    """``join_segments`` in its one launch (no sequence longer than two segments: the final states
    D_0 A_1^T + D_1 and the second segments' correction with S = D_0) against float64: a sequence
    in two segments, a padding one, a short one in one segment; a bf16 pool NaN-poisoned outside
    the written slot; both q~ dtypes and both tilings of the correction."""
    from cula_serve.kernels.common.affine_output import join_segments
    from cula_serve.kernels.common.segments import num_segment_ids

    HV, K = 32, 128
    lens, slots = [2 * tokens - 300, 200, 100], [4, -1, 2]
    T = sum(lens)
    cu_seqlens = torch.tensor([0, lens[0], lens[0] + lens[1], T], dtype=torch.int32, device=DEVICE)
    state_indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    generator = torch.Generator(DEVICE).manual_seed(5)
    transitions = torch.randn(num_segment_ids(T, len(lens), tokens), HV, 2 * K, K, generator=generator, device=DEVICE)
    transitions[:, :, K:] /= 2 * K ** 0.5  # maps of norm about 1/2
    carried = torch.randn(T, HV, K, generator=generator, device=DEVICE).to(dtype)
    out = torch.randn(T, HV, K, generator=generator, device=DEVICE).to(dtype)
    pool = torch.full((6, HV, K, K), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    expected = out.double()
    rows = slice(tokens, lens[0])  # the first sequence's second segment (segment ids 0 and 1)
    expected[rows] += torch.einsum("thk,hvk->thv", carried[rows].double(), transitions[0, :, :K].double())
    final = transitions[0, :, :K].double() @ transitions[1, :, K:].double() + transitions[1, :, :K].double()
    join_segments(cu_seqlens, state_indices, transitions, carried, out, pool, tokens=tokens)
    assert_close(out.double(), expected, tolerance(dtype, torch.float32))
    assert_close(pool[4].double(), final, tolerance(torch.bfloat16, torch.bfloat16), "final state")
    assert torch.isnan(pool[torch.arange(6, device=DEVICE) != 4]).all()


def test_rows_past_2_31_elements():
    """Offsets of a packed batch past 2^31 elements: 64-bit (``assert_rows_past_2_31_elements``)."""
    assert_rows_past_2_31_elements(TRITON)
