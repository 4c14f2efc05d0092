"""Timing device work without host overhead: calls captured in one CUDA graph, CUDA events around
each replay."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_median_s(fn: Callable[[], object], inner: int = 1, rounds: int = 20) -> float:
    """Median seconds per call of `fn`: `inner` calls recorded in one CUDA graph (after warm-up calls
    on a side stream, where compiling and lazy set-up happen), replayed `rounds` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)
