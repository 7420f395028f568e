"""Linear-attention layers of the served models on random weights, for ``bench_serving offline``.

Each layer is what the model runs around its attention core, at the model's real sizes (DESIGN
section 1 heads, the checkpoints' hidden sizes), sharded like tensor parallelism shards it
(column-parallel input projections, row-parallel output projection; the all-reduce is not run):

- Qwen3-Next (GDN): RMSNorm, ``in_proj_qkvz`` and ``in_proj_ba`` (one GEMM), core with the gate
  ``-exp(A_log) softplus(a + dt_bias)``, beta = sigmoid(b) and qk l2norm fused in the kernel,
  gated RMSNorm (``norm(o) * silu(z)``), ``out_proj``, residual.
- Kimi-Linear (KDA): RMSNorm, q/k/v, the low-rank gate (``f_a``), ``b`` and output-gate (``g_a``)
  projections (one GEMM), ``f_b`` (gate, per channel) and ``g_b`` up-projections, core with the
  per-channel gate fused, ``norm(o) * sigmoid(g)``, ``o_proj``, residual.
- MiniMax (Lightning): RMSNorm, ``qkv_proj`` with SiLU and ``output_gate`` (one GEMM), core with
  MiniMax's per-head decay, ``norm(o) * sigmoid(gate)``, ``out_proj``, residual.

Not modelled: the short causal convolution of GDN and KDA (its own small state and kernel, the same
for every attention backend), MoE / MLP blocks and the full-attention layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cula_serve.inputs import MODEL_SHAPES, minimax_decay

# hidden_size of Qwen3-Next-80B-A3B, Kimi-Linear-48B-A3B and MiniMax-Text-01
HIDDEN_SIZE = {"qwen3-next": 2048, "kimi-linear": 2304, "minimax": 6144}


@dataclass(frozen=True)
class LayerShape:
    """Per-rank sizes of one linear-attention layer: D hidden, H qk heads, HV value heads."""

    model: str
    mode: str
    hidden: int
    H: int
    HV: int
    K: int
    V: int
    tp: int

    @property
    def heads(self) -> dict:
        return dict(H=self.H, HV=self.HV, K=self.K, V=self.V)


def layer_shape(model: str, tp: int = 1) -> LayerShape:
    if model not in MODEL_SHAPES:
        raise ValueError(f"model: expected one of {sorted(MODEL_SHAPES)}, got {model!r}")
    s = MODEL_SHAPES[model]
    if tp < 1 or s["H"] % tp or s["HV"] % tp:
        raise ValueError(f"tp: expected a divisor of the {model} head counts ({s['H']} qk, {s['HV']} v), got {tp}")
    return LayerShape(model, s["mode"], HIDDEN_SIZE[model], s["H"] // tp, s["HV"] // tp, s["K"], s["V"], tp)


class LinearAttentionLayer:
    """One layer's weights (random, scaled 1/sqrt(fan_in)) and its projections around the core.

    ``project_in(x, lead)``: x [N, D] -> (core inputs, output gate), core inputs as the Level-1 API
    takes them with token dims ``lead`` ((1, N) packed prefill, (B, T) decode / verify): q, k
    [*lead, H, K], v [*lead, HV, V], g raw [*lead, HV] (gdn) / [*lead, HV, K] (kda), beta logits
    [*lead, HV] (views of one projection; no copies). ``project_out(x, o, gate)``: residual
    output [N, D]. ``core_options``: the gate keywords of every core call (shared by cula-serve
    and FLA, which use the same names).
    """

    def __init__(self, shape: LayerShape, index: int, *, dtype: torch.dtype, device: torch.device, seed: int):
        self.shape = shape
        generator = torch.Generator(device).manual_seed(seed * 1009 + index)
        D, H, HV, K, V = shape.hidden, shape.H, shape.HV, shape.K, shape.V

        def weight(rows, cols):
            return (torch.randn(rows, cols, generator=generator, device=device) * rows ** -0.5).to(dtype)

        qk, vv = H * K, HV * V
        if shape.mode == "gdn":
            self.columns = dict(q=qk, k=qk, v=vv, z=vv, b=HV, g=HV)
        elif shape.mode == "kda":
            # f_a and g_a are Kimi's rank-K (head_dim) bottlenecks of the gate and the output gate
            self.columns = dict(q=qk, k=qk, v=vv, g_low=K, b=HV, z_low=V)
            self.w_gate_up = weight(K, HV * K)
            self.w_z_up = weight(V, vv)
        else:
            self.columns = dict(q=qk, k=qk, v=vv, z=vv)
        self.w_in = weight(D, sum(self.columns.values()))
        self.w_out = weight(vv, D)
        if shape.mode == "lightning":
            decay = minimax_decay(HV * shape.tp)[:HV]  # rank 0's heads of the full model
            self.core_options = dict(decay=decay.to(device))
        else:
            A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=generator))
            dt_shape = (HV,) if shape.mode == "gdn" else (HV * K,)
            dt_bias = torch.randn(dt_shape, generator=generator, device=device) * 0.5
            self.core_options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                     dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)

    def project_in(self, x: torch.Tensor, lead: tuple):
        s = self.shape
        h = F.rms_norm(x, (s.hidden,)) @ self.w_in
        qkv_columns = 2 * s.H * s.K + s.HV * s.V
        if s.mode == "lightning":
            # MiniMax applies SiLU to q, k and v: one elementwise pass over the three
            F.silu(h[:, :qkv_columns], inplace=True)
        parts = dict(zip(self.columns, h.split(list(self.columns.values()), dim=-1)))
        inputs = dict(q=parts["q"].unflatten(-1, (s.H, s.K)).unflatten(0, lead),
                      k=parts["k"].unflatten(-1, (s.H, s.K)).unflatten(0, lead),
                      v=parts["v"].unflatten(-1, (s.HV, s.V)).unflatten(0, lead))
        if s.mode == "lightning":
            return inputs, parts["z"]
        # raw gate and beta logits in the model dtype, as engines pass them (the kernels fuse the
        # gate and the sigmoid and compute in float32)
        inputs["beta"] = parts["b"].unflatten(0, lead)
        if s.mode == "gdn":
            inputs["g"] = parts["g"].unflatten(0, lead)
            return inputs, parts["z"]
        inputs["g"] = (parts["g_low"] @ self.w_gate_up).unflatten(-1, (s.HV, s.K)).unflatten(0, lead)
        return inputs, parts["z_low"] @ self.w_z_up

    def project_out(self, x: torch.Tensor, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        s = self.shape
        N = x.shape[0]
        if s.mode == "lightning":
            y = F.rms_norm(o.reshape(N, s.HV * s.V), (s.HV * s.V,)) * torch.sigmoid(gate)
        else:
            gate = gate.reshape(N, s.HV, s.V)
            y = F.rms_norm(o.reshape(N, s.HV, s.V), (s.V,)) * (F.silu(gate) if s.mode == "gdn" else torch.sigmoid(gate))
        return x + y.reshape(N, s.HV * s.V).to(x.dtype) @ self.w_out
