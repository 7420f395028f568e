"""The oracle itself, checked against the math written out independently, and the chunked torch
forms against the oracle (DESIGN section 7: chunked == recurrent to 1e-5 in float32)."""
import pytest
import torch

from cula_serve.kernels.common.prep import FusedGate, Recipe, l2norm
from cula_serve.kernels.delta_rule.chunk_torch import delta_rule_chunked
from cula_serve.kernels.delta_rule.naive import delta_rule_recurrence
from cula_serve.kernels.lightning.chunk_torch import lightning_chunked
from cula_serve.kernels.lightning.naive import lightning_recurrence

from conftest import assert_close


def _scalar_loops_delta_rule(q, k, v, g, beta, scale, S0):
    """DESIGN section 2 for one sequence and one head with Python scalars only.
    q, k [T][K]; v [T][V]; g [T][K]; beta [T]; S0 [K][V] lists."""
    K, V = len(q[0]), len(v[0])
    S = [row[:] for row in S0]
    outs = []
    for t in range(len(q)):
        S = [[S[i][j] * torch.tensor(g[t][i]).exp().item() for j in range(V)] for i in range(K)]
        u = [beta[t] * (v[t][j] - sum(S[i][j] * k[t][i] for i in range(K))) for j in range(V)]
        S = [[S[i][j] + k[t][i] * u[j] for j in range(V)] for i in range(K)]
        outs.append([scale * sum(S[i][j] * q[t][i] for i in range(K)) for j in range(V)])
    return outs, S


@pytest.mark.parametrize("per_channel", [False, True])
def test_recurrence_matches_scalar_loops(per_channel, generator):
    T, H, HV, K, V = 5, 1, 2, 3, 4
    q = torch.randn(1, T, H, K, generator=generator, dtype=torch.float64)
    k = l2norm(torch.randn(1, T, H, K, generator=generator, dtype=torch.float64))
    v = torch.randn(1, T, HV, V, generator=generator, dtype=torch.float64)
    g = -torch.rand(1, T, HV, *([K] if per_channel else []), generator=generator, dtype=torch.float64)
    beta = torch.rand(1, T, HV, generator=generator, dtype=torch.float64)
    S0 = torch.randn(1, HV, K, V, generator=generator, dtype=torch.float64)
    o, S, _ = delta_rule_recurrence(q, k, v, g, beta, 0.7, S0)
    for hv in range(HV):  # both value heads read qk head 0
        gh = g[0, :, hv] if per_channel else g[0, :, hv, None].expand(T, K)
        ref_o, ref_S = _scalar_loops_delta_rule(q[0, :, 0].tolist(), k[0, :, 0].tolist(), v[0, :, hv].tolist(),
                                                gh.tolist(), beta[0, :, hv].tolist(), 0.7, S0[0, hv].tolist())
        torch.testing.assert_close(o[0, :, hv], torch.tensor(ref_o, dtype=torch.float64))
        torch.testing.assert_close(S[0, hv], torch.tensor(ref_S, dtype=torch.float64))


def test_delta_rule_writes_value_exactly():
    """With beta = 1, no decay and a unit key, the state afterwards maps that key to its value."""
    k = l2norm(torch.randn(1, 1, 1, 8, dtype=torch.float64))
    v = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    S0 = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    _, S, _ = delta_rule_recurrence(k, k, v, torch.zeros(1, 1, 1, dtype=torch.float64),
                                    torch.ones(1, 1, 1, dtype=torch.float64), 1.0, S0)
    torch.testing.assert_close(S[0, 0].T @ k[0, 0, 0], v[0, 0, 0], rtol=1e-5, atol=1e-5)


def test_lightning_closed_form(generator):
    """o_t = scale * sum_{s<=t} exp((t - s) d) (q_t . k_s) v_s + scale * exp((t + 1) d) S0^T q_t."""
    T, K, V = 7, 4, 3
    q = torch.randn(1, T, 1, K, generator=generator, dtype=torch.float64)
    k = torch.randn(1, T, 1, K, generator=generator, dtype=torch.float64)
    v = torch.randn(1, T, 1, V, generator=generator, dtype=torch.float64)
    S0 = torch.randn(1, 1, K, V, generator=generator, dtype=torch.float64)
    d = torch.tensor([-0.3], dtype=torch.float64)
    o, _, _ = lightning_recurrence(q, k, v, d, 0.5, S0)
    for t in range(T):
        ref = 0.5 * (torch.exp((t + 1) * d) * (S0[0, 0].T @ q[0, t, 0]))
        for s in range(t + 1):
            ref = ref + 0.5 * torch.exp((t - s) * d) * (q[0, t, 0] @ k[0, s, 0]) * v[0, s, 0]
        torch.testing.assert_close(o[0, t, 0], ref)


def test_fused_gates_match_design_formulas(generator):
    a = torch.randn(5, 3, 4, generator=generator)
    A_log = torch.randn(3, generator=generator)
    dt_bias = torch.randn(3, 4, generator=generator)
    kda = FusedGate(A_log, dt_bias).log_decay(a, per_channel=True)
    torch.testing.assert_close(kda, -A_log.exp()[:, None] * torch.nn.functional.softplus(a + dt_bias))
    safe = FusedGate(A_log, dt_bias, lower_bound=-5.0).log_decay(a, per_channel=True)
    torch.testing.assert_close(safe, -5.0 * torch.sigmoid(A_log.exp()[:, None] * (a + dt_bias)))
    gdn = FusedGate(A_log, dt_bias[:, 0]).log_decay(a[..., 0], per_channel=False)
    torch.testing.assert_close(gdn, -A_log.exp() * torch.nn.functional.softplus(a[..., 0] + dt_bias[:, 0]))
    assert (kda <= 0).all() and (safe >= -5.0).all() and (safe <= 0).all()
    recipe = Recipe("gdn", 1.0, qk_l2norm=True, beta_logits=True)
    q, k, g, beta = recipe.prepare(a, a, a[..., 0], a[..., 0], torch.float64)
    torch.testing.assert_close(beta, torch.sigmoid(a[..., 0].double()))
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(5, 3, dtype=torch.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("family", ["gdn", "kda", "lightning"])
def test_chunked_matches_oracle_float32(family, T, generator):
    B, H, HV, K, V = 2, 2, 4, 16, 8
    f64 = dict(generator=generator, dtype=torch.float64)
    q, k = torch.randn(B, T, H, K, **f64), l2norm(torch.randn(B, T, H, K, **f64))
    v = torch.randn(B, T, HV, V, **f64)
    S0 = torch.randn(B, HV, K, V, **f64)
    if family == "lightning":
        d = -torch.rand(HV, **f64)
        ref = lightning_recurrence(q, k, v, d, 0.25, S0, save_states=True)
        out = lightning_chunked(q.float(), k.float(), v.float(), d.float(), 0.25, S0.float())
    else:
        g = -torch.rand(B, T, HV, *([K] if family == "kda" else []), **f64) * 3  # strong decays
        beta = torch.rand(B, T, HV, **f64)
        ref = delta_rule_recurrence(q, k, v, g, beta, 0.25, S0, save_states=True)
        out = delta_rule_chunked(*(x.float() for x in (q, k, v, g, beta)), 0.25, S0.float())
    assert_close(out[0], ref[0], 1e-5, "output")
    assert_close(out[1], ref[1], 1e-5, "final state")
    assert out[2].shape[1] == T // 64
    for j in range(T // 64):
        assert_close(out[2][:, j], ref[2][:, (j + 1) * 64 - 1], 1e-5, f"chunk state {j}")


def test_chunked_survives_extreme_kda_gates(generator):
    """Gates of -40 per token underflow exp(G) inside a chunk; pairwise decays keep it finite."""
    T, K, V = 130, 16, 8
    f64 = dict(generator=generator, dtype=torch.float64)
    q, k, v = torch.randn(1, T, 1, K, **f64), l2norm(torch.randn(1, T, 1, K, **f64)), torch.randn(1, T, 1, V, **f64)
    g = -40 * torch.rand(1, T, 1, K, **f64)
    beta = torch.rand(1, T, 1, **f64)
    ref = delta_rule_recurrence(q, k, v, g, beta, 1.0)
    out = delta_rule_chunked(*(x.float() for x in (q, k, v, g, beta)), 1.0)
    assert torch.isfinite(out[0]).all()
    assert_close(out[0], ref[0], 1e-5)
