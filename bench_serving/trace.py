"""Request traces for ``python -m bench_serving offline``: prompt and output lengths per request.

An offline trace is what ``vllm bench throughput`` or SGLang's offline benchmark submit: every
request is known at the start and the engine admits them as state slots and its token budget
allow. Lengths come from one of three distributions around the given means, drawn from a fixed
seed so that every backend (and every rerun) serves exactly the same work.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class Request:
    """One request: ``input_len`` prompt tokens to prefill, then ``output_len`` tokens to generate
    (the first one is sampled at the end of the prefill, the rest by decode or MTP verify steps)."""

    rid: int
    input_len: int
    output_len: int


def _draw(rng: random.Random, mean: int, distribution: str, spread: float) -> int:
    if distribution == "fixed":
        return mean
    if distribution == "uniform":
        # vLLM's random dataset convention: uniform in [mean * (1 - spread), mean * (1 + spread)]
        return rng.randint(max(1, math.floor(mean * (1 - spread))), max(1, math.ceil(mean * (1 + spread))))
    # lognormal with the given mean and log-space sigma = spread; capped at 8x the mean so one
    # draw cannot dominate a small trace
    sigma = spread
    value = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
    return max(1, min(8 * mean, round(value)))


def make_trace(num_requests: int, input_len: int, output_len: int, *, distribution: str = "uniform",
               spread: float = 0.5, seed: int = 0) -> list[Request]:
    """``num_requests`` requests with prompt lengths around ``input_len`` and output lengths around
    ``output_len`` (both >= 1), drawn from ``distribution`` ("fixed", "uniform" in
    ``[mean (1 - spread), mean (1 + spread)]``, or "lognormal" with log-space sigma ``spread``)."""
    for name, value in (("num_requests", num_requests), ("input_len", input_len), ("output_len", output_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution: expected one of {DISTRIBUTIONS}, got {distribution!r}")
    if not 0 <= spread < (1 if distribution == "uniform" else 4):
        raise ValueError(f"spread: expected 0 <= spread < {1 if distribution == 'uniform' else 4} for "
                         f"{distribution}, got {spread}")
    rng = random.Random(seed)
    return [Request(rid, _draw(rng, input_len, distribution, spread), _draw(rng, output_len, distribution, spread))
            for rid in range(num_requests)]
