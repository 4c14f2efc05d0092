"""runner.build (a step planned and uploaded): the per-token inputs a step uploads (token ids,
positions, KV slots, query offsets, the rows whose logits are sampled), against the definitions
written out token by token."""

import random

import pytest

from flexsgl import LLM, SamplingParams
from flexsgl.cache.pool import DUMMY_PAGE
from flexsgl.scheduler import ScheduledBatch

PAGE = 16


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", load_format="dummy", device="cpu", page_size=PAGE, max_total_tokens=64 * PAGE,
               max_running_requests=8, compile=False)


def requests(llm, rng, lens):
    reqs = []
    for i, n in enumerate(lens):
        r = llm.make_request([rng.randrange(1, 400) for _ in range(n)], SamplingParams(max_new_tokens=4))
        r.pages = llm.allocator.alloc(-(-n // PAGE))
        rng.shuffle(r.pages)  # pages out of order, as after frees and reuse
        r.slot, r.num_scheduled_outputs = i, 1
        reqs.append(r)
    return reqs


def expected(reqs, starts, num_new):
    ids, pos, slots, offsets = [], [], [], []
    for r, s, n in zip(reqs, starts, num_new):
        offsets.append(len(pos))
        for p in range(s, s + n):
            ids.append(r.fill_ids[p])
            pos.append(p)
            slots.append(r.pages[p // PAGE] * PAGE + p % PAGE)
    return ids, pos, slots, offsets


def test_prefill_chunks_that_start_mid_page(llm):
    seed = random.randrange(1 << 30)  # conftest reports it on failure
    rng = random.Random(seed)
    reqs = requests(llm, rng, [37, 90, 5])
    starts, num_new = [0, 21, 3], [37, 50, 2]  # the second and third continue a chunked prefill mid-page
    samples = [True, False, True]
    step = llm.runner.build(ScheduledBatch("prefill", reqs, starts, num_new, samples))
    fb, n_sampled = step.fb, step.rows
    ids, pos, slots, offsets = expected(reqs, starts, num_new)
    assert fb.input_ids.tolist() == ids
    assert fb.positions.tolist() == pos
    assert fb.out_slots.tolist() == slots
    assert fb.q_offsets.tolist() == offsets
    assert fb.seq_lens.tolist() == [s + n for s, n in zip(starts, num_new)]
    last = [o + n - 1 for o, n, s in zip(offsets, num_new, samples) if s]
    assert fb.logits_index.tolist() == last and n_sampled == 2
    for r in reqs:
        llm.allocator.free(r.pages)


def test_decode_rows_and_padding(llm, monkeypatch):
    seed = random.randrange(1 << 30)  # conftest reports it on failure
    rng = random.Random(seed)
    reqs = requests(llm, rng, [40, 17, 63])
    for r in reqs:
        r.fill_ids = r.fill_ids + [1]  # the token each request decodes at position len - 1
    starts = [len(r.fill_ids) - 1 for r in reqs]
    monkeypatch.setattr(llm.runner.shape, "compiled", True)  # compiled steps pad the batch to a bucket
    step = llm.runner.build(ScheduledBatch("decode", reqs, starts, [1, 1, 1], [True] * 3))
    fb, n_sampled = step.fb, step.rows
    _, pos, slots, _ = expected(reqs, starts, [1, 1, 1])
    pad = fb.batch_size - len(reqs)
    assert pad == 1  # 3 -> the bucket of 4
    assert fb.positions.tolist() == pos + [0] * pad
    assert fb.out_slots.tolist() == slots + [DUMMY_PAGE * PAGE] * pad
    assert fb.q_offsets.tolist() == list(range(len(reqs) + pad))
    assert fb.logits_index.tolist() == list(range(len(reqs) + pad)) and n_sampled == 3
    for r in reqs:
        llm.allocator.free(r.pages)


def test_compiled_prefill_pads_a_lone_request(llm, monkeypatch):
    """A compiled prefill step of one request gets a one-token dummy row, and a step that samples
    nothing gets two dummy logits rows: no dimension the compiled step sees is 0 or 1."""
    seed = random.randrange(1 << 30)  # conftest reports it on failure
    rng = random.Random(seed)
    reqs = requests(llm, rng, [53])
    monkeypatch.setattr(llm.runner.shape, "compiled", True)
    for samples, n_logits in (([True], 1), ([False], 0)):
        step = llm.runner.build(ScheduledBatch("prefill", reqs, [0], [53], samples))
        fb, n_sampled = step.fb, step.rows
        ids, pos, slots, _ = expected(reqs, [0], [53])
        assert fb.batch_size == 2 and n_sampled == n_logits
        assert fb.input_ids.tolist() == ids + [0]
        assert fb.positions.tolist() == pos + [0]
        assert fb.out_slots.tolist() == slots + [DUMMY_PAGE * PAGE]
        assert fb.q_offsets.tolist() == [0, 53] and fb.q_lens.tolist() == [53, 1]
        assert fb.seq_lens.tolist() == [53, 1]
        assert fb.page_table[1].eq(DUMMY_PAGE).all()
        assert fb.logits_index.tolist()[:n_logits] == [52][:n_logits] and fb.logits_index.numel() == 2
    for r in reqs:
        llm.allocator.free(r.pages)
