"""Zeroed tensors for the KV pools that cost nothing until they are used.

torch.zeros writes every byte. A pool on the CPU is sized for what the model's context can fill
(16384 tokens by default, cache/sizing.py: 3.8 GB for Qwen3-0.6B in float32, about 3 s to write
on the development CPU), though a short run touches a few pages of it. On the CPU `zeroed` takes
the memory zeroed from the operating system instead (numpy's zeros: calloc, whose large blocks are
fresh pages the kernel zeroes as they are first touched), so only the pages the engine writes are
ever paid for. On a GPU it is torch.zeros (a memset at the device's bandwidth).
"""

from __future__ import annotations

import math

import numpy as np
import torch

ALIGN = 64  # bytes, as torch's CPU allocator aligns


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A contiguous tensor of zeros of `shape` and `dtype` on `device` (module docstring)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    block = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    start = -block.ctypes.data % ALIGN
    return torch.from_numpy(block[start:start + nbytes]).view(dtype).view(shape)
