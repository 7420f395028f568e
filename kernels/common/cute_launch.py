"""Calling a compiled CuTe DSL launcher with little host work.

Called with Python arguments, a compiled ``cute.jit`` function marshals every one through the
DSL's generic path before the C call: it rectifies the signature, casts each scalar to its
annotated type, and the caller has built a pointer object per tensor and a ``CUstream``. For the
GDN prefill launcher's 24 runtime arguments that is most of a call's host time (an H100 host,
2026-11-25: ``cute_prefill.launch`` took 135 of a GDN call's 286 us), which eager prefills of
short sequences wait on. ``FastLaunch`` keeps one ctypes cell per runtime argument, writes the
call's values (tensor addresses, ints, floats, the stream handle) into them and hands the cells'
addresses to the compiled program, which is what the DSL's path ends in. Host time per eager
call on an H100 machine (the DSL's path -> this): GDN prefill 1 x 2048 324 -> 206 us, 8 x 1024
271 -> 149, Lightning 8 x 1024 184 -> 115, GDN decode B = 1 312 -> 172, T = 4 verify 299 -> 137.

The first call of each compiled configuration also builds the DSL's own arguments and checks
that they marshal to as many values, in the same order, equal to the cells' (a configuration
that does not, say under another DSL version, keeps calling through the DSL). The cells' widths
are the DSL's own (its ``Integer`` types marshal as ``c_int<width>``, ``Float32`` as ``c_float``,
pointers and the stream as addresses), which the check cannot see: nvidia-cutlass-dsl stays
pinned below 5.
"""
from __future__ import annotations

import ctypes
import inspect
import threading
from typing import Callable

# the launchers' runtime annotations (their modules use postponed annotations) and the C type
# the DSL marshals each to: a pointer's address, a scalar's value, the stream's handle
_CELL_TYPES = {"cute.Pointer": ctypes.c_void_p, "Int32": ctypes.c_int32, "Int64": ctypes.c_int64,
               "Float32": ctypes.c_float, "cuda.CUstream": ctypes.c_void_p}


def runtime_cell_types(launcher) -> tuple:
    """The ctypes type of each runtime (not ``cutlass.Constexpr``) parameter of ``launcher``, in order."""
    types = []
    for name, parameter in inspect.signature(launcher).parameters.items():
        annotation = parameter.annotation if isinstance(parameter.annotation, str) else getattr(
            parameter.annotation, "__name__", repr(parameter.annotation))
        if annotation.startswith("cutlass.Constexpr"):
            continue
        if annotation not in _CELL_TYPES:
            raise TypeError(f"{launcher.__name__}: no fast marshalling for parameter {name}: {annotation}")
        types.append(_CELL_TYPES[annotation])
    return tuple(types)


def _address(exe_arg) -> int:
    return exe_arg if isinstance(exe_arg, int) else exe_arg.value


class FastLaunch:
    """A compiled launcher called with raw values: ``launch(addresses, scalars, stream)``.

    ``addresses``: the pointer arguments' tensor addresses (0 for an absent tensor); ``scalars``:
    the scalar arguments as Python numbers; ``stream``: the CUDA stream's handle.
    ``dsl_args(addresses, scalars, stream)`` builds the same arguments as the DSL takes them
    (pointer objects, ``cuda.CUstream``): used on a configuration's first call, for the check,
    and on every call where the check failed.
    """

    def __init__(self, compiled, launcher, dsl_args: Callable[[list, list, int], list]):
        self.compiled = compiled
        self._dsl_args = dsl_args
        self._types = runtime_cell_types(launcher)
        self._local = threading.local()  # each thread writes its own cells
        self.fast = None  # unchecked; then whether the cells marshal as the DSL does

    def _cells(self) -> tuple:
        cells = getattr(self._local, "cells", None)
        if cells is None:
            values = [cell_type() for cell_type in self._types]
            cells = self._local.cells = (values, [ctypes.addressof(c) for c in values])
        return cells

    def _marshals_like_the_dsl(self, values: list, dsl_args: list) -> bool:
        exe_args, adapted = self.compiled.generate_execution_args(*dsl_args)
        if len(exe_args) != len(self._types) or len(values) != len(self._types):
            return False
        for exe_arg, cell_type, value in zip(exe_args, self._types, values):
            if cell_type.from_address(_address(exe_arg)).value != cell_type(value).value:
                return False
        del adapted  # kept alive until the comparison is done
        return True

    def __call__(self, addresses: list, scalars, stream: int):
        values = [*addresses, *scalars, stream]
        if self.fast is None:
            self.fast = self._marshals_like_the_dsl(values, self._dsl_args(addresses, scalars, stream))
        if not self.fast:
            self.compiled(*self._dsl_args(addresses, scalars, stream))
            return
        cells, cell_addresses = self._cells()
        for cell, value in zip(cells, values):
            cell.value = value
        self.compiled.run_compiled_program(cell_addresses)
