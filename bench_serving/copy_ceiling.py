"""The copy ceiling of a decode step: its state bytes (one read, one write) copied under the same
CUDA-graph replay and L2 flush as the kernels, so that the bandwidth targets are measured in the
same run rather than quoted. Imported only where a GPU runs (Triton comes with CUDA torch)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .timing import time_graph


@triton.jit
def _streaming_copy_kernel(source, target, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(source + offsets, mask=mask, cache_modifier=".cg")
    tl.store(target + offsets, values, mask=mask, cache_modifier=".cs")


def _streaming_copy(source: torch.Tensor, target: torch.Tensor, block: int = 4096):
    _streaming_copy_kernel[(triton.cdiv(source.numel(), block),)](source, target, source.numel(), BLOCK=block,
                                                                  num_warps=8)


def copy_ceiling(elements: int, dtype: torch.dtype, device: torch.device, layers: int = 1) -> float:
    """Milliseconds to copy ``elements`` values of ``dtype`` between two buffers on ``device``:
    the faster of ``Tensor.copy_`` and a streaming Triton copy (on an H200, ``copy_`` of 512 MiB
    ran at 2.7 TB/s, below the decode kernels that move the same bytes). ``layers`` > 1: that many
    copies, each between its own buffers, in one graph; the time per copy."""
    pairs = []
    for _ in range(layers):
        source = torch.randn(elements, device=device).to(dtype)
        pairs.append((source, torch.empty_like(source)))
    copies = (lambda: [target.copy_(source) for source, target in pairs],
              lambda: [_streaming_copy(source, target) for source, target in pairs])
    return min(time_graph(copy, device) for copy in copies) / layers
