import subprocess
import sys
import types

import pytest
import torch

from cula_serve import BackendUnavailableError, cula_gdn, dispatch

from conftest import random_inputs


def test_table_prefers_cute_then_triton_on_hopper():
    assert dispatch.TABLE[("prefill", (9, 0))] == ("cute", "triton", "torch")
    assert dispatch.preference("decode", torch.device("cpu")) == ("torch",)


def test_cpu_runs_on_torch_and_status_is_cached():
    assert dispatch.backend_status("torch", torch.device("cpu"))[0].NAME == "torch"
    assert dispatch.backend_status("torch", torch.device("cpu")) is dispatch.backend_status("torch", torch.device("cpu"))


def test_named_backend_errors(monkeypatch):
    kw = random_inputs("gdn", (1, 4), H=1, HV=1, K=4, V=4)
    with pytest.raises(ValueError, match="backend: expected one of"):
        cula_gdn(**kw, backend="cuda")
    monkeypatch.setenv("CULA_BACKEND", "nope")
    with pytest.raises(ValueError, match="CULA_BACKEND"):
        cula_gdn(**kw)
    monkeypatch.setenv("CULA_BACKEND", "cute")
    with pytest.raises(BackendUnavailableError, match="cute"):
        cula_gdn(**kw)
    monkeypatch.delenv("CULA_BACKEND")
    o, _ = cula_gdn(**kw, backend="torch", algorithm="recurrent")
    assert o.shape == (1, 4, 1, 4)


def test_unsupported_dtype_names_the_backend():
    kw = random_inputs("gdn", (1, 4), H=1, HV=1, K=4, V=4)
    pool = torch.zeros(1, 1, 4, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="state dtype"):
        cula_gdn(**kw, state_pool=pool, state_indices=torch.tensor([0]), backend="torch")


def test_info_command_lists_every_backend():
    result = subprocess.run([sys.executable, "-m", "cula_serve", "info"], capture_output=True, text=True, check=True)
    for name in ("cute", "triton", "torch", "prefill", "decode", "verify", "commit"):
        assert name in result.stdout
    assert "torch   available" in result.stdout
    assert "qwen3-next   decode   float32  pool torch / torch / torch" in result.stdout or torch.cuda.is_available()


def test_backend_without_an_operation_is_skipped_or_refused(monkeypatch):
    """A backend lists the operations it has kernels for: automatic dispatch passes the others to
    the next backend in the table, and naming it for one of them says what it lacks."""
    cpu = torch.device("cpu")
    torch_module = dispatch.backend_status("torch", cpu)[0]
    decode_only = type("DecodeOnly", (), dict(NAME="decode_only", OPERATIONS=("decode",)))
    status = {"cute": (decode_only, None), "triton": (None, "absent"), "torch": (torch_module, None)}
    monkeypatch.setattr(dispatch, "backend_status", lambda name, device: status[name])
    monkeypatch.setattr(dispatch, "CPU_DEFAULT", ("cute", "torch"))
    always = lambda module: None  # noqa: E731
    assert dispatch.select("decode", cpu, None, always) is decode_only
    assert dispatch.select("prefill", cpu, None, always) is torch_module
    with pytest.raises(ValueError, match="has no prefill kernels"):
        dispatch.select("prefill", cpu, "cute", always)


def test_backend_defers_only_in_automatic_mode(monkeypatch):
    """A backend's ``defers`` hook (it knows the next backend is faster on such a call) moves an
    automatic call on, never a call that names the backend; ``automatic_backend`` names the same
    choice."""
    cpu = torch.device("cpu")
    torch_module = dispatch.backend_status("torch", cpu)[0]
    small_shy = type("SmallShy", (), dict(NAME="small_shy", OPERATIONS=("decode",),
                                          defers=staticmethod(
                                              lambda op, mode, N, T, HV, **_: "small" if N < 8 else None)))
    status = {"cute": (small_shy, None), "triton": (None, "absent"), "torch": (torch_module, None)}
    monkeypatch.setattr(dispatch, "backend_status", lambda name, device: status[name])
    monkeypatch.setattr(dispatch, "CPU_DEFAULT", ("cute", "torch"))
    always = lambda module: None  # noqa: E731
    assert dispatch.select("decode", cpu, None, always, dict(mode="gdn", N=1, T=1, HV=4)) is torch_module
    assert dispatch.select("decode", cpu, None, always, dict(mode="gdn", N=64, T=1, HV=4)) is small_shy
    assert dispatch.select("decode", cpu, "cute", always, dict(mode="gdn", N=1, T=1, HV=4)) is small_shy
    # the benchmarks' label of a call follows the same choice
    assert dispatch.automatic_backend("decode", cpu, dict(mode="gdn", N=1, T=1, HV=4)) == "torch"
    assert dispatch.automatic_backend("decode", cpu, dict(mode="gdn", N=64, T=1, HV=4)) == "small_shy"
    assert dispatch.automatic_backend("prefill", cpu) == "torch"


def test_backend_call_error_refuses_or_passes_on(monkeypatch):
    """A backend whose kernels cover part of an operation says which calls it cannot run
    (``call_error``): automatic dispatch passes them to the next backend, a call that names the
    backend raises that reason, and calls it can run stay with it."""
    cpu = torch.device("cpu")
    torch_module = dispatch.backend_status("torch", cpu)[0]
    lightning_only = type("LightningOnly", (), dict(
        NAME="lightning_only", OPERATIONS=("prefill",),
        call_error=staticmethod(lambda op, mode, **workload: None if mode == "lightning" else f"no {mode} prefill")))
    status = {"cute": (lightning_only, None), "triton": (None, "absent"), "torch": (torch_module, None)}
    monkeypatch.setattr(dispatch, "backend_status", lambda name, device: status[name])
    monkeypatch.setattr(dispatch, "CPU_DEFAULT", ("cute", "torch"))
    always = lambda module: None  # noqa: E731
    workload = lambda mode: dict(mode=mode, N=2, T=128, HV=4, tensors=(), options=())  # noqa: E731
    assert dispatch.select("prefill", cpu, None, always, workload("lightning")) is lightning_only
    assert dispatch.select("prefill", cpu, None, always, workload("gdn")) is torch_module
    with pytest.raises(ValueError, match="no gdn prefill"):
        dispatch.select("prefill", cpu, "cute", always, workload("gdn"))


def test_cute_gives_delta_rule_decode_to_triton():
    """On SM90 the Triton decode is as fast or faster for GDN and KDA at every batch size, and for
    Lightning below 2048 heads or with a float32 pool (``cute_backend.defers``); verify stays with
    the CuTe DSL kernel."""
    from cula_serve.kernels.backends import cute_backend
    for mode, N, HV in (("gdn", 1, 32), ("gdn", 256, 32), ("kda", 64, 32), ("lightning", 8, 64)):
        assert cute_backend.defers("decode", mode=mode, N=N, T=1, HV=HV), (mode, N)
    assert cute_backend.defers("decode", mode="lightning", N=256, T=1, HV=64, state_dtype=torch.float32)
    assert cute_backend.defers("decode", mode="lightning", N=32, T=1, HV=64) is None
    assert cute_backend.defers("decode", mode="lightning", N=32, T=1, HV=64, state_dtype=torch.bfloat16) is None
    assert cute_backend.defers("verify", mode="gdn", N=64, T=4, HV=32) is None


def test_cute_gives_few_cta_prefills_to_triton(monkeypatch):
    """Prefill whose CTAs (sequences x value heads) would fill few of an H200's 132 SMs goes to
    Triton's segments where ours cannot segment: Lightning below 0.4 of them, KDA below 0.1 (its
    Triton prefill shares our intra-chunk kernels) with checkpoints (ours segment without); GDN and
    KDA segment themselves."""
    from cula_serve.kernels.backends import cute_backend
    from cula_serve.kernels.common import segments
    monkeypatch.setattr(segments, "sm_count", lambda device: 132)
    # the kernels' head dim, from a module that needs nvidia-cutlass-dsl (not installed everywhere)
    monkeypatch.setattr(cute_backend, "chunk_cute", types.SimpleNamespace(HEAD_DIM=128), raising=False)
    tensors = (torch.empty(0),)
    defers = lambda mode, HV, T=8192, N=1, checkpoints=False: cute_backend.defers(  # noqa: E731
        "prefill", mode=mode, N=N, T=T, HV=HV, tensors=tensors, checkpoints=checkpoints)
    assert defers("kda", 8) is None and defers("kda", 8, T=32768) is None
    assert defers("kda", 8, checkpoints=True) and defers("kda", 16, checkpoints=True) is None
    assert defers("lightning", 16) and defers("lightning", 64) is None
    assert defers("gdn", 32) is None and defers("kda", 32, T=512, N=4) is None


def test_triton_recurrent_tiles_per_op():
    """``block_v`` on a GPU: streaming ops (decode, commit) on at most 8 columns, except KDA's
    commit from 2048 heads (16 columns, 32 with a float32 pool); GDN and KDA verifies from 2048
    heads on 16, except GDN's deferred verify on a float32 pool; Lightning's verifies as wide as
    the grid allows, its deferred verify 32 from 2048 heads; one warp per 4096 state floats."""
    from cula_serve.kernels.delta_rule.recurrent_triton import block_v
    gpu, bf16 = torch.device("cuda"), torch.bfloat16
    assert block_v(1, 32, 128, 128, gpu) == (4, 1)
    assert block_v(256, 32, 128, 128, gpu, "decode") == (8, 1)
    assert block_v(256, 32, 128, 128, gpu, "commit", "gdn", bf16) == (8, 1)
    assert block_v(64, 32, 128, 128, gpu, "commit", "kda", bf16) == (16, 1)
    assert block_v(64, 32, 128, 128, gpu, "commit", "kda") == (32, 1)
    assert block_v(8, 32, 128, 128, gpu, "commit", "kda") == (4, 1)
    assert block_v(64, 64, 128, 128, gpu, "deferred", "lightning") == (32, 1)
    assert block_v(64, 64, 128, 128, gpu, "buffer", "lightning") == (16, 1)
    assert block_v(64, 32, 128, 128, gpu, "deferred") == (8, 1)
    assert block_v(256, 32, 128, 128, gpu, "deferred") == (32, 1)
    assert block_v(64, 32, 128, 128, gpu, "deferred", "gdn", bf16) == (16, 1)
    assert block_v(256, 32, 128, 128, gpu, "deferred", "kda") == (16, 1)
    assert block_v(256, 32, 128, 128, gpu, "buffer") == (16, 1)
    assert block_v(256, 64, 128, 128, gpu, "buffer", "lightning") == (32, 1)
    assert block_v(8, 32, 128, 128, gpu, "slots", "kda") == (4, 1)
    assert block_v(1, 32, 128, 128, torch.device("cpu"), "deferred") == (32, 1)


def test_cute_prefill_row_checks():
    """The CuTe DSL prefills need TMA's rows (contiguous, 16-byte aligned) where their kernels load
    by TMA: GDN's q, k, v, out; KDA's v and out only (its q and k go to the Triton intra-chunk
    kernels, which take any strides)."""
    pytest.importorskip("cutlass")
    from cula_serve.kernels.delta_rule import chunk_cute
    bf16 = torch.bfloat16
    unaligned = torch.zeros(64, 32 * 128 + 3, dtype=bf16)[:, :32 * 128].unflatten(-1, (32, 128))  # odd row stride
    aligned = torch.zeros(64, 32, 128, dtype=bf16)
    assert chunk_cute.unsupported("kda", unaligned, unaligned, aligned, aligned, None) is None
    assert "16-byte aligned" in chunk_cute.unsupported("gdn", unaligned, aligned, aligned, aligned, None)
    assert "v: rows" in chunk_cute.unsupported("kda", aligned, aligned, unaligned, aligned, None)
