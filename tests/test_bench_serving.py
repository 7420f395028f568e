"""bench_serving runs without a GPU: a small reference table, cross-checked, written as JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_table_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "bench_serving", "kernels", "--filter", "gdn", "--out-dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "timings need a GPU" in out.stdout
    report = json.loads((tmp_path / "kernels.json").read_text())
    ops = {(r["op"], r["backend"], r["status"]) for r in report["rows"]}
    assert ("prefill", "cula-torch", "ok") in ops and ("decode", "cula-torch", "ok") in ops
    assert all(r["rel_err"] <= 5e-3 for r in report["rows"])
    assert report["environment"]["torch"]


def test_decode_latency_says_it_needs_a_gpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "bench_serving", "decode-latency"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "needs a GPU" in out.stdout


def test_copy_ceiling_copies_every_element_and_nothing_past_the_end():
    """decode-latency's ceiling row times this copy: it must move every value of a buffer whose
    length is not a multiple of the block (here in Triton's interpreter) and write nothing beyond."""
    pytest.importorskip("triton")
    from bench_serving.copy_ceiling import _streaming_copy
    n = 3 * 256 + 17
    source = torch.randn(n)
    target = torch.full((n + 64,), float("nan"))
    _streaming_copy(source, target[:n], block=256)
    assert torch.equal(target[:n], source) and target[n:].isnan().all()


# ---------------------------------------------------------------------------------------------
# peers: availability lines, gate forms, the vLLM kernel carrier, which peers each step gets
# ---------------------------------------------------------------------------------------------

import base64  # noqa: E402
import csv  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import zipfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bench_serving import decode_latency, peers, vllm_kernel  # noqa: E402
from cula_serve import cula_decode  # noqa: E402
from cula_serve.inputs import random_inputs, relative_error, to_float64  # noqa: E402


@pytest.fixture
def fresh_peer_status():
    peers.peer_status.cache_clear()
    yield
    peers.peer_status.cache_clear()


def test_absent_and_broken_peers_get_one_line_each(tmp_path, monkeypatch, fresh_peer_status):
    (tmp_path / "peer_that_raises.py").write_text("raise RuntimeError('no kernel for this GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(peers, "_IMPORTS", {"missing": ("peer_that_is_not_installed", "nope"),
                                            "broken": ("peer_that_raises", "nope")})
    monkeypatch.setattr(vllm_kernel, "REAL_MODULE", "peer_that_is_not_installed.ops")
    monkeypatch.setattr(vllm_kernel, "CARRIER", "peer_carrier_that_is_not_installed")
    status = peers.peer_status()
    assert set(status) == {"missing", "broken", "vllm"}
    assert status["missing"][0] is None and status["missing"][1].startswith("not installed")
    assert status["broken"][0] is None and "unusable" in status["broken"][1]
    assert "no kernel for this GPU" in status["broken"][1]
    lines = peers.absence_lines()
    assert len(lines) == 3 and all(line.endswith("skipped") for line in lines)
    assert peers.peer_versions() == {"missing": None, "broken": None, "vllm": None}


def test_kernels_on_cpu_names_every_peer_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "bench_serving", "kernels", "--filter", "gdn decode",
                          "--out-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for peer in peers.PEERS:
        assert sum(line.strip().startswith(f"peer {peer}:") for line in out.stdout.splitlines()) == 1, out.stdout
    # the peers are GPU libraries: the CPU table holds the reference backend alone
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert rows and {r["backend"] for r in rows} == {"cula-torch"}


def _fused_gate(g, beta, A_log, a, dt_bias, b):
    A = A_log.double().exp().view(*A_log.shape, *([1] * (a.dim() - 3)))
    g_back = -A * torch.nn.functional.softplus(a.double() + dt_bias.double())
    return g_back, torch.sigmoid(b.double())


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_engine_gates_reproduce_prepared_gates(mode, generator):
    kw = random_inputs(mode, (3, 2), H=2, HV=4, K=8, V=8, fused_gate=False, generator=generator)
    kw["g"][0, 0] = -25.0  # past the kernels' softplus threshold (20): a = -g there
    kw["g"][0, 1] = -1e-6
    A_log, a, dt_bias, b = peers.engine_gates(kw)
    assert A_log.shape == (4,) and dt_bias.shape == kw["g"].shape[2:] and a.dtype == torch.float32
    g_back, beta_back = _fused_gate(kw["g"], kw["beta"], A_log, a, dt_bias, b)
    assert relative_error(g_back, kw["g"].double()) < 1e-6
    assert relative_error(beta_back, kw["beta"].double()) < 1e-6


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_raw_gates_pass_through_and_evaluate_like_the_reference(mode, generator):
    kw = random_inputs(mode, (3, 1), H=2, HV=4, K=8, V=8, fused_gate=True, generator=generator)
    A_log, a, dt_bias, b = peers.engine_gates(kw)
    assert torch.equal(a, kw["g"]) and torch.equal(b, kw["beta"]) and torch.equal(dt_bias, kw["dt_bias"])
    # prepared_inputs (what FLA-style peers get) gives the reference's own gate evaluation
    prepared = peers.prepared_inputs(mode, kw)
    assert not any(key in prepared for key in ("A_log", "dt_bias", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel"))
    pool = 0.1 * torch.randn(4, 4, 8, 8, generator=generator, dtype=torch.float64)
    slots = torch.tensor([3, 0, 2], dtype=torch.int32)
    runs = []
    for call in (kw, prepared):
        c = to_float64(call)
        qkv = {k: c.pop(k) for k in ("q", "k", "v")}
        work = pool.clone()
        o, _ = cula_decode(**qkv, state_pool=work, mode=mode, state_indices=slots, backend="torch",
                           compute_dtype=torch.float64, **c)
        runs.append((o, work))
    assert relative_error(runs[1][0], runs[0][0]) < 1e-6 and relative_error(runs[1][1], runs[0][1]) < 1e-6


def test_gates_in_bf16_for_bf16_pools_round_only(generator):
    kw = random_inputs("gdn", (2, 1), H=2, HV=4, K=8, V=8, fused_gate=False, generator=generator)
    _, a32, _, b32 = peers.engine_gates(kw)
    _, a16, _, b16 = peers.engine_gates(kw, torch.bfloat16)
    assert a16.dtype == b16.dtype == torch.bfloat16
    assert torch.equal(a16, a32.to(torch.bfloat16)) and torch.equal(b16, b32.to(torch.bfloat16))


_STAND_IN_KERNEL = '''
import torch

from vllm.triton_utils import tl, triton


@triton.jit
def _scale_kernel(x, y, factor, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y + offs, tl.load(x + offs) * factor)


def fused_sigmoid_gating_delta_rule_update(x, factor):
    y = torch.empty_like(x)
    _scale_kernel[(1,)](x, y, factor, N=x.numel())
    return y
'''


def test_vllm_kernel_carrier_wheel_loads_unchanged_file(tmp_path, monkeypatch):
    wheel = vllm_kernel.carrier_wheel(_STAND_IN_KERNEL.encode(), b"Apache-2.0", "9.9.9", tmp_path / "wheels")
    assert wheel.name == f"{vllm_kernel.CARRIER}-9.9.9-py3-none-any.whl"
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        record = list(csv.reader(io.StringIO(zf.read(next(n for n in names if n.endswith("RECORD"))).decode())))
        for name, digest, size in record:
            if digest:  # every file but RECORD itself is hashed, as pip expects
                data = zf.read(name)
                assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert int(size) == len(data)
        assert {n for n, _, _ in record} == set(names)
        zf.extractall(site)
    assert (site / vllm_kernel.CARRIER / "fused_sigmoid_gating.py").read_text() == _STAND_IN_KERNEL
    monkeypatch.setattr(vllm_kernel, "REAL_MODULE", "vllm_is_not_installed_here.ops")
    monkeypatch.syspath_prepend(str(site))
    fn, origin = vllm_kernel.load()
    assert "9.9.9" in origin and "carrier" in origin
    assert "vllm.triton_utils" not in sys.modules  # the stand-in is gone once the file is imported
    x = torch.arange(8, dtype=torch.float32)
    assert torch.equal(fn(x, 3.0), 3 * x)


def test_vllm_kernel_load_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(vllm_kernel, "REAL_MODULE", "vllm_is_not_installed_here.ops")
    monkeypatch.setattr(vllm_kernel, "CARRIER", "carrier_is_not_installed_here")
    with pytest.raises(ImportError, match="python -m bench_serving.vllm_kernel build"):
        vllm_kernel.load()


def test_vllm_adapter_refuses_the_null_slot():
    with pytest.raises(ValueError, match="null block"):
        peers._check_no_null_slot("state_indices", torch.tensor([[1, 0], [2, 3]], dtype=torch.int32))
    peers._check_no_null_slot("state_indices", torch.tensor([1, 3], dtype=torch.int32))


ALL_PEERS = dict(fla="0.6.0", flashinfer="0.7.2.post1", flashqla="0.1.3", vllm="vllm 0.33.0")


@pytest.mark.parametrize("mode, state_dtype, T, expected", [
    ("gdn", torch.float32, 0, [("fla", "decode"), ("flashinfer", "decode"), ("vllm", "decode")]),
    ("gdn", torch.bfloat16, 0, [("flashinfer", "decode"), ("vllm", "decode")]),  # FLA writes fp32 states
    ("kda", torch.float32, 0, [("fla", "decode")]),
    ("lightning", torch.bfloat16, 0, []),
    ("gdn", torch.float32, 4, [("vllm", "verify slots"), ("flashinfer", "verify+commit buffer")]),
    ("kda", torch.float32, 4, []),
])
def test_decode_latency_peer_steps(mode, state_dtype, T, expected, generator):
    shape = dict(H=2, HV=4, K=8, V=8)
    kw, pool, slots, columns = decode_latency._inputs(mode, shape, 3, T, state_dtype, torch.device("cpu"), generator)
    assert pool.dtype == state_dtype and pool.shape == (2 * 3 * max(T, 1), 4, 8, 8)
    assert (slots > 0).all() and (columns > 0).all()  # slot 0 stays free (vLLM's null block)
    assert columns.reshape(-1).unique().numel() == columns.numel()
    steps = decode_latency._peer_steps(mode, kw, pool, slots, columns, T, state_dtype, ALL_PEERS)
    assert [(peer, op) for peer, op, _ in steps] == expected
    assert decode_latency._peer_steps(mode, kw, pool, slots, columns, T, state_dtype,
                                      dict.fromkeys(ALL_PEERS)) == []


def test_decode_latency_reference_of_slots_verify_writes_every_column(generator):
    shape = dict(H=2, HV=4, K=8, V=8)
    kw, pool, slots, columns = decode_latency._inputs("gdn", shape, 2, 3, torch.float32, torch.device("cpu"), generator)
    o, states = decode_latency._reference("gdn", kw, pool, slots, columns, 3, "slots")
    assert o.shape == (2, 3, 4, 8) and states.shape == (6, 4, 8, 8)
    # column t holds the state after token t: the last one is T single-token decodes from column 0
    work = pool.clone()
    for t in range(3):
        step = {k: (v[:, t:t + 1] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v) for k, v in kw.items()}
        qkv = {k: step.pop(k) for k in ("q", "k", "v")}
        cula_decode(**qkv, state_pool=work, mode="gdn", state_indices=slots, backend="torch", **step)
    assert relative_error(states.view(2, 3, 4, 8, 8)[:, -1], work[slots.long()]) < 1e-5


def test_decode_latency_layered_verify_rows_and_memory_guard(monkeypatch, generator, capsys):
    """The per-layer verify rows: one per protocol, TB/s (T + 3 state volumes) for buffer and
    slots only, the ratio over the decode's per-layer time; none when the L layers' pools would
    take more than half the free GPU memory (the timing itself is stubbed: it needs a GPU)."""
    shape = dict(H=2, HV=4, K=8, V=8)
    B, T, layers = 3, 4, 16
    kw, pool, slots, columns = decode_latency._inputs("gdn", shape, B, T, torch.float32, torch.device("cpu"),
                                                      generator)
    state_bytes = 2 * B * 4 * 8 * 8 * 4
    monkeypatch.setattr(decode_latency, "_time_layers", lambda build, L, device: 0.002)
    key = dict(model="m", state="float32", B=B)
    need = layers * (pool.numel() + B * T * pool[0].numel()) * 4
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * need, 4 * need))
    rows = decode_latency._layered_verify("gdn", kw, pool, slots, columns, T, "triton", state_bytes, 0.001, layers,
                                          torch.device("cpu"), key)
    assert [row["op"] for row in rows] == [f"verify+commit {p}" for p in ("deferred", "buffer", "slots", "pending")]
    assert all(row["layers"] == layers and row["vs_decode"] == 2.0 and row["backend"] == "cula-triton" for row in rows)
    for row in rows:
        expected = (T + 3) * state_bytes / 2 / 2e-6 / 1e12 if row["op"].endswith(("buffer", "slots")) else None
        assert row.get("TBps") == expected
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * need - 2, 4 * need))
    assert decode_latency._layered_verify("gdn", kw, pool, slots, columns, T, "triton", state_bytes, 0.001, layers,
                                          torch.device("cpu"), key) == []
    assert "skipped" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# offline: the trace, the continuous-batching scheduler, the attention cores, the whole command
# ---------------------------------------------------------------------------------------------

from bench_serving import attention_cores, offline_engine  # noqa: E402
from bench_serving.attention_cores import CulaCore, DecodeRows, FlaCore  # noqa: E402
from bench_serving.model_layers import LayerShape, LinearAttentionLayer  # noqa: E402
from bench_serving.op_clock import OpClock  # noqa: E402
from bench_serving.scheduler import AcceptanceSampler, Scheduler  # noqa: E402
from bench_serving.trace import make_trace  # noqa: E402
from cula_serve import StatePool, cula_gdn, cula_kda, cula_lightning  # noqa: E402


def _serve(trace, *, max_num_seqs, budget, T=1, rate=0.0, slots_per_sequence=1, seed=0, tamper=None):
    """Drive the scheduler as the offline engine does, without kernels; check each step's plan.
    ``tamper(plan, committed)`` may corrupt the counts handed back (to prove check() notices)."""
    pool = StatePool(max_num_seqs * slots_per_sequence, 2, 4, 4)
    scheduler = Scheduler(trace, pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, verify_tokens=T,
                          slots_per_sequence=slots_per_sequence)
    sampler = AcceptanceSampler(T, rate, seed)
    drawn_log = []
    while (plan := scheduler.plan()) is not None:
        assert plan.prefill_tokens + T * len(plan.decode) <= budget
        assert len(scheduler.running) <= max_num_seqs
        held = [s for seq in scheduler.running for s in seq.slots]
        assert len(held) == len(set(held)) == len(scheduler.running) * slots_per_sequence
        assert all(not seq.in_prefill for seq in plan.decode)
        drawn = [sampler.draw() for _ in plan.decode]
        committed = scheduler.committed_counts(plan, drawn)
        drawn_log.append((drawn, [seq.remaining for seq in plan.decode], committed))
        if tamper:
            committed = tamper(plan, committed)
        scheduler.finish_step(plan, committed)
    return scheduler, pool, drawn_log


@pytest.mark.parametrize("T, rate, slots_per_sequence", [(1, 0.0, 1), (4, 1.0, 1), (4, 0.0, 1), (3, 0.6, 3)])
def test_scheduler_serves_every_request_exactly(T, rate, slots_per_sequence):
    trace = make_trace(23, 37, 9, distribution="uniform", spread=0.9, seed=3)
    scheduler, pool, drawn_log = _serve(trace, max_num_seqs=5, budget=40, T=T, rate=rate,
                                        slots_per_sequence=slots_per_sequence)
    summary = scheduler.check()
    by_id = {seq.request.rid: seq for seq in scheduler.finished}
    for r in trace:  # every request: its whole prompt in contiguous chunks, exactly its output length
        seq = by_id[r.rid]
        assert seq.prefilled == r.input_len and sum(length for _, length in seq.chunks) == r.input_len
        assert seq.generated == r.output_len == 1 + sum(seq.accepted)
        assert len(seq.slots) == slots_per_sequence
    assert pool.num_free == pool.num_slots  # every slot came back
    assert summary["output_tokens"] == sum(r.output_len for r in trace)
    assert summary["decode_tokens"] == sum(r.output_len - 1 for r in trace)
    assert sum(n * count for n, count in summary["accepted_histogram"].items()) == summary["decode_tokens"]
    for drawn, remaining, committed in drawn_log:  # accepted lengths: drawn, capped by what is left
        assert committed == [min(d, left) for d, left in zip(drawn, remaining)]
        if rate == 1.0:
            assert drawn == [T] * len(drawn)
        if rate == 0.0:
            assert drawn == [1] * len(drawn)


def test_scheduler_check_notices_lost_slots_and_wrong_counts():
    trace = make_trace(6, 20, 5, distribution="fixed", seed=0)
    scheduler, pool, _ = _serve(trace, max_num_seqs=3, budget=24)
    pool.alloc(1)  # a slot that never comes back
    with pytest.raises(RuntimeError, match="not returned"):
        scheduler.check()

    def one_token_too_many(plan, committed):  # request 2's last verify keeps a token past its end
        return [c + 1 if seq.request.rid == 2 and seq.remaining == c else c
                for seq, c in zip(plan.decode, committed)]
    scheduler, _, _ = _serve(trace, max_num_seqs=3, budget=24, T=3, rate=0.0, tamper=one_token_too_many)
    with pytest.raises(RuntimeError, match="request 2"):
        scheduler.check()


def test_acceptance_sampler_mean_and_range():
    sampler = AcceptanceSampler(4, 0.7, seed=1)
    draws = [sampler.draw() for _ in range(20000)]
    assert set(draws) == {1, 2, 3, 4}
    assert abs(sum(draws) / len(draws) - sampler.expected) < 0.03
    assert sampler.expected == pytest.approx(1 + 0.7 + 0.7 ** 2 + 0.7 ** 3)
    with pytest.raises(ValueError, match="acceptance rate"):
        AcceptanceSampler(4, 1.5, seed=0)


def test_trace_is_reproducible_and_within_bounds():
    a = make_trace(50, 100, 20, distribution="uniform", spread=0.5, seed=7)
    assert a == make_trace(50, 100, 20, distribution="uniform", spread=0.5, seed=7)
    assert a != make_trace(50, 100, 20, distribution="uniform", spread=0.5, seed=8)
    assert all(50 <= r.input_len <= 150 and 10 <= r.output_len <= 30 for r in a)
    assert all(r.input_len == 100 for r in make_trace(5, 100, 20, distribution="fixed"))
    assert all(1 <= r.input_len <= 800 for r in make_trace(200, 100, 20, distribution="lognormal", spread=1.0))
    with pytest.raises(ValueError, match="distribution"):
        make_trace(5, 10, 2, distribution="zipf")


def _fla_stand_in(mode):
    """FLA's chunk / fused-recurrent signatures on cula-serve's torch backend, with FLA's
    semantics: dense K-last states in, dense final states out, varlen with empty sequences and
    tokens past cu_seqlens[-1] ignored. Lets the FLA core's gathers, scatters and commit packing
    run on the CPU."""
    prefill = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}[mode]

    def run(q, k, v, g=None, beta=None, *, initial_state, output_final_state, state_v_first, cu_seqlens=None,
            cu_seqlens_cpu=None, g_gamma=None, **options):
        assert state_v_first and initial_state.dtype == torch.float32
        B, T = q.shape[:2]
        if cu_seqlens is None:  # a [B, T] batch is B sequences of T tokens
            q, k, v, g, beta = (None if x is None else x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
            cu_seqlens = torch.arange(0, (B + 1) * T, T)
        bounds = cu_seqlens.tolist()
        o, finals = torch.zeros_like(v), []
        for n in range(len(bounds) - 1):
            a, b = bounds[n], bounds[n + 1]
            if a == b:
                finals.append(initial_state[n])
                continue
            seg = [x[:, a:b] for x in (q, k, v)]
            extra = dict(decay=g_gamma) if mode == "lightning" else dict(g=g[:, a:b], beta=beta[:, a:b])
            o_n, final = prefill(*seg, **extra, initial_state=initial_state[n:n + 1], output_final_state=True,
                                 backend="torch", **options)
            o[:, a:b] = o_n
            finals.append(final[0])
        o = o.reshape(B, T, *o.shape[2:]) if len(bounds) - 1 == B and bounds[-1] == B * T else o
        return o, torch.stack(finals) if output_final_state else None
    return run, run


@pytest.mark.parametrize("mode", ["gdn", "kda", "lightning"])
def test_fla_core_gathers_scatters_and_commits_like_cula(mode, monkeypatch):
    monkeypatch.setattr(attention_cores, "fla_functions", _fla_stand_in)
    shape = LayerShape("test", mode, hidden=32, H=2, HV=4, K=8, V=8, tp=1)
    layer = LinearAttentionLayer(shape, 0, dtype=torch.float32, device=torch.device("cpu"), seed=5)
    P, scratch = 8, 7
    start = 0.3 * torch.randn(P, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    clock = OpClock(torch.device("cpu"))
    cula_pool, fla_pool = [start.clone()], [start.clone()]
    cula = CulaCore(mode, cula_pool, [layer.core_options], clock, "deferred")
    fla = FlaCore(mode, fla_pool, [layer.core_options], clock, scratch_slot=scratch)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(3))

    def same(o_cula, o_fla, live):
        assert relative_error(o_fla, o_cula) < 1e-5
        assert relative_error(fla_pool[0][live], cula_pool[0][live]) < 1e-5
        untouched = [s for s in range(P) if s not in live and s != scratch]
        assert torch.equal(fla_pool[0][untouched], start[untouched])  # FLA's padding wrote only the scratch slot
        assert torch.equal(cula_pool[0][untouched], start[untouched])

    # chunked prefill of three packed sequences into permuted slots
    inputs, _ = layer.project_in(x[:15], (1, 15))
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    slots = torch.tensor([4, 0, 6], dtype=torch.int32)
    same(cula.prefill(0, inputs, cu, cu.long(), slots), fla.prefill(0, inputs, cu, cu.long(), slots), [4, 0, 6])
    # a decode bucket of 4 rows, the last one padding
    rows = DecodeRows(slots=torch.tensor([6, 0, 4, -1], dtype=torch.int32), num_accepted=torch.ones(4, dtype=torch.int32),
                      accepted=torch.tensor([3, 1, 2, 0], dtype=torch.int32))
    inputs, _ = layer.project_in(x[:4], (4, 1))
    o_cula, o_fla = cula.decode(0, inputs, rows), fla.decode(0, inputs, rows)
    same(o_cula[:3], o_fla[:3], [4, 0, 6])
    # MTP: verify 3 tokens per row, then keep 3, 1 and 2 of them
    inputs, _ = layer.project_in(x[:12], (4, 3))
    before = [cula_pool[0].clone(), fla_pool[0].clone()]
    (o_cula, pending_cula), (o_fla, pending_fla) = cula.verify(0, inputs, rows), fla.verify(0, inputs, rows)
    assert torch.equal(cula_pool[0], before[0]) and torch.equal(fla_pool[0], before[1])  # verify writes no state
    cula.commit(0, pending_cula, rows)
    fla.commit(0, pending_fla, rows)
    same(o_cula[:3], o_fla[:3], [4, 0, 6])
    assert not torch.equal(fla_pool[0][[4, 0, 6]], before[1][[4, 0, 6]])


def _run_offline(tmp_path, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "bench_serving", "offline", "--out-dir", str(tmp_path), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_offline_end_to_end_on_cpu(tmp_path):
    args = ["--model", "qwen3-next", "--layers", "1", "--num-requests", "5", "--input-len", "20", "--output-len", "5",
            "--max-num-seqs", "3", "--max-num-batched-tokens", "24", "--mtp", "3", "--acceptance-rate", "0.5",
            "--seed", "4"]
    out = _run_offline(tmp_path, *args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "timings need a GPU" in out.stdout
    assert sum(line.startswith("fla:") for line in out.stdout.splitlines()) == 1  # one line: no FLA here
    report = json.loads((tmp_path / "offline.json").read_text())
    [row] = report["rows"]
    trace = make_trace(5, 20, 5, distribution="uniform", spread=0.5, seed=4)
    s = row["scheduler"]
    assert row["model"] == "qwen3-next" and row["backend"] == "cula (torch)"
    assert s["requests"] == 5 and s["prompt_tokens"] == sum(r.input_len for r in trace)
    assert s["output_tokens"] == sum(r.output_len for r in trace)
    assert s["decode_tokens"] == s["output_tokens"] - 5
    assert sum(int(n) * c for n, c in s["accepted_histogram"].items()) == s["decode_tokens"]
    assert sum(s["accepted_histogram"].values()) == s["decode_rows"] and not s["nonfinite_outputs"]
    assert {"prefill", "verify", "commit", "projections (prefill)", "projections (decode)"} <= set(row["op_ms"])
    assert all(v > 0 for v in row["tokens_per_s"].values())
    assert sum(row["share"].values()) == pytest.approx(1.0)


def test_offline_warmup_round_serves_the_trace_again(tmp_path):
    """Warm-up rounds return every slot they took (the timed round's scheduler checks pass) and
    leave the timed round's plan unchanged: its summary is that of a run without warm-up."""
    args = ["--model", "kimi-linear", "--layers", "1", "--num-requests", "4", "--input-len", "20", "--output-len",
            "4", "--max-num-seqs", "2", "--max-num-batched-tokens", "24", "--seed", "2"]
    reports = []
    for rounds in ("0", "2"):
        out_dir = tmp_path / rounds
        out = _run_offline(out_dir, *args, "--warmup-rounds", rounds)
        assert out.returncode == 0, out.stdout + out.stderr
        # the progress bar names each round (tqdm's bar or the plain lines both go to stderr)
        assert ("warm-up 1/2" in out.stderr and "warm-up 2/2" in out.stderr) == (rounds == "2")
        assert "kimi-linear cula (torch) timed" in out.stderr
        reports.append(json.loads((out_dir / "offline.json").read_text()))
    assert [r["config"]["warmup_rounds"] for r in reports] == [0, 2]
    [cold], [warm] = (r["rows"] for r in reports)
    assert warm["scheduler"] == cold["scheduler"]
    assert set(warm["op_ms"]) == set(cold["op_ms"])
    assert cold["warmup_wall_s"] == [] and len(warm["warmup_wall_s"]) == 2
    assert sum(warm["op_ms"].values()) <= warm["wall_s"] * 1e3  # the timed round's operations only
    assert _run_offline(tmp_path, *args, "--warmup-rounds", "-1").returncode != 0


@pytest.mark.parametrize("mtp, protocol", [(1, "deferred"), (3, "slots")])
def test_offline_engine_warmup_round_then_timed_round(mtp, protocol):
    """In process: an engine that served the trace once (the warm-up round) serves it again with
    the same scheduler summary as a fresh engine's only run; after each round every slot but the
    engine's scratch slot is free (the scratch slot neither freed nor lost), and the timed round's
    totals and accepted lengths are its own."""
    from argparse import ArgumentParser

    from bench_serving import offline

    parser = ArgumentParser()
    offline.add_arguments(parser)
    args = parser.parse_args(["--model", "kimi-linear", "--layers", "1", "--num-requests", "5", "--input-len", "20",
                              "--output-len", "5", "--max-num-seqs", "2", "--max-num-batched-tokens", "24",
                              "--mtp", str(mtp), "--protocol", protocol, "--acceptance-rate", "0.6", "--seed", "3"])
    device = torch.device("cpu")
    offline._resolve_defaults(args, device)
    assert args.warmup_rounds == 1  # the default, on the CPU too
    trace = make_trace(5, 20, 5, distribution="uniform", spread=0.5, seed=3)
    shape = offline.layer_shape("kimi-linear", args.tp)

    class Count:
        def __init__(self):
            self.done = 0

        def update(self, n):
            self.done += n

    def serve(engine):
        progress = Count()
        with torch.no_grad():
            result = engine.run(trace, progress)
        assert progress.done == len(trace)
        pool = engine.pool
        assert pool.num_free == pool.num_slots - 1 and pool._in_use == {engine.scratch_slot}
        assert sorted(pool._free) == [s for s in range(pool.num_slots) if s != engine.scratch_slot]
        return result

    cold_engine = offline_engine.OfflineEngine(shape, "cula", args, device)
    cold_engine.warm_up()
    cold = serve(cold_engine)
    engine = offline_engine.OfflineEngine(shape, "cula", args, device)
    engine.warm_up()
    warm_up, timed = serve(engine), serve(engine)
    assert warm_up["summary"] == timed["summary"] == cold["summary"]
    assert not timed["summary"]["nonfinite_outputs"]
    assert set(timed["op_ms"]) == set(cold["op_ms"])
    assert sum(timed["op_ms"].values()) <= timed["wall_ms"]  # not the two rounds' totals together
    if mtp > 1:
        assert len(engine.drawn) == timed["summary"]["decode_rows"] == cold["summary"]["decode_rows"]


def test_offline_engine_says_why_it_cannot_run(tmp_path):
    out = _run_offline(tmp_path, "--engine", "vllm", "--model", "qwen3-next")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("--engine vllm:")]
    assert len(lines) == 1 and "no engine benchmark" in lines[0]
    assert json.loads((tmp_path / "offline_vllm.json").read_text())[0]["skipped"]


def test_offline_buckets_cover_every_batch():
    assert offline_engine.buckets(1) == [1]
    assert offline_engine.buckets(6) == [1, 2, 4, 6]
    assert offline_engine.buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_peer_selection(fresh_peer_status, monkeypatch):
    monkeypatch.setattr(peers, "peer_status", lambda: {p: ("1.0", None) for p in peers.PEERS})
    status = peers.select(["fla", "vllm"])
    assert peers.peer_versions(status) == dict(fla="1.0", flashinfer=None, flashqla=None, vllm="1.0")
    assert peers.absence_lines(status) == ["peer flashinfer: not selected (--peers), skipped",
                                           "peer flashqla: not selected (--peers), skipped"]
    assert peers.select(None) == peers.peer_status()
    with pytest.raises(ValueError, match="unknown"):
        peers.select(["flashattention"])


def test_layered_decode_reports_one_layer_of_a_graph_of_distinct_steps(monkeypatch):
    """``--graph-layers L``: one graph replays L steps, each built anew (its own pool), and the row
    is the replay's time over L."""
    built, ran = [], []

    def build():
        layer = len(built)
        built.append(layer)
        return lambda: ran.append(layer)

    def replay(fn, device):
        fn()
        return 8.0

    monkeypatch.setattr(decode_latency, "time_graph", replay)
    assert decode_latency._time_layers(build, 4, torch.device("cpu")) == 2.0
    assert sorted(ran) == [0, 1, 2, 3]
