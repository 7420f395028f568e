"""The serving loop of ``python -m bench_serving offline``: one model's layers, one state pool,
one attention core, a trace served step by step (see offline.py for what is measured).

``OfflineEngine`` owns the random-weight layers (``model_layers.py``), the ``StatePool`` (one slot
more than the sequences need, the scratch slot, taken for the engine's life: FLA's padding rows
write there), the attention core (``attention_cores.py``) and one ``DecodeStep`` per batch-size
bucket. Each step of the ``Scheduler``'s plan runs the prefill chunks eagerly through every layer,
then the decode rows (padded to the bucket with slot -1) as a CUDA-graph replay on a GPU or
eagerly on the CPU, then, with MTP, the commit of the accepted lengths; the host waits for the
step and reads the ``OpClock``'s marks, those inside the replayed graphs included. ``run`` can be
called again on the same engine (warm-up rounds, then the timed one): each run reports only itself.
"""
from __future__ import annotations

import time

import torch

from cula_serve.pool import StatePool
from cula_serve.warmup import warmup as cula_warmup

from .attention_cores import CulaCore, DecodeRows, FlaCore
from .model_layers import LayerShape, LinearAttentionLayer
from .op_clock import OpClock
from .scheduler import AcceptanceSampler, Scheduler


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a captured decode graph: powers of two up to, and including, max_num_seqs."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeStep:
    """One batch-size bucket of decode (or MTP verify + commit): static inputs, the step's body
    over all layers, and on a GPU its CUDA graphs."""

    def __init__(self, engine: "OfflineEngine", B: int):
        self.engine, self.B = engine, B
        T, device = engine.verify_tokens, engine.device
        # the hidden states entering the first layer; random and never written
        self.x = engine.activations[:B * T]
        slots_shape = (B, T) if engine.protocol == "slots" and T > 1 else (B,)
        intermediate = None
        if engine.intermediate is not None:
            intermediate = [buffer[:B] for buffer in engine.intermediate]
        self.rows = DecodeRows(slots=torch.full(slots_shape, -1, dtype=torch.int32, device=device),
                               num_accepted=torch.ones(B, dtype=torch.int32, device=device),
                               accepted=torch.zeros(B, dtype=torch.int32, device=device), intermediate=intermediate)
        self.pending = [None] * len(engine.layers)
        self.graph = self.commit_graph = None
        self.segments = self.commit_segments = None
        self.out = None

    def forward(self):
        e, T = self.engine, self.engine.verify_tokens
        x = self.x
        for i, layer in enumerate(e.layers):
            e.clock.mark("projections (decode)")
            inputs, gate = layer.project_in(x, (self.B, T))
            if T == 1:
                o = e.core.decode(i, inputs, self.rows)
            else:
                o, self.pending[i] = e.core.verify(i, inputs, self.rows)
            e.clock.mark("projections (decode)")
            x = layer.project_out(x, o, gate)
        e.clock.stop()
        self.out = x

    def commit(self):
        e = self.engine
        for i in range(len(e.layers)):
            e.core.commit(i, self.pending[i], self.rows)
        e.clock.stop()

    def capture(self):
        """Warm up on a side stream, then capture forward (and commit) as CUDA graphs. All rows are
        padding while capturing, so no pool state is touched."""
        e = self.engine
        stream = torch.cuda.Stream(e.device)
        stream.wait_stream(torch.cuda.current_stream(e.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
                if e.commits:
                    self.commit()
        torch.cuda.current_stream(e.device).wait_stream(stream)
        torch.cuda.synchronize(e.device)
        e.clock.discard()
        self.graph = torch.cuda.CUDAGraph()
        e.clock.begin_capture()
        with torch.cuda.graph(self.graph):
            self.forward()
        self.segments = e.clock.end_capture()
        if e.commits:
            self.commit_graph = torch.cuda.CUDAGraph()
            e.clock.begin_capture()
            with torch.cuda.graph(self.commit_graph):
                self.commit()
            self.commit_segments = e.clock.end_capture()

    def _run(self, graph, segments, body):
        """Replay ``graph`` (its timing marks are read after the step), or run ``body`` eagerly."""
        if graph is None:
            body()
        else:
            graph.replay()
            self.engine.replayed.append(segments)

    def run_forward(self):
        self._run(self.graph, self.segments, self.forward)

    def run_commit(self):
        self._run(self.commit_graph, self.commit_segments, self.commit)


class OfflineEngine:
    """Serves a trace with ``layers`` linear-attention layers over one pool and one attention core."""

    def __init__(self, shape: LayerShape, backend: str, args, device: torch.device):
        self.shape, self.args, self.device = shape, args, device
        self.dtype = getattr(torch, args.dtype)
        self.state_dtype = getattr(torch, args.state_dtype)
        self.verify_tokens = max(1, args.mtp)
        # --protocol is cula-serve's; FLA's verify + commit is always the replay described in attention_cores
        self.protocol = args.protocol if backend == "cula" else "deferred"
        self.clock = OpClock(device)
        self.layers = [LinearAttentionLayer(shape, i, dtype=self.dtype, device=device, seed=args.seed)
                       for i in range(args.layers)]
        slots_per_sequence = self.verify_tokens if self.protocol == "slots" and self.verify_tokens > 1 else 1
        self.slots_per_sequence = slots_per_sequence
        # one slot more than the sequences can hold: FLA's padding rows write their states there
        self.pool = StatePool(args.max_num_seqs * slots_per_sequence + 1, shape.HV, shape.V, shape.K,
                              num_layers=args.layers, dtype=self.state_dtype, device=device)
        self.scratch_slot = int(self.pool.alloc(1)[0])
        options = [layer.core_options for layer in self.layers]
        pools = self.pool.tensors
        if backend == "cula":
            self.core = CulaCore(shape.mode, pools, options, self.clock, self.protocol)
        else:
            self.core = FlaCore(shape.mode, pools, options, self.clock, self.scratch_slot)
        self.commits = self.verify_tokens > 1 and self.core.needs_commit
        self.intermediate = None
        if backend == "cula" and self.protocol == "buffer" and self.verify_tokens > 1:
            self.intermediate = [torch.empty(args.max_num_seqs, self.verify_tokens, shape.HV, shape.V, shape.K,
                                             dtype=self.state_dtype, device=device) for _ in self.layers]
        rows = max(args.max_num_batched_tokens, args.max_num_seqs * self.verify_tokens)
        generator = torch.Generator(device).manual_seed(args.seed)
        self.activations = torch.randn(rows, shape.hidden, generator=generator, device=device).to(self.dtype)
        self.steps = {B: DecodeStep(self, B) for B in buckets(args.max_num_seqs)}
        self.replayed = []  # graph segments replayed in this step, read after it
        self.drawn = []  # MTP accepted lengths drawn in this run
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)

    # ------------------------------------------------------------------ one step's work

    def prefill(self, lengths: list[int], slots: list[int]):
        """Chunked prefill of packed chunks of ``lengths`` tokens into ``slots``, through every layer."""
        cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu_cpu.to(self.device)
        slot_tensor = torch.tensor(slots, dtype=torch.int32).to(self.device)
        N = int(cu_cpu[-1])
        x = self.activations[:N]
        for i, layer in enumerate(self.layers):
            self.clock.mark("projections (prefill)")
            inputs, gate = layer.project_in(x, (1, N))
            o = self.core.prefill(i, inputs, cu, cu_cpu.long(), slot_tensor)
            self.clock.mark("projections (prefill)")
            x = layer.project_out(x, o.reshape(N, *o.shape[2:]), gate)
        self.clock.stop()
        self.nonfinite |= ~torch.isfinite(x).all()

    def decode_step(self, plan, scheduler, sampler) -> list[int]:
        """Decode (or verify + commit) the decode rows of ``plan``; returns the tokens each keeps
        (with MTP: the accepted length drawn by ``sampler``, capped by the scheduler)."""
        sequences = plan.decode
        n = len(sequences)
        step = self.steps[next(B for B in self.steps if B >= n)]
        pad = step.B - n
        if step.rows.slots.dim() == 2:
            slots = [seq.slots for seq in sequences] + [[-1] * self.verify_tokens] * pad
            step.rows.num_accepted.copy_(torch.tensor([seq.state_column + 1 for seq in sequences] + [1] * pad,
                                                      dtype=torch.int32))
        else:
            slots = [seq.slots[seq.state_column] for seq in sequences] + [-1] * pad
        step.rows.slots.copy_(torch.tensor(slots, dtype=torch.int32))
        step.run_forward()
        self.nonfinite |= ~torch.isfinite(step.out).all()
        if self.verify_tokens == 1:
            return [1] * n
        drawn = [sampler.draw() for _ in range(n)]
        self.drawn.extend(drawn)
        committed = scheduler.committed_counts(plan, drawn)
        if self.commits:
            step.rows.accepted.copy_(torch.tensor(committed + [0] * pad, dtype=torch.int32))
            step.run_commit()
        return committed

    # ------------------------------------------------------------------ set-up and the run

    def warm_up(self):
        """Compile before timing: cula-serve's decode buckets (``cula_serve.warmup``) and, on a
        GPU, a few prefill shapes (Triton specialises on lengths that are 1 or multiples of 16),
        then the graphs of every bucket."""
        s = self.shape
        if isinstance(self.core, CulaCore):
            cula_warmup(s.mode, **s.heads, batch_sizes=list(self.steps),
                        verify_tokens=(self.verify_tokens,) if self.verify_tokens > 1 else (),
                        protocols=(self.protocol,), state_dtype=self.state_dtype, dtype=self.dtype,
                        device=self.device, **self.layers[0].core_options)
        if self.device.type != "cuda":
            return
        budget = self.args.max_num_batched_tokens
        shapes = [[1], [17], [64], [16, 17]] + ([[budget // 2, budget - budget // 2]] if budget >= 2 else [])
        for lengths in shapes:
            slots = self.pool.alloc(len(lengths))
            self.prefill(lengths, slots.tolist())
            self.pool.free(slots)
        for step in self.steps.values():
            step.capture()
        torch.cuda.synchronize(self.device)
        self.clock.discard()

    def run(self, trace, progress) -> dict:
        """Serve ``trace`` once and report this run only: a fresh ``Scheduler`` and acceptance
        sampler, and the ``OpClock``'s totals, the drawn accepted lengths and the non-finite flag
        start anew, so a timed run after warm-up runs of the same trace (same layers, pool and
        graphs) reports only itself. Every slot the run took is back in the pool afterwards, so
        the engine can serve a trace again: the pool holds only the scratch slot before the run
        (checked here) and the scheduler's end-of-run check finds every slot it took returned."""
        args = self.args
        held = self.pool.num_slots - self.pool.num_free
        if held != 1:
            raise RuntimeError(f"pool before a run: {held} slots taken, expected only the scratch slot")
        scheduler = Scheduler(trace, self.pool, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              verify_tokens=self.verify_tokens, slots_per_sequence=self.slots_per_sequence)
        sampler = (AcceptanceSampler(self.verify_tokens, args.acceptance_rate, args.seed)
                   if self.verify_tokens > 1 else None)
        self.drawn = []
        self.nonfinite.zero_()
        self.replayed.clear()
        self.clock.reset()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        while (plan := scheduler.plan()) is not None:
            if plan.prefill:
                self.prefill([c.length for c in plan.prefill],
                             [c.sequence.slots[c.sequence.state_column] for c in plan.prefill])
            committed = self.decode_step(plan, scheduler, sampler) if plan.decode else []
            if cuda:
                torch.cuda.synchronize(self.device)
            self.clock.collect()
            for segments in self.replayed:
                self.clock.add(segments.elapsed())
            self.replayed.clear()
            progress.update(len(scheduler.finish_step(plan, committed)))
        wall_ms = (time.perf_counter() - start) * 1e3
        summary = scheduler.check()
        summary["nonfinite_outputs"] = bool(self.nonfinite)
        if sampler is not None:
            summary["mean_accepted_drawn"] = sum(self.drawn) / max(1, len(self.drawn))
            summary["mean_accepted_expected"] = sampler.expected
        return dict(summary=summary, wall_ms=wall_ms, op_ms=dict(self.clock.totals))
