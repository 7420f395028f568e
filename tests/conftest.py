"""Shared test helpers: the float64 oracle, poisoned pools, tolerances, and the gpu marker."""
from __future__ import annotations

import contextlib
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter; it is read when triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cula_serve import cula_gdn, cula_kda, cula_lightning
from cula_serve.inputs import random_inputs, relative_error, to_float64

# The oracle: the torch backend's token-by-token recurrence in float64 (DESIGN section 7).
ORACLE = dict(backend="torch", algorithm="recurrent", compute_dtype=torch.float64)

SMALL = dict(H=2, HV=4, K=16, V=8)  # GVA: two value heads per qk head
SMALL_MHA = dict(H=3, HV=3, K=8, V=16)


def tolerance(input_dtype: torch.dtype, state_dtype: torch.dtype) -> float:
    """DESIGN section 7: 1e-5 for float32 paths, 5e-3 bf16 inputs + fp32 state, 2e-2 bf16 state."""
    if state_dtype == torch.bfloat16:
        return 2e-2
    if input_dtype in (torch.bfloat16, torch.float16):
        return 5e-3
    return 1e-5


def poisoned_pool(P, HV, V, K, dtype, live_slots, generator) -> torch.Tensor:
    """A pool that is NaN everywhere except ``live_slots``, which hold random states."""
    pool = torch.full((P, HV, V, K), float("nan"), dtype=dtype)
    for slot in live_slots:
        pool[slot] = (0.5 * torch.randn(HV, V, K, generator=generator)).to(dtype)
    return pool


def lightning_strided_views(T, H, HV, K, V, aligned, generator, device="cpu"):
    """Lightning's q [T, H, K], k, v [T, HV, V] sliced from one fused bf16 projection and a NaN
    ``out`` view [T, HV, V], laid out for each of its kernel's row paths. aligned: rows 16-byte
    aligned with contiguous last dims (descriptors). Not aligned: an odd row stride, k with
    strided head vectors, ``out`` with a strided last dim (masked pointers)."""
    fused = torch.randn(T, 2 * H * K + HV * V + (8 if aligned else 3), generator=generator, device=device).bfloat16()
    q = fused[:, :H * K].unflatten(-1, (H, K))
    keys = fused[:, H * K:2 * H * K]
    k = keys.unflatten(-1, (H, K)) if aligned else keys.unflatten(-1, (K, H)).transpose(-1, -2)
    v = fused[:, 2 * H * K:2 * H * K + HV * V].unflatten(-1, (HV, V))
    if aligned:
        out = torch.full((T, HV, 2 * V), float("nan"), dtype=torch.bfloat16, device=device)[..., :V]
    else:
        out = torch.full((T, HV, V, 2), float("nan"), dtype=torch.bfloat16, device=device)[..., 0]
    return q, k, v, out


def oracle_pool(pool: torch.Tensor) -> torch.Tensor:
    return pool.double().clone()


def assert_close(out, ref, tol, what="output"):
    err = relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:g}"


PREFILL = {"gdn": cula_gdn, "kda": cula_kda, "lightning": cula_lightning}


def prefill_call(mode, kw, **options):
    """cula_{mode}(...) on ``random_inputs``' dict ``kw`` plus ``options`` (pool, backend, ...)."""
    kw = dict(kw)
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    if mode == "lightning":
        return PREFILL[mode](q, k, v, kw.pop("decay"), **kw, **options)
    return PREFILL[mode](q, k, v, kw.pop("g"), kw.pop("beta"), **kw, **options)


def prefill_and_oracle(mode, kw, pool, backend, out=None, **options):
    """(out, ref_out, ref_pool): the prefill of ``backend`` (a dict of the options that go to its
    call alone) into ``pool`` and ``out`` (a NaN-poisoned contiguous tensor when None), and the
    float64 oracle on a float64 copy of the pool, both with ``options``."""
    ref_pool = None if pool is None else pool.double()
    T, HV, V = kw["v"].shape
    if out is None:
        out = torch.full((T, HV, V), float("nan"), dtype=kw["v"].dtype, device=kw["v"].device)
    o, _ = prefill_call(mode, kw, state_pool=pool, out=out, **options, **backend)
    ref_o, _ = prefill_call(mode, to_float64(kw), state_pool=ref_pool, **options, **ORACLE)
    assert o is out
    return o, ref_o, ref_pool


def assert_same_writes(pool, ref_pool, tol, what="pool"):
    """The pool holds NaN exactly where the oracle's does (slots neither may touch) and the
    oracle's values elsewhere."""
    nan, ref_nan = torch.isnan(pool.float()), torch.isnan(ref_pool)
    assert torch.equal(nan, ref_nan), f"{what}: written where the oracle did not write, or the reverse"
    assert_close(pool[~nan], ref_pool[~ref_nan], tol, what)


def assert_untouched(pool, untouched_slots):
    """Slots that must not have been written are still all NaN."""
    for slot in untouched_slots:
        assert torch.isnan(pool[slot].float()).all(), f"slot {slot} was written"


@pytest.fixture
def generator(request):
    # a fresh but reproducible stream per test: different tests draw different inputs
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def skip_module_unless_gpu():
    """Called at the top of a tests/gpu module: skip it all without a CUDA GPU, or when
    TRITON_INTERPRET=1 would run its kernels in Triton's interpreter instead of on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 would run the kernels in Triton's interpreter; unset it to test the GPU",
                    allow_module_level=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


__all__ = ["ORACLE", "PREFILL", "SMALL", "SMALL_MHA", "assert_close", "assert_same_writes", "assert_untouched",
           "oracle_pool", "poisoned_pool", "prefill_and_oracle", "prefill_call", "random_inputs", "relative_error",
           "to_float64", "tolerance"]


@contextlib.contextmanager
def gpu_faithful_interpreter():
    """Patches Triton 3.6's interpreter while the block runs (test modules whose kernels use
    bf16 / tf32 products enter it), restoring it afterwards:

    - ``range`` over a runtime bound indexes a 1-element array, which numpy >= 2.4 refuses
      (triton-lang/triton#9171): index its single element instead.
    - ``tl.dot`` of bf16 tiles multiplies their raw uint16 bit patterns: decode them first.
    - float32 -> bf16 casts truncate: round to nearest even, as the GPU's cvt.rn does.
    - tf32 products are exact float32 products: drop the 13 low mantissa bits of each operand
      first, as the tensor cores do (truncation: the pessimistic reading).
    - every call of a @triton.jit helper re-patches triton.language (~2 ms of inspect each):
      patch once per module per launch.
    Without the first four, the bf16 paths would fail (or pass) for the wrong reasons.
    """
    import numpy as np
    import triton

    interp = triton.runtime.interpreter
    tl = triton.language
    saved = dict(patch_tensor=interp._patch_lang_tensor, dot=interp.InterpreterBuilder.create_dot,
                 cast=interp.InterpreterBuilder.cast_impl, launch=interp.GridExecutor.__call__,
                 device_call=interp.InterpretedFunction.__call__)

    def patch_tensor(tensor, scope):
        saved["patch_tensor"](tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    def bf16_to_f32(bits):
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def f32_to_bf16(x):
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        return ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)

    def tf32(x):
        return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = interp.TensorHandle(bf16_to_f32(a.data), tl.float32)
            b = interp.TensorHandle(bf16_to_f32(b.data), tl.float32)
        elif a.dtype.scalar == tl.float32 and input_precision == interp._ir.INPUT_PRECISION.TF32:
            a = interp.TensorHandle(tf32(a.data), tl.float32)
            b = interp.TensorHandle(tf32(b.data), tl.float32)
        return saved["dot"](self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interp.TensorHandle(f32_to_bf16(src.data), tl.bfloat16)
        return saved["cast"](self, src, dst_type)

    patched = set()

    def launch(self, *args, **kwargs):
        patched.clear()
        return saved["launch"](self, *args, **kwargs)

    def device_call(self, *args, **kwargs):
        if id(self.fn.__globals__) not in patched:
            interp._patch_lang(self.fn)
            patched.add(id(self.fn.__globals__))
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            raise interp.InterpreterError(repr(err)) from err

    interp._patch_lang_tensor = patch_tensor
    interp.InterpreterBuilder.create_dot = create_dot
    interp.InterpreterBuilder.cast_impl = cast_impl
    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = device_call
    try:
        yield
    finally:
        interp._patch_lang_tensor = saved["patch_tensor"]
        interp.InterpreterBuilder.create_dot = saved["dot"]
        interp.InterpreterBuilder.cast_impl = saved["cast"]
        interp.GridExecutor.__call__ = saved["launch"]
        interp.InterpretedFunction.__call__ = saved["device_call"]
