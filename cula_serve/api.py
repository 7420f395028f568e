"""Level 1: one entry point per serving job, each dispatched to the best backend for the device.

    cula_gdn, cula_kda, cula_lightning   chunked prefill of a (varlen) batch
    cula_decode                          one token per sequence, pool updated in place
    cula_verify                          MTP / speculative verify: T tokens per sequence
    cula_commit                          make the accepted prefix of a verify the pool's state

Conventions (DESIGN section 3): layout BSHD; q, k bf16 / fp16 (fp32 accepted); gates, beta and
gate parameters fp32 (bf16 accepted); the state pool is ``[P, HV, V, K]`` (K-last) in float32 or
bfloat16, addressed by ``state_indices`` where a negative index is padding (no read, no write,
zero output). Every call is validated whole before anything runs, so a bad call raises
``TypeError`` / ``ValueError`` and leaves the pool as it was.

MTP protocols (``cula_verify(..., protocol=...)``), for N sequences verifying T tokens each:

- ``"buffer"`` (SGLang): the pool is only read. The state after token t of sequence n goes to
  ``intermediate_states[intermediate_indices[n], t]`` (``[R, T_buf, HV, V, K]``, T_buf >= T).
  ``cula_commit`` copies entry ``num_accepted_tokens[n] - 1`` to the slot.
- ``"slots"`` (vLLM): ``state_indices`` is ``[N, T_cols]`` (T_cols >= T). The initial state is
  read from column ``num_accepted_tokens[n] - 1`` (the accepted count of the previous step) and
  the state after token t is written to column t. vLLM's flow needs no commit; ``cula_commit``
  optionally copies column ``num_accepted_tokens[n] - 1`` to column 0.
- ``"deferred"`` (fewest bytes): verify reads each state once and writes nothing;
  ``cula_commit`` replays the accepted tokens onto the slot in one read-modify-write. The
  tensors given to verify must stay unchanged until the commit. In an engine's steady state the
  commit goes into the next verify instead: ``cula_verify(..., pending=previous,
  num_accepted_tokens=accepted)`` commits and then verifies, one kernel on the cute backend (and
  on the Triton one for GDN / KDA) that reads and writes each state once, a decode step's bytes.

Example (deferred, GDN, 3 sequences verifying 4 draft tokens)::

    o, pending = cula_verify(q, k, v, pool, mode="gdn", g=g, beta=beta, state_indices=slots,
                             protocol="deferred")          # q, k [3, 4, H, K]; o [3, 4, HV, V]
    accepted = torch.tensor([4, 1, 2], dtype=torch.int32)  # from the sampler
    cula_commit(pending, accepted)                          # pool[slots[n]] = state after accepted[n] tokens

or, step after step, the commit inside the next verify (the same rows and slots)::

    o, pending = cula_verify(q, k, v, pool, mode="gdn", g=g, beta=beta, state_indices=slots,
                             pending=pending, num_accepted_tokens=accepted)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dispatch
from .kernels.common.prep import FusedGate, Recipe
from .validation import (FLOAT_DTYPES, INDEX_DTYPES, check_cu_seqlens, check_flag, check_range,
                         check_scale, check_slots, check_tensor, value_checks_enabled)

MODES = ("gdn", "kda", "lightning")
PROTOCOLS = ("buffer", "slots", "deferred")
CHECKPOINT_ALIGNMENT = 64  # checkpoints fall on chunk boundaries of the fast kernels


@dataclass(frozen=True)
class PendingCommit:
    """What ``cula_commit`` needs to finish a verify; returned by ``cula_verify``.

    protocol:  "buffer", "slots" or "deferred".
    num_tokens: T, the tokens per sequence of the verify.
    state_pool, state_indices: as given to the verify (indices int32, [N] or [N, T_cols]).
    intermediate_states, intermediate_indices: the buffer protocol's buffer and its rows.
    k, v, g, beta: the deferred protocol's inputs, as passed to the backend.
    saved: what the verify's backend kept for its own commit (the Triton backend's deferred
        delta-rule verify: every token's u, float32 [N, T, HV, V], 4 bytes per token and value
        column held until the commit); None otherwise. A commit on another backend ignores it
        and replays from k, v, g, beta.
    The remaining fields carry the verify's options to the same backend.
    """

    protocol: str
    recipe: Recipe
    backend: str
    num_tokens: int
    state_pool: torch.Tensor
    state_indices: torch.Tensor
    intermediate_states: torch.Tensor | None = None
    intermediate_indices: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    g: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    saved: torch.Tensor | None = None


# --------------------------------------------------------------------------------------------
# shared validation


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return mode


def _check_qkv(q, k, v, lead_ndim: int):
    """q, k [*lead, H, K]; v [*lead, HV, V] with HV a multiple of H. Returns (lead, H, HV, K, V)."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES)
    if q.dim() != lead_ndim + 2:
        raise ValueError(f"q: expected {lead_ndim + 2} dims, got shape {list(q.shape)}")
    check_tensor("k", k, shape=tuple(q.shape), dtypes=(q.dtype,), device=q.device)
    lead = tuple(q.shape[:lead_ndim])
    check_tensor("v", v, shape=(*lead, None, None), dtypes=(q.dtype,), device=q.device)
    H, K = q.shape[-2:]
    HV, V = v.shape[-2:]
    if min(H, K, HV, V) == 0:
        raise ValueError(f"q, v: head counts and head dims must be positive, got H={H}, K={K}, HV={HV}, V={V}")
    if HV % H:
        raise ValueError(f"v: value heads HV={HV} must be a multiple of the qk heads H={H}")
    return lead, H, HV, K, V


def _recipe(mode, lead, HV, K, *, device, g, beta, decay, scale, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel):
    """Check the gate / beta inputs of ``mode`` and build the call's Recipe. Returns (recipe, g, beta)
    where g is the per-token gate (gdn, kda) or the per-head decay (lightning)."""
    scale = check_scale(scale, K)
    qk_l2norm = check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    gate_in_kernel = check_flag("use_gate_in_kernel", use_gate_in_kernel)
    beta_logits = check_flag("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
    if mode == "lightning":
        for name, value in (("g", g), ("beta", beta), ("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(f"{name}: not used by lightning (it takes decay [HV]); got a value")
        if gate_in_kernel or beta_logits:
            raise ValueError("use_gate_in_kernel / use_beta_sigmoid_in_kernel: not used by lightning")
        check_tensor("decay", decay, shape=(HV,), dtypes=FLOAT_DTYPES, device=device)
        return Recipe("lightning", scale, qk_l2norm), decay, None
    if decay is not None:
        raise ValueError(f"decay: only used by lightning, not by {mode} (give g and beta)")
    gate_shape = (*lead, HV) if mode == "gdn" else (*lead, HV, K)
    check_tensor("g", g, shape=gate_shape, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("beta", beta, shape=(*lead, HV), dtypes=FLOAT_DTYPES, device=device)
    fused_gate = None
    if gate_in_kernel:
        check_tensor("A_log", A_log, shape=(HV,), dtypes=FLOAT_DTYPES, device=device)
        if dt_bias is not None and mode == "kda":
            check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES, device=device)
            if tuple(dt_bias.shape) not in ((HV, K), (HV * K,)):
                raise ValueError(f"dt_bias: expected shape [{HV}, {K}] or [{HV * K}], got {list(dt_bias.shape)}")
            dt_bias = dt_bias.reshape(HV, K)
        else:
            check_tensor("dt_bias", dt_bias, shape=(HV,), dtypes=FLOAT_DTYPES, device=device, optional=True)
        if lower_bound is not None:
            if mode != "kda":
                raise ValueError("lower_bound: the safe gate is a KDA option")
            if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
                raise TypeError(f"lower_bound: expected a float, got {type(lower_bound).__name__}")
            if not -float("inf") < lower_bound < 0:
                raise ValueError(f"lower_bound: expected a finite negative number, got {lower_bound}")
            lower_bound = float(lower_bound)
        fused_gate = FusedGate(A_log, dt_bias, lower_bound)
    else:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(f"{name}: only used with use_gate_in_kernel=True")
    return Recipe(mode, scale, qk_l2norm, fused_gate, beta_logits), g, beta


def _check_pool(state_pool, HV, K, V, device):
    check_tensor("state_pool", state_pool, shape=(None, HV, V, K), dtypes=FLOAT_DTYPES, device=device)
    return state_pool


def _check_indices(name, x, shape, device, optional=False):
    return check_tensor(name, x, shape=shape, dtypes=INDEX_DTYPES, device=device, optional=optional)


def _check_out(out, shape, dtype, device):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor("out", out, shape=tuple(shape), dtypes=(dtype,), device=device)
    return out


def _select(operation, device, backend, *, input_dtype, state_dtype, K, V, workload=None):
    def supports(module):
        if input_dtype not in module.INPUT_DTYPES:
            return f"q/k/v dtype {input_dtype} is not supported (supported: {module.INPUT_DTYPES})"
        if state_dtype is not None and state_dtype not in module.STATE_DTYPES:
            return f"state dtype {state_dtype} is not supported (supported: {module.STATE_DTYPES})"
        return module.head_dims_error(K, V)

    return dispatch.select(operation, device, backend, supports, workload)


def _int32(x):
    return None if x is None else x.to(torch.int32)


# --------------------------------------------------------------------------------------------
# prefill


def _prefill(mode, q, k, v, g, beta, decay, *, scale, cu_seqlens, state_pool, state_indices,
             has_initial_state, initial_state, output_final_state, use_qk_l2norm_in_kernel,
             use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, out,
             checkpoint_every, checkpoint_indices, backend, kwargs):
    check_tensor("q", q, dtypes=FLOAT_DTYPES)
    if q.dim() not in (3, 4):
        raise ValueError(f"q: expected [B, T, H, K] or packed [T, H, K], got shape {list(q.shape)}")
    lead, H, HV, K, V_values = _check_qkv(q, k, v, q.dim() - 2)
    map_columns = kwargs.pop("map_columns", 0)
    if map_columns not in (0, K):
        raise ValueError(f"map_columns: expected 0 or K={K}, got {map_columns!r}")
    V = V_values + map_columns  # state and output columns
    device = q.device
    recipe, g, beta = _recipe(mode, lead, HV, K, device=device, g=g, beta=beta, decay=decay, scale=scale,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                              use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                              lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    T = lead[-1]
    batch = lead[0] if len(lead) == 2 else 1
    if cu_seqlens is not None:
        _check_indices("cu_seqlens", cu_seqlens, (None,), device)
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens: expected [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
        if batch != 1:
            raise ValueError(f"q: with cu_seqlens the batch must be packed into one row, got batch {batch}")
        N = cu_seqlens.shape[0] - 1
    else:
        N = batch
    check_flag("output_final_state", output_final_state)

    if state_pool is not None and initial_state is not None:
        raise ValueError("state_pool, initial_state: give one of them (pool + state_indices, or a dense initial_state)")
    if state_pool is not None:
        _check_pool(state_pool, HV, K, V, device)
        _check_indices("state_indices", state_indices, (N,), device)
    elif state_indices is not None:
        raise ValueError("state_indices: only used with state_pool")
    check_tensor("initial_state", initial_state, shape=(N, HV, V, K), dtypes=FLOAT_DTYPES, device=device, optional=True)
    check_tensor("has_initial_state", has_initial_state, shape=(N,), dtypes=(torch.bool,), device=device, optional=True)

    if checkpoint_every is not None:
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
            raise TypeError(f"checkpoint_every: expected an int, got {type(checkpoint_every).__name__}")
        if checkpoint_every <= 0 or checkpoint_every % CHECKPOINT_ALIGNMENT:
            raise ValueError(f"checkpoint_every: expected a positive multiple of {CHECKPOINT_ALIGNMENT}, got {checkpoint_every}")
        if state_pool is None:
            raise ValueError("checkpoint_every: checkpoints are written into state_pool; give state_pool")
        _check_indices("checkpoint_indices", checkpoint_indices, (N, None), device)
    elif checkpoint_indices is not None:
        raise ValueError("checkpoint_indices: only used with checkpoint_every")

    out_shape = (*lead, HV, V)
    out = _check_out(out, out_shape, v.dtype, device)

    pool_for_dtype = state_pool if state_pool is not None else initial_state
    module = _select("prefill", device, backend, input_dtype=q.dtype,
                     state_dtype=None if pool_for_dtype is None else pool_for_dtype.dtype, K=K, V=V,
                     workload=dict(mode=mode, N=N, T=T, HV=HV, tensors=(q, k, v, out, pool_for_dtype),
                                   options=tuple(kwargs), checkpoints=checkpoint_every is not None))

    if value_checks_enabled(cu_seqlens, state_indices, checkpoint_indices):
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, T)
        if state_pool is not None:
            check_slots("state_indices", state_indices, state_pool.shape[0])
            if checkpoint_indices is not None:
                check_slots("checkpoint_indices", checkpoint_indices, state_pool.shape[0])
                both = torch.cat([state_indices[state_indices >= 0], checkpoint_indices[checkpoint_indices >= 0]])
                if both.numel() != both.unique().numel():
                    raise ValueError("checkpoint_indices: a checkpoint slot is also a sequence's state slot")

    # normalise: packed [T_total, ...] tokens, int32 offsets and slots
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (N + 1) * T, T, dtype=torch.int32, device=device)
    packed = lambda x: x.reshape(-1, *x.shape[len(lead):])  # noqa: E731
    if mode == "lightning":
        g_packed = g
    else:
        g_packed = packed(g)
    if map_columns and not module.native_map_columns(recipe):
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], map_columns)], dim=-1)  # zero values, same math
    elif map_columns:
        kwargs["map_columns"] = map_columns
    pool, slots = state_pool, _int32(state_indices)
    if initial_state is not None or output_final_state:
        # dense states (FLA-style callers): run on a private pool, one slot per sequence
        pool = initial_state.clone() if initial_state is not None else torch.zeros(
            N, HV, V, K, dtype=torch.float32, device=device)
        slots = torch.arange(N, dtype=torch.int32, device=device)
        if initial_state is None:
            has_initial_state = torch.zeros(N, dtype=torch.bool, device=device)
    module.prefill(recipe, packed(q), packed(k), packed(v), g_packed, None if beta is None else packed(beta),
                   cu_seqlens=cu_seqlens.to(torch.int32), state_pool=pool, state_indices=slots,
                   has_initial_state=has_initial_state, out=out.view(-1, HV, V),
                   checkpoint_every=checkpoint_every, checkpoint_indices=_int32(checkpoint_indices), **kwargs)
    if state_pool is not None:
        return out, state_pool
    return out, (pool if output_final_state else None)


_PREFILL_DOC = """
    Args:
        q, k: [B, T, H, K], or packed [1, T, H, K] / [T, H, K] with ``cu_seqlens``; bf16 / fp16 / fp32.
        v:    [..., T, HV, V], same leading dims and dtype; HV a multiple of H (grouped value heads).
        {gates}
        scale: output multiplier; None means K ** -0.5.
        cu_seqlens: int32 / int64 [N + 1] token offsets of N packed sequences (on q's device).
        state_pool: [P, HV, V, K] float32 / bfloat16 pool; initial states are read from
            ``state_pool[state_indices]`` and final states written back in place.
        state_indices: int32 / int64 [N]; negative = padding (no read, no write, zero output).
        has_initial_state: bool [N]; False starts that sequence from zeros (its slot is still written).
        initial_state: dense [N, HV, V, K] initial states instead of a pool (FLA-style callers).
        output_final_state: with a dense ``initial_state`` (or none), return the final states.
        out: preallocated output, same shape as v's leading dims + [HV, V], v's dtype.
        checkpoint_every, checkpoint_indices: prefix caching. The state after
            (j + 1) * checkpoint_every tokens of sequence n (counted from the start of this call) is
            written to ``state_pool[checkpoint_indices[n, j]]`` when that index is >= 0;
            checkpoint_every is a positive multiple of 64, checkpoint_indices int [N, M].
        backend: "cute" | "triton" | "torch"; None picks the best available (``CULA_BACKEND`` overrides).
        **kwargs: forwarded to the backend (the torch backend takes ``algorithm`` and ``compute_dtype``;
            the triton backend ``segment_tokens``: None cuts long sequences into segments run in
            parallel where the shapes would leave SMs idle, 0 never, a multiple of 64 forces that
            length; see ``kernels/common/segments.py``; the cute backend takes it for GDN and KDA).
            ``map_columns=K`` (context parallelism, see ``cula_serve.dist.cp``): the state, the
            pool / initial_state and ``out`` get K more columns than v, whose values are zero;
            started from the identity they carry the affine map of the segment.

    Returns:
        (o, final): o [..., T, HV, V] in v's dtype. final is ``state_pool`` when a pool is given;
        a new [N, HV, V, K] tensor when ``output_final_state`` (dense mode); else None.
"""

_DELTA_GATES = """g:    {gshape} log decay (<= 0), or the raw gate projection with ``use_gate_in_kernel``.
        beta: [..., T, HV] in (0, 1), or logits with ``use_beta_sigmoid_in_kernel``.
        use_qk_l2norm_in_kernel: l2-normalise q and k per head inside the kernel.
        use_gate_in_kernel, A_log [HV], dt_bias {dtshape}: g = -exp(A_log) * softplus(g + dt_bias){safe}.
        use_beta_sigmoid_in_kernel: beta = sigmoid(beta)."""


def cula_gdn(q, k, v, g, beta, *, scale=None, cu_seqlens=None, state_pool=None, state_indices=None,
             has_initial_state=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
             use_beta_sigmoid_in_kernel=False, out=None, backend=None, checkpoint_every=None,
             checkpoint_indices=None, **kwargs):
    return _prefill("gdn", q, k, v, g, beta, None, scale=scale, cu_seqlens=cu_seqlens, state_pool=state_pool,
                    state_indices=state_indices, has_initial_state=has_initial_state, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=None,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, out=out,
                    checkpoint_every=checkpoint_every, checkpoint_indices=checkpoint_indices,
                    backend=backend, kwargs=kwargs)


def cula_kda(q, k, v, g, beta, *, scale=None, cu_seqlens=None, state_pool=None, state_indices=None,
             has_initial_state=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
             lower_bound=None, use_beta_sigmoid_in_kernel=False, out=None, backend=None,
             checkpoint_every=None, checkpoint_indices=None, **kwargs):
    return _prefill("kda", q, k, v, g, beta, None, scale=scale, cu_seqlens=cu_seqlens, state_pool=state_pool,
                    state_indices=state_indices, has_initial_state=has_initial_state, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, out=out,
                    checkpoint_every=checkpoint_every, checkpoint_indices=checkpoint_indices,
                    backend=backend, kwargs=kwargs)


def cula_lightning(q, k, v, decay, *, scale=None, cu_seqlens=None, state_pool=None, state_indices=None,
                   has_initial_state=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, out=None, backend=None, checkpoint_every=None,
                   checkpoint_indices=None, **kwargs):
    return _prefill("lightning", q, k, v, None, None, decay, scale=scale, cu_seqlens=cu_seqlens,
                    state_pool=state_pool, state_indices=state_indices, has_initial_state=has_initial_state,
                    initial_state=initial_state, output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=False, A_log=None,
                    dt_bias=None, lower_bound=None, use_beta_sigmoid_in_kernel=False, out=out,
                    checkpoint_every=checkpoint_every, checkpoint_indices=checkpoint_indices,
                    backend=backend, kwargs=kwargs)


cula_gdn.__doc__ = "Chunked prefill of gated DeltaNet (GDN: scalar gate per value head).\n" + _PREFILL_DOC.format(
    gates=_DELTA_GATES.format(gshape="[..., T, HV]", dtshape="[HV]", safe=""))
cula_kda.__doc__ = "Chunked prefill of Kimi delta attention (KDA: per-channel gate).\n" + _PREFILL_DOC.format(
    gates=_DELTA_GATES.format(gshape="[..., T, HV, K]", dtshape="[HV, K] or [HV * K]",
                              safe=";\n            with ``lower_bound`` (< 0) the safe gate "
                                   "g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))"))
cula_lightning.__doc__ = "Chunked prefill of Lightning attention (constant per-head decay, no delta rule).\n" + \
    _PREFILL_DOC.format(gates="decay: [HV] log decay per value head (<= 0; MiniMax: -slope).\n"
                              "        use_qk_l2norm_in_kernel: l2-normalise q and k per head inside the kernel.")


# --------------------------------------------------------------------------------------------
# decode, verify, commit


def _multi_token(operation, q, k, v, state_pool, *, mode, g, beta, decay, scale, use_qk_l2norm_in_kernel,
                 use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, out, backend):
    """Shared checks of decode and verify: q, k [N, T, H, K]. Returns the checked pieces."""
    _check_mode(mode)
    check_tensor("q", q, dtypes=FLOAT_DTYPES)
    if q.dim() != 4:
        raise ValueError(f"q: expected [N, T, H, K], got shape {list(q.shape)}")
    lead, H, HV, K, V = _check_qkv(q, k, v, 2)
    device = q.device
    recipe, g, beta = _recipe(mode, lead, HV, K, device=device, g=g, beta=beta, decay=decay, scale=scale,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                              use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                              lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    _check_pool(state_pool, HV, K, V, device)
    out = _check_out(out, (*lead, HV, V), v.dtype, device)
    module = _select(operation, device, backend, input_dtype=q.dtype, state_dtype=state_pool.dtype, K=K, V=V,
                     workload=dict(mode=mode, N=lead[0], T=lead[1], HV=HV, state_dtype=state_pool.dtype))
    return lead, HV, V, recipe, g, beta, out, module


def cula_decode(q, k, v, state_pool, *, mode="gdn", g=None, beta=None, decay=None, state_indices=None,
                scale=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                lower_bound=None, use_beta_sigmoid_in_kernel=False, out=None, backend=None, **kwargs):
    """One decode step: one token per sequence, the pool updated in place.

    Args:
        q, k: [N, 1, H, K]; v: [N, 1, HV, V] (bf16 / fp16 / fp32).
        state_pool: [P, HV, V, K] float32 / bfloat16, updated in place.
        mode: "gdn" (g [N, 1, HV]), "kda" (g [N, 1, HV, K]) or "lightning" (decay [HV]).
        g, beta, decay, use_*_in_kernel, A_log, dt_bias, lower_bound, scale: as for prefill.
        state_indices: int32 / int64 [N]; negative = padding (no read, no write, zero output);
            None means sequence n uses slot n.
        out: preallocated [N, 1, HV, V] in v's dtype.

    Returns (o [N, 1, HV, V], state_pool). No host synchronisation on the GPU backends, so the
    call can be captured in a CUDA graph and replayed with new inputs.
    """
    lead, HV, V, recipe, g, beta, out, module = _multi_token(
        "decode", q, k, v, state_pool, mode=mode, g=g, beta=beta, decay=decay, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        out=out, backend=backend)
    N, T = lead
    if T != 1:
        raise ValueError(f"q: decode takes one token per sequence ([N, 1, H, K]), got T={T}; use cula_verify")
    if state_indices is None:
        if state_pool.shape[0] < N:
            raise ValueError(f"state_indices: None means slot n for sequence n, but the pool has "
                             f"{state_pool.shape[0]} slots for {N} sequences")
        state_indices = torch.arange(N, dtype=torch.int32, device=q.device)
    _check_indices("state_indices", state_indices, (N,), q.device)
    if value_checks_enabled(state_indices):
        check_slots("state_indices", state_indices, state_pool.shape[0])
    module.decode(recipe, q[:, 0], k[:, 0], v[:, 0], g[:, 0] if mode != "lightning" else g,
                  None if beta is None else beta[:, 0], state_pool=state_pool,
                  state_indices=_int32(state_indices), out=out[:, 0], **kwargs)
    return out, state_pool


def cula_verify(q, k, v, state_pool, *, mode="gdn", g=None, beta=None, decay=None, state_indices=None,
                protocol="deferred", num_accepted_tokens=None, intermediate_states=None,
                intermediate_indices=None, pending=None, scale=None, use_qk_l2norm_in_kernel=False,
                use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
                use_beta_sigmoid_in_kernel=False, out=None, backend=None, **kwargs):
    """MTP / speculative verify: T tokens per sequence, an output for every token.

    Args:
        q, k: [N, T, H, K]; v: [N, T, HV, V]; g [N, T, HV] (gdn) / [N, T, HV, K] (kda) / decay [HV]
            (lightning); beta [N, T, HV]; gate options as for prefill.
        state_pool: [P, HV, V, K] float32 / bfloat16.
        protocol: "buffer", "slots" or "deferred" (see the module docstring).
        state_indices: int32 / int64 [N] ("buffer", "deferred") or [N, T_cols] with T_cols >= T
            ("slots"); a negative read slot marks a padding row (zero output, nothing written).
            With ``pending``: None (the pending verify's) or the same values.
        num_accepted_tokens: "slots": int [N], 1..T_cols, tokens accepted in the previous step
            (the initial state is read from column num_accepted_tokens[n] - 1). "deferred" with
            ``pending``: int [N], 0..the pending verify's T, the tokens of it to commit first.
        intermediate_states: "buffer" only: [R, T_buf, HV, V, K] (T_buf >= T), pool dtype.
        intermediate_indices: "buffer" only: int [N], row of the buffer per sequence (None: row n).
        pending: "deferred" only: the previous step's uncommitted deferred verify of the same rows
            (same pool, N and slots). Its accepted tokens are committed first, then these T tokens
            are verified from the committed states: the same result as ``cula_commit(pending,
            num_accepted_tokens)`` followed by this verify, and on the cute backend one kernel
            that reads and writes each state once (an engine's steady state: one launch per step
            instead of a commit and a verify). Rows that change slots between steps need the
            separate ``cula_commit``.
        out: preallocated [N, T, HV, V] in v's dtype.

    Returns (o [N, T, HV, V], pending): pass ``pending`` to ``cula_commit`` with the accepted counts
    (or to the next step's ``cula_verify``).
    """
    lead, HV, V, recipe, g, beta, out, module = _multi_token(
        "verify", q, k, v, state_pool, mode=mode, g=g, beta=beta, decay=decay, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        out=out, backend=backend)
    N, T = lead
    K = q.shape[-1]
    device = q.device
    P = state_pool.shape[0]
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol: expected one of {PROTOCOLS}, got {protocol!r}")
    if pending is not None:
        state_indices = _check_pending(pending, protocol, mode, state_pool, state_indices, num_accepted_tokens, N)
    elif protocol != "slots" and num_accepted_tokens is not None:
        raise ValueError("num_accepted_tokens: used at verify time by the slots protocol, or with pending=")
    if protocol != "buffer" and (intermediate_states is not None or intermediate_indices is not None):
        raise ValueError("intermediate_states / intermediate_indices: only used by the buffer protocol")
    if protocol == "slots":
        _check_indices("state_indices", state_indices, (N, None), device)
        if state_indices.shape[1] < T:
            raise ValueError(f"state_indices: the slots protocol needs [N, T_cols] with T_cols >= T={T}, "
                             f"got {list(state_indices.shape)}")
        _check_indices("num_accepted_tokens", num_accepted_tokens, (N,), device)
    else:
        if state_indices is None:
            if P < N:
                raise ValueError(f"state_indices: None means slot n for sequence n, but the pool has {P} slots for {N} sequences")
            state_indices = torch.arange(N, dtype=torch.int32, device=device)
        _check_indices("state_indices", state_indices, (N,), device)
    if protocol == "buffer":
        check_tensor("intermediate_states", intermediate_states, shape=(None, None, HV, V, K),
                     dtypes=(state_pool.dtype,), device=device)
        R, T_buf = intermediate_states.shape[:2]
        if T_buf < T:
            raise ValueError(f"intermediate_states: room for {T_buf} tokens per row, the verify has T={T}")
        if intermediate_indices is None:
            if R < N:
                raise ValueError(f"intermediate_indices: None means row n for sequence n, but the buffer has {R} rows for {N} sequences")
            intermediate_indices = torch.arange(N, dtype=torch.int32, device=device)
        _check_indices("intermediate_indices", intermediate_indices, (N,), device)
    if value_checks_enabled(state_indices, num_accepted_tokens, intermediate_indices):
        if protocol == "slots":
            check_range("num_accepted_tokens", num_accepted_tokens, 1, state_indices.shape[1])
            check_slots("state_indices", state_indices[:, :T], P)
        else:
            check_slots("state_indices", state_indices, P)
        if protocol == "buffer":
            live = state_indices >= 0
            check_slots("intermediate_indices", intermediate_indices[live], intermediate_states.shape[0],
                        allow_padding=False)
        if pending is not None:
            check_range("num_accepted_tokens", num_accepted_tokens, 0, pending.num_tokens)
            if not torch.equal(_int32(state_indices), pending.state_indices):
                raise ValueError("state_indices: a verify with pending= must keep the pending verify's slots "
                                 "(commit rows that change slots with cula_commit first)")
    state_indices, intermediate_indices = _int32(state_indices), _int32(intermediate_indices)
    if pending is not None and not (hasattr(module, "commit_verify") and module.fuses_commit(pending, recipe, g)):
        cula_commit(pending, num_accepted_tokens)  # every check above has passed: nothing fails after it
        pending = None
    if pending is not None:
        saved = module.commit_verify(recipe, q, k, v, g, beta, pending=pending,
                                     num_accepted_tokens=_int32(num_accepted_tokens), state_pool=state_pool,
                                     state_indices=state_indices, out=out, **kwargs)
    else:
        saved = module.verify(recipe, q, k, v, g, beta, protocol=protocol, state_pool=state_pool,
                              state_indices=state_indices,
                              num_accepted_tokens=_int32(num_accepted_tokens) if protocol == "slots" else None,
                              intermediate_states=intermediate_states, intermediate_indices=intermediate_indices,
                              out=out, **kwargs)
    deferred = protocol == "deferred"
    pending = PendingCommit(protocol, recipe, module.NAME, T, state_pool, state_indices,
                            intermediate_states, intermediate_indices,
                            k if deferred else None, v if deferred else None,
                            g if deferred else None, beta if deferred else None, saved)
    return out, pending


def _check_pending(pending, protocol, mode, state_pool, state_indices, num_accepted_tokens, N):
    """Checks of a verify's ``pending=`` (a deferred verify to commit first); returns the slots
    to use (the pending verify's when ``state_indices`` is None). Values are compared later, with
    the other value checks."""
    if not isinstance(pending, PendingCommit):
        raise TypeError(f"pending: expected the PendingCommit returned by cula_verify, got {type(pending).__name__}")
    if protocol != "deferred" or pending.protocol != "deferred":
        raise ValueError(f"pending: only a deferred verify commits a pending deferred verify first "
                         f"(protocol={protocol!r}, pending protocol={pending.protocol!r})")
    if pending.recipe.mode != mode:
        raise ValueError(f"pending: a {pending.recipe.mode} verify cannot be committed by a {mode} verify")
    if (pending.state_pool.data_ptr() != state_pool.data_ptr() or pending.state_pool.shape != state_pool.shape
            or pending.state_pool.dtype != state_pool.dtype):
        raise ValueError("pending: its verify ran on another state_pool")
    if pending.state_indices.shape[0] != N:
        raise ValueError(f"pending: its verify had {pending.state_indices.shape[0]} rows, this one has N={N}")
    if num_accepted_tokens is None:
        raise ValueError("num_accepted_tokens: required with pending= (the pending tokens to commit, per row)")
    _check_indices("num_accepted_tokens", num_accepted_tokens, (N,), state_pool.device)
    if state_indices is None:
        return pending.state_indices
    return state_indices


def cula_commit(pending: PendingCommit, num_accepted_tokens, *, backend=None, **kwargs):
    """Make the accepted prefix of a verify the pool's state, per sequence.

    Args:
        pending: what ``cula_verify`` returned.
        num_accepted_tokens: int32 / int64 [N], each in 0..T: the verify tokens sequence n keeps.
            0 leaves its slot unchanged; padding rows are never touched.
        backend: defaults to the backend that ran the verify.

    Returns the state pool (updated in place).
    """
    if not isinstance(pending, PendingCommit):
        raise TypeError(f"pending: expected the PendingCommit returned by cula_verify, got {type(pending).__name__}")
    pool, slots = pending.state_pool, pending.state_indices
    N, T = slots.shape[0], pending.num_tokens
    _check_indices("num_accepted_tokens", num_accepted_tokens, (N,), pool.device)
    K = pool.shape[-1]
    module = _select("commit", pool.device, backend or pending.backend,
                     input_dtype=pending.k.dtype if pending.k is not None else torch.float32,
                     state_dtype=pool.dtype, K=K, V=pool.shape[-2], workload=dict(mode=pending.recipe.mode, N=N, T=T, HV=pool.shape[1]))
    if value_checks_enabled(num_accepted_tokens):
        check_range("num_accepted_tokens", num_accepted_tokens, 1 if pending.protocol == "slots" else 0, T)
    module.commit(pending.recipe, protocol=pending.protocol, state_pool=pool, state_indices=slots,
                  num_accepted_tokens=_int32(num_accepted_tokens), intermediate_states=pending.intermediate_states,
                  intermediate_indices=pending.intermediate_indices, k=pending.k, v=pending.v, g=pending.g,
                  beta=pending.beta, saved=pending.saved if module.NAME == pending.backend else None, **kwargs)
    return pool
