"""torch's CPU threads, sized to the cores this process may use, once, where an engine starts on the CPU.

torch sizes its intra-op thread pool from the machine (its OpenMP build takes the physical cores
of the host), which can be more than the cores the process may run on: those of its CPU affinity
(a container's cpuset, `taskset`: os.sched_getaffinity) and of its cgroup's CPU quota
(`cpu.max`). With more threads than cores, each parallel op waits at its end for threads that
are not running. `size_cpu_threads` lowers torch's thread count to those cores (shared among the
tensor-parallel ranks of one engine), never raises it, and leaves it alone where the user chose
it: OMP_NUM_THREADS or MKL_NUM_THREADS set, or torch.set_num_threads called after flexsgl was
imported (a count set before that import is taken as torch's own, and lowered only if it exceeds
the cores).
"""

from __future__ import annotations

import math
import os

import torch

from flexsgl.log import logger

ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" (microseconds) or "max PERIOD"

_threads_at_import = torch.get_num_threads()
_sized = False


def usable_cores(cpu_max: str = CPU_MAX) -> int:
    """The cores this process may use: its CPU affinity, capped by its cgroup's CPU quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cores = os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def size_cpu_threads(ranks: int = 1) -> int | None:
    """The first time an engine starts on the CPU in this process: lower torch's intra-op threads to
    the usable cores over `ranks` (at least one), unless the user chose the count (module
    docstring). Returns the count set, or None where it was left as it is."""
    global _sized
    if _sized:
        return None
    _sized = True
    current = torch.get_num_threads()
    if any(os.environ.get(name) for name in ENV) or current != _threads_at_import:
        return None
    cores = max(1, usable_cores() // ranks)
    if current <= cores:
        return None
    torch.set_num_threads(cores)
    logger.debug(f"torch CPU threads: {cores} (the cores this process may use), not {current}")
    return cores
