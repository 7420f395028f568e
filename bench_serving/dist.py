"""``python -m bench_serving dist``: context-parallel prefill of one long sequence, 1 GPU against N.

One process per GPU (NCCL; gloo and the torch backend on a machine without GPUs, as a smoke run).
For each model and sequence length, every rank draws the same inputs on its GPU and runs the
whole sequence alone once (the 1-GPU reference it checks against; rank 0's run is the timed
1-GPU baseline); then the ranks run ``cula_*_cp`` on their shares of the tokens together. Reported:
1-GPU and N-GPU milliseconds (N-GPU = the slowest rank per repetition, median over repetitions;
each rank's own median beside it, to show the balance),
speed-up, the all-gather of the state maps timed alone on the same tensors (communication), and the
largest relative error of outputs and final state against the 1-GPU run.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cula_serve import cula_gdn, cula_kda, cula_lightning
from cula_serve.dist import cula_gdn_cp, cula_kda_cp, cula_lightning_cp, split_cu_seqlens_for_sp
from cula_serve.inputs import MODEL_SHAPES, random_inputs, relative_error

from .plotting import pyplot
from .timing import time_call

SINGLE = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}
CP = {"gdn": cula_gdn_cp, "kda": cula_kda_cp, "lightning": cula_lightning_cp}
CPU_SHAPES = dict(H=2, HV=4, K=16, V=16)


def _per_token(x, T):
    return isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[1] == T


def _run_case(rank, world_size, device, model, T, weights, reps, backend):
    shape = MODEL_SHAPES[model] if device.type == "cuda" else dict(mode=MODEL_SHAPES[model]["mode"], **CPU_SHAPES)
    mode = shape["mode"]
    dims = {key: shape[key] for key in ("H", "HV", "K", "V")}
    generator = torch.Generator(device=device).manual_seed(T + len(model))
    kw = random_inputs(mode, (1, T), dtype=torch.bfloat16, device=device, generator=generator, **dims)
    initial = 0.1 * torch.randn(1, dims["HV"], dims["V"], dims["K"], device=device, generator=generator)
    cu = torch.tensor([0, T], dtype=torch.int32)
    slots = torch.zeros(1, dtype=torch.int32)

    # 1-GPU reference (every rank, for checking); rank 0's runs are the timed baseline
    ref_pool = initial.clone()
    ref_o, _ = SINGLE[mode](**kw, cu_seqlens=cu.to(device), state_pool=ref_pool, state_indices=slots.to(device),
                            backend=backend)
    single_ms = None
    if rank == 0:
        pool = initial.clone()
        single_ms = time_call(lambda: SINGLE[mode](**kw, cu_seqlens=cu.to(device), state_pool=pool.copy_(initial),
                                                   state_indices=slots.to(device), backend=backend),
                              device, reps=reps, warmup=1)
    dist.barrier()

    plan = split_cu_seqlens_for_sp(cu, world_size, weights=weights)[rank]
    mine = slice(plan.token_start, plan.token_end)
    local = {key: (x[:, mine] if _per_token(x, T) else x) for key, x in kw.items()}
    pool = initial.clone()

    def cp_call():
        pool.copy_(initial)
        return CP[mode](**local, cu_seqlens=cu, state_pool=pool, state_indices=slots, weights=weights,
                        backend=backend)[0]

    o = cp_call()  # compile, and the result to check
    errors = torch.tensor([relative_error(o, ref_o[:, mine]) if plan.num_tokens else 0.0,
                           relative_error(pool, ref_pool) if rank == world_size - 1 else 0.0], device=device)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)

    rank_times = []  # per repetition, every rank's milliseconds
    for _ in range(reps):
        dist.barrier()
        elapsed = torch.tensor([time_call(cp_call, device, reps=1, warmup=0)], device=device)
        gathered = [torch.empty_like(elapsed) for _ in range(world_size)]
        dist.all_gather(gathered, elapsed)
        rank_times.append([float(t) for t in gathered])
    carry = torch.zeros(dims["HV"], dims["K"] + dims["V"], dims["K"], device=device)
    gathered = [torch.empty_like(carry) for _ in range(world_size)]
    comm_ms = time_call(lambda: dist.all_gather(gathered, carry), device, reps=reps, warmup=2)
    return dict(model=model, mode=mode, tokens=T, gpus=world_size, weights=weights, single_ms=single_ms,
                cp_ms=statistics.median(max(times) for times in rank_times),
                rank_ms=[statistics.median(times[r] for times in rank_times) for r in range(world_size)],
                comm_ms=comm_ms, output_error=float(errors[0]),
                state_error=float(errors[1]))


def _worker(rank, world_size, init_file, args, results_file):
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, device_id=device if cuda else None)
    backend = None if cuda else "torch"
    rows = []
    try:
        for model in args.models:
            for T in args.tokens:
                if rank == 0:
                    print(f"[dist] {model} {T} tokens on {world_size} {'GPUs' if cuda else 'CPU processes'} ...",
                          flush=True)
                rows.append(_run_case(rank, world_size, device, model, T, args.weights, args.reps, backend))
        if rank == 0:
            Path(results_file).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _table(rows):
    lines = ["| model | tokens | ranks | 1 rank ms | CP ms | speed-up | each rank ms | all-gather ms (share) "
             "| max rel. error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        each = " / ".join(f"{t:.2f}" for t in r["rank_ms"])
        lines.append(f"| {r['model']} ({r['mode']}) | {r['tokens']} | {r['gpus']} | {r['single_ms']:.2f} | "
                     f"{r['cp_ms']:.2f} | {r['single_ms'] / r['cp_ms']:.2f}x | {each} | {r['comm_ms']:.3f} "
                     f"({100 * r['comm_ms'] / r['cp_ms']:.1f}%) | {max(r['output_error'], r['state_error']):.1e} |")
    return "\n".join(lines)


def _plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{r['model']}\n{r['tokens']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(rows)), 3.5))
    ax.bar(labels, [r["single_ms"] / r["cp_ms"] for r in rows], color="tab:blue")
    ax.axhline(rows[0]["gpus"], color="gray", linestyle="--", label="ideal")
    ax.set_ylabel(f"speed-up on {rows[0]['gpus']} GPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < args.nproc:
        print(f"dist: --nproc {args.nproc} needs {args.nproc} GPUs, this machine has {torch.cuda.device_count()}")
        return 2
    if not cuda:
        print("dist: no GPU here: a small correctness run with gloo and the torch backend; timings need GPUs")
        args.tokens = sorted({min(t, 2048) for t in args.tokens})
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        mp.spawn(_worker, args=(args.nproc, os.path.join(tmp, "init"), args, results), nprocs=args.nproc, join=True)
        rows = json.loads(Path(results).read_text())
    meta = dict(date=datetime.date.today().isoformat(), torch=torch.__version__, python=sys.version.split()[0],
                device=torch.cuda.get_device_name(0) if cuda else "cpu")
    (out_dir / "dist.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    _plot(rows, out_dir / "dist.png")
    print(f"{meta['device']}, torch {meta['torch']}, {meta['date']}")
    print(_table(rows))
    return 0
