"""The scheduler under memory pressure: prefix sharing, eviction, preemption, chunked prefill, abort.

Every request must finish, greedy outputs must equal those of the same request run alone, and at
rest every page must be free or cached and unreferenced.
"""

import random

import pytest

from flexsgl import LLM, SamplingParams
from tests.hf_models import capture_logits, make_checkpoint, same_greedy_tokens
from tests.test_engine import assert_no_page_leak


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-load")
    seed = random.randrange(1 << 30)
    make_checkpoint("qwen3", path, seed)
    return str(path), seed


def workload(rng: random.Random, n: int):
    """Prompts made of a few shared heads plus random tails, so prefixes are shared page-wise."""
    heads = [[rng.randrange(300) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    prompts, params = [], []
    for _ in range(n):
        tail = [rng.randrange(300) for _ in range(rng.randrange(0, 12))]
        prompts.append((rng.choice(heads) + tail) or [1])
        params.append(SamplingParams(max_new_tokens=rng.randrange(1, 9), temperature=0.0))
    return prompts, params


def test_500_requests_under_memory_pressure_match_each_run_alone(model_dir, monkeypatch):
    path, seed = model_dir
    rng = random.Random(seed)
    prompts, params = workload(rng, 500)
    # 24 pages of 4 tokens: a few requests at a time, so the cache is evicted and requests preempted.
    llm = LLM(path, device="cpu", page_size=4, max_total_tokens=96, max_running_requests=12, max_num_batched_tokens=40)
    llm.allocator.shuffle(seed)
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["evicted_pages"] > 0 and stats["prefix_hit_tokens"] > 0, stats
    assert stats["finished_length"] + stats.get("finished_stop", 0) == len(prompts)
    assert_no_page_leak(llm)

    alone = LLM(path, device="cpu", page_size=4, max_total_tokens=4096, max_running_requests=1)
    for i, (p, sp, out) in enumerate(zip(prompts, params, outs)):
        ref = alone.generate([p], sp)[0]
        if out.token_ids != ref.token_ids:  # a near-tie? its logits, recorded (slowly) for this one
            with monkeypatch.context() as patch:
                seen = capture_logits(alone, patch)
                ref = alone.generate([p], sp)[0]
            assert same_greedy_tokens(out.token_ids, ref.token_ids, seen[ref.request_id]), \
                f"request {i} (seed={seed}, stats={stats})"
        assert out.finish_reason == ref.finish_reason and len(out.token_ids) == sp.max_new_tokens


def test_chunked_prefill_gives_the_same_tokens(model_dir, monkeypatch):
    path, seed = model_dir
    rng = random.Random(seed + 1)
    prompts = [[rng.randrange(300) for _ in range(rng.randrange(20, 200))] for _ in range(8)]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    chunked_llm = LLM(path, device="cpu", page_size=16, max_num_batched_tokens=24)
    chunked = chunked_llm.generate(prompts, sp)
    whole_llm = LLM(path, device="cpu", page_size=16)
    seen = capture_logits(whole_llm, monkeypatch)  # (it records every engine's sampling from here)
    whole = whole_llm.generate(prompts, sp)
    assert all(same_greedy_tokens(c.token_ids, w.token_ids, seen[w.request_id]) for c, w in zip(chunked, whole)), \
        f"seed={seed}"
    assert chunked_llm.stats()["prefill_steps"] >= sum(len(p) for p in prompts) // 24


@pytest.mark.parametrize("prefill_first", [False, True])
def test_prefill_first_decodes_the_whole_batch_once_every_prompt_is_in(model_dir, prefill_first, monkeypatch):
    """By default a decode step follows each prefill step while requests decode; with prefill_first
    every prompt is prefilled (in chunks) before the first decode step, which runs them all. The
    tokens are those of one unchunked prefill either way."""
    path, seed = model_dir
    rng = random.Random(seed + 5)
    prompts = [[rng.randrange(300) for _ in range(rng.randrange(20, 100))] for _ in range(6)]
    sp = SamplingParams(max_new_tokens=5, temperature=0.0)
    llm = LLM(path, device="cpu", page_size=16, max_num_batched_tokens=24, prefill_first=prefill_first)
    steps, schedule = [], llm.scheduler.schedule

    def recorded():
        batch = schedule()
        if batch is not None:
            steps.append((batch.mode, len(batch.requests)))
        return batch

    llm.scheduler.schedule = recorded
    outs = llm.generate(prompts, sp)
    first_decode = [m for m, _ in steps].index("decode")
    last_prefill = max(i for i, (m, _) in enumerate(steps) if m == "prefill")
    if prefill_first:
        assert last_prefill < first_decode and steps[first_decode][1] == len(prompts), steps
    else:
        assert first_decode < last_prefill, steps
    whole_llm = LLM(path, device="cpu", page_size=16)
    seen = capture_logits(whole_llm, monkeypatch)
    whole = whole_llm.generate(prompts, sp)
    assert all(same_greedy_tokens(o.token_ids, w.token_ids, seen[w.request_id]) for o, w in zip(outs, whole)), \
        f"seed={seed}"


def test_prefix_cache_reuses_pages_and_reports_cached_tokens(model_dir):
    path, seed = model_dir
    rng = random.Random(seed + 2)
    head = [rng.randrange(300) for _ in range(37)]
    llm = LLM(path, device="cpu", page_size=8)
    first = llm.generate([head + [5, 6]], SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    second = llm.generate([head + [7]], SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    assert first.cached_tokens == 0 and second.cached_tokens == 32  # 4 whole pages of the 37-token head
    fresh = LLM(path, device="cpu", page_size=8).generate([head + [7]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert second.token_ids == fresh[0].token_ids


def test_abort_running_and_waiting_requests(model_dir):
    path, seed = model_dir
    rng = random.Random(seed + 3)
    llm = LLM(path, device="cpu", page_size=8, max_running_requests=2)
    ids = [llm.add_request([rng.randrange(300) for _ in range(10)], SamplingParams(max_new_tokens=30))
           for _ in range(4)]
    outs = {}
    for _ in range(3):
        outs.update((o.request_id, o) for o in llm.step())
    llm.abort(ids[0])  # running by now
    llm.abort(ids[3])  # still waiting (two slots)
    while llm.has_unfinished:
        outs.update((o.request_id, o) for o in llm.step())
    assert outs[ids[0]].finish_reason == "abort" and 0 < len(outs[ids[0]].token_ids) < 30
    assert outs[ids[3]].finish_reason == "abort" and not outs[ids[3]].token_ids
    assert all(outs[i].finish_reason == "length" and len(outs[i].token_ids) == 30 for i in ids[1:3])
    assert_no_page_leak(llm)
