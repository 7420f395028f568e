"""Context-parallel cases run by every rank of a process group (gloo on the CPU, NCCL on GPUs).

Each rank draws the same global batch (same seed), runs its tokens through ``cula_*_cp`` and
checks its outputs and the pool slots it owns against the float64 oracle run on the whole batch.
Pools are poisoned (NaN) outside the live slots, so a read of the wrong slot or a write by the
wrong rank shows up.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from cula_serve import cula_gdn, cula_kda, cula_lightning
from cula_serve.dist import cula_gdn_cp, cula_kda_cp, cula_lightning_cp, split_cu_seqlens_for_sp
from cula_serve.inputs import random_inputs, relative_error, to_float64

ORACLE = dict(backend="torch", algorithm="recurrent", compute_dtype=torch.float64)
SINGLE = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}
CP = {"gdn": cula_gdn_cp, "kda": cula_kda_cp, "lightning": cula_lightning_cp}
TOLERANCE = {(torch.float32, torch.float32): 1e-5, (torch.bfloat16, torch.float32): 5e-3,
             (torch.bfloat16, torch.bfloat16): 2e-2, (torch.float32, torch.bfloat16): 2e-2}

# (name, mode, seqlens, input dtype, pool dtype, placement, weights, padded sequences,
#  no-initial-state sequences, long memory). With long memory (prepared gates near 0, small beta)
# the state entering a rank's piece still matters hundreds of tokens later, so a wrong map or a
# wrong composition shows in the outputs; the fused-gate cases forget within tens of tokens.
CASES = [
    ("gdn fp32 split", "gdn", [300, 17, 0, 900, 1], torch.float32, torch.float32, "split", None, [], [1], True),
    ("gdn fused-gate split", "gdn", [300, 17, 0, 900, 1], torch.float32, torch.float32, "split", None, [], [], False),
    ("kda bf16 split padded", "kda", [700, 5, 600], torch.bfloat16, torch.float32, "split", None, [1], [0], True),
    ("lightning bf16-pool split", "lightning", [129, 1000, 64], torch.float32, torch.bfloat16, "split", None, [], [2],
     True),
    ("gdn weighted split", "gdn", [1500], torch.bfloat16, torch.float32, "split", [3, 1, 1, 1, 2, 2, 2, 2], [], [],
     True),
    ("kda complete", "kda", [200, 300, 64, 500, 90], torch.float32, torch.float32, "complete", None, [3], [0], True),
]


def run_cases(rank: int, world_size: int, *, device: str, shapes: dict, backend: str | None, cases=CASES):
    """Run every case on this rank; raises AssertionError naming the case on a mismatch.

    shapes: dict(H=, HV=, K=, V=) for every mode, or {mode: dict(...)} (the model shapes)."""
    errors = []
    for name, mode, seqlens, dtype, pool_dtype, placement, weights, padded, fresh, long_memory in cases:
        gen = torch.Generator().manual_seed(len(name) * 1000 + sum(seqlens))
        T = sum(seqlens)
        N = len(seqlens)
        cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32)
        mode_shapes = shapes.get(mode, shapes)  # one dict for every mode, or one per mode
        kw = random_inputs(mode, (1, T), dtype=dtype, generator=gen, fused_gate=not long_memory, **mode_shapes)
        if long_memory and mode != "lightning":
            kw["g"], kw["beta"] = kw["g"] * 0.02, kw["beta"] * 0.1
        elif long_memory:
            kw["decay"] = kw["decay"] * 0.01
        HV, V, K = mode_shapes["HV"], mode_shapes["V"], mode_shapes["K"]
        P = 2 * N + 2
        slots = torch.randperm(P, generator=gen)[:N].to(torch.int32)
        for n in padded:
            slots[n] = -1
        has_init = torch.ones(N, dtype=torch.bool)
        for n in fresh:
            has_init[n] = False
        pool = torch.full((P, HV, V, K), float("nan"))
        for n in range(N):
            if slots[n] >= 0:
                pool[slots[n]] = 0.5 * torch.randn(HV, V, K, generator=gen)
        pool = pool.to(pool_dtype)

        # the oracle runs where the ranks do (token by token in float64: on a GPU at model shapes)
        ref_pool = pool.double().to(device)
        ref_o, _ = SINGLE[mode](**to_float64({key: x.to(device) if isinstance(x, torch.Tensor) else x
                                              for key, x in kw.items()}),
                                cu_seqlens=cu.to(device), state_pool=ref_pool, state_indices=slots.to(device),
                                has_initial_state=has_init.to(device), **ORACLE)
        ref_o, ref_pool = ref_o.cpu(), ref_pool.cpu()

        w = None if weights is None else weights[:world_size]
        plan = split_cu_seqlens_for_sp(cu, world_size, placement=placement, weights=w)[rank]
        mine = slice(plan.token_start, plan.token_end)
        local = {key: (x[:, mine].to(device) if isinstance(x, torch.Tensor) and x.dim() >= 3 else
                       (x.to(device) if isinstance(x, torch.Tensor) else x)) for key, x in kw.items()}
        my_pool = pool.to(device)
        o, _ = CP[mode](**local, cu_seqlens=cu, state_pool=my_pool, state_indices=slots, has_initial_state=has_init,
                        placement=placement, weights=w, backend=backend)
        tol = TOLERANCE[(dtype, pool_dtype)]
        if plan.num_tokens:
            err = relative_error(o.cpu(), ref_o[:, mine])
            if not err <= tol:
                errors.append(f"{name}: rank {rank} output relative error {err:.3e} > {tol:g}")
        my_pool = my_pool.cpu()
        for piece in plan.pieces:
            slot = int(slots[piece.sequence])
            if slot < 0:
                continue
            if piece.last:
                err = relative_error(my_pool[slot], ref_pool[slot])
                if not err <= tol:
                    errors.append(f"{name}: rank {rank} final state of sequence {piece.sequence} error {err:.3e}")
            else:
                # not this rank's to write: still the initial state it started with
                if not torch.equal(my_pool[slot].float().nan_to_num(7.0), pool[slot].float().nan_to_num(7.0)):
                    errors.append(f"{name}: rank {rank} wrote the slot of sequence {piece.sequence}, "
                                  "whose last token is on another rank")
        untouched = set(range(P)) - {int(s) for s in slots if s >= 0}
        if any(not torch.isnan(my_pool[s].float()).all() for s in untouched):
            errors.append(f"{name}: rank {rank} wrote a slot no sequence uses")
    if errors:
        raise AssertionError("; ".join(errors))


def worker(rank: int, world_size: int, init_file: str, device_type: str, shapes: dict, backend):
    """torch.multiprocessing.spawn target: join the group, run the cases, leave."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # one core per rank: CI has two cores for up to four ranks
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank) if device_type == "cuda" else None)
    try:
        device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
        run_cases(rank, world_size, device=device, shapes=shapes, backend=backend)
        dist.barrier()
    finally:
        dist.destroy_process_group()
