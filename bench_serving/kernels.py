"""``python -m bench_serving kernels``: every operation on every available backend and installed peer.

For each case, every candidate first runs once on the same inputs and is compared with the torch
reference backend (outputs and final states, relative error <= 5e-3, DESIGN section 7); one that
disagrees is reported as wrong and not timed, one that raises as failed. Candidates: the cula
backends, then the installed peers (peers.py): FLA for every family; for GDN FlashInfer (prefill
and decode, on the pool), FlashQLA (prefill) and vLLM's serving decode kernel (decode, on the
pool). Prefill reports ns per token-head, decode TB/s of state traffic (one read and one write
of every live state); both report the ratio to FLA measured in this process. Decode is timed as
CUDA-graph replay, as engines run it (a contender that cannot be captured is timed eagerly and
marked so); prefill eagerly, as engines run it, and also as CUDA-graph replay where the contender
can be captured ("graph": the device time without the host's launch work, which dominates small
prefills).
"""
from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from cula_serve import cula_decode, cula_gdn, cula_kda, cula_lightning, dispatch
from cula_serve.inputs import random_inputs, relative_error

from . import peers
from .cases import Case, cpu_cases, gpu_cases
from .plotting import pyplot
from .timing import time_call, time_graph

PREFILL = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}
AGREEMENT = 5e-3


def _inputs(case: Case, device, generator):
    lead = (1, sum(case.seqlens)) if case.op == "prefill" else (case.batch, 1)
    kw = random_inputs(case.mode, lead, H=case.H, HV=case.HV, K=case.K, V=case.V, device=device,
                       fused_gate=case.raw_gates, generator=generator)
    n = len(case.seqlens) if case.op == "prefill" else case.batch
    # a pool with spare slots and permuted indices, as an engine's would be; slot 0 stays free
    # because vLLM's decode kernel treats it as its null block
    pool = 0.1 * torch.randn(2 * n, case.HV, case.V, case.K, generator=generator).to(device)
    slots = (1 + torch.randperm(2 * n - 1, generator=generator)[:n]).to(torch.int32).to(device)
    return kw, pool, slots


def _cula_call(case, kw, pool, slots, backend, **extra):
    if case.op == "prefill":
        cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], dtype=torch.int32, device=pool.device)

        def run():
            return PREFILL[case.mode](**kw, cu_seqlens=cu, state_pool=pool, state_indices=slots, backend=backend,
                                      **extra)[0]
    else:
        qkv = {k: kw[k] for k in ("q", "k", "v")}
        rest = {k: v for k, v in kw.items() if k not in qkv}

        def run():
            return cula_decode(**qkv, state_pool=pool, mode=case.mode, state_indices=slots, backend=backend,
                               **rest, **extra)[0]
    return run


def _peer(out, name, build):
    """Append ``(name, run, pool_or_None)`` from ``build()``, or ``(name, error, None)`` if it raises."""
    try:
        out.append((name, *build()))
    except Exception as err:  # noqa: BLE001 - a peer that cannot run this case is reported, not fatal
        out.append((name, err, None))


def _candidates(case, device, kw, pool, slots, versions):
    """[(name, run or the exception that prevented it, pool_or_None)] for every backend and peer
    that can run the case. With a pool, ``run()`` returns the output and the final states are read
    from the pool; without, it returns (output, final states [N, HV, V, K])."""
    out = []
    for name in dispatch.BACKENDS:
        module, _ = dispatch.backend_status(name, device)
        if module is None or (name == "torch") == (device.type == "cuda"):
            # on a GPU the torch reference is the cross-check, not a contender; on the CPU it is the
            # only backend worth timing (Triton's interpreter is a correctness tool)
            continue
        work = pool.clone()
        out.append((f"cula-{name}", _cula_call(case, kw, work, slots, name), work))
    if device.type != "cuda":
        return out  # the peers are GPU libraries; the CPU table is the reference backend alone
    cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], device=device) if case.op == "prefill" else None
    if versions.get("fla"):
        # FLA and FlashQLA take dense states: gathered from the pool here, outside the timed call
        _peer(out, "fla", lambda: ((peers.fla_prefill(case.mode, kw, pool[slots.long()].clone(), cu)
                                    if case.op == "prefill" else
                                    peers.fla_decode(case.mode, kw, pool[slots.long()].clone())), None))
    if case.mode != "gdn":
        return out
    if versions.get("flashinfer"):
        def flashinfer():
            work = pool.clone()
            return ((peers.flashinfer_prefill(kw, work, slots, case.seqlens) if case.op == "prefill"
                     else peers.flashinfer_decode(kw, work, slots)), work)
        _peer(out, "flashinfer", flashinfer)
    if case.op == "prefill" and versions.get("flashqla"):
        _peer(out, "flashqla", lambda: (peers.flashqla_prefill(kw, pool[slots.long()].clone(), cu), None))
    if case.op == "decode" and versions.get("vllm"):
        def vllm():
            work = pool.clone()
            return peers.vllm_decode(kw, work, slots), work
        _peer(out, "vllm", vllm)
    return out


def _state_bytes(case, pool):
    return 2 * case.batch * case.HV * case.V * case.K * pool.element_size()


def run_case(case: Case, device, versions, generator):
    kw, pool, slots = _inputs(case, device, generator)
    ref_pool = pool.clone()
    ref_o = _cula_call(case, kw, ref_pool, slots, "torch")()
    ref_final = ref_pool[slots.long()]
    rows = []
    for name, run, work in _candidates(case, device, kw, pool, slots, versions):
        start_states = None if work is None else work.clone()
        row = dict(case=case.name, op=case.op, backend=name)
        try:
            if isinstance(run, Exception):
                raise run
            result = run()
            o, final = (result, work[slots.long()]) if work is not None else result
            row["rel_err"] = max(relative_error(o.reshape(ref_o.shape), ref_o), relative_error(final, ref_final))
            if not row["rel_err"] <= AGREEMENT:
                row["status"] = "wrong"
                rows.append(row)
                continue
            if work is not None:
                work.copy_(start_states)
            ms = None
            if case.op == "decode" and device.type == "cuda":
                ms = time_graph(run, device)
                row["timing"] = "graph" if ms is not None else "eager (capture failed)"
            if ms is None:
                ms = time_call(run, device)
                row.setdefault("timing", "eager")
        except Exception as exc:  # noqa: BLE001 - one contender failing must not stop the table
            text = str(exc).strip().splitlines()
            row.update(status="failed", error=f"{type(exc).__name__}: {text[0] if text else ''}")
            rows.append(row)
            continue
        row.update(status="ok", ms=ms)
        if case.op == "prefill":
            token_heads = sum(case.seqlens) * case.HV
            row["ns_per_token_head"] = ms * 1e6 / token_heads
            if device.type == "cuda":
                if work is not None:
                    work.copy_(start_states)
                graph_ms = time_graph(run, device)
                if graph_ms is not None:
                    row.update(graph_ms=graph_ms, graph_ns_per_token_head=graph_ms * 1e6 / token_heads)
        else:
            row["TBps"] = _state_bytes(case, pool) / (ms * 1e-3) / 1e12
        rows.append(row)
    fla = next((r for r in rows if r["backend"] == "fla" and r["status"] == "ok"), None)
    for r in rows:
        if fla and r["status"] == "ok":
            r["speedup_vs_fla"] = fla["ms"] / r["ms"]
    return rows


def _print_rows(rows):
    for r in rows:
        if r["status"] == "failed":
            print(f"{r['case']:38s} {r['backend']:12s} FAILED, not timed: {r['error']}")
            continue
        if r["status"] != "ok":
            print(f"{r['case']:38s} {r['backend']:12s} WRONG: rel err {r['rel_err']:.2e} > {AGREEMENT:g}, not timed")
            continue
        metric = (f"{r['ns_per_token_head']:8.3f} ns/tok-head" if "ns_per_token_head" in r
                  else f"{r['TBps']:8.3f} TB/s       ")
        ratio = f"{r['speedup_vs_fla']:6.2f}x FLA" if "speedup_vs_fla" in r else ""
        graph = f" graph {r['graph_ns_per_token_head']:.3f}" if "graph_ns_per_token_head" in r else ""
        print(f"{r['case']:38s} {r['backend']:12s} {r['ms']:9.4f} ms {metric} {ratio:11s} {r['timing']:6s} "
              f"(err {r['rel_err']:.1e}){graph}",
              flush=True)


def environment(device) -> dict:
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               python=platform.python_version(), torch=torch.__version__, device=str(device))
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    env["peers"] = peers.peer_versions()
    return env


def plot(rows, path: Path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(16, 6))
    for ax, op, metric, label in ((axes[0], "prefill", "ns_per_token_head", "ns per token-head (lower is better)"),
                                  (axes[1], "decode", "TBps", "TB/s of state traffic (higher is better)")):
        ok = [r for r in rows if r["op"] == op and r["status"] == "ok"]
        cases = list(dict.fromkeys(r["case"] for r in ok))
        backends = list(dict.fromkeys(r["backend"] for r in ok))
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            xs = [j + i * width for j, c in enumerate(cases) for r in ok if r["case"] == c and r["backend"] == b]
            ys = [r[metric] for c in cases for r in ok if r["case"] == c and r["backend"] == b]
            ax.bar(xs, ys, width, label=b)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(label)
        ax.set_title(op)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(args) -> int:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    env = environment(device)
    print(f"bench_serving kernels on {env.get('gpu', 'cpu')}: torch {env['torch']}, triton {env['triton']}, "
          f"python {env['python']}, {env['date']}")
    status = peers.select(getattr(args, "peers", None))
    for peer, (version, why) in status.items():
        print(f"  peer {peer}: {version or why + ', skipped'}")
    versions = peers.peer_versions(status)
    if device.type != "cuda":
        print("no GPU: a small table on the reference backend; timings need a GPU")
    cases = gpu_cases() if device.type == "cuda" else cpu_cases()
    if args.filter:
        cases = [c for c in cases if all(word in c.name for word in args.filter.split())]
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.name}", file=sys.stderr, flush=True)
        case_rows = run_case(case, device, versions, generator)
        _print_rows(case_rows)
        rows += case_rows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    print(f"json: {out_dir / 'kernels.json'}")
    plot(rows, out_dir / "kernels.png")
    return 1 if any(r["status"] != "ok" for r in rows) else 0
