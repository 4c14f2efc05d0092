"""A step's sampling parameters: the host lists that go to the device in the runner's packed
uploads, then the SamplingTensors made from the uploaded views.

The optional parts (logit bias, allowed token ids, penalties, min_tokens, log-probabilities) cost
nothing in a step where no request uses them: their lists are empty and their tensors are not built.
Nor do the sampling parameters themselves where every row is greedy and nothing changes its logits:
the argmax needs none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from flexsgl.sampling.sampler import AllowedTokens, LogitBias, MinTokens, Penalties, SamplingTensors
from flexsgl.sampling.token_counts import TokenCounts

if TYPE_CHECKING:  # the requests are read, never made here: no import of flexsgl.request at run time
    from flexsgl.request import Request


def host_parts(sampled: list[Request], prefill: bool) -> tuple[dict, dict]:
    """(int64 parts, float32 parts) of the sampled requests' parameters, for step/inputs.upload."""
    sp = [r.sampling for r in sampled]
    if all(p.greedy and not p.penalized and p.min_tokens == 0 and not p.logit_bias and p.allowed_token_ids is None
           for p in sp):
        return {}, {}
    i64 = {"top_k": [p.top_k for p in sp], "seed": [r.rng_seed for r in sampled],
           "step": [r.num_scheduled_outputs - 1 for r in sampled]}
    f32 = {"temperature": [p.temperature for p in sp], "top_p": [p.top_p for p in sp], "min_p": [p.min_p for p in sp]}
    if any(p.penalized for p in sp):
        f32.update(presence=[p.presence_penalty for p in sp], frequency=[p.frequency_penalty for p in sp],
                   repetition=[p.repetition_penalty for p in sp])
        # A request's first sample after (re)admission rebuilds its slot's counts from its token lists.
        fresh = [r for r in sampled if prefill and r.sampling.penalized]
        i64.update(
            reset_slots=[r.slot for r in fresh],
            prompt_slots=_repeat([r.slot for r in fresh], [r.prompt_len for r in fresh]),
            prompt_ids=_concat([r.prompt_ids for r in fresh]),
            output_slots=_repeat([r.slot for r in fresh], [len(r.output_ids) for r in fresh]),
            output_ids=_concat([r.output_ids for r in fresh]))
    if any(p.min_tokens > 0 for p in sp):
        stops = [r.stop_ids for r in sampled]
        width = max(1, max(map(len, stops)))
        i64.update(min_tokens=[p.min_tokens for p in sp],
                   stop_ids=_concat([list(s) + [s[0] if s else 0] * (width - len(s)) for s in stops]),
                   has_stops=[int(bool(s)) for s in stops])
    if any(p.logit_bias for p in sp):
        i64.update(bias_rows=[row for row, p in enumerate(sp) for _ in p.logit_bias],
                   bias_ids=[t for p in sp for t, _ in p.logit_bias])
        f32.update(bias_values=[b for p in sp for _, b in p.logit_bias])
    if any(p.allowed_token_ids is not None for p in sp):
        rows = [row for row, p in enumerate(sp) if p.allowed_token_ids is not None]
        words = [sp[row].allowed_words for row in rows]
        width = max(len(w) for w in words)
        i64.update(allowed_rows=rows,
                   allowed_words=[w if len(w) == width else np.pad(w, (0, width - len(w))) for w in words])
    return i64, f32


@dataclass(frozen=True)
class HostFlags:
    """What the step's sampler decides on the host (no device tensor): rows sampled, whether all are
    greedy, whether any filters (top-k/p, min-p), and the most log-probabilities asked for (-1: none)."""

    rows: int
    all_greedy: bool
    any_filter: bool
    logprobs: int


def host_flags(sampled: list[Request]) -> HostFlags:
    sp = [r.sampling for r in sampled]
    asked = [p.logprobs for p in sp if p.logprobs is not None]
    return HostFlags(rows=len(sampled), all_greedy=all(p.greedy for p in sp),
                     any_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sp if not p.greedy),
                     logprobs=max(asked, default=-1))


def make_tensors(flags: HostFlags, i64: dict, f32: dict, counts: TokenCounts,
                 write_slots: torch.Tensor) -> SamplingTensors:
    """The SamplingTensors of a step from its uploaded views (host_parts' names) and host_flags."""
    penalties = min_tokens = bias = allowed = None
    if "presence" in f32:
        if i64["reset_slots"].numel():  # host metadata: no sync
                counts.reset(i64["reset_slots"], i64["prompt_slots"], i64["prompt_ids"], i64["output_slots"],
                         i64["output_ids"])
        token_counts, in_prompt = counts.rows(write_slots)
        penalties = Penalties(presence=f32["presence"], frequency=f32["frequency"], repetition=f32["repetition"],
                              counts=token_counts, in_prompt=in_prompt)
    if "min_tokens" in i64:
        min_tokens = MinTokens(min_tokens=i64["min_tokens"], stop_ids=i64["stop_ids"].view(flags.rows, -1),
                               has_stops=i64["has_stops"].bool())
    if "bias_rows" in i64:
        bias = LogitBias(rows=i64["bias_rows"], ids=i64["bias_ids"], values=f32["bias_values"])
    if "allowed_rows" in i64:
        rows = i64["allowed_rows"]
        allowed = AllowedTokens(rows=rows, words=i64["allowed_words"].view(rows.numel(), -1))
    return SamplingTensors(
        temperature=f32.get("temperature"), top_k=i64.get("top_k"), top_p=f32.get("top_p"), min_p=f32.get("min_p"),
        seed=i64.get("seed"), step=i64.get("step"), all_greedy=flags.all_greedy, any_filter=flags.any_filter,
        penalties=penalties, min_tokens=min_tokens, logprobs=flags.logprobs, logit_bias=bias, allowed=allowed,
    )


def _concat(lists: list[list[int]]) -> list:
    """One part made of several lists, as numpy arrays (how step/inputs.pack takes a part in pieces)."""
    return [np.asarray(x, dtype=np.int64) for x in lists] or [np.zeros(0, dtype=np.int64)]


def _repeat(values: list[int], counts: list[int]) -> list:
    return [np.repeat(np.asarray(values, dtype=np.int64), counts)]
