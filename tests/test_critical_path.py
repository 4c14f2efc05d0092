"""flexsgl/bench/critical_path.py against hand-computed spans, and its shares against the span of
random overlapping kernels."""

import random

import pytest

from flexsgl.bench.critical_path import Launch, by_name, by_position, critical_path


def test_overlap_counts_once_and_a_gap_goes_to_the_kernel_after_it():
    # a: 0-10; b overlaps its end (5-12): 2 of its own; c after a gap (15-20): the gap's 3 and its 5;
    # d inside c (16-18): nothing. Given out of order.
    launches = critical_path([("c", 15, 20), ("a", 0, 10), ("d", 16, 18), ("b", 5, 12)])
    assert launches == [Launch("a", 10, 10), Launch("b", 2, 7), Launch("c", 8, 5), Launch("d", 0, 2)]
    assert by_name(launches + critical_path([("a", 30, 31)])) == {"a": (11, 2), "b": (2, 1), "c": (8, 1),
                                                                  "d": (0, 1)}


def test_shares_add_up_to_the_span():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kernels = []
    for i in range(200):
        start = rng.uniform(0, 1000)
        kernels.append((f"k{i % 7}", start, start + rng.expovariate(1 / 20)))
    span = max(end for _, _, end in kernels) - min(start for _, start, _ in kernels)
    launches = critical_path(kernels)
    assert sum(launch.share for launch in launches) == pytest.approx(span), f"seed={seed}"
    assert all(launch.share >= 0 for launch in launches), f"seed={seed}"
    assert sum(share for share, _ in by_name(launches).values()) == pytest.approx(span), f"seed={seed}"


def test_positions_average_steps_that_launched_the_same_kernels():
    steps = [Launch("gemv", 4, 5), Launch("attn", 2, 3), Launch("gemv", 6, 7), Launch("attn", 4, 9)]
    assert by_position(steps, 2) == [Launch("gemv", 5, 6), Launch("attn", 3, 6)]
    assert by_position(steps, 1) == steps
    assert by_position(steps, 3) is None  # 4 launches do not split into 3 steps
    assert by_position(steps[:2] + [Launch("attn", 1, 1), Launch("gemv", 1, 1)], 2) is None  # another order
