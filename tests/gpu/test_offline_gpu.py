"""``python -m bench_serving offline`` on a GPU: its CUDA graphs compute what its eager steps
compute, its FLA core (gathers, scatters, commit replay) agrees with cula-serve on the same
weights and inputs, and the command runs end to end with every operation timed inside the graphs.

Run with ``pytest -m gpu tests/gpu/test_offline_gpu.py``. Shapes are the models' TP4 shards with
one layer and small buckets, so each case compiles and captures quickly.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench_serving import offline
from bench_serving.offline_engine import OfflineEngine
from bench_serving.model_layers import layer_shape
from cula_serve.inputs import MODEL_SHAPES, relative_error

from conftest import skip_module_unless_gpu

pytestmark = pytest.mark.gpu

skip_module_unless_gpu()

DEVICE = torch.device("cuda", torch.cuda.current_device())
ROOT = Path(__file__).resolve().parents[2]
AGREEMENT = 5e-3  # bf16 inputs, fp32 states (DESIGN section 7), between two backends
HAS_FLA = offline._fla_version() is not None


def _args(*extra):
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    args = parser.parse_args(["--layers", "1", "--tp", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                              *extra])
    offline._resolve_defaults(args, DEVICE)
    return args


def _engine(model, backend, *extra):
    engine = OfflineEngine(layer_shape(model, 4), backend, _args(*extra), DEVICE)
    with torch.no_grad():
        engine.warm_up()
    return engine


def _live_slots(engine, n, seed):
    """n allocated slots holding the same random states in every engine built with ``seed``."""
    slots = engine.pool.alloc(n)
    generator = torch.Generator(DEVICE).manual_seed(seed)
    for pool in engine.pool.tensors:
        pool[slots.long()] = 0.1 * torch.randn(n, *pool.shape[1:], generator=generator, device=DEVICE)
    return slots


def _step(engine, slots, accepted, graph: bool):
    """One decode (or verify + commit) of the rows ``slots`` through the bucket of 8, as a graph
    replay or eagerly. Returns (pools after the step, the step's hidden output) as copies."""
    step = engine.steps[8]
    n = len(slots)
    step.rows.slots.fill_(-1)
    step.rows.slots[:n] = slots
    step.rows.accepted.zero_()
    step.rows.accepted[:n] = torch.tensor(accepted, dtype=torch.int32)
    with torch.no_grad():
        if graph:
            step.graph.replay()
        else:
            step.forward()
        out = step.out.clone()
        if engine.commits:
            step.commit_graph.replay() if graph else step.commit()
    torch.cuda.synchronize()
    engine.clock.discard()
    engine.replayed.clear()
    return [p.clone() for p in engine.pool.tensors], out


@pytest.mark.parametrize("backend", ["cula", "fla"])
@pytest.mark.parametrize("mtp", ["1", "3"])
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_graph_replay_matches_eager_step(model, mtp, backend):
    if backend == "fla" and not HAS_FLA:
        pytest.skip("FLA is not installed")
    engine = _engine(model, backend, "--mtp", mtp)
    slots = _live_slots(engine, 5, seed=1)
    start = [p.clone() for p in engine.pool.tensors]
    accepted = [3, 1, 2, 3, 1] if mtp == "3" else [1] * 5
    pools_graph, out_graph = _step(engine, slots, accepted, graph=True)
    for pool, saved in zip(engine.pool.tensors, start):
        pool.copy_(saved)
    pools_eager, out_eager = _step(engine, slots, accepted, graph=False)
    assert relative_error(out_graph, out_eager) < 1e-5
    live = slots.long()
    # FLA's padding rows all write the scratch slot, in no fixed order: it holds garbage
    kept = torch.ones(start[0].shape[0], dtype=torch.bool, device=DEVICE)
    kept[engine.scratch_slot] = False
    others = kept.clone()
    others[live] = False
    for after_graph, after_eager, before in zip(pools_graph, pools_eager, start):
        assert relative_error(after_graph[kept], after_eager[kept]) < 1e-5
        assert not torch.equal(after_graph[live], before[live])  # the step did update the states
        assert torch.equal(after_graph[others], before[others])


@pytest.mark.skipif(not HAS_FLA, reason="FLA is not installed")
@pytest.mark.parametrize("mtp", ["1", "3"])
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_fla_core_agrees_with_cula(model, mtp):
    engines = [_engine(model, backend, "--mtp", mtp) for backend in ("cula", "fla")]
    slots = [_live_slots(engine, 5, seed=2) for engine in engines]
    assert torch.equal(slots[0], slots[1])
    with torch.no_grad():  # chunked prefill of three packed chunks into three of the slots
        for engine in engines:
            engine.prefill([100, 1, 70], slots[0][:3].tolist())
            engine.clock.discard()
    for a, b in zip(*(e.pool.tensors for e in engines)):
        assert relative_error(b[slots[0].long()], a[slots[0].long()]) < AGREEMENT
    accepted = [2, 3, 1, 3, 1] if mtp == "3" else [1] * 5
    (pools_cula, out_cula), (pools_fla, out_fla) = (_step(e, slots[0], accepted, graph=True) for e in engines)
    # the live rows' tokens only: FLA's padding rows run on the scratch slot's garbage state
    live_rows = len(slots[0]) * engines[0].verify_tokens
    assert relative_error(out_fla[:live_rows], out_cula[:live_rows]) < AGREEMENT
    for a, b in zip(pools_cula, pools_fla):
        assert relative_error(b[slots[0].long()], a[slots[0].long()]) < AGREEMENT


@pytest.mark.parametrize("mtp", ["1", "3"])
def test_offline_command_times_every_operation(tmp_path, mtp):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "bench_serving", "offline", "--model", "qwen3-next", "--layers", "1",
                          "--num-requests", "24", "--input-len", "300", "--output-len", "12", "--max-num-seqs", "8",
                          "--max-num-batched-tokens", "512", "--mtp", mtp, "--out-dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "offline.json").read_text())
    rows = report["rows"]
    assert [r["backend"].split()[0] for r in rows] == (["cula", "fla"] if HAS_FLA else ["cula"])
    decode_op = "verify" if mtp == "3" else "decode"
    for r in rows:
        assert r["scheduler"]["requests"] == 24 and not r["scheduler"]["nonfinite_outputs"]
        # timed inside the replayed graphs
        assert r["op_ms"][decode_op] > 0 and r["op_ms"]["projections (decode)"] > 0
        assert r["op_ms"]["prefill"] > 0 and r["op_ms"]["projections (prefill)"] > 0
        assert sum(r["share"].values()) == pytest.approx(1.0)
        if mtp == "3":
            assert r["op_ms"]["commit"] > 0
        if r["backend"].startswith("fla"):
            assert r["op_ms"]["state copy (decode)"] > 0 and "vs_fla" in r
    assert (tmp_path / "offline.png").exists() or "matplotlib is not installed" in out.stdout
