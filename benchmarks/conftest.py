"""Comparison runs (pytest-benchmark): attention kernels per backend, the engine per backend, and peers.

Small shapes on a CPU, so CI runs the whole folder in seconds with `--benchmark-disable` (each
benchmark then runs once, and its output checks still run); real shapes when CUDA is present:

    python -m pytest benchmarks                                   # timings, one table per group
    python -m pytest benchmarks --benchmark-json=$OUT/bench.json  # and every figure as JSON
    python -m pytest benchmarks -k "decode and 32x4096"           # one shape

Benchmarks measure and check outputs (token counts, finite values); they never assert a timing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `tests.hf_models`
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common`, whichever way pytest was started

from common import DEVICE  # noqa: E402


@pytest.fixture(scope="session")
def bandwidth() -> float:
    from flexsgl.bench import copy_bandwidth

    return copy_bandwidth(DEVICE)


@pytest.fixture(autouse=True)
def record_as_measured(request):
    """With FLEXSGL_BENCH_LINES=PATH, append each benchmark's figures to PATH (JSON lines) as soon as
    it finishes: pytest-benchmark writes its JSON only at the end, and a run stopped at a time limit
    then keeps nothing. Every round's time is kept: a median can hide a round that compiled."""
    yield
    path = os.environ.get("FLEXSGL_BENCH_LINES")
    bench = request.node.funcargs.get("benchmark") if hasattr(request.node, "funcargs") else None
    stats = getattr(bench, "stats", None)
    if path and stats is not None and stats.stats.data:
        line = {"name": request.node.name, "group": bench.group, "median_s": stats.stats.median,
                "rounds": stats.stats.rounds, "rounds_s": list(stats.stats.data),
                "extra_info": bench.extra_info}
        with open(path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")
