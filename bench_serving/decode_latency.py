"""``python -m bench_serving decode-latency``: one layer's decode step and MTP verify + commit
under CUDA-graph replay, per model shape, batch size, pool dtype and protocol, against the peers.

Each step is captured once and replayed with L2 flushed before every replay (states come from
HBM, as they do in a model with dozens of layers). verify + commit is captured as one graph, with
every sequence accepting all T tokens (the most state a commit can move). The ratio column is
(verify + commit) over the decode step automatic dispatch runs for the same batch (the row marked
"dispatch"; ``dispatch.automatic_backend``): the deferred protocol should cost about one decode
step (DESIGN section 4), the buffer and slots protocols write T states. The "pending"
rows are the deferred protocol's steady state: one ``cula_verify(..., pending=...)`` call that
commits the previous verify's T tokens and verifies T new ones (one kernel on the cute backend,
a commit and a verify on the others). The "copy
ceiling" row copies a decode step's state bytes under the same replay (``copy_ceiling.py``): what
the bandwidth targets are measured against.

"graph of L layers" rows (``--graph-layers L``, batch sizes up to ``LAYERED_MAX_BATCH``): a model
captures all its layers in one decode graph, so one replay's launch and the event pair are shared
by every layer. These rows capture L decode steps, each on its own pool (so each reads its states
from HBM after the flush), and report the replay's time over L: the per-layer cost inside a model's
graph, where the single-step rows above carry the whole replay's fixed cost (about 3.5 us on an H100).
The verify + commit steps of the backend dispatch picks get the same rows, over the decode's.

The buffer and slots rows also give TB/s: their verify reads each state and writes T, their commit
copies one, T + 3 state volumes in all.

Peers (peers.py), each on the same inputs and first checked against the torch reference
(DESIGN section 7 tolerances: 5e-3 with a float32 pool, 2e-2 with a bfloat16 one; one that
disagrees is reported and not timed):
- decode: FLA's fused recurrent kernel (every family; float32 pools only, since it always writes
  float32 final states), FlashInfer's GDN decode and vLLM's serving GDN decode kernel (both on the
  pool);
- verify: vLLM's kernel in vLLM's own slots protocol (verify only: vLLM has no commit step) and
  FlashInfer's MTP kernel in SGLang's buffer protocol (verify, then SGLang's torch gather-copy
  commit). "x cula" is the peer's time over that of the cula-serve backend automatic dispatch picks
  for the same step and protocol.
Inputs are the engines' raw gate projections (A_log, dt_bias, beta logits); FLA gets them
evaluated to prepared gates outside the timed call.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from cula_serve import cula_commit, cula_decode, cula_verify
from cula_serve.inputs import MODEL_SHAPES, random_inputs, relative_error

from . import peers
from .kernels import environment
from .plotting import pyplot
from .timing import time_call, time_graph

PROTOCOLS = ("deferred", "buffer", "slots")
LAYERED_MAX_BATCH = 64  # L pools of 2 B slots each: at B = 512 a Lightning float32 layer's pool is 4 GiB


def tolerance(state_dtype) -> float:
    """DESIGN section 7: bf16 inputs with a float32 state 5e-3, with a bfloat16 state 2e-2."""
    return 5e-3 if state_dtype == torch.float32 else 2e-2


def _inputs(mode, shape, B, T, state_dtype, device, generator):
    """Engine-form inputs of one decode (T = 0) or verify of T tokens: (kw, pool, slots [B],
    columns [B, T] for the slots protocol). Slot 0 stays free: vLLM's kernel treats it as its null block."""
    kw = random_inputs(mode, (B, max(T, 1)), **shape, device=device, generator=generator)
    HV, V, K = shape["HV"], shape["V"], shape["K"]
    P = 2 * B * max(T, 1)
    # the pool (up to 16 GiB) is drawn on the device, seeded from the CPU generator: reproducible
    # and seconds faster than drawing it on the host
    on_device = torch.Generator(device).manual_seed(int(torch.randint(2 ** 62, (1,), generator=generator)))
    pool = (0.1 * torch.randn(P, HV, V, K, generator=on_device, device=device)).to(state_dtype)
    order = (1 + torch.randperm(P - 1, generator=generator)).to(torch.int32).to(device)
    return kw, pool, order[:B], order[:B * max(T, 1)].view(B, max(T, 1))


def _split(kw):
    qkv = {k: kw[k] for k in ("q", "k", "v")}
    return qkv, {k: v for k, v in kw.items() if k not in qkv}


def _cula_step(mode, kw, pool, slots, columns, T, protocol, backend=None):
    """A zero-argument callable for one cula decode (T = 0) or one verify + commit of T tokens
    (all accepted), reading and writing ``pool``; returns the output."""
    qkv, rest = _split(kw)
    B = slots.shape[0]
    if T == 0:
        return lambda: cula_decode(**qkv, state_pool=pool, mode=mode, state_indices=slots, backend=backend, **rest)[0]
    extra = dict(state_indices=slots)
    if protocol == "slots":
        extra = dict(state_indices=columns, num_accepted_tokens=torch.ones(B, dtype=torch.int32, device=pool.device))
    elif protocol == "buffer":
        HV, V, K = pool.shape[1:]
        extra["intermediate_states"] = torch.zeros(B, T, HV, V, K, dtype=pool.dtype, device=pool.device)
    accepted = torch.full((B,), T, dtype=torch.int32, device=pool.device)
    if protocol == "pending":
        # the steady state of the deferred protocol: each verify commits the previous one first
        _, pending = cula_verify(**qkv, state_pool=pool, mode=mode, protocol="deferred", backend=backend, **extra,
                                 **rest)
        return lambda: cula_verify(**qkv, state_pool=pool, mode=mode, pending=pending, num_accepted_tokens=accepted,
                                   backend=backend, **rest)[0]

    def run():
        o, pending = cula_verify(**qkv, state_pool=pool, mode=mode, protocol=protocol, backend=backend, **extra,
                                 **rest)
        cula_commit(pending, accepted)
        return o
    return run


def _time_layers(build, layers: int, device) -> float:
    """Milliseconds per layer of one CUDA-graph replay of ``layers`` steps, ``build()`` giving each
    layer's zero-argument step on its own pool."""
    steps = [build() for _ in range(layers)]
    return time_graph(lambda: [step() for step in steps], device) / layers


def _layered_decode(mode, shape, kw, pool, slots, backends, versions, state_dtype, layers, device, key) -> list:
    """The "graph of L layers" rows (module docstring) of one batch: cula-serve's backends, FLA
    (float32 pools) and the copy ceiling, each layer on its own copy of ``pool``."""
    from .copy_ceiling import copy_ceiling  # Triton: present wherever CUDA torch is
    elements = slots.shape[0] * shape["HV"] * shape["V"] * shape["K"]
    state_bytes = 2 * elements * torch.finfo(state_dtype).bits // 8
    builds = [(f"cula-{name}", lambda name=name: _cula_step(mode, kw, pool.clone(), slots, None, 0, None, name))
              for name in backends]
    if versions.get("fla") and state_dtype == torch.float32:
        builds.append(("fla", lambda: peers.fla_decode(mode, kw, pool[slots.long()].clone())))
    timings = [(name, _time_layers(build, layers, device)) for name, build in builds]
    timings.append(("copy ceiling", copy_ceiling(elements, state_dtype, device, layers=layers)))
    rows = []
    for name, ms in timings:
        rows.append(dict(**key, op="decode", backend=name, T=1, layers=layers, ms=ms,
                         TBps=state_bytes / (ms * 1e-3) / 1e12))
        print(f"{key['model']:12s} {key['state']:9s} B{key['B']:<4d} decode, graph of {layers:<3d}  {name:12s} "
              f"{ms * 1e3:8.1f} us {rows[-1]['TBps']:6.2f} TB/s per layer", flush=True)
    torch.cuda.empty_cache()
    return rows


def _copy_bandwidth(protocol, T, state_bytes, ms) -> dict:
    """{"TBps": ...} for the buffer and slots protocols: their verify reads each state once and
    writes T states, the commit copies one (T + 3 state volumes, ``state_bytes`` / 2 each); the
    other protocols' rows are read against a decode step instead."""
    if protocol not in ("buffer", "slots"):
        return {}
    return dict(TBps=(T + 3) * state_bytes / 2 / (ms * 1e-3) / 1e12)


def _bandwidth_text(row) -> str:
    return f" {row['TBps']:6.2f} TB/s" if "TBps" in row else ""


def _layered_verify(mode, kw, pool, slots, columns, T, backend, state_bytes, decode_ms, layers, device, key) -> list:
    """The "graph of L layers" rows of verify + commit on ``backend`` (every protocol), each layer
    on its own pool; the ratio is over the dispatched decode's time per layer (``decode_ms``)."""
    rows = []
    # each layer's pool, and the buffer protocol's T states a sequence
    need = layers * (pool.numel() + slots.shape[0] * T * pool[0].numel()) * pool.element_size()
    free = torch.cuda.mem_get_info(device)[0]
    if need > free // 2:
        print(f"{key['model']:12s} {key['state']:9s} B{key['B']:<4d} T{T} verify + commit, graph of {layers}: skipped "
              f"({need / 2 ** 30:.1f} GiB of pools, {free / 2 ** 30:.1f} GiB free)", flush=True)
        return rows
    for protocol in PROTOCOLS + ("pending",):
        ms = _time_layers(lambda: _cula_step(mode, kw, pool.clone(), slots, columns, T, protocol, backend), layers,
                          device)
        rows.append(dict(**key, op=f"verify+commit {protocol}", backend=f"cula-{backend}", T=T, layers=layers, ms=ms,
                         vs_decode=ms / decode_ms, **_copy_bandwidth(protocol, T, state_bytes, ms)))
        print(f"{key['model']:12s} {key['state']:9s} B{key['B']:<4d} T{T} {protocol:9s} v+c, graph of {layers:<3d} "
              f"cula-{backend:7s} {ms * 1e3:8.1f} us {ms / decode_ms:5.2f}x decode{_bandwidth_text(rows[-1])} "
              f"per layer", flush=True)
    torch.cuda.empty_cache()
    return rows


def _reference(mode, kw, pool, slots, columns, T, protocol):
    """(o, states written) of the torch reference: for a decode (T = 0) and verify + commit of all
    T tokens the slots' states; for the slots protocol the verify alone (vLLM has no commit step)
    and every column's state."""
    ref = pool.clone()
    if protocol != "slots":
        o = _cula_step(mode, kw, ref, slots, columns, T, protocol, backend="torch")()
        return o, ref[slots.long()]
    qkv, rest = _split(kw)
    o, _ = cula_verify(**qkv, state_pool=ref, mode=mode, protocol="slots", state_indices=columns,
                       num_accepted_tokens=torch.ones(slots.shape[0], dtype=torch.int32, device=pool.device),
                       backend="torch", **rest)
    return o, ref[columns.reshape(-1).long()]


def _peer_steps(mode, kw, pool, slots, columns, T, state_dtype, versions):
    """[(peer, op label, build)] of the peers that have an equivalent of this step; ``build()``
    returns (run, work pool or None, written rows of the pool to compare) with ``run()`` giving
    the output (or (output, final dense states) when the work pool is None)."""
    steps = []
    B = slots.shape[0]
    if T == 0:
        if versions.get("fla") and state_dtype == torch.float32:
            steps.append(("fla", "decode", lambda: (peers.fla_decode(mode, kw, pool[slots.long()].clone()), None, slots)))
        if mode == "gdn" and versions.get("flashinfer"):
            def flashinfer():
                work = pool.clone()
                return peers.flashinfer_decode(kw, work, slots), work, slots
            steps.append(("flashinfer", "decode", flashinfer))
        if mode == "gdn" and versions.get("vllm"):
            def vllm():
                work = pool.clone()
                return peers.vllm_decode(kw, work, slots), work, slots
            steps.append(("vllm", "decode", vllm))
        return steps
    if mode != "gdn":
        return steps
    if versions.get("vllm"):
        def vllm_verify():
            work = pool.clone()
            accepted = torch.ones(B, dtype=torch.int32, device=pool.device)
            return peers.vllm_decode(kw, work, columns, accepted), work, columns.reshape(-1)
        steps.append(("vllm", "verify slots", vllm_verify))
    if versions.get("flashinfer"):
        def flashinfer_verify():
            work = pool.clone()
            HV, V, K = pool.shape[1:]
            intermediate = torch.zeros(B, T, HV, V, K, dtype=pool.dtype, device=pool.device)
            accepted = torch.full((B,), T, dtype=torch.int32, device=pool.device)
            return peers.flashinfer_verify_commit(kw, work, slots, intermediate, accepted), work, slots
        steps.append(("flashinfer", "verify+commit buffer", flashinfer_verify))
    return steps


def _run_peer(build, ref_o, ref_states, state_dtype, device):
    """Check one peer step against the reference (output and the states it wrote), then time it
    (the timed replays carry on from the checked states). Returns a partial row."""
    try:
        run, work, written = build()
        result = run()
        o, final = (result, work[written.long()]) if work is not None else result
        err = max(relative_error(o.reshape(ref_o.shape), ref_o), relative_error(final, ref_states))
        if not err <= tolerance(state_dtype):
            return dict(status="wrong", rel_err=err)
        ms, timing = time_graph(run, device), "graph"
        if ms is None:
            ms, timing = time_call(run, device), "eager (capture failed)"
    except Exception as exc:  # noqa: BLE001 - a peer failing is reported, not fatal
        text = str(exc).strip().splitlines()
        return dict(status="failed", error=f"{type(exc).__name__}: {text[0] if text else ''}")
    return dict(status="ok", rel_err=err, ms=ms, timing=timing)


def _print_peer(model, state, B, T, row):
    if T:  # laid out like the cula rows: "T4 slots     v+c" (vLLM's slots verify has no commit: "v")
        op = row["op"].split()
        step = f"T{T} {op[-1]:9s} {'v+c' if op[0] == 'verify+commit' else 'v':5s}"
    else:
        step = f"{'decode':21s}"
    head = f"{model:12s} {state:9s} B{B:<4d} {step} {row['backend']:10s}"
    if row["status"] == "failed":
        print(f"{head} FAILED, not timed: {row['error']}", flush=True)
    elif row["status"] == "wrong":
        print(f"{head} WRONG: rel err {row['rel_err']:.2e} > {tolerance(torch.float32 if state == 'float32' else torch.bfloat16):g}, "
              f"not timed", flush=True)
    else:
        extra = f"{row['TBps']:6.2f} TB/s " if "TBps" in row else ""
        ratio = f"{row['vs_cula']:5.2f}x cula" if "vs_cula" in row else ""
        print(f"{head} {row['ms'] * 1e3:8.1f} us {extra}{ratio} {row['timing']}", flush=True)


def _cula_backends(device) -> list[str]:
    """cula-serve's GPU backends that run on ``device``, in dispatch order: each is timed."""
    from cula_serve import dispatch
    names = [name for name in dispatch.preference("decode", device) if name != "torch"
             and dispatch.backend_status(name, device)[0] is not None]
    return names or ["torch"]


def _dispatched(operation, mode, B, T, shape, state_dtype, device, backends) -> str:
    """The timed backend automatic dispatch picks for this step (the first timed one if it picks
    another, e.g. under CULA_BACKEND)."""
    from cula_serve import dispatch
    name = dispatch.automatic_backend(operation, device, dict(mode=mode, N=B, T=max(T, 1), HV=shape["HV"],
                                                              state_dtype=state_dtype))
    return name if name in backends else backends[0]


def main(args) -> int:
    if not torch.cuda.is_available():
        print("decode-latency measures CUDA-graph replay: it needs a GPU")
        return 0
    from .copy_ceiling import copy_ceiling  # Triton: present wherever CUDA torch is
    device = torch.device("cuda", torch.cuda.current_device())
    env = environment(device)
    print(f"bench_serving decode-latency on {env['gpu']}: torch {env['torch']}, triton {env['triton']}, {env['date']}")
    status = peers.select(getattr(args, "peers", None))
    for line in peers.absence_lines(status):
        print(f"  {line}")
    versions = peers.peer_versions(status)
    backends = _cula_backends(device)
    print(f"  cula-serve backends timed: {', '.join(backends)}")
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    models = [m for m in MODEL_SHAPES if not args.filter or args.filter in m]
    for model in models:
        s = MODEL_SHAPES[model]
        mode, shape = s["mode"], dict(H=s["H"], HV=s["HV"], K=s["K"], V=s["V"])
        for state_dtype in (torch.float32, torch.bfloat16):
            state = str(state_dtype)[6:]
            for B in args.batch_sizes:
                print(f"{model} {state} B{B}", file=sys.stderr, flush=True)
                kw, pool, slots, columns = _inputs(mode, shape, B, 0, state_dtype, device, generator)
                state_bytes = 2 * B * shape["HV"] * shape["V"] * shape["K"] * torch.finfo(state_dtype).bits // 8
                decode_ms = {}
                auto = _dispatched("decode", mode, B, 1, shape, state_dtype, device, backends)
                for name in backends:
                    decode_ms[name] = time_graph(_cula_step(mode, kw, pool.clone(), slots, columns, 0, None, name),
                                                 device)
                    rows.append(dict(model=model, state=state, B=B, op="decode", backend=f"cula-{name}", T=1,
                                     ms=decode_ms[name], TBps=state_bytes / (decode_ms[name] * 1e-3) / 1e12,
                                     dispatched=name == auto))
                    print(f"{model:12s} {state:9s} B{B:<4d} decode                {'cula-' + name:12s} "
                          f"{decode_ms[name] * 1e3:8.1f} us {rows[-1]['TBps']:6.2f} TB/s"
                          f"{'  dispatch' if name == auto else ''}", flush=True)
                ceiling_ms = copy_ceiling(B * shape["HV"] * shape["V"] * shape["K"], state_dtype, device)
                rows.append(dict(model=model, state=state, B=B, op="decode", backend="copy ceiling", T=1,
                                 ms=ceiling_ms, TBps=state_bytes / (ceiling_ms * 1e-3) / 1e12))
                print(f"{model:12s} {state:9s} B{B:<4d} decode                {'copy ceiling':12s} "
                      f"{ceiling_ms * 1e3:8.1f} us {rows[-1]['TBps']:6.2f} TB/s", flush=True)
                layered_decode_ms = None
                if args.graph_layers > 1 and B <= LAYERED_MAX_BATCH:
                    layered = _layered_decode(mode, shape, kw, pool, slots, backends, versions, state_dtype,
                                              args.graph_layers, device, dict(model=model, state=state, B=B))
                    rows += layered
                    layered_decode_ms = next(row["ms"] for row in layered if row["backend"] == f"cula-{auto}")
                first = decode_ms[auto]
                steps = _peer_steps(mode, kw, pool, slots, columns, 0, state_dtype, versions)
                if steps:
                    ref_o, ref_states = _reference(mode, kw, pool, slots, columns, 0, None)
                for peer, op, build in steps:
                    row = dict(model=model, state=state, B=B, op=op, backend=peer, T=1,
                               **_run_peer(build, ref_o, ref_states, state_dtype, device))
                    if row["status"] == "ok":
                        row.update(TBps=state_bytes / (row["ms"] * 1e-3) / 1e12, vs_cula=row["ms"] / first)
                    rows.append(row)
                    _print_peer(model, state, B, 0, row)
                for T in args.verify_tokens:
                    kw, pool, slots, columns = _inputs(mode, shape, B, T, state_dtype, device, generator)
                    cula_ms = {}
                    auto_verify = _dispatched("verify", mode, B, T, shape, state_dtype, device, backends)
                    for name in backends:
                        for protocol in PROTOCOLS + ("pending",):
                            ms = time_graph(_cula_step(mode, kw, pool.clone(), slots, columns, T, protocol, name), device)
                            if name == auto_verify:
                                cula_ms[protocol] = ms
                            rows.append(dict(model=model, state=state, B=B, op=f"verify+commit {protocol}",
                                             backend=f"cula-{name}", T=T, ms=ms, vs_decode=ms / first,
                                             dispatched=name == auto_verify,
                                             **_copy_bandwidth(protocol, T, state_bytes, ms)))
                            print(f"{model:12s} {state:9s} B{B:<4d} T{T} {protocol:9s} v+c   {'cula-' + name:12s} "
                                  f"{ms * 1e3:8.1f} us {ms / first:5.2f}x decode{_bandwidth_text(rows[-1])}"
                                  f"{'  dispatch' if name == auto_verify else ''}", flush=True)
                    if layered_decode_ms is not None:
                        rows += _layered_verify(mode, kw, pool, slots, columns, T, auto_verify, state_bytes,
                                                layered_decode_ms, args.graph_layers, device,
                                                dict(model=model, state=state, B=B))
                    for peer, op, build in _peer_steps(mode, kw, pool, slots, columns, T, state_dtype, versions):
                        protocol = op.split()[-1]
                        ref_o, ref_states = _reference(mode, kw, pool, slots, columns, T, protocol)
                        row = dict(model=model, state=state, B=B, op=op, backend=peer, T=T,
                                   **_run_peer(build, ref_o, ref_states, state_dtype, device))
                        if row["status"] == "ok":
                            row.update(vs_decode=row["ms"] / first, vs_cula=row["ms"] / cula_ms[protocol])
                        rows.append(row)
                        _print_peer(model, state, B, T, row)
                torch.cuda.empty_cache()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_latency.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    print(f"json: {out / 'decode_latency.json'}")
    plot(rows, out / "decode_latency.png")
    return 0


def plot(rows, path: Path):
    """Left: decode TB/s against the batch size, per model, pool and backend. Right: cula-serve's
    verify + commit over one decode step against T, per model and protocol, at the largest batch
    and the float32 pool."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 6))
    decode = [r for r in rows if r["op"] == "decode" and "TBps" in r and "layers" not in r]
    for key in dict.fromkeys((r["model"], r["state"], r["backend"]) for r in decode):
        line = sorted((r["B"], r["TBps"]) for r in decode if (r["model"], r["state"], r["backend"]) == key)
        left.plot(*zip(*line), marker="o", label=" ".join(key))
    left.set_xscale("log", base=2)
    left.set_xlabel("batch size")
    left.set_ylabel("TB/s of state traffic (higher is better)")
    left.set_title("decode, CUDA-graph replay")
    left.legend(fontsize=7)
    verify = [r for r in rows if r["backend"].startswith("cula") and "vs_decode" in r and r["state"] == "float32"
              and "layers" not in r]
    if verify:
        B = max(r["B"] for r in verify)
        for key in dict.fromkeys((r["model"], r["op"], r["backend"]) for r in verify):
            line = sorted((r["T"], r["vs_decode"]) for r in verify
                          if (r["model"], r["op"], r["backend"]) == key and r["B"] == B)
            right.plot(*zip(*line), marker="o", label=f"{key[0]} {key[1].split()[-1]} {key[2]}")
        right.set_title(f"cula-serve verify + commit, float32 pool, B = {B}")
        right.legend(fontsize=7)
    right.set_xlabel("verify tokens T")
    right.set_ylabel("time over one decode step (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
