"""Model shapes (DESIGN section 1) and random inputs for them: shared by the demo, the tests
and the benchmarks, so every caller exercises the same realistic distributions."""
from __future__ import annotations

import torch

# Per-rank shapes at TP1. Under tensor parallelism each rank holds H / TP qk and HV / TP v heads.
MODEL_SHAPES = {
    "qwen3-next": dict(mode="gdn", H=16, HV=32, K=128, V=128),
    "kimi-linear": dict(mode="kda", H=32, HV=32, K=128, V=128),
    "minimax": dict(mode="lightning", H=64, HV=64, K=128, V=128),
}
# The same shapes keyed by family: {"gdn": dict(H=16, HV=32, K=128, V=128), ...}
MODE_SHAPES = {s["mode"]: {key: s[key] for key in ("H", "HV", "K", "V")} for s in MODEL_SHAPES.values()}


def minimax_decay(num_heads: int) -> torch.Tensor:
    """MiniMax / Lightning's per-head log decay -slope_h, slope_h = 2 ** (-8 (h + 1) / HV)."""
    h = torch.arange(num_heads, dtype=torch.float64)
    return -(2.0 ** (-8.0 * (h + 1) / num_heads)).float()


def random_inputs(mode: str, lead: tuple, *, H: int, HV: int, K: int, V: int, dtype=torch.bfloat16,
                  device="cpu", fused_gate: bool = True, generator: torch.Generator | None = None) -> dict:
    """Keyword arguments for a Level-1 call of ``mode`` with token dims ``lead`` ([T], [B, T] or [N, T]).

    Delta rule (gdn, kda): raw q, k with ``use_qk_l2norm_in_kernel``; with ``fused_gate`` the raw
    gate projection plus A_log / dt_bias and beta as logits (what engines pass), otherwise a
    prepared log decay in about [-1, 0) and beta in (0, 1). Lightning: MiniMax's decay.
    Tensors are drawn from ``generator`` (reproducible) on its device (the CPU without one; a CUDA
    generator draws long inputs quickly) and then moved to ``device``.
    """
    draw_on = generator.device if generator is not None else "cpu"

    def rand(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=generator, dtype=torch.float32, device=draw_on).to(dt).to(device)

    kw = dict(q=rand(*lead, H, K, dt=dtype), k=rand(*lead, H, K, dt=dtype), v=rand(*lead, HV, V, dt=dtype))
    if mode == "lightning":
        kw["decay"] = minimax_decay(HV).to(device)
        return kw
    gate_shape = (*lead, HV) if mode == "gdn" else (*lead, HV, K)
    kw["use_qk_l2norm_in_kernel"] = True
    if fused_gate:
        kw.update(g=rand(*gate_shape), beta=rand(*lead, HV), use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True,
                  A_log=torch.empty(HV, device=draw_on).uniform_(0, 2.5, generator=generator).to(device),
                  dt_bias=rand(HV) if mode == "gdn" else rand(HV, K))
    else:
        kw.update(g=torch.nn.functional.logsigmoid(rand(*gate_shape) + 3.0),
                  beta=torch.sigmoid(rand(*lead, HV)))
    return kw


def to_float64(kwargs: dict) -> dict:
    """The same call with every floating tensor in float64 (for the float64 oracle)."""
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kwargs.items()}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (DESIGN section 7's measure)."""
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
