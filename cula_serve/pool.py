"""The paged recurrent-state pool: per layer a tensor ``[P, HV, V, K]`` addressed by slot.

Layout is K-last: ``pool[slot, hv, v, k] == S[k, v]`` for the math's state S in R^{K x V}
(DESIGN section 3). Slots are handed to sequences by ``alloc`` and returned by ``free``; kernels
read and write them through ``state_indices``. Engines that own their memory keep it and pass
the raw tensors to the API directly; ``StatePool.wrap`` gives such tensors the slot bookkeeping.
"""
from __future__ import annotations

import torch

STATE_DTYPES = (torch.float32, torch.bfloat16)


def k_first_to_k_last(states: torch.Tensor) -> torch.Tensor:
    """``[..., K, V]`` (FLA's older and vLLM Lightning's layout) -> contiguous ``[..., V, K]``."""
    return states.transpose(-1, -2).contiguous()


def k_last_to_k_first(states: torch.Tensor) -> torch.Tensor:
    """``[..., V, K]`` (the pool's layout) -> contiguous ``[..., K, V]``."""
    return states.transpose(-1, -2).contiguous()


class StatePool:
    """Slots of recurrent state for ``num_layers`` layers, each layer a ``[P, HV, V, K]`` tensor.

    Args:
        num_slots:   P, the number of sequences that can hold a state at once.
        num_heads:   HV, value heads held by this rank (local heads under tensor parallelism).
        head_v_dim, head_k_dim: V and K.
        num_layers:  linear-attention layers sharing the slot numbering.
        dtype:       torch.float32 or torch.bfloat16 (arithmetic is float32 either way).
        device:      where the states live.

    Example::

        pool = StatePool(256, num_heads=32, head_v_dim=128, head_k_dim=128, num_layers=48,
                         device="cuda")
        slots = pool.alloc(4)                 # int32 [4] on the pool's device, zeroed in every layer
        o, _ = cula_gdn(q, k, v, g, beta, cu_seqlens=cu, state_pool=pool.layer(0), state_indices=slots)
        pool.free(slots)
    """

    def __init__(self, num_slots: int, num_heads: int, head_v_dim: int, head_k_dim: int, *,
                 num_layers: int = 1, dtype: torch.dtype = torch.float32, device=None):
        for name, value in (("num_slots", num_slots), ("num_heads", num_heads), ("head_v_dim", head_v_dim),
                            ("head_k_dim", head_k_dim), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value}")
        if dtype not in STATE_DTYPES:
            raise TypeError(f"dtype: expected torch.float32 or torch.bfloat16, got {dtype}")
        tensors = [torch.zeros(num_slots, num_heads, head_v_dim, head_k_dim, dtype=dtype, device=device)
                   for _ in range(num_layers)]
        self._init(tensors)

    @classmethod
    def wrap(cls, tensors) -> "StatePool":
        """Slot bookkeeping over tensors an engine allocated: one ``[P, HV, V, K]`` per layer
        (any strides, e.g. vLLM's padded pages), all with the same P. Nothing is copied."""
        tensors = list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors]
        if not tensors:
            raise ValueError("tensors: expected at least one [P, HV, V, K] tensor")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}]: expected a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"tensors[{i}]: expected shape [P, HV, V, K], got {list(t.shape)}")
            if t.dtype not in STATE_DTYPES:
                raise TypeError(f"tensors[{i}]: expected float32 or bfloat16, got {t.dtype}")
            if t.shape[0] != tensors[0].shape[0]:
                raise ValueError(f"tensors[{i}]: {t.shape[0]} slots, but tensors[0] has {tensors[0].shape[0]}")
        pool = cls.__new__(cls)
        pool._init(tensors)
        return pool

    def _init(self, tensors):
        self._tensors = tensors
        self._free = list(range(tensors[0].shape[0] - 1, -1, -1))  # pop() hands out slot 0 first
        self._in_use = set()

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The raw per-layer ``[P, HV, V, K]`` tensors (engines that own memory use these)."""
        return self._tensors

    def layer(self, index: int) -> torch.Tensor:
        """The raw ``[P, HV, V, K]`` tensor of one layer."""
        return self._tensors[index]

    @property
    def num_slots(self) -> int:
        return self._tensors[0].shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def device(self) -> torch.device:
        return self._tensors[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self._tensors[0].dtype

    def alloc(self, n: int = 1) -> torch.Tensor:
        """Take ``n`` free slots, zero them in every layer, return them as int32 [n] on the pool's device."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected a non-negative int, got {n!r}")
        if n > len(self._free):
            raise RuntimeError(f"pool exhausted: asked for {n} slots, {len(self._free)} free of {self.num_slots}")
        taken = [self._free.pop() for _ in range(n)]
        self._in_use.update(taken)
        slots = torch.tensor(taken, dtype=torch.int32, device=self.device)
        for t in self._tensors:
            t[slots.long()] = 0
        return slots

    def free(self, slots) -> None:
        """Return slots (a tensor or sequence of ints) to the pool. Freeing a slot that is not in
        use is an error, and then nothing is freed."""
        ids = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        bad = [s for s in ids if s not in self._in_use]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"slots: not allocated or repeated: {bad or ids}")
        self._in_use.difference_update(ids)
        self._free.extend(reversed(ids))
