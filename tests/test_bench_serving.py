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
