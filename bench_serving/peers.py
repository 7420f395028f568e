"""Other libraries' kernels, run on the same inputs as cula-serve in the same process.

Each peer is optional: ``peer_status()`` says for each one which version runs, or in one line why
it does not (not installed, or installed but failing to import on this machine). Each adapter
builds a zero-argument callable; every conversion it needs (gate form, dense states gathered from
the pool, index dtype) is done when it is built, outside the timed call. What each peer runs:

- ``fla``: FLA's ``chunk_*`` prefill and ``fused_recurrent_*`` decode on dense K-last states
  ``[N, HV, V, K]`` (``state_v_first=True``): the same state bytes as a pool decode.
- ``flashinfer``: FlashInfer's GDN prefill ``chunk_gated_delta_rule`` (CuTe DSL on SM90) and GDN
  decode / MTP ``gated_delta_rule_decode_pretranspose`` (CuTe DSL), reading and writing our
  ``[P, HV, V, K]`` pool in place through its ``state_indices`` / ``initial_state_indices``.
  Its prefill takes the decay factor ``exp(g)``, its decode the engines' raw gate inputs.
- ``flashqla``: FlashQLA's GDN prefill (TileLang kernels) on dense K-last states.
- ``vllm``: vLLM's serving GDN decode kernel ``fused_sigmoid_gating_delta_rule_update`` (Triton;
  see vllm_kernel.py) on our pool through ``ssm_state_indices``. Slot 0 is vLLM's null block
  (the kernel skips it), so pools used with it keep slot 0 free.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata

import torch

from . import vllm_kernel

# peer: (import name, distribution name)
_IMPORTS = {"fla": ("fla", "fla-core"), "flashinfer": ("flashinfer", "flashinfer-python"),
            "flashqla": ("flash_qla", "flash-qla")}
PEERS = (*_IMPORTS, "vllm")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


@functools.lru_cache(maxsize=None)
def peer_status() -> dict:
    """{peer: (version or None, why not or None)}. A peer whose import raises anything is absent."""
    status = {}
    for peer, (module, dist) in _IMPORTS.items():
        try:
            importlib.import_module(module)
            status[peer] = (importlib.metadata.version(dist), None)
        except ImportError as err:
            status[peer] = (None, f"not installed ({_first_line(err)})")
        except Exception as err:  # noqa: BLE001 - e.g. a peer that rejects this GPU at import time
            status[peer] = (None, f"installed but unusable here ({_first_line(err)})")
    try:
        _, origin = vllm_kernel.load()
        status["vllm"] = (origin, None)
    except ImportError as err:
        status["vllm"] = (None, f"not installed ({err})")
    except Exception as err:  # noqa: BLE001
        status["vllm"] = (None, f"installed but unusable here ({_first_line(err)})")
    return status


def select(names=None) -> dict:
    """``peer_status()`` with only the peers in ``names`` (None: all) present; the others absent, saying so."""
    if names is not None and set(names) - set(PEERS):
        raise ValueError(f"peers: unknown {sorted(set(names) - set(PEERS))}, expected some of {list(PEERS)}")
    return {peer: (status if names is None or peer in names else (None, "not selected (--peers)"))
            for peer, status in peer_status().items()}


def peer_versions(status=None) -> dict:
    """{peer: version or None when absent} of ``status`` (default: ``peer_status()``)."""
    return {peer: version for peer, (version, _) in (status or peer_status()).items()}


def absence_lines(status=None) -> list:
    """One line per absent peer of ``status`` (default: ``peer_status()``), saying why it is skipped."""
    return [f"peer {peer}: {why}, skipped" for peer, (version, why) in (status or peer_status()).items()
            if version is None]


# ---------------------------------------------------------------------------------------------
# gate forms
# ---------------------------------------------------------------------------------------------

def prepared_inputs(mode: str, kw: dict) -> dict:
    """``kw`` with prepared gates: g a natural-log decay (<= 0), beta in (0, 1), no in-kernel gate
    flags (what FLA-style kernels take). Raw engine gates (``use_gate_in_kernel``) are evaluated here
    in float32 with the formulas of DESIGN section 2."""
    out = dict(kw)
    if mode == "lightning":
        return out
    if out.pop("use_gate_in_kernel", False):
        if out.get("lower_bound") is not None:
            raise ValueError("lower_bound: the KDA safe gate has no peer equivalent")
        x = kw["g"].float()
        if kw.get("dt_bias") is not None:
            x = x + kw["dt_bias"].float()
        A = kw["A_log"].float().exp()
        A = A.view(*A.shape, *([1] * (x.dim() - 3)))  # per value head, broadcast over KDA's channels
        out["g"] = -A * torch.nn.functional.softplus(x)
    if out.pop("use_beta_sigmoid_in_kernel", False):
        out["beta"] = torch.sigmoid(kw["beta"].float())
    for key in ("A_log", "dt_bias", "lower_bound"):
        out.pop(key, None)
    return out


def engine_gates(kw: dict, dtype=torch.float32):
    """(A_log [HV], a, dt_bias, b): the raw gate inputs of vLLM's and FlashInfer's decode kernels,
    which compute ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``.

    From raw inputs they are passed through; from prepared ones (g <= 0, beta in (0, 1)) they are
    A_log = 0, dt_bias = 0, a = softplus^-1(-g), b = logit(beta), computed in float64, so the
    kernel's gate is the prepared one up to rounding of ``a`` and ``b`` to ``dtype``.
    """
    g, beta = kw["g"], kw["beta"]
    per_head = g.shape[2:]  # [HV] for GDN, [HV, K] for KDA
    if kw.get("use_gate_in_kernel"):
        if kw.get("lower_bound") is not None:
            raise ValueError("lower_bound: the KDA safe gate has no peer equivalent")
        A_log, a = kw["A_log"].float(), g
        dt_bias = kw["dt_bias"] if kw.get("dt_bias") is not None else torch.zeros(per_head, device=g.device)
    else:
        x = (-g).double()
        # softplus(a) = log(1 + e^a) = x  <=>  a = log(e^x - 1); the kernels use softplus(a) = a above 20
        a = torch.where(x > 20, x, torch.log(torch.expm1(x)))
        A_log = torch.zeros(per_head[0], device=g.device)
        dt_bias = torch.zeros(per_head, device=g.device)
    if kw.get("use_beta_sigmoid_in_kernel"):
        b = beta
    else:
        p = beta.double()
        b = torch.log(p) - torch.log1p(-p)
    return A_log.float().contiguous(), a.to(dtype).contiguous(), dt_bias.float().contiguous(), b.to(dtype).contiguous()


# ---------------------------------------------------------------------------------------------
# FLA
# ---------------------------------------------------------------------------------------------

def fla_prefill(mode, kw, initial_state, cu_seqlens):
    """A zero-argument callable running FLA's chunked prefill; returns (o, final [N, HV, V, K])."""
    kw = prepared_inputs(mode, kw)
    common = dict(initial_state=initial_state, output_final_state=True, state_v_first=True,
                  cu_seqlens=cu_seqlens.long())
    if mode == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])
        common["use_qk_l2norm_in_kernel"] = True
    elif mode == "kda":
        from fla.ops.kda import chunk_kda as fn
        args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])
        common["use_qk_l2norm_in_kernel"] = True
    else:
        from fla.ops.simple_gla import chunk_simple_gla as fn
        args = (kw["q"], kw["k"], kw["v"])
        common["g_gamma"] = kw["decay"]

    def run():
        with torch.inference_mode():
            return fn(*args, **common)

    return run


def fla_decode(mode, kw, states):
    """FLA's fused recurrent kernel for one token per sequence on dense states ``[B, HV, V, K]``
    (slot n = sequence n): the same state bytes as a pool decode. Returns (o, final)."""
    kw = prepared_inputs(mode, kw)
    B = kw["q"].shape[0]
    cu = torch.arange(B + 1, dtype=torch.long, device=kw["q"].device)
    packed = {k: (v.reshape(1, B, *v.shape[2:]) if isinstance(v, torch.Tensor) and v.dim() >= 3 else v)
              for k, v in kw.items()}
    common = dict(initial_state=states, output_final_state=True, state_v_first=True, cu_seqlens=cu)
    if mode == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
        args = (packed["q"], packed["k"], packed["v"])
        common.update(g=packed["g"], beta=packed["beta"], use_qk_l2norm_in_kernel=True)
    elif mode == "kda":
        from fla.ops.kda import fused_recurrent_kda as fn
        args = (packed["q"], packed["k"], packed["v"], packed["g"], packed["beta"])
        common["use_qk_l2norm_in_kernel"] = True
    else:
        from fla.ops.simple_gla import fused_recurrent_simple_gla as fn
        args = (packed["q"], packed["k"], packed["v"])
        common["g_gamma"] = kw["decay"]

    def run():
        with torch.inference_mode():
            o, final = fn(*args, **common)
        return o.reshape(B, 1, *o.shape[2:]), final

    return run


# ---------------------------------------------------------------------------------------------
# FlashInfer (GDN)
# ---------------------------------------------------------------------------------------------

def flashinfer_prefill(kw, state_pool, state_indices, seqlens):
    """FlashInfer's GDN chunked prefill of packed sequences of lengths ``seqlens`` (host ints),
    initial states read from and final states written to ``state_pool[state_indices]`` in place.
    ``kw``: q, k [1, T, H, K], v [1, T, HV, V] and GDN gates. Returns o [1, T, HV, V]."""
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    kw = prepared_inputs("gdn", kw)
    q, k, v = kw["q"][0], kw["k"][0], kw["v"][0]  # FlashInfer packs tokens as [T, heads, dim]
    T, HV, V = v.shape
    alpha = kw["g"][0].float().exp().contiguous()  # FlashInfer takes the decay factor, not its log
    beta = kw["beta"][0].float().contiguous()
    offsets = [0]
    for n in seqlens:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=q.device)
    out = torch.empty(T, HV, V, dtype=v.dtype, device=v.device)

    def run():
        chunk_gated_delta_rule(q, k, v, alpha, beta, initial_state=state_pool, output_final_state=True,
                               cu_seqlens=cu, use_qk_l2norm_in_kernel=kw.get("use_qk_l2norm_in_kernel", False),
                               output=out, output_state=state_pool, state_indices=state_indices,
                               max_seqlen=max(seqlens))
        return out.view(1, T, HV, V)

    return run


def flashinfer_decode(kw, state_pool, state_indices):
    """FlashInfer's GDN decode (``gated_delta_rule_decode_pretranspose``, generic FlashInfer
    kernels) on ``state_pool[state_indices]`` in place. q, k [B, 1, H, K]; returns o [B, 1, HV, V].
    Gates go in the engines' raw form (``engine_gates``), in bf16 for a bf16 pool as engines pass
    them, else float32."""
    from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose

    gate_dtype = torch.bfloat16 if state_pool.dtype == torch.bfloat16 else torch.float32
    A_log, a, dt_bias, b = engine_gates(kw, gate_dtype)
    q, k, v = kw["q"], kw["k"], kw["v"]
    out = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)

    def run():
        gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, output=out,
                                             use_qk_l2norm=kw.get("use_qk_l2norm_in_kernel", False),
                                             initial_state=state_pool, initial_state_indices=state_indices,
                                             backend="flashinfer")
        return out

    return run


def flashinfer_verify_commit(kw, state_pool, state_indices, intermediate, num_accepted_tokens):
    """The buffer protocol (SGLang's) with FlashInfer's MTP kernel: verify T tokens from
    ``state_pool[state_indices]`` without updating it, the state after each token to
    ``intermediate [B, T, HV, V, K]`` (pool dtype); then commit as SGLang does, a torch gather-copy
    of ``intermediate[n, accepted_n - 1]`` into the slot. Returns o [B, T, HV, V]."""
    from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose

    gate_dtype = torch.bfloat16 if state_pool.dtype == torch.bfloat16 else torch.float32
    A_log, a, dt_bias, b = engine_gates(kw, gate_dtype)
    q, k, v = kw["q"], kw["k"], kw["v"]
    out = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    rows = torch.arange(q.shape[0], device=q.device)
    last = (num_accepted_tokens.long() - 1).clamp(min=0)
    slots = state_indices.long()

    def run():
        gated_delta_rule_decode_pretranspose(q, k, v, None, A_log, a, dt_bias, b, output=out,
                                             use_qk_l2norm=kw.get("use_qk_l2norm_in_kernel", False),
                                             initial_state=state_pool, initial_state_indices=state_indices,
                                             intermediate_states_buffer=intermediate, disable_state_update=True,
                                             backend="flashinfer")
        state_pool.index_copy_(0, slots, intermediate[rows, last])
        return out

    return run


# ---------------------------------------------------------------------------------------------
# FlashQLA (GDN prefill)
# ---------------------------------------------------------------------------------------------

def flashqla_prefill(kw, initial_state, cu_seqlens):
    """FlashQLA's GDN chunked prefill on dense K-last states ``initial_state [N, HV, V, K]``
    (``state_v_first=True``). Returns (o [1, T, HV, V], final [N, HV, V, K])."""
    from flash_qla import chunk_gated_delta_rule

    kw = prepared_inputs("gdn", kw)
    args = (kw["q"], kw["k"], kw["v"], kw["g"].float(), kw["beta"].float())
    common = dict(initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens.long(),
                  use_qk_l2norm_in_kernel=kw.get("use_qk_l2norm_in_kernel", False), state_v_first=True)

    def run():
        with torch.inference_mode():
            return chunk_gated_delta_rule(*args, **common)

    return run


# ---------------------------------------------------------------------------------------------
# vLLM's serving decode kernel (GDN)
# ---------------------------------------------------------------------------------------------

def _check_no_null_slot(name, indices):
    if bool((indices == 0).any()):
        raise ValueError(f"{name}: slot 0 is vLLM's null block (its kernel skips it); keep slot 0 free")


def vllm_decode(kw, state_pool, state_indices, num_accepted_tokens=None):
    """vLLM's ``fused_sigmoid_gating_delta_rule_update`` on ``state_pool [P, HV, V, K]`` in place
    (gates in the raw form, ``engine_gates``; slot 0 is vLLM's null block and must stay unused).

    Decode: q, k [B, 1, H, K], sequence n in slot ``state_indices[n]``. Spec-decode verify (the
    slots protocol), with ``num_accepted_tokens``: T tokens per sequence, the initial state from
    column ``num_accepted_tokens[n] - 1`` of ``state_indices [B, T]`` and the state after token t
    written to column t; vLLM has no commit step (the next step passes the accepted count).
    Returns a callable giving o [B, T, HV, V]."""
    fn, _ = vllm_kernel.load()
    _check_no_null_slot("state_indices", state_indices)
    A_log, a, dt_bias, b = engine_gates(kw)
    q, k, v = kw["q"], kw["k"], kw["v"]
    l2norm = kw.get("use_qk_l2norm_in_kernel", False)
    verify = {} if num_accepted_tokens is None else dict(num_accepted_tokens=num_accepted_tokens)

    def run():
        o, _ = fn(A_log, a, b, dt_bias, q, k, v, initial_state=state_pool, inplace_final_state=True,
                  ssm_state_indices=state_indices, use_qk_l2norm_in_kernel=l2norm, **verify)
        return o

    return run
