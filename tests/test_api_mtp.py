"""Decode, verify and commit through the Level-1 API against the oracle and against each other:
decode == one-token prefill, verify == T decode steps, commit for every accepted length, the three
MTP protocols agree, padded rows untouched with zero output, both pool dtypes."""
import pytest
import torch

from cula_serve import api, cula_commit, cula_decode, cula_gdn, cula_kda, cula_lightning, cula_verify

from conftest import (ORACLE, SMALL, SMALL_MHA, assert_close, assert_untouched, oracle_pool, poisoned_pool,
                      random_inputs, to_float64, tolerance)

PREFILL = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}
MODES = ["gdn", "kda", "lightning"]
STATE_DTYPES = [torch.float32, torch.bfloat16]
# 5 sequences over a pool of 8 slots: permuted, one padding row; slots 1, 4, 6 are never used
SLOTS = [5, 0, -1, 7, 2]
UNUSED = [1, 4, 6]


def _setup(mode, lead, state_dtype, generator, shape=SMALL):
    kw = random_inputs(mode, lead, **shape, generator=generator)
    pool = poisoned_pool(8, shape["HV"], shape["V"], shape["K"], state_dtype, [s for s in SLOTS if s >= 0], generator)
    return kw, pool, torch.tensor(SLOTS, dtype=torch.int32)


def _step(kw, t):
    """Token t of a [N, T, ...] verify input as a [N, 1, ...] decode input."""
    return {k: (v[:, t:t + 1] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v) for k, v in kw.items()}


def _split_gates(kw):
    inputs = {k: kw[k] for k in ("q", "k", "v")}
    return inputs, {k: v for k, v in kw.items() if k not in inputs}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("shape", [SMALL, SMALL_MHA], ids=["gva", "mha"])
def test_decode_matches_oracle_and_one_token_prefill(mode, state_dtype, shape, generator):
    kw, pool, slots = _setup(mode, (5, 1), state_dtype, generator, shape)
    prefill_pool, ref_pool = pool.clone(), oracle_pool(pool)
    qkv, rest = _split_gates(kw)
    o, returned = cula_decode(**qkv, state_pool=pool, mode=mode, state_indices=slots, **rest)
    ref_qkv, ref_rest = _split_gates(to_float64(kw))
    ref_o, _ = cula_decode(**ref_qkv, state_pool=ref_pool, mode=mode, state_indices=slots, **ref_rest, **ORACLE)
    tol = tolerance(torch.bfloat16, state_dtype)
    assert returned is pool and o.shape == (5, 1, shape["HV"], shape["V"])
    assert_close(o, ref_o, tol)
    live = slots[slots >= 0].long()
    assert_close(pool[live], ref_pool[live], tol, "state")
    assert (o[2] == 0).all()
    assert_untouched(pool, UNUSED)
    # the same tokens as a varlen prefill of five one-token sequences
    packed = {k: (v.reshape(1, 5, *v.shape[2:]) if isinstance(v, torch.Tensor) and v.dim() >= 3 else v)
              for k, v in kw.items()}
    o_prefill, _ = PREFILL[mode](**packed, cu_seqlens=torch.arange(6, dtype=torch.int32), state_pool=prefill_pool,
                                 state_indices=slots)
    torch.testing.assert_close(o_prefill[0], o[:, 0], rtol=1e-2, atol=1e-2)  # bf16 outputs
    assert_close(prefill_pool[live], pool[live], 1e-5 if state_dtype == torch.float32 else 1e-2, "prefill state")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("protocol", ["buffer", "slots", "deferred"])
def test_verify_equals_decode_steps_and_commit_every_length(mode, state_dtype, protocol, generator):
    """For each accepted length a: verify + commit(a) leaves the slot where a decode steps leave it,
    and the verify outputs equal the T decode outputs."""
    T = 4
    kw, pool, slots = _setup(mode, (5, T), state_dtype, generator)
    qkv, rest = _split_gates(kw)
    tol = tolerance(torch.bfloat16, state_dtype)
    live = torch.tensor([n for n, s in enumerate(SLOTS) if s >= 0])
    live_slots = slots[live].long()

    # reference: T decode steps on the oracle, remembering the state after each step
    ref_pool = oracle_pool(pool)
    ref_outputs, ref_states = [], []
    for t in range(T):
        step = _step(to_float64(kw), t)
        o, _ = cula_decode(**_split_gates(step)[0], state_pool=ref_pool, mode=mode, state_indices=slots,
                           **_split_gates(step)[1], **ORACLE)
        ref_outputs.append(o)
        ref_states.append(ref_pool[live_slots].clone())
    ref_o = torch.cat(ref_outputs, 1)

    for accepted_len in range(1 if protocol == "slots" else 0, T + 1):
        work = pool.clone()
        call = dict(state_pool=work, mode=mode, protocol=protocol, **rest)
        if protocol == "slots":
            # column 0 holds the current state; columns 1.. are scratch slots from the unused ones
            columns = torch.full((5, T), -1, dtype=torch.int32)
            columns[:, 0] = slots
            scratch = iter([1, 4, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16])
            work = torch.cat([work, torch.full((9, *work.shape[1:]), float("nan"), dtype=work.dtype)])
            call["state_pool"] = work
            for n in live.tolist():
                for t in range(1, T):
                    columns[n, t] = next(scratch)
            call.update(state_indices=columns, num_accepted_tokens=torch.ones(5, dtype=torch.int32))
        elif protocol == "buffer":
            buffer = torch.full((6, T, *work.shape[1:]), float("nan"), dtype=work.dtype)
            call.update(state_indices=slots, intermediate_states=buffer,
                        intermediate_indices=torch.tensor([3, 0, 5, 1, 2], dtype=torch.int32))
        else:
            call.update(state_indices=slots)
        before = work.clone()
        o, pending = cula_verify(**qkv, **call)
        assert_close(o, ref_o, tol, "verify outputs")
        assert (o[2] == 0).all()
        if protocol != "slots":
            assert torch.equal(work.nan_to_num(7.0), before.nan_to_num(7.0)), "verify wrote the pool"
        accepted = torch.full((5,), accepted_len, dtype=torch.int32)
        cula_commit(pending, accepted)
        if accepted_len == 0:
            assert torch.equal(work.nan_to_num(7.0), before.nan_to_num(7.0)), "commit of 0 tokens wrote the pool"
        else:
            assert_close(work[live_slots], ref_states[accepted_len - 1], tol, f"state after commit({accepted_len})")
        assert_untouched(work, UNUSED if protocol != "slots" else [])


@pytest.mark.parametrize("mode", MODES)
def test_protocols_agree_with_mixed_accepted_lengths(mode, generator):
    T = 3
    kw, pool, slots = _setup(mode, (5, T), torch.float32, generator)
    qkv, rest = _split_gates(kw)
    accepted = torch.tensor([3, 1, 2, 2, 1], dtype=torch.int32)
    results = {}
    for protocol in ("buffer", "deferred"):
        work = pool.clone()
        extra = dict(intermediate_states=torch.zeros(5, T, *pool.shape[1:])) if protocol == "buffer" else {}
        o, pending = cula_verify(**qkv, state_pool=work, mode=mode, state_indices=slots, protocol=protocol,
                                 **extra, **rest)
        cula_commit(pending, accepted)
        results[protocol] = (o, work)
    torch.testing.assert_close(results["buffer"][0], results["deferred"][0])
    live = slots[slots >= 0].long()
    torch.testing.assert_close(results["buffer"][1][live], results["deferred"][1][live], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verify_with_pending_commits_it_first(mode, state_dtype, backend, generator, monkeypatch):
    """An engine's steady state: each deferred verify commits the previous one's accepted tokens
    first (``pending=``). Three steps of different lengths against the oracle run as separate
    verify and commit calls, with every accepted count 0..T across the rows. The Triton delta-rule
    kernel commits inside the verify (no separate commit may run); the others commit first."""
    if backend == "triton":
        pytest.importorskip("triton")
    fused = backend == "triton" and mode != "lightning"
    lengths = (3, 4, 2)
    accepted = [torch.tensor([3, 0, 1, 2, 1], dtype=torch.int32), torch.tensor([4, 1, 0, 0, 2], dtype=torch.int32)]
    shape = dict(H=2, HV=4, K=16, V=16)  # head dims the Triton kernels take
    pool = _setup(mode, (5, 1), state_dtype, generator, shape)[1]
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    ref_pool = oracle_pool(pool)
    tol = tolerance(torch.bfloat16, state_dtype)
    live = slots[slots >= 0].long()
    pending = ref_pending = layer = None
    for step, T in enumerate(lengths):
        kw = random_inputs(mode, (5, T), **shape, generator=generator)
        layer = layer or {key: kw[key] for key in ("A_log", "dt_bias", "decay") if key in kw}
        kw.update(layer)  # a layer's gate parameters are the same every step
        qkv, rest = _split_gates(kw)
        commit_first = {} if pending is None else dict(pending=pending, num_accepted_tokens=accepted[step - 1])
        before = pool.clone()
        with monkeypatch.context() as patched:
            if fused:
                patched.setattr(api, "cula_commit", None)  # calling it would fail
            o, pending = cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=None if step else slots,
                                     backend=backend, **commit_first, **rest)
        ref_qkv, ref_rest = _split_gates(to_float64(dict(qkv, **rest)))
        if ref_pending is not None:
            cula_commit(ref_pending, accepted[step - 1])
        ref_o, ref_pending = cula_verify(**ref_qkv, state_pool=ref_pool, mode=mode, state_indices=slots,
                                         **ref_rest, **ORACLE)
        assert_close(o, ref_o, tol, f"step {step} outputs")
        assert (o[2] == 0).all()
        if step == 0:
            assert torch.equal(pool.nan_to_num(7.0), before.nan_to_num(7.0)), "a verify without pending wrote the pool"
        else:
            assert_close(pool[live], ref_pool[live], tol, f"step {step}: the committed states")
        assert_untouched(pool, UNUSED)
    cula_commit(pending, torch.tensor([2, 1, 2, 0, 2], dtype=torch.int32))
    cula_commit(ref_pending, torch.tensor([2, 1, 2, 0, 2], dtype=torch.int32))
    assert_close(pool[live], ref_pool[live], tol, "the last commit")


def test_slots_protocol_reads_the_accepted_column(generator):
    """vLLM's flow: the next verify reads column num_accepted_tokens - 1 of the previous step."""
    T = 3
    kw, pool, _ = _setup("gdn", (2, T), torch.float32, generator)
    qkv, rest = _split_gates(kw)
    columns = torch.tensor([[0, 1, 3], [2, 4, 6]], dtype=torch.int32)
    pool[[1, 3, 4, 6]] = torch.randn(4, *pool.shape[1:], generator=generator)
    accepted = torch.tensor([3, 2], dtype=torch.int32)  # read slot 3 for row 0, slot 4 for row 1
    ref_pool = oracle_pool(pool)
    o, _ = cula_verify(**qkv, state_pool=pool, mode="gdn", protocol="slots", state_indices=columns,
                       num_accepted_tokens=accepted, **rest)
    dense = torch.stack([ref_pool[3], ref_pool[4]])
    ref = {k: v for k, v in to_float64(kw).items()}
    ref_o, _ = cula_gdn(ref["q"].reshape(1, 2 * T, *ref["q"].shape[2:]), ref["k"].reshape(1, 2 * T, *ref["k"].shape[2:]),
                        ref["v"].reshape(1, 2 * T, *ref["v"].shape[2:]), ref["g"].reshape(1, 2 * T, -1),
                        ref["beta"].reshape(1, 2 * T, -1), cu_seqlens=torch.tensor([0, T, 2 * T]),
                        initial_state=dense, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        A_log=ref["A_log"], dt_bias=ref["dt_bias"], use_beta_sigmoid_in_kernel=True, **ORACLE)
    assert_close(o.reshape(1, 2 * T, *o.shape[2:]), ref_o, 5e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_slots_wide_columns_and_long_buffer(backend, generator):
    """T_cols > T: the read column is num_accepted_tokens - 1 even past T; a buffer with room
    for more than T tokens keeps its extra entries untouched."""
    if backend == "triton":
        pytest.importorskip("triton")
    T = 2
    kw, pool, _ = _setup("kda", (2, T), torch.float32, generator, dict(H=2, HV=4, K=16, V=16))
    qkv, rest = _split_gates(kw)
    pool[[1, 3, 4, 6]] = torch.randn(4, *pool.shape[1:], generator=generator)
    columns = torch.tensor([[0, 1, 3, 6], [2, 4, 7, 5]], dtype=torch.int32)
    accepted = torch.tensor([4, 3], dtype=torch.int32)  # read slot 6 for row 0, slot 7 for row 1
    work = pool.clone()
    o, _ = cula_verify(**qkv, state_pool=work, mode="kda", protocol="slots", state_indices=columns,
                       num_accepted_tokens=accepted, backend=backend, **rest)
    ref_o, _ = cula_verify(**_split_gates(to_float64(kw))[0], state_pool=oracle_pool(pool)[[6, 7]], mode="kda",
                           protocol="deferred", **_split_gates(to_float64(kw))[1], **ORACLE)
    assert_close(o, ref_o, 5e-3)
    buffer = torch.full((2, T + 2, *pool.shape[1:]), float("nan"))
    cula_verify(**qkv, state_pool=pool, mode="kda", protocol="buffer", state_indices=torch.tensor([0, 2]),
                intermediate_states=buffer, backend=backend, **rest)
    assert torch.isfinite(buffer[:, :T]).all() and torch.isnan(buffer[:, T:]).all()
