"""What the comparison runs share: the device, the workloads (small on a CPU, real on a GPU), timing helpers."""

from __future__ import annotations

import torch

from flexsgl import bench

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

# Engine workloads, the same for flexsgl (test_engine, test_peers) and its peers (test_peers).
if CUDA:
    MODEL = "qwen3-0.6b"  # dummy weights: the real shapes, seeded random values
    THROUGHPUT = {"num_prompts": 256, "input_len": (100, 1024), "output_len": (100, 1024)}
    LATENCY = {"batch_size": 1, "input_len": 1024, "output_len": 256}
    PEER = {"batch_size": 16, "input_len": 512, "output_len": 256}
    ROUNDS = 3  # timed rounds after one warm-up round (throughput: 1, its pass alone takes seconds)
else:
    MODEL = "tiny"
    THROUGHPUT = {"num_prompts": 6, "input_len": (16, 48), "output_len": (4, 12)}
    LATENCY = {"batch_size": 1, "input_len": 32, "output_len": 8}
    PEER = {"batch_size": 4, "input_len": 32, "output_len": 8}
    ROUNDS = 1  # timed rounds after one warm-up round


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def free_memory() -> None:
    """Between engines: drop the last one's memory and compiled graphs, and unfreeze the heap that
    flexsgl.bench.timed_pass froze (flexsgl bench's own routine)."""
    bench.free_memory(DEVICE)


def repeated(fn, inner: int):
    """A callable that runs `fn` `inner` times and waits for the device, and how it runs them.

    On CUDA the `inner` calls are captured once into a CUDA graph, so host launch overhead (large
    for compiled flex at small batch) does not count; a backend that cannot be captured falls back
    to back-to-back launches. On the CPU: plain calls.
    """
    if not CUDA:
        return (lambda: [fn() for _ in range(inner)]), "eager"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (and compile) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except Exception as e:  # noqa: BLE001 - any capture failure means: time it without a graph
        sync()

        def launches():
            for _ in range(inner):
                fn()
            sync()

        return launches, f"launches (capture failed: {type(e).__name__})"

    def replay():
        graph.replay()
        sync()

    return replay, "cuda-graph"


def per_call(benchmark, inner: int) -> float | None:
    """Median seconds per call of a `repeated` callable, or None when benchmarks are disabled."""
    stats = getattr(benchmark, "stats", None)
    return None if not stats else stats.stats.median / inner
