"""Validation: every bad call raises TypeError / ValueError naming the argument, and the pool is
bit-identical afterwards. Property-based: hypothesis draws valid calls (which must match the
oracle) and applies one mutation to make them invalid (which must raise and write nothing)."""
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cula_serve import cula_commit, cula_decode, cula_gdn, cula_kda, cula_lightning, cula_verify

from conftest import ORACLE, assert_close, oracle_pool, random_inputs, to_float64, tolerance

PREFILL = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so NaN == NaN and -0 != 0."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32 if t.element_size() == 4 else torch.int64).clone()


def assert_rejected(fn, pool, arg):
    before = bits(pool)
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    assert re.search(rf"\b{arg}\b", str(info.value)), f"message {str(info.value)!r} does not name {arg!r}"
    assert torch.equal(bits(pool), before), "a rejected call wrote the pool"


@st.composite
def prefill_calls(draw):
    """A valid prefill call: (mode, kwargs, pool) with small random shapes."""
    mode = draw(st.sampled_from(["gdn", "kda", "lightning"]))
    H = draw(st.integers(1, 2))
    HV = H * draw(st.integers(1, 2))
    K, V = draw(st.sampled_from([4, 8])), draw(st.sampled_from([4, 8]))
    seqlens = draw(st.lists(st.integers(0, 70), min_size=1, max_size=4))
    N = len(seqlens)
    P = N + draw(st.integers(0, 3))
    state_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    kw = random_inputs(mode, (1, sum(seqlens)), H=H, HV=HV, K=K, V=V, generator=generator,
                       fused_gate=draw(st.booleans()))
    slots = torch.randperm(P, generator=generator)[:N].to(torch.int32)
    padding = torch.tensor(draw(st.lists(st.booleans(), min_size=N, max_size=N)))
    slots[padding] = -1
    kw.update(cu_seqlens=torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32),
              state_indices=slots,
              has_initial_state=torch.tensor(draw(st.lists(st.booleans(), min_size=N, max_size=N))))
    pool = (0.5 * torch.randn(P, HV, V, K, generator=generator)).to(state_dtype)
    return mode, kw, pool


@given(prefill_calls())
@settings(max_examples=30, **SETTINGS)
def test_valid_prefill_calls_match_oracle(call):
    mode, kw, pool = call
    ref_pool = oracle_pool(pool)
    o, _ = PREFILL[mode](**kw, state_pool=pool)
    ref_o, _ = PREFILL[mode](**to_float64(kw), state_pool=ref_pool, **ORACLE)
    tol = tolerance(torch.bfloat16, pool.dtype)
    if ref_o.norm() > 0:
        assert_close(o, ref_o, tol)
    live = kw["state_indices"][kw["state_indices"] >= 0].long()
    if live.numel() and ref_pool[live].norm() > 0:
        assert_close(pool[live], ref_pool[live], tol, "final states")


def _mutations(mode, kw, pool):
    """(argument named in the error, mutated kwargs, mutated pool) for one call."""
    T = kw["q"].shape[1]
    N = kw["state_indices"].shape[0]
    P = pool.shape[0]
    out = []

    def mutated(arg, **changes):
        out.append((arg, {**kw, **changes}))

    mutated("q", q=kw["q"].to(torch.int32))
    mutated("k", k=kw["k"][:, :, :, :-1])
    # (with no tokens, a v of another batch size: a narrower v would only change V, which the
    # pool's shape check reports first)
    mutated("v", v=kw["v"][:, :-1] if T > 0 else torch.zeros(2, *kw["v"].shape[1:], dtype=kw["v"].dtype))
    mutated("v", v=kw["v"].float())
    mutated("cu_seqlens", cu_seqlens=kw["cu_seqlens"] + 1)
    mutated("cu_seqlens", cu_seqlens=kw["cu_seqlens"].float())
    mutated("cu_seqlens", cu_seqlens=torch.cat([kw["cu_seqlens"][:-1], kw["cu_seqlens"][-1:] + 1]))
    if N >= 2 and T > 0:
        bad = kw["cu_seqlens"].clone()
        bad[1] = T + 1
        mutated("cu_seqlens", cu_seqlens=bad)
    mutated("state_indices", state_indices=kw["state_indices"][:-1])
    mutated("state_indices", state_indices=torch.full_like(kw["state_indices"], P))
    mutated("state_indices", state_indices=kw["state_indices"].float())
    if N >= 2:
        mutated("state_indices", state_indices=torch.zeros_like(kw["state_indices"]))
    mutated("has_initial_state", has_initial_state=kw["has_initial_state"].int())
    mutated("scale", scale=float("nan"))
    mutated("out", out=torch.empty(1, T, kw["v"].shape[2], kw["v"].shape[3] + 1, dtype=kw["v"].dtype))
    mutated("initial_state", initial_state=torch.zeros(N, *pool.shape[1:]))
    mutated("checkpoint_every", checkpoint_every=50, checkpoint_indices=torch.zeros(N, 1, dtype=torch.int32))
    if mode == "lightning":
        mutated("decay", decay=kw["decay"][:-1])
        mutated("g", g=torch.zeros(1, T, kw["v"].shape[2]))
    else:
        mutated("g", g=kw["g"][..., :1] if mode == "kda" else kw["g"][..., None])
        mutated("beta", beta=None)
        mutated("beta", beta=kw["beta"].to(torch.int64))
        mutated("lower_bound", lower_bound=-5.0 if mode == "gdn" else 1.0, use_gate_in_kernel=True,
                A_log=kw.get("A_log", torch.zeros(kw["v"].shape[2])))
        if kw.get("use_gate_in_kernel"):
            mutated("A_log", A_log=kw["A_log"][:-1])
            mutated("dt_bias", dt_bias=torch.zeros(3, 5))
        else:
            mutated("A_log", A_log=torch.zeros(kw["v"].shape[2]))
    return out


@given(prefill_calls(), st.data())
@settings(max_examples=60, **SETTINGS)
def test_invalid_prefill_calls_raise_and_write_nothing(call, data):
    mode, kw, pool = call
    arg, bad = data.draw(st.sampled_from(_mutations(mode, kw, pool)))
    assert_rejected(lambda: PREFILL[mode](**bad, state_pool=pool), pool, arg)


def test_wrong_pool_shape_and_dtype_rejected():
    kw = random_inputs("gdn", (1, 10), H=2, HV=4, K=8, V=8)
    call = dict(cu_seqlens=torch.tensor([0, 10]), state_indices=torch.tensor([0], dtype=torch.int32))
    for pool in (torch.zeros(2, 3, 8, 8), torch.zeros(2, 4, 8, 4)):
        assert_rejected(lambda: cula_gdn(**kw, state_pool=pool, **call), pool, "state_pool")
    pool = torch.zeros(2, 4, 8, 8, dtype=torch.int32)
    assert_rejected(lambda: cula_gdn(**kw, state_pool=pool, **call), pool, "state_pool")


def test_pool_and_dense_state_are_exclusive():
    kw = random_inputs("gdn", (1, 4), H=1, HV=1, K=4, V=4)
    pool = torch.zeros(1, 1, 4, 4)
    assert_rejected(lambda: cula_gdn(**kw, state_pool=pool, state_indices=torch.tensor([0]),
                                     initial_state=torch.zeros(1, 1, 4, 4)), pool, "initial_state")


def test_checkpoint_slot_clash_rejected():
    kw = random_inputs("gdn", (1, 128), H=1, HV=1, K=4, V=4)
    pool = torch.zeros(3, 1, 4, 4)
    assert_rejected(lambda: cula_gdn(**kw, state_pool=pool, state_indices=torch.tensor([1]), checkpoint_every=64,
                                     checkpoint_indices=torch.tensor([[2, 1]])), pool, "checkpoint_indices")


def test_unknown_backend_kwarg_rejected_before_writing():
    kw = random_inputs("gdn", (1, 4), H=1, HV=1, K=4, V=4)
    pool = torch.zeros(1, 1, 4, 4)
    assert_rejected(lambda: cula_gdn(**kw, state_pool=pool, state_indices=torch.tensor([0]), bogus=1), pool, "bogus")


@st.composite
def multi_token_calls(draw):
    mode = draw(st.sampled_from(["gdn", "kda", "lightning"]))
    N, T = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    P = N + 2
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kw = random_inputs(mode, (N, T), H=1, HV=2, K=4, V=4, generator=generator)
    pool = torch.randn(P, 2, 4, 4, generator=generator)
    slots = torch.randperm(P, generator=generator)[:N].to(torch.int32)
    return mode, kw, pool, slots


@given(multi_token_calls(), st.data())
@settings(max_examples=60, **SETTINGS)
def test_invalid_decode_verify_commit_raise_and_write_nothing(call, data):
    mode, kw, pool, slots = call
    N, T = kw["q"].shape[:2]
    qkv = {k: kw.pop(k) for k in ("q", "k", "v")}
    step = lambda d: {k: (v[:, :1] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v) for k, v in d.items()}  # noqa: E731
    buffer = torch.zeros(N, T, *pool.shape[1:])
    columns = torch.stack([slots] + [torch.full_like(slots, -1)] * (T - 1), 1)

    def pending():  # a deferred verify of the same rows, not committed yet
        return cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=slots, **kw)[1]

    cases = [
        ("mode", lambda: cula_decode(**step(qkv), state_pool=pool, mode="mamba", state_indices=slots, **step(kw))),
        ("state_indices", lambda: cula_decode(**step(qkv), state_pool=pool, mode=mode,
                                              state_indices=torch.full_like(slots, pool.shape[0]), **step(kw))),
        ("state_pool", lambda: cula_decode(**step(qkv), state_pool=pool[:, :1], mode=mode, state_indices=slots,
                                           **step(kw))),
        ("protocol", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=slots, protocol="eager",
                                         **kw)),
        ("intermediate_states", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=slots,
                                                    protocol="buffer", intermediate_states=buffer[:, :T - 1], **kw)),
        ("intermediate_states", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=slots,
                                                    protocol="buffer", intermediate_states=buffer.bfloat16(), **kw)),
        ("num_accepted_tokens", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=columns,
                                                    protocol="slots", num_accepted_tokens=torch.zeros_like(slots),
                                                    **kw)),
        ("state_indices", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=columns[:, :T - 1],
                                              protocol="slots", num_accepted_tokens=torch.ones_like(slots), **kw)),
        ("num_accepted_tokens", lambda: cula_commit(
            cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=slots, **kw)[1],
            torch.full_like(slots, T + 1))),
        ("num_accepted_tokens", lambda: cula_commit(
            cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=slots, **kw)[1], slots[:-1])),
        ("pending", lambda: cula_commit(object(), slots)),
        # a verify that commits a pending one first: nothing is committed when the call is invalid
        ("pending", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=slots, protocol="buffer",
                                        intermediate_states=buffer, pending=pending(), num_accepted_tokens=slots, **kw)),
        ("pending", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=slots, num_accepted_tokens=slots,
                                        pending=cula_verify(**qkv, state_pool=pool, mode=mode, state_indices=slots,
                                                            protocol="buffer", intermediate_states=buffer, **kw)[1],
                                        **kw)),
        ("pending", lambda: cula_verify(**qkv, state_pool=pool.clone(), mode=mode, state_indices=slots,
                                        pending=pending(), num_accepted_tokens=torch.ones_like(slots), **kw)),
        ("num_accepted_tokens", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, pending=pending(), **kw)),
        ("num_accepted_tokens", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, pending=pending(),
                                                    num_accepted_tokens=torch.full_like(slots, T + 1), **kw)),
        ("state_indices", lambda: cula_verify(**qkv, state_pool=pool, mode=mode, pending=pending(),
                                              state_indices=(slots + 1) % pool.shape[0],
                                              num_accepted_tokens=torch.ones_like(slots), **kw)),
    ]
    if T > 1:  # decode takes one token
        cases.append(("q", lambda: cula_decode(**qkv, state_pool=pool, mode=mode, state_indices=slots, **kw)))
    arg, fn = data.draw(st.sampled_from(cases))
    assert_rejected(fn, pool, arg)


def test_decode_rejects_multi_token_input():
    kw = random_inputs("gdn", (2, 3), H=1, HV=1, K=4, V=4)
    pool = torch.zeros(2, 1, 4, 4)
    qkv = {k: kw.pop(k) for k in ("q", "k", "v")}
    assert_rejected(lambda: cula_decode(**qkv, state_pool=pool, **kw), pool, "cula_verify")


def test_gpu_value_checks_follow_the_environment(monkeypatch):
    from cula_serve.validation import value_checks_enabled

    cpu = torch.zeros(1)
    assert value_checks_enabled(cpu)
    monkeypatch.setenv("CULA_CHECK_VALUES", "0")
    assert not value_checks_enabled(cpu)
    monkeypatch.setenv("CULA_CHECK_VALUES", "sometimes")
    with pytest.raises(ValueError, match="CULA_CHECK_VALUES"):
        value_checks_enabled(cpu)
