"""The ``cute`` backend: CuTe DSL kernels for Hopper (SM90), from ``nvidia-cutlass-dsl``.

    decode, verify (buffer, slots, deferred; deferred with the previous verify's commit first),
    deferred commit
             kernels/delta_rule/recurrent_cute.py (gdn, kda and lightning: one kernel)
    buffer / slots commit
             the Triton backend's state copy (a plain copy of one state per sequence)
    prefill  kernels/delta_rule/chunk_cute.py (GDN fused; KDA's state pass after the Triton
             intra-chunk kernels and kernels/delta_rule/solve_cute.py; long sequences of both in
             segments) and kernels/lightning/chunk_cute.py
             (Lightning), bf16 rows, K = V = 128; dispatch passes every other shape to the Triton
             backend (``call_error``), and batches that Triton runs faster (``defers``)
Shapes, dtypes, pool semantics and the three MTP protocols are those of the torch backend, the
reference. Nothing synchronises with the host or compiles after the first call of a shape, so
decode, verify and commit can be captured in CUDA graphs (warm up first: ``cula_serve.warmup``).
The GDN and KDA prefills take one backend-specific keyword, ``segment_tokens`` (as the triton
backend's).
"""
from __future__ import annotations

import torch

from ..common.pool_protocol import fuses_pending

try:
    from ..delta_rule import chunk_cute as delta_chunk_cute, recurrent_cute
    from ..lightning import chunk_cute
    _IMPORT_ERROR = None
except ImportError as err:  # pragma: no cover - depends on the environment
    _IMPORT_ERROR = f"nvidia-cutlass-dsl does not import ({err})"

NAME = "cute"
OPERATIONS = ("prefill", "decode", "verify", "commit")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS_K = (32, 64, 128, 256)  # 32 lanes x K / 32 channels
HEAD_DIMS_V = (16, 32, 64, 128, 256)


def availability(device: torch.device) -> str | None:
    if _IMPORT_ERROR:
        return _IMPORT_ERROR
    if device.type != "cuda":
        return f"CuTe DSL kernels run on CUDA GPUs only, not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"the kernels are built for SM90 (Hopper), {device} is {major}.{minor}"
    return None


def head_dims_error(K: int, V: int) -> str | None:
    if K in HEAD_DIMS_K and V in HEAD_DIMS_V:
        return None
    return f"head dims K={K}, V={V}: the CuTe DSL kernels take K in {HEAD_DIMS_K} and V in {HEAD_DIMS_V}"


def call_error(operation: str, *, mode: str, tensors: tuple = (), options: tuple = (), **_) -> str | None:
    """Why this backend cannot run a call that its dtypes and head dims admit (None when it can).
    Its prefill kernels take bf16 rows, K = V = 128 (the kernels' ``unsupported``); the GDN and
    KDA prefills take the option ``segment_tokens``, Lightning's none."""
    if operation != "prefill":
        return None
    own = ("segment_tokens",) if mode in ("gdn", "kda") else ()
    if set(options) - set(own):
        return f"prefill options {sorted(set(options) - set(own))} are not the cute backend's for {mode}"
    if mode == "lightning":
        return chunk_cute.unsupported(*tensors)
    return delta_chunk_cute.unsupported(mode, *tensors)


# The prefill kernels run one CTA per sequence and value head (GDN's and KDA's long sequences in
# segments); below this share of the SMs the Triton kernels' segments win where ours cannot
# segment (H100, device time per token-head: Lightning 1 x 8192 tokens, 48 heads 0.948 against
# Triton's 0.884, 64 heads 0.733 against 0.795; GDN unsegmented at 32 heads, 1 x 8192 tokens 5.13
# against 4.95, the bench, eager: 1 x 32768 4.02 against 3.40).
PREFILL_MIN_SM_SHARE = 0.4
# KDA's Triton prefill runs the same intra-chunk kernels as ours, so only the state passes differ:
# unsegmented, ours wins from 16 CTAs (H200, 2026-11-27, CUDA-graph replay, ns per token-head,
# ours against Triton's segments, strong fused gates: one sequence of 8192 tokens at 8 / 16 / 32
# heads 9.75 / 7.95 / 6.38 against 8.56 / 8.28 / 7.42; of 32768 tokens 9.61 / 7.35 / 6.43 against
# 7.86 / 7.52 / 7.39). In segments ours wins there too (a TP4 shard of 8 heads on 8192 tokens 3.49
# against 5.38, raw gates 4.27 against 6.21; segments of 1024): this share applies with checkpoints,
# which ours do not write in segments.
KDA_PREFILL_MIN_SM_SHARE = 0.1


def defers(operation: str, *, mode: str, N: int, T: int, HV: int, tensors: tuple = (), checkpoints: bool = False,
           state_dtype: torch.dtype | None = None, **_) -> str | None:
    """Why automatic dispatch should pass this call to the next backend although this one can
    run it: where the Triton kernels measured faster (BENCHMARKS.md).

    Decode of GDN and KDA at every size, and of Lightning below 2048 heads (B < 32 at 64 heads) or
    with a float32 pool (``state_dtype``; None: a bfloat16 one is assumed).
    CUDA-graph replay, H200, 2026-11-26, us, Triton / ours: GDN float32 B = 64 72.0 / 75.1, B = 256
    270.8 / 274.1; bfloat16 41.5 / 41.6, 145.4 / 144.4; KDA float32 72.6 / 75.4, 271.5 / 275.7;
    bfloat16 41.0 / 42.7, 145.4 / 148.3 (many one-warp programs keep more loads in flight than
    our CTAs). Lightning, twice the state per sequence: ours from 2048 heads with a bfloat16 pool
    (B = 256 279.7 against 293.4; B = 64 80.9 against 78.0 single-step but 71.7 against 75.0 per
    layer of a 16-layer graph, H200, 2026-11-27); with a float32 pool Triton (B = 64 135.6 against
    137.6-150.9, per layer 133.3 against 135.2; B = 256 526.3-526.6 against 531.0-587.3, two runs);
    below 2048 heads Triton (H200, 2026-11-24: GDN B = 8 14.6 against 15.9, B = 1 6.8
    against 7.3; per layer of a 16-layer graph on an H100: B = 1 3.9 against 4.8). Verify and
    commit: faster, or within 5% (Lightning at B = 1 and 8), from B = 1 on (T = 4 with a pending
    commit, H200, B = 64: GDN float32 96.6 against 124.0 us, Lightning 165.7 against 249.1).

    Prefill where the CuTe DSL kernel's CTAs (one per sequence and value head) would fill less
    than ``PREFILL_MIN_SM_SHARE`` of the SMs (KDA: ``KDA_PREFILL_MIN_SM_SHARE``), the Triton kernel
    cuts the batch into segments and ours does not (Lightning never; GDN and KDA with checkpoints
    or where ``segments.one_pass_segment_tokens`` finds it not worth it): a TP4 shard's 16
    Lightning heads on one 8192-token sequence, 2.90 against 1.15 ns per token-head on an H100."""
    lightning_decode = mode == "lightning" and N * HV >= 2048 and state_dtype != torch.float32
    if operation == "decode" and not lightning_decode:
        return f"{mode} decode of {N} x {HV} heads: the triton kernel is as fast or faster"
    if operation == "prefill":
        from ..common.segments import one_pass_segment_tokens, sm_count
        from ..delta_rule.chunk_triton import planned_segment_tokens as delta_segments
        from ..lightning.chunk_triton import planned_segment_tokens as lightning_segments
        device = tensors[0].device
        sms = sm_count(device)
        D = chunk_cute.HEAD_DIM
        if mode == "lightning":
            triton_segments, ours = lightning_segments(T, N, HV, D, device), 0
        else:
            triton_segments = delta_segments(T, N, HV, D, D, sms)
            ours = one_pass_segment_tokens(T, N, HV, sms, checkpoints=checkpoints)
        share = KDA_PREFILL_MIN_SM_SHARE if mode == "kda" else PREFILL_MIN_SM_SHARE
        if N * HV < share * sms and triton_segments and not ours:
            return (f"prefill of {N} sequences x {HV} heads fills few SMs: the triton kernel spreads it "
                    "over more, in parallel")
    return None


def _no_options(operation: str, kwargs: dict):
    if kwargs:
        raise TypeError(f"cute backend {operation}: unexpected keyword arguments {sorted(kwargs)}")


def prefill(recipe, q, k, v, g, beta, *, cu_seqlens, state_pool, state_indices, has_initial_state, out,
            checkpoint_every=None, checkpoint_indices=None, **kwargs):
    """Chunked prefill of a packed varlen batch (GDN, KDA and Lightning); arguments as for the
    torch backend's ``prefill``, plus ``segment_tokens`` for GDN and KDA (``segments.one_pass_segment_tokens``).
    Raises ValueError for calls it cannot run (``call_error``)."""
    common = dict(cu_seqlens=cu_seqlens, state_pool=state_pool, state_indices=state_indices,
                  has_initial_state=has_initial_state, out=out, checkpoint_every=checkpoint_every,
                  checkpoint_indices=checkpoint_indices)
    if recipe.mode == "lightning":
        _no_options("prefill", kwargs)
        return chunk_cute.lightning_prefill(recipe, q, k, v, g, beta, **common)
    segment_tokens = kwargs.pop("segment_tokens", None)
    _no_options("prefill", kwargs)
    run = delta_chunk_cute.kda_prefill if recipe.mode == "kda" else delta_chunk_cute.gdn_prefill
    return run(recipe, q, k, v, g, beta, segment_tokens=segment_tokens, **common)


def decode(recipe, q, k, v, g, beta, *, state_pool, state_indices, out, **kwargs):
    """One token per sequence, pool updated in place; shapes as for the triton backend's ``decode``."""
    _no_options("decode", kwargs)
    token = lambda x: None if x is None else x.unsqueeze(1)  # noqa: E731  ([N, ...] -> [N, 1, ...])
    recurrent_cute.recurrent(recipe, token(q), token(k), token(v), token(g) if recipe.delta_rule else g,
                             token(beta), op="decode", state_pool=state_pool, state_indices=state_indices,
                             out=token(out))


def verify(recipe, q, k, v, g, beta, *, protocol, state_pool, state_indices, num_accepted_tokens,
           intermediate_states, intermediate_indices, out, **kwargs):
    """MTP verify of T tokens for N sequences, as the triton backend's ``verify`` (a deferred
    delta-rule verify returns the tokens' u, float32 [N, T, HV, V], for ``commit``)."""
    _no_options("verify", kwargs)
    saved = None
    if protocol == "deferred" and recipe.delta_rule:
        saved = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    recurrent_cute.recurrent(recipe, q, k, v, g, beta, op=protocol, state_pool=state_pool,
                             state_indices=state_indices, out=out,
                             num_accepted_tokens=num_accepted_tokens if protocol == "slots" else None,
                             intermediate_states=intermediate_states, intermediate_indices=intermediate_indices,
                             saved_u=saved)
    return saved


def fuses_commit(pending, recipe, g) -> bool:
    """Whether ``commit_verify`` runs this verify with ``pending`` in one kernel (every family)."""
    return fuses_pending(pending, recipe, g, NAME, ("gdn", "kda", "lightning"))


def commit_verify(recipe, q, k, v, g, beta, *, pending, num_accepted_tokens, state_pool, state_indices, out,
                  **kwargs):
    """The deferred commit of ``pending`` (``num_accepted_tokens`` [N] of its tokens, 0..its T)
    and the deferred verify of these T tokens from the committed states, in one kernel: each state
    is read once and written once (where a commit is due). Only where ``fuses_commit``. Returns
    the new u as ``verify`` does."""
    _no_options("verify", kwargs)
    saved = None
    if recipe.delta_rule:
        saved = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    pending_u = pending.saved if recipe.delta_rule else pending.v
    recurrent_cute.recurrent(recipe, q, k, v, g, beta, op="deferred", state_pool=state_pool,
                             state_indices=state_indices, out=out, num_accepted_tokens=num_accepted_tokens,
                             saved_u=saved, pending=(pending.k, pending.g, pending_u))
    return saved


def commit(recipe, *, protocol, state_pool, state_indices, num_accepted_tokens, intermediate_states,
           intermediate_indices, k, v, g, beta, saved=None, **kwargs):
    """As the triton backend's ``commit``: "deferred" replays the accepted tokens (from the
    verify's ``saved`` u when given), "buffer" and "slots" copy one saved state per sequence."""
    _no_options("commit", kwargs)
    if protocol == "deferred":
        recurrent_cute.recurrent(recipe, None, k, v, g, beta, op="commit", state_pool=state_pool,
                                 state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
                                 saved_u=saved if recipe.delta_rule else None)
        return
    from ..delta_rule.recurrent_triton import copy_committed_states
    copy_committed_states(protocol, state_pool=state_pool, state_indices=state_indices,
                          num_accepted_tokens=num_accepted_tokens, intermediate_states=intermediate_states,
                          intermediate_indices=intermediate_indices)
