"""The host side of a step: a ScheduledBatch as a StepPlan, every list the device needs.

The shapes come from the step's StepShape (flexsgl/step_shape.py): how many rows, how wide the page table goes
up, whether the step replays a CUDA graph. Padding rows are made here and nowhere else: one token
each at position 0, written to the dummy page and attending only to it (a one-page table, length
1), its input read from and its output written to the token buffer's pad slot. A plan holds only
host values, so it pickles: under tensor parallelism rank 0 makes it and every rank uploads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from flexsgl.sampling import batch as sampling_batch
from flexsgl.cache.pool import DUMMY_PAGE
from flexsgl.scheduler import ScheduledBatch
from flexsgl.step_shape import StepShape


@dataclass
class StepPlan:
    """One step as host lists (picklable): what inputs.upload turns into device tensors."""

    mode: str
    graphed: bool  # replays a CUDA graph: its inputs go into the graph's own buffers
    tables: list[list[int]]  # page table rows, padding rows included
    width: int  # the uploaded table's width
    seq_lens: list[int]
    q_lens: list[int]
    offsets: list[int]
    ids: list  # token ids to feed (prefill; decode feeds the token buffer's entries at decode_slots)
    positions: list
    slots: list  # KV slot of each token
    logits_index: list[int]
    decode_slots: list[int]
    write_slots: list[int]  # token buffer slot of each sampled row
    sampling_i64: dict
    sampling_f32: dict
    flags: sampling_batch.HostFlags
    num_kv_pages: int
    # Prefill: the attention variants' per-request parameters of its requests (bound_variant.py),
    # written at their slots: {name: values}, integers and floats apart
    variant_i64: dict = field(default_factory=dict)
    variant_f32: dict = field(default_factory=dict)
    # Prompt log-probabilities (prefill): the next prompt token of each logits row after the sampled
    # ones, the most top log-probabilities asked for, and per request (its index in the batch, the
    # index of its first target token, how many).
    prompt_targets: list[int] = ()
    prompt_k: int = 0
    prompt_spans: list[tuple[int, int, int]] = ()
    # Gather the whole logits under tensor parallelism even where the rows could race their slices
    # (a step sampled under a token mask; flexsgl/bench/sampled_logits.py, to record them)
    keep_logits: bool = False
    # Pages to zero on every rank before the step: a finished request's whose logits were not
    # finite (its K/V may hold NaN, and masked slots still enter attention as 0 * v)
    clear_pages: list[int] = ()


def plan_step(batch: ScheduledBatch, shape: StepShape, page_size: int, pad_slot: int,
              rows: int | None = None, variants=None) -> StepPlan:
    """The plan of `batch`, padded as `shape` says (or to `rows` rows); `variants`: the engine's
    VariantSet, whose per-request parameters a prefill step writes."""
    ps = page_size
    reqs, decode = batch.requests, batch.mode == "decode"
    n_real = len(reqs)
    rows = shape.rows(batch.mode, n_real) if rows is None else rows
    pad = rows - n_real
    tables = [r.pages for r in reqs] + [[DUMMY_PAGE]] * pad
    seq_lens = [s + n for s, n in zip(batch.starts, batch.num_new)] + [1] * pad
    q_lens = list(batch.num_new) + [1] * pad
    if decode:  # one token per request, at its next position
        ids, positions = [], list(batch.starts) + [0] * pad
        slots = [r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, batch.starts)] + [DUMMY_PAGE * ps] * pad
        offsets = list(range(rows))
    else:  # thousands of tokens: per-request numpy ranges (a per-token loop cost ~1.3 ms per 8k tokens)
        one = np.zeros(1, dtype=np.int64)
        ids = [np.asarray(r.fill_ids[s:s + n]) for r, s, n in zip(reqs, batch.starts, batch.num_new)] + [one] * pad
        positions = [np.arange(s, s + n) for s, n in zip(batch.starts, batch.num_new)] + [one] * pad
        slots = ([np.asarray(r.pages)[p // ps] * ps + p % ps for r, p in zip(reqs, positions)]
                 + [one + DUMMY_PAGE * ps] * pad)
        offsets = [0, *accumulate(q_lens)][:-1]
    sampled = [r for r, s in zip(reqs, batch.samples) if s]
    prompt_rows, prompt_targets, prompt_spans = ([], [], []) if decode else _prompt_logprob_rows(batch, offsets)
    n_logits = shape.logits_rows(batch.mode, rows, len(sampled) + len(prompt_rows))
    if decode:
        logits_index = list(range(n_logits))
    else:  # rows past the sampled ones (and the prompt log-probabilities' rows) are computed and dropped
        last = [o + n - 1 for o, n, s in zip(offsets, q_lens, batch.samples) if s] + prompt_rows
        logits_index = last + [offsets[-1]] * (n_logits - len(last))
    sampling_i64, sampling_f32 = sampling_batch.host_parts(sampled, not decode)
    variant_i64, variant_f32 = {}, {}
    if variants is not None and not decode:
        for name, values in variants.host_values(reqs).items():
            floating = variants.request_tensors[name].is_floating_point()
            (variant_f32 if floating else variant_i64)[f"variant_{name}"] = values
    return StepPlan(
        mode=batch.mode, graphed=shape.graphed(batch.mode, rows), tables=tables,
        width=shape.table_width(batch.mode, rows, max(map(len, tables))), seq_lens=seq_lens, q_lens=q_lens,
        offsets=offsets, ids=ids, positions=positions, slots=slots, logits_index=logits_index,
        decode_slots=[r.slot for r in reqs] + [pad_slot] * pad, write_slots=[r.slot for r in sampled],
        sampling_i64=sampling_i64, sampling_f32=sampling_f32, flags=sampling_batch.host_flags(sampled),
        num_kv_pages=shape.kv_pages(tables), variant_i64=variant_i64, variant_f32=variant_f32,
        prompt_targets=prompt_targets, prompt_spans=prompt_spans,
        prompt_k=max((reqs[i].sampling.prompt_logprobs for i, _, _ in prompt_spans), default=0))


def _prompt_logprob_rows(batch: ScheduledBatch, offsets: list[int]) -> tuple[list[int], list[int], list]:
    """For the requests that want their prompt's log-probabilities: the packed token rows of this
    chunk whose logits predict a prompt token still unreported, those tokens, and the spans."""
    rows, targets, spans = [], [], []
    for i, (r, s, n) in enumerate(zip(batch.requests, batch.starts, batch.num_new)):
        if r.prompt_logprobs is None:
            continue
        lo, hi = max(s, len(r.prompt_logprobs) - 1), min(s + n, r.prompt_len - 1)
        if lo < hi:
            rows += range(offsets[i] + lo - s, offsets[i] + hi - s)
            targets += r.prompt_ids[lo + 1:hi + 1]
            spans.append((i, lo + 1, hi - lo))
    return rows, targets, spans


def padding_plan(rows: int, shape: StepShape, page_size: int, pad_slot: int) -> StepPlan:
    """A decode step of `rows` padding rows alone (what a CUDA graph is captured on)."""
    return plan_step(ScheduledBatch("decode", [], [], [], []), shape, page_size, pad_slot, rows)
