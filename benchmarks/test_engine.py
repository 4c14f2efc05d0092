"""The engine per attention backend: offline throughput and batch latency (the `flexsgl bench` workloads).

Each round runs fresh random prompts (no prefix-cache hits) through `flexsgl.bench.timed_pass`,
which drives the engine's step API with a device synchronize at both ends; the first round (a
warm-up, on CUDA) compiles the shapes. extra_info carries tokens/s, and for latency TTFT, TPOT and
the percentage of the decode floor (see flexsgl/bench/roofline.py).
"""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
from common import DEVICE, LATENCY, MODEL, ROUNDS, THROUGHPUT, free_memory

from flexsgl import LLM
from flexsgl.attention.registry import check_override
from flexsgl.bench import decode_floor, random_prompts, timed_pass

OVERRIDES = ["flex", "fa3", "fi", "fa3-prefill,fi-decode", "fi-decode", "auto"]  # fi-decode: flex prefill


@pytest.fixture(scope="module", params=OVERRIDES)
def llm(request):
    override = request.param
    try:
        label = check_override(override, DEVICE)
    except ValueError as e:
        pytest.skip(str(e))
    if override == "auto" and label in OVERRIDES:
        pytest.skip(f"auto is {label} here, measured under that name")
    engine = LLM(MODEL, device=DEVICE.type, load_format="dummy", override=override)
    engine.override = label
    yield engine
    del engine
    free_memory()


def rounds(benchmark, llm, in_lens, out_lens, n_rounds=ROUNDS):
    """Time timed_pass on fresh prompts each round; returns the last round's result."""
    seeds = itertools.count(1)

    def fresh():
        prompts = random_prompts(random.Random(next(seeds)), in_lens, llm.config.vocab_size)
        return (llm, prompts, out_lens, "", False), {}

    res = benchmark.pedantic(timed_pass, setup=fresh, rounds=n_rounds, warmup_rounds=1)
    assert [len(o.token_ids) for o in res["outputs"]] == out_lens  # EOS is ignored: every request runs out
    assert all(o.cached_tokens == 0 for o in res["outputs"])
    return res


def median_s(benchmark, res) -> float:
    stats = getattr(benchmark, "stats", None)
    return stats.stats.median if stats else res["wall_s"]


def test_throughput(benchmark, llm):
    rng = random.Random(0)
    n = THROUGHPUT["num_prompts"]
    in_lens = [rng.randint(*THROUGHPUT["input_len"]) for _ in range(n)]
    out_lens = [rng.randint(*THROUGHPUT["output_len"]) for _ in range(n)]
    benchmark.group = "engine throughput"
    res = rounds(benchmark, llm, in_lens, out_lens, n_rounds=1)
    wall = median_s(benchmark, res)
    benchmark.extra_info.update({"backends": llm.override, "model": MODEL, **THROUGHPUT,
                                 "output_tokens_per_s": sum(out_lens) / wall,
                                 "total_tokens_per_s": (sum(in_lens) + sum(out_lens)) / wall,
                                 "requests_per_s": n / wall})


def test_latency(benchmark, llm, bandwidth):
    b, n_in, n_out = LATENCY["batch_size"], LATENCY["input_len"], LATENCY["output_len"]
    benchmark.group = "engine latency"
    res = rounds(benchmark, llm, [n_in] * b, [n_out] * b)
    tpot = statistics.mean(res["tpot_s"])
    floor = decode_floor(llm, b, n_in + n_out / 2, bandwidth)
    benchmark.extra_info.update({"backends": llm.override, "model": MODEL, **LATENCY,
                                 "ttft_s": statistics.mean(res["ttft_s"]), "tpot_s": tpot,
                                 "tokens_per_s": b * n_out / median_s(benchmark, res),
                                 "floor_tpot_s": floor["floor_tpot_s"],
                                 "pct_of_floor": 100 * floor["floor_tpot_s"] / tpot})
