"""Where a profiled span of device time goes, kernel by kernel, overlap counted once.

With PDL a kernel starts while the one before it runs (flexsgl/kernels/launch.py), so kernel
durations overlap and their sum overstates the device's time. The critical path gives each kernel
its end less the latest end before it (kernels in start order): the shares add up to the span from
the first start to the last end, overlap counted once, and a gap (the device idle, waiting for the
host) goes to the kernel after it. tools/profile_step.py prints both from a torch.profiler trace.

    critical_path(kernels)       -> one Launch per kernel, in start order
    by_name(launches)            -> {name: (share, calls)} summed over the span
    by_position(launches, steps) -> each launch of one step averaged over `steps` steps that
                                    launched the same kernels (graph replays do), else None
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Iterable, NamedTuple


class Launch(NamedTuple):
    name: str
    share: float  # of the critical path: its end less the latest end before it
    duration: float  # its own end less its start


def critical_path(kernels: Iterable[tuple[str, float, float]]) -> list[Launch]:
    """Each kernel (name, start, end) with its critical-path share, in start order."""
    launches, last = [], None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        launches.append(Launch(name, end - (start if last is None else min(last, end)), end - start))
        last = end if last is None else max(last, end)
    return launches


def by_name(launches: list[Launch]) -> dict[str, tuple[float, int]]:
    """{kernel name: (summed critical-path share, calls)}."""
    share, calls = defaultdict(float), defaultdict(int)
    for launch in launches:
        share[launch.name] += launch.share
        calls[launch.name] += 1
    return {name: (share[name], calls[name]) for name in share}


def by_position(launches: list[Launch], steps: int) -> list[Launch] | None:
    """The launches of one step, each share and duration the mean over `steps` consecutive steps;
    None where the steps did not launch the same kernels in the same order."""
    if steps < 1 or len(launches) % steps:
        return None
    per_step = len(launches) // steps
    runs = [launches[i * per_step:(i + 1) * per_step] for i in range(steps)]
    if any([launch.name for launch in run] != [launch.name for launch in runs[0]] for run in runs):
        return None
    return [Launch(first.name, statistics.fmean(run[i].share for run in runs),
                   statistics.fmean(run[i].duration for run in runs)) for i, first in enumerate(runs[0])]
