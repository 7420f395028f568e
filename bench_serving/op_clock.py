"""Where the time of an engine step goes: device time per labelled operation.

``mark(label)`` opens a segment that lasts until the next mark or ``stop()``; segments with the
same label add up. On a GPU a mark records a CUDA event on the current stream, so a segment is the
device time between two points of the stream (kernels plus any gap while the host was still
launching them: host overhead of an operation counts against that operation). Marks made while a
CUDA graph is being captured record external events into the graph; ``GraphSegments`` reads them
after each replay, so every operation inside a replayed graph is timed too. On the CPU a mark
reads the wall clock (the work is synchronous).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class GraphSegments:
    """The labelled event marks captured inside one CUDA graph, read after each replay."""

    def __init__(self, marks):
        self.marks = marks  # [(label or None for the final stop, event)]

    def elapsed(self) -> dict[str, float]:
        """Milliseconds per label for the last replay (call after the replay has finished)."""
        out = defaultdict(float)
        for (label, start), (_, end) in zip(self.marks, self.marks[1:]):
            if label is not None:
                out[label] += start.elapsed_time(end)
        return out


class OpClock:
    """Accumulates milliseconds per label over a run. See the module docstring."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self._marks = []  # this step's marks: [(label or None, event or time)]
        self._spare = []  # events whose times were read, for reuse
        self._capture = None  # the marks of a graph being captured

    def _now(self, external: bool):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True, external=True) if external else (
            self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True))
        event.record()
        return event

    def mark(self, label: str) -> None:
        if self._capture is not None:
            self._capture.append((label, self._now(external=True)))
        else:
            self._marks.append((label, self._now(external=False)))

    def stop(self) -> None:
        """End the open segment (no time is counted until the next mark)."""
        self.mark(None)

    def begin_capture(self) -> None:
        self._capture = []

    def end_capture(self) -> GraphSegments:
        marks, self._capture = self._capture, None
        if marks and marks[-1][0] is not None:
            raise RuntimeError("OpClock: close a captured graph's last segment with stop()")
        return GraphSegments(marks)

    def discard(self) -> None:
        """Drop this step's marks without counting them (warm-up work)."""
        marks, self._marks = self._marks, []
        if self.cuda:
            self._spare.extend(event for _, event in marks)

    def reset(self) -> None:
        """Start a new run: drop the totals so far and any marks not yet collected."""
        self.discard()
        self.totals.clear()

    def add(self, elapsed: dict[str, float]) -> None:
        for label, ms in elapsed.items():
            self.totals[label] += ms

    def collect(self) -> None:
        """Add this step's eager segments to the totals (on a GPU, after the step has finished)."""
        marks, self._marks = self._marks, []
        for (label, start), (_, end) in zip(marks, marks[1:]):
            if label is None:
                continue
            self.totals[label] += start.elapsed_time(end) if self.cuda else (end - start) * 1e3
        if self.cuda:
            self._spare.extend(event for _, event in marks)
