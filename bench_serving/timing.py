"""Timing that does not flatter small cases: CUDA events around each call with L2 flushed first."""
from __future__ import annotations

import statistics
import time

import torch

L2_FLUSH_BYTES = 256 << 20  # several times the 50-60 MB L2 of an H100 / H200


def time_call(fn, device: torch.device, *, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()``. On a GPU each repetition first overwrites a 256 MiB buffer
    so inputs and states come from HBM, not L2; on the CPU it is wall-clock time."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(max(1, reps // 5)):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_graph(fn, device: torch.device, *, reps: int = 50) -> float | None:
    """Median milliseconds of replaying ``fn`` captured in a CUDA graph (how engines run decode:
    no host work per step), L2 flushed before each replay. None if ``fn`` cannot be captured."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and settle allocations outside the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 - a peer that syncs or allocates on the host cannot be captured
        torch.cuda.synchronize(device)
        return None
    return time_call(graph.replay, device, reps=reps)
