"""Tensor descriptors (Hopper's TMA) built on the device: when a tensor can take one, and the
scratch memory they are built in.

A kernel that walks one sequence builds a descriptor of that sequence's rows
(``tl.make_tensor_descriptor`` with the sequence's start as base and its length as the row
count): loads past the sequence's end read zeros and stores there are dropped, so packed varlen
needs no masks. On sm_90 the loads are asynchronous bulk copies into shared memory and the
stores leave from shared memory, which frees the registers that masked pointer loads hold; Triton
lowers the same code to pointer loads before sm_90 and runs it in the interpreter.
"""
from __future__ import annotations

import torch
import triton
from triton.runtime import _allocation

ALIGN = 16  # bytes: a descriptor's base address and its row strides


def descriptor_ready(*tensors: torch.Tensor) -> bool:
    """Whether every [T, H, D] tensor can be read (or written) through a descriptor at any token
    and head: last dim contiguous, base and every other stride a multiple of 16 bytes."""
    for x in tensors:
        size = x.element_size()
        if x.stride(-1) != 1 or x.data_ptr() % ALIGN:
            return False
        if any(s * size % ALIGN for s in x.stride()[:-1]):
            return False
    return True


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # the caching allocator's blocks are 512-byte aligned, above any alignment Triton asks for
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_scratch_allocator() -> None:
    """Device-built descriptors live in global scratch that Triton takes from the allocator set
    with ``triton.set_allocator``. Set one backed by torch's caching allocator (safe inside CUDA
    graph capture) unless the caller already set their own."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)
