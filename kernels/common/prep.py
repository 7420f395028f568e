"""Turning raw projections into the recurrence's inputs (DESIGN section 2).

Every backend computes exactly these maps; the Triton and CuTe kernels fuse them into their loads,
this module is the readable reference the torch backend uses and the tests check against.

    l2norm(x)        = x / sqrt(sum(x^2) + 1e-6)                        over the last dim
    GDN gate         g = -exp(A_log[hv]) * softplus(a + dt_bias[hv])
    KDA gate         g = -exp(A_log[hv]) * softplus(a + dt_bias[hv, :])
    KDA safe gate    g = lower_bound * sigmoid(exp(A_log[hv]) * (a + dt_bias[hv, :]))
    beta from logits beta = sigmoid(b)

Gates are natural-log decays (g <= 0): the state is multiplied by exp(g) before each update.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension, in ``x``'s dtype."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


@dataclass(frozen=True)
class FusedGate:
    """Parameters of a gate computed inside the kernel from the raw projection ``a``.

    A_log:       [HV] float32 (bf16 accepted), per value head.
    dt_bias:     [HV] for GDN, [HV, K] for KDA, or None (no bias).
    lower_bound: KDA safe gate only: a negative float, the most negative g may be.
    """

    A_log: torch.Tensor
    dt_bias: torch.Tensor | None = None
    lower_bound: float | None = None

    def log_decay(self, a: torch.Tensor, per_channel: bool) -> torch.Tensor:
        """Raw gate projection ``a`` -> log decay ``g`` (same shape, float32 or wider).

        a: [..., HV] (GDN, ``per_channel=False``) or [..., HV, K] (KDA, ``per_channel=True``).
        The computation runs in ``a``'s dtype promoted to at least float32.
        """
        dtype = torch.promote_types(a.dtype, torch.float32)
        a = a.to(dtype)
        A = self.A_log.to(dtype).exp()
        if per_channel:  # A_log is per head; broadcast it over the K channels
            A = A[:, None]
        if self.dt_bias is not None:
            a = a + self.dt_bias.to(dtype)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(A * a)
        return -A * F.softplus(a)


@dataclass(frozen=True)
class Recipe:
    """How a call's raw inputs become the recurrence's inputs; one per call, shared by all backends.

    mode:       "gdn" (scalar gate per head), "kda" (per-channel gate) or "lightning" (constant
                per-head decay, no delta rule).
    scale:      multiplier of the output, K ** -0.5 unless the caller gives one.
    qk_l2norm:  l2-normalise q and k per head before use.
    fused_gate: compute g from the raw projection inside the kernel (see ``FusedGate``); None
                means g is already a log decay.
    beta_logits: beta is given as logits; the kernel applies the sigmoid.
    """

    mode: str
    scale: float
    qk_l2norm: bool = False
    fused_gate: FusedGate | None = None
    beta_logits: bool = False

    @property
    def delta_rule(self) -> bool:
        return self.mode in ("gdn", "kda")

    def prepare(self, q, k, g, beta, dtype):
        """Apply l2norm, the gate and the beta sigmoid; cast to the compute ``dtype``.

        Shapes are untouched: q, k [..., H, K]; g [..., HV] / [..., HV, K] (delta rule) or [HV]
        (lightning); beta [..., HV] or None. Returns (q, k, g, beta).
        """
        q, k = q.to(dtype), k.to(dtype)
        if self.qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        if self.fused_gate is not None:
            g = self.fused_gate.log_decay(g, per_channel=self.mode == "kda")
        g = g.to(dtype)
        if beta is not None:
            beta = beta.to(dtype)
            if self.beta_logits:
                beta = torch.sigmoid(beta)
        return q, k, g, beta


def expand_heads(x: torch.Tensor, num_value_heads: int, head_dim: int = -2) -> torch.Tensor:
    """Repeat the H qk heads of ``x`` so value head ``hv`` sees qk head ``hv // (HV // H)``."""
    groups = num_value_heads // x.shape[head_dim]
    return x if groups == 1 else x.repeat_interleave(groups, dim=head_dim)
