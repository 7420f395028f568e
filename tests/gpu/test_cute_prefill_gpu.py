"""The cute backend's prefill kernels (``kernels/lightning/chunk_cute.py``, and
``kernels/delta_rule/chunk_cute.py`` for GDN and KDA: bf16, K = V = 128) on a Hopper GPU against the
float64 oracle: lengths 1, 63, 64, 65, a few hundred and a thousand in one varlen batch with a
padding row, permuted NaN-poisoned slots and has_initial_state mixes, with and without qk l2norm
(GDN, KDA: raw projections with the fused gate and beta sigmoid, or prepared gates and normalised
q, k); both pool dtypes; a sequence of several thousand tokens; many short and empty sequences;
checkpoints; grouped value heads; no pool and dense initial states; a capture in a CUDA graph
replayed with new inputs; which calls automatic dispatch gives them. GDN and KDA also: in-card
segments, forced short and by the automatic rule, with and without a pool, under CUDA-graph
replay; KDA's intra-chunk operands and its triangular solve on the tensor cores alone, against
float64. Lightning also: strided
views of a fused projection, a packed batch past 2^31 elements. GDN also: segments over many
short sequences, and bitwise the same from call to call.

Run with ``pytest -m gpu tests/gpu``; skipped where the cute backend is unavailable.
"""
import pytest
import torch

from cula_serve import cula_gdn, cula_lightning, dispatch
from cula_serve.inputs import random_inputs
from cula_serve.kernels.common.prep import l2norm as _l2norm

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
MODE = "lightning"  # the tests of Lightning alone
MODES = pytest.mark.parametrize("mode", ["lightning", "gdn", "kda"])
DELTA = pytest.mark.parametrize("mode", ["gdn", "kda"])
# one varlen batch: permuted slots, row 3 is padding, rows 1 and 5 start from zeros (NaN slots)
LENS = [1, 63, 64, 17, 65, 300, 1000]
SLOTS = [9, 2, 11, -1, 0, 5, 7]
HAS_INIT = [True, False, True, True, True, False, True]


def _run(mode, kw, pool, **options):
    """``prefill_and_oracle`` on the cute backend."""
    return prefill_and_oracle(mode, kw, pool, CUTE, **options)


def _inputs(mode, T, seed, l2norm=True):
    """Model-shaped inputs; GDN and KDA without the in-kernel l2norm take normalised q, k and
    prepared gates (raw q, k would make the delta rule diverge), with it the raw projections and
    the fused gate and beta sigmoid."""
    kw = inputs(mode, T, torch.bfloat16, seed=seed, **({} if mode == "lightning" or l2norm else dict(fused_gate=False)))
    if mode != "lightning" and not l2norm:
        kw.update(q=_l2norm(kw["q"].float()).bfloat16(), k=_l2norm(kw["k"].float()).bfloat16())
    kw["use_qk_l2norm_in_kernel"] = l2norm
    return kw


def _live(slots, has_init):
    return [s for s, h in zip(slots, has_init) if s >= 0 and h]


@MODES
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32pool", "bf16pool"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["raw", "l2norm"])
def test_varlen_model_shapes(mode, state_dtype, l2norm):
    kw = _inputs(mode, sum(LENS), seed=1, l2norm=l2norm)
    pool = poisoned_pool(mode, state_dtype, _live(SLOTS, HAS_INIT), seed=2)
    o, ref_o, ref_pool = _run(mode, kw, pool, **varlen_call(LENS, SLOTS, HAS_INIT))
    tol = tolerance(torch.bfloat16, state_dtype)
    assert_close(o, ref_o, tol)
    assert (o[sum(LENS[:3]):sum(LENS[:4])] == 0).all()
    assert_same_writes(pool, ref_pool, tol)


@pytest.mark.parametrize("mode, state_tol", [("lightning", 5e-5), ("gdn", 5e-3), ("kda", 5e-3)])
def test_long_sequence(mode, state_tol):
    """One sequence of several thousand tokens next to a short one: outputs at the bf16
    tolerance; Lightning's final states near float32 (its state update keeps 16 bits of the
    decayed v), GDN's and KDA's at the bf16 tolerance (their T and decayed keys enter the tensor
    cores in 16 bits)."""
    lens, slots, has_init = [4133, 5, 700], [3, 1, 6], [True, False, True]
    kw = _inputs(mode, sum(lens), seed=3)
    pool = poisoned_pool(mode, torch.float32, [3, 6], seed=4)
    o, ref_o, ref_pool = _run(mode, kw, pool, **varlen_call(lens, slots, has_init))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, state_tol, "final states")


@MODES
def test_many_short_and_empty_sequences(mode):
    """256 sequences of 0 to 40 tokens: every CTA ends inside its first chunk, or has none."""
    _assert_many_short_sequences(mode, CUTE)


def test_gdn_segments_many_short_sequences():
    """The same batch in forced 64-token segments, its last sequence 300 tokens long (five
    segments): every CTA walks the sequences before its segment (``cute_prefill.block_segment``),
    an empty one counting one segment, and the composition and the output correction must count
    them alike to find the long sequence's segments."""
    _assert_many_short_sequences("gdn", dict(CUTE, segment_tokens=64), last=300)


def _assert_many_short_sequences(mode, backend, last=None):
    gen = torch.Generator().manual_seed(5)
    N = 256
    lens = torch.randint(0, 41, (N,), generator=gen).tolist()
    lens[:3] = [0, 40, 0]
    if last is not None:
        lens[-1] = last
    slots = torch.randperm(N + 64, generator=gen)[:N]
    slots[::7] = -1
    has_init = torch.rand(N, generator=gen) < 0.8
    kw = _inputs(mode, sum(lens), seed=6)
    pool = poisoned_pool(mode, torch.float32, slots[(slots >= 0) & has_init].tolist(), seed=7, size=N + 64)
    o, ref_o, ref_pool = prefill_and_oracle(mode, kw, pool, backend,
                                            **varlen_call(lens, slots.tolist(), has_init.tolist()))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


@MODES
@pytest.mark.parametrize("every", [64, 128])
def test_checkpoints(mode, every):
    assert_checkpoints_match_oracle(mode, CUTE, every)


@MODES
@pytest.mark.parametrize("H", [16, 1])
def test_grouped_value_heads(mode, H):
    """The model's value heads reading H qk heads (value head hv reads qk head hv // (HV // H))."""
    lens, slots, has_init = [300, 77, 1], [2, 0, 1], [True, False, True]
    s = SHAPES[mode]
    kw = random_inputs(mode, (sum(lens),), H=H, HV=s["HV"], K=s["K"], V=s["V"], dtype=torch.bfloat16,
                       device=DEVICE, generator=torch.Generator().manual_seed(10 + H))
    kw["use_qk_l2norm_in_kernel"] = True
    pool = poisoned_pool(mode, torch.float32, [2, 1], seed=11)
    o, ref_o, ref_pool = _run(mode, kw, pool, **varlen_call(lens, slots, has_init))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


@MODES
def test_no_pool_and_dense_states(mode):
    """Without a pool (outputs only), and FLA-style dense initial / final states."""
    lens = [200, 1, 64]
    kw = _inputs(mode, sum(lens), seed=12)
    o, ref_o, _ = _run(mode, kw, None, cu_seqlens=cu(lens))
    assert_close(o, ref_o, 5e-3)
    s = SHAPES[mode]
    initial = torch.randn(len(lens), s["HV"], s["V"], s["K"], generator=torch.Generator(DEVICE).manual_seed(13),
                          device=DEVICE)
    o, final = prefill_call(mode, kw, cu_seqlens=cu(lens), initial_state=initial, output_final_state=True, **CUTE)
    ref_o, ref_final = prefill_call(mode, to_float64(kw), cu_seqlens=cu(lens), initial_state=initial.double(),
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
    o, ref_o, ref_pool = _run(MODE, kw, pool, out=out, **varlen_call(lens, slots, [True] * len(lens)))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)


def test_kda_unaligned_q_k(monkeypatch):
    """KDA's q and k sliced with an odd row stride and k's head vectors strided: only the Triton
    intra-chunk kernels read them, so the cute backend runs the call (automatic dispatch too)."""
    lens, slots = [333, 20, 700], [4, 1, 6]
    s = SHAPES["kda"]
    T, H, K = sum(lens), s["H"], s["K"]
    kw = _inputs("kda", T, seed=16)
    gen = torch.Generator(device=DEVICE).manual_seed(17)
    fused = torch.randn(T, 2 * H * K + 3, generator=gen, device=DEVICE).bfloat16()
    fused[:, :H * K] = kw["q"].flatten(1)
    fused[:, H * K:2 * H * K] = kw["k"].transpose(-1, -2).flatten(1)
    kw.update(q=fused[:, :H * K].unflatten(-1, (H, K)),
              k=fused[:, H * K:2 * H * K].unflatten(-1, (K, H)).transpose(-1, -2))
    assert kw["q"].data_ptr() % 16 == 0 and kw["q"].stride(0) % 8 != 0 and kw["k"].stride(-1) != 1
    pool = poisoned_pool("kda", torch.float32, slots, seed=18)
    o, ref_o, ref_pool = _run("kda", kw, pool, **varlen_call(lens, slots, [True] * len(lens)))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3)
    assert _picked(monkeypatch, lambda **call: prefill_call("kda", call), **kw) == "cute"


@MODES
def test_cuda_graph_prefill(mode):
    """Captured once, replayed with new inputs, lengths and slots: equals an eager call."""
    assert_graph_replay_matches_eager(mode, CUTE, seed=16)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32pool", "bf16pool"])
@pytest.mark.parametrize("tokens", [64, 128])
@DELTA
def test_segments(mode, state_dtype, tokens):
    """In-card segments forced at small lengths (``segment_tokens``): the varlen batch plus an
    empty sequence without an initial state (its slot gets zeros), cut into segments of 64 or
    128 tokens, each segment's value rows and K map rows on their own CTAs, then composed and
    the outputs corrected (``chunk_cute.gdn_prefill``, ``chunk_cute.kda_prefill``)."""
    lens, slots, has_init = LENS + [0], SLOTS + [12], HAS_INIT + [False]
    kw = _inputs(mode, sum(lens), seed=30)
    pool = poisoned_pool(mode, state_dtype, _live(slots, has_init), seed=31)
    o, ref_o, ref_pool = prefill_and_oracle(mode, kw, pool, dict(CUTE, segment_tokens=tokens),
                                            **varlen_call(lens, slots, has_init))
    tol = tolerance(torch.bfloat16, state_dtype)
    assert_close(o, ref_o, tol)
    assert (o[sum(lens[:3]):sum(lens[:4])] == 0).all()
    assert_same_writes(pool, ref_pool, tol)
    assert not torch.isnan(pool[12]).any()


@DELTA
def test_segments_automatic_long_sequence(mode):
    """One 4500-token sequence at 32 heads: the rule cuts it (two segments, three CTAs a head);
    outputs and final state against the oracle, and the same as with segments forced off up to
    bf16 rounding."""
    from cula_serve.kernels.common.segments import one_pass_segment_tokens, sm_count

    T = 4500
    assert one_pass_segment_tokens(T, 1, SHAPES[mode]["HV"], sm_count(torch.device(DEVICE))) > 0
    kw = _inputs(mode, T, seed=32)
    pool = poisoned_pool(mode, torch.float32, [3], seed=33)
    whole = pool.clone()
    o, ref_o, ref_pool = _run(mode, kw, pool, **varlen_call([T], [3], [True]))
    assert_close(o, ref_o, 5e-3)
    assert_same_writes(pool, ref_pool, 5e-3, "final state")
    o_whole, _ = prefill_call(mode, kw, state_pool=whole, segment_tokens=0, **varlen_call([T], [3], [True]), **CUTE)
    assert_close(o, o_whole.double(), 5e-3)


def test_gdn_segments_repeat_bitwise():
    """One 32768-token sequence at 32 heads (two segments by the rule, three CTAs a head), called
    twelve times: outputs and final state bitwise the same every time. Guards the release of v's
    stage after its ldmatrix.trans (``chunk_cute._state_math``): without the proxy fence there the
    TMA refill raced the last ldmatrix and about a third of such calls differed on an H200."""
    from cula_serve.kernels.common.segments import one_pass_segment_tokens, sm_count

    T = 32768
    assert one_pass_segment_tokens(T, 1, SHAPES["gdn"]["HV"], sm_count(torch.device(DEVICE))) > 0
    kw = _inputs("gdn", T, seed=40)
    pool = poisoned_pool("gdn", torch.float32, [3], seed=41)
    call = varlen_call([T], [3], [True])
    first = first_state = None
    for _ in range(12):
        work = pool.clone()
        o, _ = prefill_call("gdn", kw, state_pool=work, **call, **CUTE)
        if first is None:
            first, first_state = o, work[3]
        else:
            assert torch.equal(o, first) and torch.equal(work[3], first_state)  # the other slots hold NaN


@DELTA
def test_segments_without_pool(mode):
    """Segments without a pool (zero initial states, nothing written) and with dense states."""
    lens = [200, 1, 64]
    kw = _inputs(mode, sum(lens), seed=34)
    o, ref_o, _ = prefill_and_oracle(mode, kw, None, dict(CUTE, segment_tokens=64), cu_seqlens=cu(lens))
    assert_close(o, ref_o, 5e-3)
    s = SHAPES[mode]
    initial = torch.randn(len(lens), s["HV"], s["V"], s["K"], generator=torch.Generator(DEVICE).manual_seed(35),
                          device=DEVICE)
    o, final = prefill_call(mode, kw, cu_seqlens=cu(lens), initial_state=initial, output_final_state=True,
                            segment_tokens=64, **CUTE)
    ref_o, ref_final = prefill_call(mode, to_float64(kw), cu_seqlens=cu(lens), initial_state=initial.double(),
                                    output_final_state=True, **ORACLE)
    assert_close(o, ref_o, 5e-3)
    assert_close(final, ref_final, 5e-3, "final states")


@DELTA
def test_segments_refuse_checkpoints(mode):
    """Segments write no checkpoints: asking for both names ``segment_tokens`` and writes nothing."""
    kw = _inputs(mode, 256, seed=36)
    pool = poisoned_pool(mode, torch.float32, [], seed=37)
    out = torch.full((256, SHAPES[mode]["HV"], SHAPES[mode]["V"]), float("nan"), dtype=torch.bfloat16,
                     device=DEVICE)
    with pytest.raises(ValueError, match="segment_tokens"):
        prefill_call(mode, kw, state_pool=pool, out=out, checkpoint_every=64,
                     checkpoint_indices=torch.tensor([[1, 2, 3, 4]], dtype=torch.int32, device=DEVICE),
                     segment_tokens=64, **varlen_call([256], [0], [False]), **CUTE)
    assert torch.isnan(pool).all() and torch.isnan(out).all()


@DELTA
def test_segments_cuda_graph(mode):
    """Segmented GDN and KDA captured once and replayed with new lengths (other segment counts)."""
    assert_graph_replay_matches_eager(mode, dict(CUTE, segment_tokens=128), seed=38)


def _picked(monkeypatch, run=cula_lightning, **call_args):
    """The backend automatic dispatch runs a prefill on: "cute" if its prefill was called."""
    from cula_serve.kernels.backends import cute_backend

    calls = []
    original = cute_backend.prefill
    monkeypatch.setattr(cute_backend, "prefill", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    run(**call_args)
    return "cute" if calls else "other"


def test_automatic_dispatch(monkeypatch):
    """bf16 rows at K = V = 128 run on the CuTe DSL kernels (Lightning, GDN, KDA; a TP4 shard's
    KDA in segments); float32 inputs, unaligned rows, other head dims, and batches whose CTAs
    would fill few SMs where Triton cuts them into segments and the CuTe DSL kernel does not
    (Lightning: one long sequence at 16 heads; GDN: one long sequence with checkpoints) go to the
    triton backend; a named cute backend refuses what it cannot run and writes nothing."""
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

    gdn = _inputs("gdn", 512, seed=20)
    gdn_call = dict(gdn, cu_seqlens=cu([500, 12]))
    assert _picked(monkeypatch, cula_gdn, **gdn_call) == "cute"  # 2 x 32 CTAs
    assert _picked(monkeypatch, cula_gdn, **dict(gdn, cu_seqlens=cu([512]))) == "cute"  # too short to cut, for both
    long_gdn = dict(_inputs("gdn", 8192, seed=22), cu_seqlens=cu([8192]))
    assert _picked(monkeypatch, cula_gdn, **long_gdn) == "cute"  # 2 segments
    with_checkpoints = dict(long_gdn, state_pool=poisoned_pool("gdn", torch.float32, [0], seed=23, size=1),
                            state_indices=torch.zeros(1, dtype=torch.int32, device=DEVICE), checkpoint_every=64,
                            checkpoint_indices=torch.full((1, 128), -1, dtype=torch.int32, device=DEVICE))
    assert _picked(monkeypatch, cula_gdn, **with_checkpoints) == "other"  # segments write no checkpoints
    kda = inputs("kda", 512, torch.bfloat16, seed=21)
    run_kda = lambda **kw: prefill_call("kda", kw)  # noqa: E731
    assert _picked(monkeypatch, run_kda, **kda) == "cute"  # 32 CTAs, too short for Triton to cut
    assert _picked(monkeypatch, run_kda, **inputs("kda", 8192, torch.bfloat16, seed=24)) == "cute"  # 32 CTAs
    shard = random_inputs("kda", (8192,), H=8, HV=8, K=128, V=128, dtype=torch.bfloat16, device=DEVICE,
                          generator=torch.Generator().manual_seed(25))
    assert _picked(monkeypatch, run_kda, **shard) == "cute"  # a TP4 shard, 8 heads: ours in segments

    fp32 = args(256, dtype=torch.float32)
    fp32["state_pool"].fill_(float("nan"))
    with pytest.raises(ValueError, match="bf16"):
        cula_lightning(**fp32, backend="cute")
    assert torch.isnan(fp32["state_pool"]).all()


@pytest.mark.parametrize("keys", ["random", "correlated"])
def test_kda_solve_against_float64(keys):
    """KDA's triangular solve on the tensor cores (``solve_cute.kda_solve``): each live chunk's
    rows t < L of (I + N)^-1 in fp16 against float64, from N = M - I as KDA's block kernels leave
    it (strictly lower; NaN on and above the diagonal and in rows past a sequence, which must not
    be read). Lengths 1, 63, 64, 65, 300; a padding sequence's rows stay NaN. Keys drawn around one
    direction (``correlated``) with beta near 1: the case where M^-1's accuracy matters most
    (``chunk_triton._mm``)."""
    from cula_serve.kernels.common.varlen import chunk_indices
    from cula_serve.kernels.delta_rule.solve_cute import kda_solve

    HV, K, C = 4, 128, 64
    lens, slots = [1, 63, 17, 64, 65, 300], [2, 0, -1, 5, 1, 3]
    gen = torch.Generator(device=DEVICE).manual_seed(31)
    T = sum(lens)
    k = torch.randn(T, HV, K, generator=gen, device=DEVICE, dtype=torch.float64)
    if keys == "correlated":
        k = torch.randn(HV, K, generator=gen, device=DEVICE, dtype=torch.float64) + 0.1 * k
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid((6.0 if keys == "correlated" else 0.0) + torch.randn(T, HV, generator=gen, device=DEVICE,
                                                                              dtype=torch.float64))
    g = -0.05 * torch.rand(T, HV, generator=gen, device=DEVICE, dtype=torch.float64)
    N_ws = torch.full((T, HV, C), float("nan"), device=DEVICE)
    expected = {}
    bos = 0
    for length, slot in zip(lens, slots):
        for t0 in range(bos, bos + length, C):
            L = min(bos + length - t0, C)
            G = g[t0:t0 + L].cumsum(0)  # [L, HV]
            kc = k[t0:t0 + L].transpose(0, 1)  # [HV, L, K]
            A = (kc @ kc.transpose(1, 2)) * (G.T[:, :, None] - G.T[:, None, :]).clamp(max=0).exp()
            N = torch.tril(beta[t0:t0 + L].T[:, :, None] * A, -1)  # [HV, L, L]
            N_ws[t0:t0 + L, :, :L] = torch.where(torch.tril(torch.ones(L, L, dtype=torch.bool, device=DEVICE), -1),
                                                 N, float("nan")).transpose(0, 1).float()
            if slot >= 0:
                inverse = torch.linalg.inv(torch.eye(L, dtype=torch.float64, device=DEVICE) + N.float().double())
                expected[t0] = (L, torch.nn.functional.pad(inverse, (0, C - L)).transpose(0, 1))
        bos += length
    T_ws = torch.full((T, HV, C), float("nan"), dtype=torch.float16, device=DEVICE)
    cu_seqlens = cu(lens)
    kda_solve(N_ws, T_ws, chunk_indices(cu_seqlens, T, C), cu_seqlens,
              torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    written = torch.zeros(T, dtype=torch.bool, device=DEVICE)
    for t0, (L, inverse) in expected.items():
        assert_close(T_ws[t0:t0 + L], inverse, 1e-3, f"M^-1 of the chunk at token {t0}")
        written[t0:t0 + L] = True
    assert torch.isnan(T_ws[~written].float()).all(), "rows of the padding sequence were written"


class _NanWorkspaces:
    """``torch`` as ``intra_cute`` sees it, with every ``empty`` tensor filled with NaN (integer
    ones with -1): rows the kernels must write show where they did not."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **options):
        dtype = options.get("dtype", torch.get_default_dtype())
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, **options)


@pytest.mark.parametrize("gate", ["prepared", "raw", "safe"])
def test_kda_chunk_operands_against_float64(gate, monkeypatch):
    """KDA's intra-chunk kernel (``intra_cute.kda_chunk_operands``) against float64 from the chunked
    form's definitions, chunk by chunk: P and M^-1 as whole rows (zeros above the diagonal), the
    decayed Q and K tiles, G at each chunk's last row. A varlen batch with a padding row (never
    written) and chunk tails, grouped value heads, NaN workspaces. Prepared gates (mild) take the
    fp16 diagonal blocks everywhere; the engines' raw gates span more than SPAN_LIMIT in some
    blocks, which go to the exact kernel (checked to happen); the safe gate's lower bound (-0.4 a
    token) keeps every block within it."""
    from cula_serve.api import _recipe
    from cula_serve.kernels.delta_rule import intra_cute

    monkeypatch.setattr(intra_cute, "torch", _NanWorkspaces())
    lens, slots = [70, 5, 64, 1, 300], [1, -1, 0, 3, 2]
    H, HV, K, C = 2, 4, 128, 64
    gen = torch.Generator().manual_seed({"prepared": 41, "raw": 42, "safe": 43}[gate])
    kw = random_inputs("kda", (sum(lens),), H=H, HV=HV, K=K, V=K, dtype=torch.bfloat16, device=DEVICE,
                       generator=gen, fused_gate=gate != "prepared")
    options = dict(A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"), lower_bound=-0.4 if gate == "safe" else None)
    recipe, g, beta = _recipe("kda", (sum(lens),), HV, K, device=kw["q"].device, g=kw["g"], beta=kw["beta"],
                              decay=None, scale=None, use_qk_l2norm_in_kernel=True,
                              use_gate_in_kernel=gate != "prepared", use_beta_sigmoid_in_kernel=gate != "prepared",
                              **options)
    ops = intra_cute.kda_chunk_operands(recipe, kw["q"], kw["k"], g, beta, cu_seqlens=cu(lens),
                                        state_indices=torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    q, k, g64, b64 = recipe.prepare(*(x.double() for x in (kw["q"], kw["k"], g, beta)), torch.float64)
    q, k = (x.repeat_interleave(HV // H, dim=1) for x in (q, k))
    widest = 0.0  # the largest per-channel gate span of a live 16-row block
    bos = 0
    for length, slot in zip(lens, slots):
        for t0 in range(bos, bos + length, C):
            rows = slice(t0, min(t0 + C, bos + length))
            L = rows.stop - rows.start
            if slot < 0:
                assert all(torch.isnan(x[rows].float()).all() for x in ops.values()), "a padding row was written"
                continue
            G = g64[rows].cumsum(0)  # [L, HV, K]
            for b0 in range(0, L, 16):
                widest = max(widest, ((G[b0 - 1] if b0 else 0.0) - G[min(b0 + 15, L - 1)]).max().item())
            qc, kc = (x[rows].transpose(0, 1) for x in (q, k))  # [HV, L, K]
            Gc = G.transpose(0, 1)
            causal = torch.ones(L, L, dtype=torch.bool, device=DEVICE).tril()
            decay = torch.where(causal[..., None], Gc[:, :, None] - Gc[:, None], -float("inf")).exp()
            P = recipe.scale * torch.einsum("htk,hsk,htsk->hts", qc, kc, decay)
            A = torch.einsum("htk,hsk,htsk->hts", kc, kc, decay).tril(-1)
            M = torch.eye(L, dtype=torch.float64, device=DEVICE) + b64[rows].T[:, :, None] * A
            expected = dict(P=P, T=torch.linalg.inv(M), Qd=recipe.scale * Gc.exp() * qc, Ke=Gc.exp() * kc,
                            Kd=(Gc[:, -1:] - Gc).exp() * kc)
            for name, ref in expected.items():
                got = ops[name][rows].transpose(0, 1).double()
                if name in ("P", "T"):
                    got, zeros = got[..., :L], got[..., L:]
                    assert (zeros == 0).all(), f"{name}: columns past the chunk's rows must be zero"
                assert_close(got, ref, 1e-2, f"{name} of the chunk at token {t0}")
            assert_close(ops["G"][rows.stop - 1].double(), G[-1], 2e-3, f"G at the end of the chunk at token {t0}")
        bos += length
    if gate == "raw":
        assert widest >= intra_cute.SPAN_LIMIT, f"no block for the exact kernel (widest span {widest:.1f})"
    else:
        assert widest < intra_cute.SPAN_LIMIT, f"a block spans {widest:.1f}"


def test_rows_past_2_31_elements():
    """Offsets of a packed batch past 2^31 elements: 64-bit (``assert_rows_past_2_31_elements``)."""
    assert_rows_past_2_31_elements(CUTE)
