"""cute_launch.FastLaunch: raw argument values go to a compiled CuTe DSL program only where they
marshal exactly as the DSL's own path does; otherwise every call goes through the DSL."""
import ctypes
import os
import subprocess
import sys

import pytest

from cula_serve.kernels.common.cute_launch import FastLaunch, runtime_cell_types
from cute_sm90 import GDN_PREFILL


def _launcher(q_ptr, n, stride, scale, stream, BLOCK):
    """Annotated below as the launchers are (their modules postpone annotations: strings)."""


_launcher.__annotations__ = dict(q_ptr="cute.Pointer", n="Int32", stride="Int64", scale="Float32",
                                 stream="cuda.CUstream", BLOCK="cutlass.Constexpr[int]")


class _FakeCompiled:
    """Marshals like the DSL (a cell per argument, ``widths`` its types) and records what runs."""

    def __init__(self, widths):
        self.widths = widths
        self.runs, self.calls = [], []

    def generate_execution_args(self, *args):
        cells = [width(getattr(arg, "value", arg)) for width, arg in zip(self.widths, args)]
        return [ctypes.addressof(c) for c in cells], cells

    def run_compiled_program(self, addresses):
        self.runs.append([width.from_address(a).value for width, a in zip(self.widths, addresses)])

    def __call__(self, *args):
        self.calls.append(args)


class _Stream:
    def __init__(self, handle):
        self.value = handle


TYPES = (ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p)


def test_runtime_cell_types_skip_constexprs_and_refuse_what_they_cannot_marshal():
    assert runtime_cell_types(_launcher) == TYPES

    def odd(x):
        pass
    odd.__annotations__ = dict(x="cute.Tensor")
    with pytest.raises(TypeError, match="x: cute.Tensor"):
        runtime_cell_types(odd)


def _dsl_args(addresses, scalars, stream):
    """The fakes' stand-in for the DSL's arguments (pointers are plain addresses here)."""
    return [*addresses, *scalars, _Stream(stream)]


def test_values_reach_the_program_through_the_cells():
    compiled = _FakeCompiled(TYPES)
    built = []

    def dsl_args(addresses, scalars, stream):
        built.append(1)
        return _dsl_args(addresses, scalars, stream)

    launch = FastLaunch(compiled, _launcher, dsl_args)
    for address, scalars, stream in ((0x7F0000001000, (64, 1 << 40, 0.5), 0xABC000), (0, (7, 3, -1.25), 0xDEF000)):
        launch([address], scalars, stream)
    assert launch.fast is True and not compiled.calls
    assert compiled.runs == [[0x7F0000001000, 64, 1 << 40, 0.5, 0xABC000], [None, 7, 3, -1.25, 0xDEF000]]
    assert len(built) == 1, "the DSL's arguments are built for the first call's check only"


@pytest.mark.parametrize("widths", [TYPES[:4],  # the DSL marshals one argument fewer
                                    (ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p)])
def test_a_configuration_that_marshals_otherwise_keeps_the_dsl_path(widths):
    compiled = _FakeCompiled(widths)
    launch = FastLaunch(compiled, _launcher, _dsl_args)
    for _ in range(2):
        launch([0x7F0000001000], (64, 1 << 40, 0.1), 0xABC000)
    assert launch.fast is False and not compiled.runs and len(compiled.calls) == 2


_REAL_LAUNCHERS = "SEGMENTED = True\n" + GDN_PREFILL + """
import cuda.bindings.driver as cuda

stream = 0x5555AAAA0000
addresses = [0x7F0000001000 + 4096 * i for i in range(len(dtypes))]
addresses[8] = 0  # an absent tensor
scalars = [123456, 7, 99, 3, 128, 5, 0.0883883, 512]


def dsl_args(scalars):
    return [*(recurrent_cute.pointer(dt, a, name in cute_prefill.ALIGNED)
              for name, dt, a in zip(chunk_cute._POINTERS, dtypes, addresses)), *scalars, cuda.CUstream(stream)]


assert launch._marshals_like_the_dsl([*addresses, *scalars, stream], dsl_args(scalars))
assert launch._marshals_like_the_dsl([*addresses, *scalars, stream], launch._dsl_args(addresses, scalars, stream))
assert not launch._marshals_like_the_dsl([*addresses, *scalars, stream], dsl_args(scalars[:-1] + [513]))

dtypes = (bf16, bf16, bf16, f32, bf16, bf16, f32, f32, f32, f32, f32, i32, i32, f32, f32, f32, f32)
constexprs = (("T", 4), ("TP", 0), ("H", H), ("HV", HV), ("K", D), ("V", D), ("R", 8), ("G", 16), ("OP", 3),
              ("FAMILY", 0), ("GATE", recurrent_cute.GATE_SOFTPLUS), ("HAS_DT_BIAS", True), ("QK_L2NORM", True),
              ("BETA_LOGITS", True), ("SAVED_U", True), ("VECTOR_POOL", True), ("WARPS", 4), ("STAGE", False),
              ("TENSOR_CORES", False), ("MIN_CTAS", 0))
launch = recurrent_cute._compiled(dtypes, constexprs)
addresses = [0x7F0000100000 + 65536 * i for i in range(len(dtypes))]
scalars = [64, 1, *range(100, 135), 0.08838, -5.0]
dsl = [*(recurrent_cute.pointer(dt, a, name in ("pool", "buffer"))
         for name, dt, a in zip(recurrent_cute._POINTERS, dtypes, addresses)), *scalars, cuda.CUstream(stream)]
assert launch._marshals_like_the_dsl([*addresses, *scalars, stream], dsl)
assert launch._marshals_like_the_dsl([*addresses, *scalars, stream], launch._dsl_args(addresses, scalars, stream))
print("ok")
"""


def test_the_kernels_launchers_marshal_like_the_dsl():
    """The CuTe DSL prefill and recurrent launchers, compiled for SM90 on the CPU where
    nvidia-cutlass-dsl is installed (in a fresh process: the DSL reads its target at import):
    FastLaunch's check passes on their real arguments and catches a wrong value."""
    pytest.importorskip("cutlass")
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    result = subprocess.run([sys.executable, "-c", _REAL_LAUNCHERS], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
