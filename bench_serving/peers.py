"""Other libraries' kernels, run on the same inputs as cula-serve in the same process.

Each peer is optional: an absent one is reported with one line. FLA is called with the K-last
state layout (``state_v_first=True``) so it reads and writes the same bytes as cula-serve.
"""
from __future__ import annotations

import importlib
import importlib.metadata

import torch

PEERS = {"fla": "fla", "flashinfer": "flashinfer", "flashqla": "flashqla"}


def peer_versions() -> dict:
    """{peer: version or None when not installed}."""
    versions = {}
    for peer, dist in (("fla", "fla-core"), ("flashinfer", "flashinfer-python"), ("flashqla", "flashqla")):
        try:
            importlib.import_module(PEERS[peer])
            versions[peer] = importlib.metadata.version(dist)
        except (ImportError, importlib.metadata.PackageNotFoundError):
            versions[peer] = None
    return versions


def fla_prefill(mode, kw, initial_state, cu_seqlens):
    """A zero-argument callable running FLA's chunked prefill; returns (o, final [N, HV, V, K])."""
    common = dict(initial_state=initial_state, output_final_state=True, state_v_first=True,
                  cu_seqlens=cu_seqlens.long())
    if mode == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])
        common["use_qk_l2norm_in_kernel"] = True
    elif mode == "kda":
        from fla.ops.kda import chunk_kda as fn
        args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])
        common["use_qk_l2norm_in_kernel"] = True
    else:
        from fla.ops.simple_gla import chunk_simple_gla as fn
        args = (kw["q"], kw["k"], kw["v"])
        common["g_gamma"] = kw["decay"]

    def run():
        with torch.inference_mode():
            return fn(*args, **common)

    return run


def fla_decode(mode, kw, states):
    """FLA's fused recurrent kernel for one token per sequence on dense states ``[B, HV, V, K]``
    (slot n = sequence n): the same state bytes as a pool decode. Returns (o, final)."""
    B = kw["q"].shape[0]
    cu = torch.arange(B + 1, dtype=torch.long, device=kw["q"].device)
    packed = {k: (v.reshape(1, B, *v.shape[2:]) if isinstance(v, torch.Tensor) and v.dim() >= 3 else v)
              for k, v in kw.items()}
    common = dict(initial_state=states, output_final_state=True, state_v_first=True, cu_seqlens=cu)
    if mode == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
        args = (packed["q"], packed["k"], packed["v"])
        common.update(g=packed["g"], beta=packed["beta"], use_qk_l2norm_in_kernel=True)
    elif mode == "kda":
        from fla.ops.kda import fused_recurrent_kda as fn
        args = (packed["q"], packed["k"], packed["v"], packed["g"], packed["beta"])
        common["use_qk_l2norm_in_kernel"] = True
    else:
        from fla.ops.simple_gla import fused_recurrent_simple_gla as fn
        args = (packed["q"], packed["k"], packed["v"])
        common["g_gamma"] = kw["decay"]

    def run():
        with torch.inference_mode():
            o, final = fn(*args, **common)
        return o.reshape(B, 1, *o.shape[2:]), final

    return run
