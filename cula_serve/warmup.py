"""Compile ahead of CUDA-graph capture: nothing may compile while a graph is being captured.

An engine calls ``warmup`` once per linear-attention layer configuration with the batch sizes it
will capture (its graph buckets) and the options its layers pass; every decode, verify and commit
variant those calls will need is then compiled. Triton also specialises on whether strides are 1
and pointers 16-byte aligned, so warm up with tensors laid out like the ones that will be
captured (this uses contiguous ones, which is what engines' static buffers are).
"""
from __future__ import annotations

import torch

from .api import PROTOCOLS, cula_commit, cula_decode, cula_verify


def warmup(mode: str, *, H: int, HV: int, K: int, V: int, batch_sizes, verify_tokens=(), protocols=PROTOCOLS,
           state_dtype=torch.float32, dtype=torch.bfloat16, device="cuda", backend=None, **options) -> int:
    """Run decode for each batch size and, for each T in ``verify_tokens`` and each protocol, a
    verify + commit, on scratch tensors; for the deferred protocol also a verify with ``pending=``
    after a pending verify of every length in ``verify_tokens`` (its own kernel variants).
    ``options`` are the keyword arguments the engine's calls pass (``use_qk_l2norm_in_kernel``,
    ``use_gate_in_kernel``, ``A_log``, ``dt_bias``, ``lower_bound``, ``use_beta_sigmoid_in_kernel``,
    ``scale``; ``decay`` for lightning).
    Returns the number of calls made."""
    device = torch.device(device)
    calls = 0
    for N in batch_sizes:
        for T in (1, *verify_tokens):
            lead = (N, T)
            qk = torch.zeros(*lead, H, K, dtype=dtype, device=device)
            v = torch.zeros(*lead, HV, V, dtype=dtype, device=device)
            gates = {}
            if mode != "lightning":
                g_shape = (*lead, HV) if mode == "gdn" else (*lead, HV, K)
                gates = dict(g=torch.zeros(g_shape, device=device), beta=torch.zeros(*lead, HV, device=device))
            pool = torch.zeros(N * T, HV, V, K, dtype=state_dtype, device=device)
            slots = torch.arange(N, dtype=torch.int32, device=device)
            common = dict(mode=mode, backend=backend, **gates, **options)
            if T == 1:
                cula_decode(qk, qk, v, pool, state_indices=slots, **common)
                calls += 1
                continue
            for protocol in protocols:
                extra = dict(state_indices=slots)
                if protocol == "slots":
                    extra = dict(state_indices=torch.arange(N * T, dtype=torch.int32, device=device).view(N, T),
                                 num_accepted_tokens=torch.ones(N, dtype=torch.int32, device=device))
                elif protocol == "buffer":
                    extra["intermediate_states"] = torch.zeros(N, T, HV, V, K, dtype=state_dtype, device=device)
                _, pending = cula_verify(qk, qk, v, pool, protocol=protocol, **extra, **common)
                accepted = torch.ones(N, dtype=torch.int32, device=device)
                if protocol == "deferred":
                    for previous in verify_tokens:
                        _, earlier = cula_verify(qk[:, :previous], qk[:, :previous], v[:, :previous], pool,
                                                 protocol=protocol, **extra, **_tokens(common, previous))
                        cula_verify(qk, qk, v, pool, protocol=protocol, pending=earlier, num_accepted_tokens=accepted,
                                    **extra, **common)
                        calls += 2
                cula_commit(pending, accepted)
                calls += 2
    return calls


def _tokens(common: dict, T: int) -> dict:
    """``common`` with its per-token gates cut to the first T tokens."""
    return {key: val[:, :T] if key in ("g", "beta") else val for key, val in common.items()}
