"""Comparison runs (pytest-benchmark): attention kernels per backend, the engine per backend, and peers.

Small shapes on a CPU, so CI runs the whole folder in seconds with `--benchmark-disable` (each
benchmark then runs once, and its output checks still run); real shapes when CUDA is present:

    python -m pytest benchmarks                                   # timings, one table per group
    python -m pytest benchmarks --benchmark-json=$OUT/bench.json  # and every figure as JSON
    python -m pytest benchmarks -k "decode and 32x4096"           # one shape

Benchmarks measure and check outputs (token counts, finite values); they never assert a timing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `tests.hf_models`
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common`, whichever way pytest was started

from common import DEVICE  # noqa: E402


@pytest.fixture(scope="session")
def bandwidth() -> float:
    from flexsgl.bench_env import copy_bandwidth

    return copy_bandwidth(DEVICE)
