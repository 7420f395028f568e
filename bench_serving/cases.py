"""Benchmark cases at the model shapes of DESIGN section 1 and their TP4 shards."""
from __future__ import annotations

from dataclasses import dataclass

from cula_serve.inputs import MODEL_SHAPES


@dataclass(frozen=True)
class Case:
    """One benchmark row. ``seqlens`` for prefill; ``batch`` for decode. ``raw_gates``: the
    engines' raw gate projections with the fused gate (``random_inputs(fused_gate=True)``: KDA's
    per-channel decays then reach tens per token), instead of prepared mild decays (about -0.05)."""

    op: str  # "prefill" or "decode"
    model: str
    mode: str
    H: int
    HV: int
    K: int
    V: int
    seqlens: tuple = ()
    batch: int = 0
    tp: int = 1
    raw_gates: bool = False

    @property
    def name(self) -> str:
        heads = f"h{self.H}/{self.HV}" if self.H != self.HV else f"h{self.HV}"
        shard = f" tp{self.tp}" if self.tp > 1 else ""
        if self.op == "prefill":
            lengths = sorted(set(self.seqlens))
            size = f"{len(self.seqlens)}x{lengths[0]}" if len(lengths) == 1 else f"{len(self.seqlens)} seqs"
            return f"{self.mode} prefill {heads}{shard} {size}" + (" raw gates" if self.raw_gates else "")
        return f"{self.mode} decode {heads}{shard} B{self.batch}"


def _shape(model, tp=1):
    s = MODEL_SHAPES[model]
    return dict(model=model, mode=s["mode"], H=s["H"] // tp, HV=s["HV"] // tp, K=s["K"], V=s["V"], tp=tp)


def gpu_cases():
    cases = []
    for model, runs in (("qwen3-next", [(4, 8192), (1, 32768), (8, 1024), (1, 2048)]),
                        ("kimi-linear", [(4, 8192), (1, 32768), (8, 1024), (1, 2048)]),
                        ("minimax", [(4, 8192), (8, 1024)])):
        cases += [Case("prefill", seqlens=(length,) * n, **_shape(model)) for n, length in runs]
        cases.append(Case("prefill", seqlens=(8192,), **_shape(model, tp=4)))
    # strong per-channel decays take KDA's exact diagonal-block path (chunk_triton._split_diag_block)
    cases.append(Case("prefill", seqlens=(8192,) * 4, **_shape("kimi-linear"), raw_gates=True))
    for model in MODEL_SHAPES:
        cases += [Case("decode", batch=b, **_shape(model)) for b in (1, 8, 64, 256)]
        cases.append(Case("decode", batch=64, **_shape(model, tp=4)))
    return cases


def cpu_cases():
    """A small table for machines without a GPU (reference backend only)."""
    return ([Case("prefill", seqlens=(256, 64), **_shape(m, tp=8)) for m in MODEL_SHAPES]
            + [Case("decode", batch=8, **_shape(m, tp=8)) for m in MODEL_SHAPES])
