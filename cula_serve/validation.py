"""Input checks shared by every Level-1 function.

Every public function validates its whole call before it launches anything, so a bad call raises
and leaves the pool bit-identical. A bad type or dtype raises ``TypeError``; a bad shape, device
or value raises ``ValueError``; both name the argument and say what was expected.

Two kinds of checks:
- metadata (types, dtypes, shapes, devices): always, they cost no device work;
- values (index ranges, repeats, cu_seqlens order, accepted lengths): these read tensor data,
  which on a GPU would synchronise the host and break CUDA-graph capture. They run when
  ``value_checks_enabled`` says so: ``CULA_CHECK_VALUES=auto`` (default) checks when the tensors
  are on the CPU, ``1`` always (except during graph capture), ``0`` never.
"""
from __future__ import annotations

import math
import os

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def value_checks_enabled(*tensors: torch.Tensor | None) -> bool:
    """Whether to check tensor values in this call (see the module docstring)."""
    mode = os.environ.get("CULA_CHECK_VALUES", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"CULA_CHECK_VALUES: expected 'auto', '0' or '1', got {mode!r}")
    if mode == "0":
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    if mode == "1":
        return True
    return all(t.device.type == "cpu" for t in tensors if t is not None)


def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_tensor(name: str, x, *, shape=None, dtypes=None, device=None, optional=False):
    """Check that ``x`` is a tensor with the given ``shape`` (a tuple; None entries match any
    size), one of ``dtypes`` and on ``device``. Returns ``x``. ``optional`` admits None."""
    if x is None:
        if optional:
            return None
        raise ValueError(f"{name}: required, got None")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")
    if shape is not None:
        ok = x.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, x.shape))
        if not ok:
            want = _fmt("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {_fmt(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {x.device}")
    return x


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def check_scale(scale, head_k_dim: int) -> float:
    """``None`` -> K ** -0.5; otherwise a finite real number."""
    if scale is None:
        return head_k_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return float(scale)


def check_slots(name: str, slots: torch.Tensor, num_slots: int, *, allow_padding=True):
    """Values of a slot-index tensor: every live entry (>= 0) in [0, num_slots) and not repeated."""
    live = slots[slots >= 0] if allow_padding else slots.flatten()
    if not allow_padding and bool((slots < 0).any()):
        raise ValueError(f"{name}: negative entries are not allowed here")
    if live.numel() and int(live.max()) >= num_slots:
        raise ValueError(f"{name}: slot {int(live.max())} out of range for a pool of {num_slots} slots")
    if live.numel() != live.unique().numel():
        raise ValueError(f"{name}: a live slot appears more than once (each row needs its own slot)")


def check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int):
    """Values of ``cu_seqlens``: starts at 0, non-decreasing, ends at the token count."""
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens: must start at 0, starts at {int(cu_seqlens[0])}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens: must be non-decreasing")
    if int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens: last entry {int(cu_seqlens[-1])} != number of tokens T = {num_tokens}")


def check_range(name: str, x: torch.Tensor, low: int, high: int):
    """Values of an integer tensor: all in [low, high]."""
    if x.numel() and (int(x.min()) < low or int(x.max()) > high):
        raise ValueError(f"{name}: values must lie in [{low}, {high}], got [{int(x.min())}, {int(x.max())}]")
