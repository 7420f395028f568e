"""Which backend runs an operation: a table keyed by (operation, compute capability).

Backends are tried in the table's order; the first that is available on the device and supports
the call (dtypes, head dims) runs it. Availability is decided by importing the backend module
and asking it, once per device. ``backend=`` on a call, or ``CULA_BACKEND=cute|triton|torch`` in
the environment, picks one by name; a named backend that is unavailable is an error saying why.
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

OPERATIONS = ("prefill", "decode", "verify", "commit")
BACKENDS = ("cute", "triton", "torch")
_MODULES = {name: f"cula_serve.kernels.backends.{name}_backend" for name in BACKENDS}

# Preference per (operation, compute capability). Hopper gets its CuTe DSL kernels first; any
# other CUDA GPU (SM80+) the portable Triton kernels; everything else the torch reference.
_HOPPER = ("cute", "triton", "torch")
TABLE = {(op, (9, 0)): _HOPPER for op in OPERATIONS}
CUDA_DEFAULT = ("triton", "torch")
CPU_DEFAULT = ("torch",)


class BackendUnavailableError(RuntimeError):
    """A backend asked for by name cannot run on this device."""


def _device_key(device: torch.device):
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def preference(operation: str, device: torch.device) -> tuple[str, ...]:
    """Backends for ``operation`` on ``device``, best first."""
    capability = _device_key(device)
    if capability is None:
        return CPU_DEFAULT
    return TABLE.get((operation, capability), CUDA_DEFAULT)


@functools.lru_cache(maxsize=None)
def backend_status(name: str, device: torch.device):
    """(module, None) if backend ``name`` can run on ``device``, else (None, reason). Cached."""
    if name not in _MODULES:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    try:
        module = importlib.import_module(_MODULES[name])
    except ModuleNotFoundError as err:
        if err.name == _MODULES[name]:
            return None, f"not part of this build ({_MODULES[name]} does not exist)"
        return None, f"cannot import {err.name!r} ({err})"
    except ImportError as err:
        return None, f"import failed: {err}"
    reason = module.availability(device)
    return (None, reason) if reason else (module, None)


def requested_backend(backend: str | None) -> str | None:
    """The backend named by the call or, failing that, by ``CULA_BACKEND``; None for automatic."""
    name = backend if backend is not None else os.environ.get("CULA_BACKEND") or None
    if name is not None and name not in BACKENDS:
        source = "backend" if backend is not None else "CULA_BACKEND"
        raise ValueError(f"{source}: expected one of {BACKENDS}, got {name!r}")
    return name


def _operation_error(module, operation: str) -> str | None:
    """Why ``module`` cannot run ``operation`` at all (a backend lists the operations it has)."""
    if operation not in module.OPERATIONS:
        return f"has no {operation} kernels (it provides {', '.join(module.OPERATIONS)})"
    return None


def _call_error(module, operation: str, workload: dict | None) -> str | None:
    """Why ``module`` cannot run this particular call although it has the operation, the dtypes
    and the head dims (``module.call_error(operation, **workload)``, for backends whose kernels
    cover part of an operation; the others define no such hook)."""
    if workload is None or not hasattr(module, "call_error"):
        return None
    return module.call_error(operation, **workload)


def select(operation: str, device: torch.device, backend: str | None, supports, workload: dict | None = None):
    """Pick the backend module for a call.

    ``supports(module)`` returns None if the module can serve this call's dtypes and head dims,
    else the reason. ``workload`` describes the call (mode, N, T, HV; for a prefill also its
    tensors and backend options): a backend whose kernels cover part of an operation says what
    it cannot run (``module.call_error(operation, **workload)``). A named backend that cannot
    serve the call raises; in automatic mode the next one in the table's order is tried, and a
    backend that knows it is slower on such a call defers to the next one
    (``module.defers(operation, **workload)``).
    """
    name = requested_backend(backend)
    if name is not None:
        module, reason = backend_status(name, device)
        if module is None:
            raise BackendUnavailableError(f"backend {name!r} is not available on {device}: {reason}")
        reason = _operation_error(module, operation) or supports(module) or _call_error(module, operation, workload)
        if reason:
            raise ValueError(f"backend {name!r} cannot serve this call: {reason}")
        return module
    reasons = []
    candidates = preference(operation, device)
    for position, candidate in enumerate(candidates):
        module, reason = backend_status(candidate, device)
        reason = reason or _operation_error(module, operation) or supports(module) or _call_error(
            module, operation, workload)
        if not reason and workload is not None and position + 1 < len(candidates) and hasattr(module, "defers"):
            reason = module.defers(operation, **workload)
        if not reason:
            return module
        reasons.append(f"{candidate}: {reason}")
    raise ValueError(f"no backend can serve this {operation} call on {device}: " + "; ".join(reasons))


def automatic_backend(operation: str, device: torch.device, workload: dict | None = None) -> str:
    """Name of the backend automatic dispatch picks for ``operation`` with inputs every backend
    supports (bf16 q / k / v, K = V = 128): what benchmarks label cula-serve's rows with.
    ``workload`` (mode, N, T, HV, as ``select`` takes it) lets a backend defer a decode, verify or
    commit of that size; without it only the order and the operations count (a prefill's own
    checks need its tensors)."""
    return select(operation, device, None, lambda module: None, workload).NAME
