"""Continuous batching for ``python -m bench_serving offline``: what each engine step computes.

Each step is planned the way vLLM's and SGLang's schedulers plan one: running sequences that have
finished their prompt decode first (one token each, or T tokens each when MTP verifies T tokens),
then the remaining token budget goes to chunked prefill, first to prompts already under way, then
to waiting requests, which are admitted while fewer than ``max_num_seqs`` run and the state pool
has free slots. A request holds its slots (one, or T under vLLM's slots protocol) from admission
until its last token and then returns them to the ``StatePool``.

Token accounting: the last prefill chunk of a prompt samples the request's first output token;
every decode step adds one, every MTP verify step adds the accepted length (at most what the
request still needs). ``check()`` verifies after a run that every request got exactly its prompt
and output lengths and that every slot came back.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from cula_serve.pool import StatePool

from .trace import Request


@dataclass
class Sequence:
    """A request being served. ``slots``: its pool slots (state in ``slots[state_column]``)."""

    request: Request
    slots: list[int]
    prefilled: int = 0
    generated: int = 0
    state_column: int = 0
    first_step: int = -1
    last_step: int = -1
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (start, length) of each prefill chunk
    accepted: list[int] = field(default_factory=list)  # tokens committed by each decode / verify step

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.request.input_len

    @property
    def remaining(self) -> int:
        return self.request.output_len - self.generated


@dataclass(frozen=True)
class PrefillChunk:
    sequence: Sequence
    start: int
    length: int


@dataclass(frozen=True)
class StepPlan:
    """One engine step: prefill chunks (packed varlen) and decode rows (one sequence each)."""

    index: int
    prefill: tuple[PrefillChunk, ...]
    decode: tuple[Sequence, ...]

    @property
    def prefill_tokens(self) -> int:
        return sum(c.length for c in self.prefill)


class AcceptanceSampler:
    """Accepted lengths of MTP verify steps: each of the T - 1 draft tokens after the verified
    token is accepted with probability ``rate`` until the first rejection, so the accepted length
    is 1 + (accepted drafts), in 1..T, with mean sum_{i < T} rate^i."""

    def __init__(self, verify_tokens: int, rate: float, seed: int):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rate: expected a probability in [0, 1], got {rate}")
        self.verify_tokens = verify_tokens
        self.rate = rate
        self._rng = random.Random(seed)

    def draw(self) -> int:
        accepted = 1
        while accepted < self.verify_tokens and self._rng.random() < self.rate:
            accepted += 1
        return accepted

    @property
    def expected(self) -> float:
        return sum(self.rate ** i for i in range(self.verify_tokens))


class Scheduler:
    """Plans steps over ``trace`` with slots from ``pool``.

    Args:
        trace: the requests, admitted in order.
        pool: the state pool (``StatePool``) slots come from; shared by all layers.
        max_num_seqs: most sequences running at once (the largest decode batch).
        max_num_batched_tokens: token budget of one step (decode rows count T tokens each).
        verify_tokens: T, tokens per decode row (1: plain decode; > 1: MTP verify).
        slots_per_sequence: 1, or T for the slots protocol (a slot per verify token).
    """

    def __init__(self, trace: list[Request], pool: StatePool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 verify_tokens: int = 1, slots_per_sequence: int = 1):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected a positive int, got {max_num_seqs}")
        if max_num_batched_tokens < max(verify_tokens, 1):
            raise ValueError(f"max_num_batched_tokens: a step must fit at least one verify row of "
                             f"{verify_tokens} tokens, got {max_num_batched_tokens}")
        if pool.num_free < slots_per_sequence:
            raise ValueError(f"pool: {pool.num_free} free slots cannot hold one sequence of {slots_per_sequence}")
        self.pool = pool
        self.free_at_start = pool.num_free
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.verify_tokens = verify_tokens
        self.slots_per_sequence = slots_per_sequence
        self.requests = list(trace)
        self.waiting = deque(self.requests)
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.steps = 0
        self.peak_running = 0

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def plan(self) -> StepPlan | None:
        """The next step, or None when every request has finished."""
        if self.done:
            return None
        budget = self.budget
        decode = []
        for seq in self.running:
            if not seq.in_prefill and budget >= self.verify_tokens:
                decode.append(seq)
                budget -= self.verify_tokens
        prefill = []
        for seq in self.running:
            if seq.in_prefill and budget > 0:
                length = min(seq.request.input_len - seq.prefilled, budget)
                prefill.append(PrefillChunk(seq, seq.prefilled, length))
                budget -= length
        while (budget > 0 and self.waiting and len(self.running) < self.max_num_seqs
               and self.pool.num_free >= self.slots_per_sequence):
            request = self.waiting.popleft()
            # alloc zeroes the slots in every layer: a new sequence starts from the zero state
            seq = Sequence(request, self.pool.alloc(self.slots_per_sequence).tolist(), first_step=self.steps)
            self.running.append(seq)
            length = min(request.input_len, budget)
            prefill.append(PrefillChunk(seq, 0, length))
            budget -= length
        self.peak_running = max(self.peak_running, len(self.running))
        if not prefill and not decode:
            raise RuntimeError("scheduler: a step with no work (budget too small for any running sequence)")
        plan = StepPlan(self.steps, tuple(prefill), tuple(decode))
        self.steps += 1
        return plan

    def committed_counts(self, plan: StepPlan, drawn: list[int]) -> list[int]:
        """Tokens each decode row keeps: the drawn accepted length, capped at what it still needs."""
        if len(drawn) != len(plan.decode):
            raise ValueError(f"drawn: expected {len(plan.decode)} accepted lengths, got {len(drawn)}")
        return [min(a, seq.remaining) for a, seq in zip(drawn, plan.decode)]

    def finish_step(self, plan: StepPlan, committed: list[int]) -> list[Sequence]:
        """Advance the sequences of ``plan`` (``committed`` tokens per decode row); finished
        sequences give their slots back to the pool. Returns the sequences that finished."""
        if len(committed) != len(plan.decode):
            raise ValueError(f"committed: expected {len(plan.decode)} counts, got {len(committed)}")
        for chunk in plan.prefill:
            seq = chunk.sequence
            seq.chunks.append((chunk.start, chunk.length))
            seq.prefilled += chunk.length
            if not seq.in_prefill:
                seq.generated += 1  # the last prompt position samples the first output token
        for seq, count in zip(plan.decode, committed):
            if not 1 <= count <= self.verify_tokens:
                raise ValueError(f"committed: expected 1..{self.verify_tokens} tokens per row, got {count}")
            seq.generated += count
            seq.accepted.append(count)
            seq.state_column = count - 1 if self.slots_per_sequence > 1 else 0
        done = [seq for seq in self.running if not seq.in_prefill and seq.remaining <= 0]
        for seq in done:
            seq.last_step = plan.index
            self.pool.free(seq.slots)
            self.running.remove(seq)
            self.finished.append(seq)
        return done

    def check(self) -> dict:
        """After the last step: every request got exactly its prompt and output tokens, every
        prefill chunk continued where the previous one stopped, every slot came back. Raises
        RuntimeError naming the first violation; returns a summary."""
        if not self.done:
            raise RuntimeError(f"scheduler: {len(self.waiting)} waiting and {len(self.running)} running requests left")
        if sorted(s.request.rid for s in self.finished) != sorted(r.rid for r in self.requests):
            raise RuntimeError("scheduler: the finished requests are not the trace's requests")
        for seq in self.finished:
            r = seq.request
            starts = [start for start, _ in seq.chunks]
            expected_starts = [sum(length for _, length in seq.chunks[:i]) for i in range(len(seq.chunks))]
            if seq.prefilled != r.input_len or starts != expected_starts:
                raise RuntimeError(f"request {r.rid}: prefilled {seq.prefilled} of {r.input_len} tokens in chunks "
                                   f"{seq.chunks}")
            if seq.generated != r.output_len or 1 + sum(seq.accepted) != r.output_len:
                raise RuntimeError(f"request {r.rid}: generated {seq.generated} tokens, wanted {r.output_len}")
        if self.pool.num_free != self.free_at_start:
            raise RuntimeError(f"pool: {self.free_at_start - self.pool.num_free} slots were not returned")
        accepted = [a for seq in self.finished for a in seq.accepted]
        return dict(requests=len(self.finished), steps=self.steps, peak_running=self.peak_running,
                    prompt_tokens=sum(r.input_len for r in self.requests),
                    output_tokens=sum(r.output_len for r in self.requests),
                    decode_rows=len(accepted), decode_tokens=sum(accepted),
                    accepted_histogram={n: accepted.count(n) for n in range(1, self.verify_tokens + 1)})
