"""``python -m bench_serving decode-latency``: one layer's decode step and MTP verify + commit
under CUDA-graph replay, per model shape, batch size, pool dtype and protocol.

Each step is captured once and replayed with L2 flushed before every replay (states come from
HBM, as they do in a model with dozens of layers). verify + commit is captured as one graph, with
every sequence accepting all T tokens (the most state a commit can move). The ratio column is
(verify + commit) over one decode step of the same batch: the deferred protocol should cost about
one decode step (DESIGN section 4), the buffer and slots protocols write T states.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from cula_serve import cula_commit, cula_decode, cula_verify
from cula_serve.inputs import MODEL_SHAPES, random_inputs

from .kernels import environment
from .timing import time_graph


def _step_call(mode, shape, B, T, protocol, state_dtype, device, generator):
    """A zero-argument callable for one decode (T = 0) or one verify + commit of T tokens."""
    kw = random_inputs(mode, (B, max(T, 1)), **shape, device=device, generator=generator)
    qkv = {k: kw.pop(k) for k in ("q", "k", "v")}
    HV, V, K = shape["HV"], shape["V"], shape["K"]
    P = 2 * B * max(T, 1)
    pool = (0.1 * torch.randn(P, HV, V, K, generator=generator)).to(state_dtype).to(device)
    slots = torch.randperm(P, generator=generator)[:B].to(torch.int32).to(device)
    if T == 0:
        return lambda: cula_decode(**qkv, state_pool=pool, mode=mode, state_indices=slots, **kw)
    extra = dict(state_indices=slots)
    if protocol == "slots":
        columns = torch.randperm(P, generator=generator)[:B * T].to(torch.int32).to(device).view(B, T)
        extra = dict(state_indices=columns, num_accepted_tokens=torch.ones(B, dtype=torch.int32, device=device))
    elif protocol == "buffer":
        extra["intermediate_states"] = torch.zeros(B, T, HV, V, K, dtype=state_dtype, device=device)
    accepted = torch.full((B,), T, dtype=torch.int32, device=device)

    def run():
        _, pending = cula_verify(**qkv, state_pool=pool, mode=mode, protocol=protocol, **extra, **kw)
        cula_commit(pending, accepted)
    return run


def main(args) -> int:
    if not torch.cuda.is_available():
        print("decode-latency measures CUDA-graph replay: it needs a GPU")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    env = environment(device)
    print(f"bench_serving decode-latency on {env['gpu']}: torch {env['torch']}, triton {env['triton']}, {env['date']}")
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    models = [m for m in MODEL_SHAPES if not args.filter or args.filter in m]
    for model in models:
        s = MODEL_SHAPES[model]
        shape = dict(H=s["H"], HV=s["HV"], K=s["K"], V=s["V"])
        for state_dtype in (torch.float32, torch.bfloat16):
            for B in args.batch_sizes:
                print(f"{model} {str(state_dtype)[6:]} B{B}", file=sys.stderr, flush=True)
                decode_ms = time_graph(_step_call(s["mode"], shape, B, 0, None, state_dtype, device, generator), device)
                state_bytes = 2 * B * shape["HV"] * shape["V"] * shape["K"] * torch.finfo(state_dtype).bits // 8
                rows.append(dict(model=model, state=str(state_dtype)[6:], B=B, op="decode", T=1, ms=decode_ms,
                                 TBps=state_bytes / (decode_ms * 1e-3) / 1e12))
                print(f"{model:12s} {rows[-1]['state']:9s} B{B:<4d} decode                {decode_ms * 1e3:8.1f} us "
                      f"{rows[-1]['TBps']:6.2f} TB/s", flush=True)
                for T in args.verify_tokens:
                    for protocol in ("deferred", "buffer", "slots"):
                        ms = time_graph(_step_call(s["mode"], shape, B, T, protocol, state_dtype, device, generator),
                                        device)
                        rows.append(dict(model=model, state=rows[-1]["state"], B=B, op=f"verify+commit {protocol}",
                                         T=T, ms=ms, vs_decode=ms / decode_ms))
                        print(f"{model:12s} {rows[-1]['state']:9s} B{B:<4d} T{T} {protocol:9s} v+c   {ms * 1e3:8.1f} us "
                              f"{ms / decode_ms:5.2f}x decode", flush=True)
                torch.cuda.empty_cache()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_latency.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    print(f"json: {out / 'decode_latency.json'}")
    return 0
