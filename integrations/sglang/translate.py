"""SGLang's linear-attention metadata -> cula-serve calls. Imports nothing from SGLang.

SGLang's linear backends (``GDNAttnBackend``, ``KDAAttnBackend``, ``LightningAttentionBackend``)
hand their kernels packed tokens, the per-layer ``MambaPool`` tensors and slot ids. This module
turns exactly those arguments into Level-1 calls, so the same code runs inside SGLang (through
``cula_serve.integrations.sglang.kernels``) and on a GPU machine without SGLang installed.

SGLang's conventions, as of 0.5.23, and how they are translated:

- **Pool.** ``MambaPool.State.temporal[layer]`` is ``[size + 1, HV, V, K]`` for GDN and KDA, the
  K-last layout cula-serve uses, so it is passed as is. For Lightning SGLang's seg_la kernels store
  ``[size + 1, H, K, V]`` (K-first). With K == V the shapes agree, so when every Lightning phase
  runs on cula-serve the same memory simply holds K-last states: nothing is transposed, ever. The
  pool only ever leaves these kernels through whole-slot copies (radix prefix copy-on-write, MTP
  commit, track slots), which do not care about the order inside a slot. That is why Lightning
  refuses to mix cula-serve with seg_la across phases (``LIGHTNING_MIXED_PHASES``).
- **Slots.** ``cache_indices`` are int32 slot ids. Slot 0 is reserved: SGLang's allocator never
  hands it out and eager padded rows point to it as a dummy write target; CUDA-graph padded rows
  carry -1. Both become -1 (padding: no read, no write, zero output) in ``slots_from_sglang``, so
  padded rows neither race on slot 0 nor cost state traffic.
- **Tokens.** Extend and verify pack tokens as ``[1, T, H, K]`` (or ``[T, H, K]``) with
  ``query_start_loc`` int32 ``[N + 1]``; decode passes ``[1, N, H, K]``. Verify has
  ``cache_steps`` (= draft_token_num) tokens per request.
- **Gates.** GDN extend gets prepared gates (``g = -exp(A_log) softplus(a + dt_bias)``,
  ``beta = sigmoid(b)``, ``[1, T, HV]``); GDN decode / verify and all KDA calls get the raw ``a``,
  ``b`` with ``A_log``, ``dt_bias`` (and KDA's safe-gate ``lower_bound``), which cula-serve fuses in
  the kernel. q and k are always l2-normalised in the kernel; the scale is K ** -0.5 unless given.
  Lightning's decay is SGLang's per-layer slope: ``S = exp(-slope) S + k v^T``.
- **Target verify.** SGLang leaves ``temporal`` untouched and writes the state after token t of
  request n to ``intermediate_ssm[layer][intermediate_state_indices[n], t]``
  (``[spec_size + 1, T, HV, V, K]``); after sampling it commits
  ``temporal[slot_n] = intermediate_ssm[row_n, last_correct_step_indices[n]]``. That is
  cula-serve's ``protocol="buffer"``; ``protocol="deferred"`` writes no intermediate states and
  replays the accepted tokens in the commit instead. Either way the commit goes through
  ``cula_commit`` with ``accepted = last_correct_step_indices + 1`` (a negative step: nothing kept).
"""
from __future__ import annotations

import os

import torch

from ...api import PendingCommit, cula_commit, cula_decode, cula_gdn, cula_kda, cula_lightning, cula_verify

DELTA_RULE_MODES = ("gdn", "kda")
VERIFY_PROTOCOLS = ("buffer", "deferred")
VERIFY_PROTOCOL_ENV = "CULA_SGLANG_VERIFY_PROTOCOL"
LIGHTNING_MIXED_PHASES = (
    "Lightning on cula-serve keeps SGLang's Lightning pool in cula-serve's K-last order (no per-step "
    "transpose), so prefill, decode and verify must all run on cula-serve; seg_la reads the pool "
    "K-first and cannot share it")


def verify_protocol_from_env() -> str:
    """The MTP protocol the plugin uses: ``CULA_SGLANG_VERIFY_PROTOCOL`` = ``buffer`` (default:
    SGLang's intermediate-state buffer) or ``deferred`` (no intermediate states; the commit replays
    the accepted tokens, fewer bytes per step)."""
    protocol = os.environ.get(VERIFY_PROTOCOL_ENV, "buffer")
    if protocol not in VERIFY_PROTOCOLS:
        raise ValueError(f"{VERIFY_PROTOCOL_ENV}: expected one of {VERIFY_PROTOCOLS}, got {protocol!r}")
    return protocol


def slots_from_sglang(cache_indices: torch.Tensor) -> torch.Tensor:
    """SGLang mamba slot ids (int32 / int64 ``[N]``) -> cula-serve slot ids (int32 ``[N]``).

    Slot 0 (SGLang's reserved dummy slot for eager padded rows) and negative ids (CUDA-graph
    padding) become -1. One elementwise op: no host synchronisation, so it can be captured."""
    if not isinstance(cache_indices, torch.Tensor) or cache_indices.dim() != 1:
        raise ValueError(f"cache_indices: expected a 1-D tensor of slot ids, got "
                         f"{getattr(cache_indices, 'shape', type(cache_indices).__name__)}")
    if cache_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_indices: expected int32 or int64, got {cache_indices.dtype}")
    return torch.where(cache_indices > 0, cache_indices, torch.full_like(cache_indices, -1)).to(torch.int32)


def accepted_from_last_correct_step(last_correct_step_indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """SGLang's ``last_correct_step_indices`` ([R], R <= num_rows; -1 for a request that keeps
    nothing) -> ``num_accepted_tokens`` int32 [num_rows] for ``cula_commit``. Rows past R (graph
    padding) keep 0 tokens. No host synchronisation."""
    R = last_correct_step_indices.shape[0]
    if R > num_rows:
        raise ValueError(f"last_correct_step_indices: {R} requests, but the verify had {num_rows} rows")
    accepted = torch.zeros(num_rows, dtype=torch.int32, device=last_correct_step_indices.device)
    accepted[:R] = (last_correct_step_indices.to(torch.int32) + 1).clamp(min=0)
    return accepted


def _packed(x: torch.Tensor, name: str, per_token_dims: int) -> torch.Tensor:
    """[T, *d] or [1, T, *d] -> [1, T, *d] (a view)."""
    if x.dim() == per_token_dims + 1:
        return x.unsqueeze(0)
    if x.dim() == per_token_dims + 2 and x.shape[0] == 1:
        return x
    raise ValueError(f"{name}: expected packed tokens [T, ...] or [1, T, ...] with {per_token_dims} "
                     f"per-token dims, got shape {list(x.shape)}")


def _check_mode(mode: str):
    if mode not in DELTA_RULE_MODES:
        raise ValueError(f"mode: expected one of {DELTA_RULE_MODES}, got {mode!r}")


def _delta_rule_gate_options(mode, A_log, dt_bias, lower_bound, scale):
    """Keyword arguments of a fused-gate delta-rule call from SGLang's layer parameters."""
    if A_log is None:
        raise ValueError("A_log: required for the fused gate of SGLang's GDN / KDA layers")
    options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   A_log=A_log.reshape(-1), dt_bias=None if dt_bias is None else dt_bias.reshape(-1),
                   scale=scale)
    if mode == "kda":
        options["lower_bound"] = lower_bound
    elif lower_bound is not None:
        raise ValueError("lower_bound: the safe gate is a KDA option, the layer is GDN")
    return options


def _tokens_per_request(q: torch.Tensor, mode_dims: int, num_requests: int, name="q"):
    T_total = q.shape[-mode_dims - 1]
    if num_requests <= 0 or T_total % num_requests:
        raise ValueError(f"{name}: {T_total} tokens do not split evenly over {num_requests} requests "
                         f"(ragged verify layouts are not supported by cula-serve)")
    return T_total // num_requests


# ------------------------------------------------------------------------------------------------
# extend (prefill)


def gdn_extend(q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, scale=None,
               output=None, backend=None):
    """SGLang GDN extend -> ``cula_gdn``. q, k [1, T, H, K] or [T, H, K]; v [.., T, HV, V]; g, beta
    prepared [.., T, HV] (fp32); ssm_states the layer's ``[size + 1, HV, V, K]`` pool, updated in
    place; cache_indices [N]; query_start_loc int32 [N + 1]; output an optional preallocated
    ``[1, T, HV, V]``. Returns the output [1, T, HV, V]."""
    q, k, v = _packed(q, "q", 2), _packed(k, "k", 2), _packed(v, "v", 2)
    g, beta = _packed(g, "g", 1), _packed(beta, "beta", 1)
    o, _ = cula_gdn(q, k, v, g, beta, scale=scale, cu_seqlens=query_start_loc, state_pool=ssm_states,
                    state_indices=slots_from_sglang(cache_indices), use_qk_l2norm_in_kernel=True,
                    out=_output_view(output, v), backend=backend)
    return o


def kda_extend(q, k, v, a, b, *, A_log, dt_bias, lower_bound, ssm_states, cache_indices, query_start_loc,
               scale=None, output=None, backend=None):
    """SGLang KDA extend -> ``cula_kda`` with the gate fused: a is the raw gate projection
    [.., T, HV, K] (or [.., T, HV * K]), b the raw beta logits [.., T, HV]; A_log [HV] (any shape
    with HV entries), dt_bias [HV * K] or [HV, K], lower_bound the safe gate's bound or None.
    Other arguments as for ``gdn_extend``. Returns the output [1, T, HV, V]."""
    q, k, v = _packed(q, "q", 2), _packed(k, "k", 2), _packed(v, "v", 2)
    T, HV, K = v.shape[1], v.shape[2], q.shape[-1]
    g = a.reshape(1, T, HV, K)
    beta = b.reshape(1, T, HV)
    o, _ = cula_kda(q, k, v, g, beta, cu_seqlens=query_start_loc, state_pool=ssm_states,
                    state_indices=slots_from_sglang(cache_indices), out=_output_view(output, v),
                    backend=backend, **_delta_rule_gate_options("kda", A_log, dt_bias, lower_bound, scale))
    return o


def lightning_extend(q, k, v, *, slope, scale, ssm_states, cache_indices, query_start_loc,
                     has_initial_state=None, backend=None):
    """SGLang Lightning extend (seg_la's contract) -> ``cula_lightning``. q, k, v [T, H, D] packed;
    slope [H] (any shape with H entries; decay = -slope); scale the layer's softmax scale;
    ssm_states the layer's ``[size + 1, H, D, D]`` pool, holding K-last states (module docstring);
    has_initial_state bool [N] or None (SGLang: ``extend_prefix_lens > 0``). Returns [T, H, D]."""
    q, k, v = _packed(q, "q", 2), _packed(k, "k", 2), _packed(v, "v", 2)
    check_lightning_pool(ssm_states)
    o, _ = cula_lightning(q, k, v, -slope.reshape(-1).float(), scale=scale, cu_seqlens=query_start_loc,
                          state_pool=ssm_states, state_indices=slots_from_sglang(cache_indices),
                          has_initial_state=has_initial_state, backend=backend)
    return o[0]


def _output_view(output, v):
    if output is None:
        return None
    return output.view(1, v.shape[1], v.shape[2], v.shape[3])


def check_lightning_pool(ssm_states: torch.Tensor):
    """SGLang's Lightning pool is reused in K-last order, which needs square states (K == V)."""
    if ssm_states.dim() != 4 or ssm_states.shape[-1] != ssm_states.shape[-2]:
        raise ValueError(f"ssm_states: the Lightning pool must be [P, H, D, D], got {list(ssm_states.shape)}")


# ------------------------------------------------------------------------------------------------
# decode


def delta_rule_decode(mode, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, lower_bound=None,
                      scale=None, backend=None):
    """SGLang GDN / KDA decode -> ``cula_decode`` (one token per request, pool updated in place).

    q, k [1, N, H, K]; v [1, N, HV, V]; a the raw gate [N, HV] (gdn) or [N, HV * K] / [.., N, HV, K]
    (kda); b [N, HV] raw beta logits; A_log, dt_bias, lower_bound the layer's gate parameters;
    ssm_states ``[size + 1, HV, V, K]``; cache_indices [N]. Returns the output [1, N, HV, V]."""
    _check_mode(mode)
    q, k, v = _packed(q, "q", 2), _packed(k, "k", 2), _packed(v, "v", 2)
    N, HV, K = v.shape[1], v.shape[2], q.shape[-1]
    g = a.reshape(N, 1, HV) if mode == "gdn" else a.reshape(N, 1, HV, K)
    o, _ = cula_decode(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), ssm_states, mode=mode, g=g,
                       beta=b.reshape(N, 1, HV), state_indices=slots_from_sglang(cache_indices),
                       backend=backend, **_delta_rule_gate_options(mode, A_log, dt_bias, lower_bound, scale))
    return o.transpose(0, 1)


def lightning_decode(q, k, v, *, slope, scale, ssm_states, cache_indices, backend=None):
    """SGLang Lightning decode -> ``cula_decode(mode="lightning")``. q, k, v [N, H, D] (one token
    per request); other arguments as for ``lightning_extend``. Returns [N, H, D]."""
    check_lightning_pool(ssm_states)
    o, _ = cula_decode(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), ssm_states, mode="lightning",
                       decay=-slope.reshape(-1).float(), scale=scale,
                       state_indices=slots_from_sglang(cache_indices), backend=backend)
    return o[:, 0]


# ------------------------------------------------------------------------------------------------
# target verify


def _verify(mode, q, k, v, gates, *, ssm_states, cache_indices, num_requests, protocol,
            intermediate_states_buffer, intermediate_state_indices, backend):
    if protocol not in VERIFY_PROTOCOLS:
        raise ValueError(f"protocol: expected one of {VERIFY_PROTOCOLS}, got {protocol!r}")
    extra = {}
    if protocol == "buffer":
        if intermediate_states_buffer is None or intermediate_state_indices is None:
            raise ValueError("intermediate_states_buffer, intermediate_state_indices: the buffer protocol writes "
                             "SGLang's intermediate_ssm; allocate the pool with speculative state")
        extra = dict(intermediate_states=intermediate_states_buffer,
                     intermediate_indices=intermediate_state_indices[:num_requests])
    slots = slots_from_sglang(cache_indices[:num_requests])
    return cula_verify(q, k, v, ssm_states, mode=mode, state_indices=slots, protocol=protocol,
                       backend=backend, **extra, **gates)


def delta_rule_verify(mode, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
                      cache_steps, protocol="buffer", intermediate_states_buffer=None,
                      intermediate_state_indices=None, lower_bound=None, scale=None, backend=None):
    """SGLang GDN / KDA target verify -> ``cula_verify``; the pool is not written.

    q, k [1, N * T, H, K]; v [1, N * T, HV, V]; a, b the raw gate / beta per token (shapes as for
    decode, with N * T rows); query_start_loc int32 [N + 1] (uniform: T = cache_steps tokens each);
    intermediate_states_buffer the layer's ``intermediate_ssm`` ``[spec_size + 1, T, HV, V, K]`` and
    intermediate_state_indices its rows per request (protocol "buffer"). Returns (o [1, N * T, HV, V],
    PendingCommit) to commit with ``commit_verify``."""
    _check_mode(mode)
    q, k, v = _packed(q, "q", 2), _packed(k, "k", 2), _packed(v, "v", 2)
    N = query_start_loc.shape[0] - 1
    T = _tokens_per_request(q, 2, N)
    if T != cache_steps:
        raise ValueError(f"cache_steps: {cache_steps} draft tokens per request, but the batch has {T} "
                         f"(ragged verify layouts are not supported by cula-serve)")
    HV, K = v.shape[2], q.shape[-1]
    g = a.reshape(N, T, HV) if mode == "gdn" else a.reshape(N, T, HV, K)
    gates = dict(g=g, beta=b.reshape(N, T, HV), **_delta_rule_gate_options(mode, A_log, dt_bias, lower_bound, scale))
    o, pending = _verify(mode, q.view(N, T, *q.shape[2:]), k.view(N, T, *k.shape[2:]), v.view(N, T, *v.shape[2:]),
                         gates, ssm_states=ssm_states, cache_indices=cache_indices, num_requests=N,
                         protocol=protocol, intermediate_states_buffer=intermediate_states_buffer,
                         intermediate_state_indices=intermediate_state_indices, backend=backend)
    return o.view(1, N * T, *o.shape[2:]), pending


def lightning_verify(q, k, v, *, slope, scale, ssm_states, cache_indices, query_start_loc, cache_steps,
                     protocol="buffer", intermediate_states_buffer=None, intermediate_state_indices=None,
                     backend=None):
    """SGLang Lightning target verify -> ``cula_verify(mode="lightning")``. q, k, v [N * T, H, D];
    other arguments as for ``delta_rule_verify`` and ``lightning_extend``. Returns
    (o [N * T, H, D], PendingCommit)."""
    check_lightning_pool(ssm_states)
    N = query_start_loc.shape[0] - 1
    T = _tokens_per_request(q, 2, N)
    if T != cache_steps:
        raise ValueError(f"cache_steps: {cache_steps} draft tokens per request, but the batch has {T}")
    o, pending = _verify("lightning", q.view(N, T, *q.shape[1:]), k.view(N, T, *k.shape[1:]),
                         v.view(N, T, *v.shape[1:]), dict(decay=-slope.reshape(-1).float(), scale=scale),
                         ssm_states=ssm_states, cache_indices=cache_indices, num_requests=N, protocol=protocol,
                         intermediate_states_buffer=intermediate_states_buffer,
                         intermediate_state_indices=intermediate_state_indices, backend=backend)
    return o.view(N * T, *o.shape[2:]), pending


def commit_verify(pending: PendingCommit, last_correct_step_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's post-verify commit for one layer: ``pool[slot_n] =`` the state after
    ``last_correct_step_indices[n] + 1`` tokens (``cula_commit``). Returns the pool."""
    accepted = accepted_from_last_correct_step(last_correct_step_indices, pending.state_indices.shape[0])
    return cula_commit(pending, accepted)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class PendingVerifies:
    """The verifies of one forward whose commit is still owed, one ``PendingCommit`` per layer.

    SGLang verifies every linear layer, samples, then commits once for all layers through
    ``update_mamba_state_after_mtp_verify``. Eager forwards record into one list that the next
    forward replaces. A CUDA graph is captured once per batch size and replayed without running
    Python, so the pendings recorded while capturing are kept per graph key (their tensors are the
    captured ones: the replay refreshes them in place) and ``use_graph(key)`` selects them before
    each replay. Deferred pendings hold references to the verify's k, v, g, beta, which keeps those
    graph-pool blocks from being reused by later captures.

    Usage: ``begin_eager()`` at eager metadata init, ``begin_capture(key)`` before a capture,
    ``use_graph(key)`` before a replay, ``record(pending)`` from each layer's verify, and
    ``commit(last_correct_step_indices)`` after sampling.
    """

    def __init__(self):
        self._eager: list[PendingCommit] = []
        self._graphs: dict = {}
        self._capture_key = None
        self._active: list[PendingCommit] | None = None

    def begin_eager(self):
        self._eager = []
        self._active = self._eager

    def begin_capture(self, key):
        self._graphs[key] = []
        self._capture_key = key
        self._active = self._graphs[key]

    def use_graph(self, key):
        if key not in self._graphs:
            raise RuntimeError(f"no CUDA graph was captured for batch size {key}; captured: {sorted(self._graphs)}")
        self._active = self._graphs[key]

    def record(self, pending: PendingCommit):
        if _capturing():
            if self._capture_key is None:
                raise RuntimeError("a verify is being captured, but begin_capture() was not called")
            self._graphs[self._capture_key].append(pending)
        else:
            self._eager.append(pending)

    @property
    def active(self) -> list[PendingCommit]:
        return list(self._active or [])

    def commit(self, last_correct_step_indices: torch.Tensor) -> int:
        """Commit every recorded layer of the active forward; returns the number of layers."""
        if self._active is None:
            raise RuntimeError("commit: no verify forward has run")
        for pending in self._active:
            commit_verify(pending, last_correct_step_indices)
        count = len(self._active)
        if self._active is self._eager:
            self._eager.clear()  # an eager verify is committed once; drop its tensors
        return count
