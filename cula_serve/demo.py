"""``python -m cula_serve demo``: prefill -> decode -> verify -> commit on the present device.

Each family runs a small serving sequence on the chosen backend with a bf16 model and a float32
pool, then replays the same calls on the float64 oracle (the torch backend's token-by-token
recurrence) and prints the timings and the relative error of every output and of the pool.
"""
from __future__ import annotations

import time

import torch

from .api import cula_commit, cula_decode, cula_gdn, cula_kda, cula_lightning, cula_verify
from .inputs import MODE_SHAPES, random_inputs, relative_error, to_float64
from .pool import StatePool

PREFILL = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}
ORACLE = dict(backend="torch", algorithm="recurrent", compute_dtype=torch.float64)
TOLERANCE = 5e-3  # bf16 inputs, fp32 state (DESIGN section 7)


def _on_cpu_float64(kwargs):
    return to_float64({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})


def _serving_steps(mode, pool, slots, steps, backend_kwargs):
    """Run the recorded calls against ``pool``; return the outputs and each step's seconds."""
    outputs, seconds = [], []
    device = pool.device
    for kind, kw in steps:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if kind == "prefill":
            o, _ = PREFILL[mode](**kw, state_pool=pool, state_indices=slots, **backend_kwargs)
        elif kind == "decode":
            o, _ = cula_decode(**kw, state_pool=pool, mode=mode, state_indices=slots, **backend_kwargs)
        else:
            o, pending = cula_verify(**kw["inputs"], state_pool=pool, mode=mode, state_indices=slots,
                                     protocol="deferred", **backend_kwargs)
            cula_commit(pending, kw["accepted"])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        outputs.append(o)
    return outputs, seconds


def run_demo(device: torch.device, modes, backend=None) -> int:
    generator = torch.Generator().manual_seed(0)
    seqlens = [300, 1, 129]
    N = len(seqlens)
    failed = False
    print(f"cula-serve demo on {device}: {N} sequences of {seqlens} tokens, then 3 decode steps, "
          f"then a 4-token verify + commit; bf16 inputs, float32 pool, oracle = float64 recurrence")
    print(f"{'mode':10s} {'step':14s} {'ms':>9s} {'rel err':>10s}")
    for mode in modes:
        shape = MODE_SHAPES[mode]
        prefill_kw = random_inputs(mode, (1, sum(seqlens)), **shape, device=device, generator=generator)
        prefill_kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()],
                                                dtype=torch.int32, device=device)
        steps = [("prefill", prefill_kw)]
        for _ in range(3):
            steps.append(("decode", random_inputs(mode, (N, 1), **shape, device=device, generator=generator)))
        accepted = torch.tensor([4, 1, 2], dtype=torch.int32, device=device)
        steps.append(("verify", dict(inputs=random_inputs(mode, (N, 4), **shape, device=device,
                                                          generator=generator), accepted=accepted)))

        pool = StatePool(8, shape["HV"], shape["V"], shape["K"], device=device)
        slots = pool.alloc(N)
        outputs, seconds = _serving_steps(mode, pool.layer(0), slots,
                                          steps, {} if backend is None else {"backend": backend})
        oracle_pool = torch.zeros_like(pool.layer(0), dtype=torch.float64, device="cpu")
        oracle_steps = [(kind, _on_cpu_float64(kw) if kind != "verify" else
                         dict(inputs=_on_cpu_float64(kw["inputs"]), accepted=kw["accepted"].cpu()))
                        for kind, kw in steps]
        ref_outputs, _ = _serving_steps(mode, oracle_pool, slots.cpu(), oracle_steps, ORACLE)
        names = ["prefill"] + [f"decode {i}" for i in range(1, 4)] + ["verify+commit"]
        for name, o, ref, sec in zip(names, outputs, ref_outputs, seconds):
            err = relative_error(o.cpu(), ref)
            failed |= not err <= TOLERANCE
            print(f"{mode:10s} {name:14s} {sec * 1e3:9.2f} {err:10.2e}")
        err = relative_error(pool.layer(0)[slots.long()].cpu(), oracle_pool[slots.long().cpu()])
        failed |= not err <= TOLERANCE
        print(f"{mode:10s} {'final pool':14s} {'':>9s} {err:10.2e}")
    print(("FAIL: an error exceeds " if failed else "all errors within ") + f"{TOLERANCE:g} (DESIGN section 7)")
    if device.type != "cuda":
        print("timings are CPU timings of the torch reference; speed is measured on a GPU")
    return 1 if failed else 0
