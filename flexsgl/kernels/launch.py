"""How flexsgl's own Triton kernels (gemv.py, rope_store.py, triton-decode's split_kv_decode, the
latent and MoE kernels) launch: with programmatic dependent launch (PDL) on SM90 and newer.

A decode step at batch 1 is a chain of short kernels, and each one would otherwise start only after
the one before has drained: the GPU idles through every launch and every memory pipeline's first
load. With PDL a kernel is launched while its predecessor still runs. It does what depends on no
earlier kernel first (the projection kernel starts loading its weight), then `gdc_wait()`, which
returns once the predecessor has finished and its writes are visible; everything that reads
another kernel's output, and every write, comes after it. The kernel then calls
`gdc_launch_dependents()` so the next kernel may start the same way. CUDA graphs keep these edges.
Inductor's own kernels in compiled code launch the same way (compile.settings turns on its
`triton.enable_pdl`; flex's attention templates it leaves plain): each waits before it reads what
the kernel before it wrote and signals its dependents after that wait, as these do, so a kernel two
launches back has always finished. Set FLEXSGL_PDL=0 to launch plainly (for comparison runs).
"""

from __future__ import annotations

import functools
import os

import torch


def allowed() -> bool:
    """Whether PDL is allowed at all (FLEXSGL_PDL is not 0)."""
    return os.environ.get("FLEXSGL_PDL", "1") != "0"


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability 9 or higher, not turned off."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9 and allowed()
