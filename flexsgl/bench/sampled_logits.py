"""The logits each request's tokens were sampled from, per request id in step order (rank 0's: the
whole vocabulary under tensor parallelism), recorded by wrapping the engine's step launch and the
sampler. For accuracy tools (tools/fp8_agreement.py) and the tests that compare logits."""

from __future__ import annotations

from typing import Callable

import torch

import flexsgl.runner


def logit_recorder(llm) -> tuple[dict[int, list[torch.Tensor]], Callable, Callable]:
    """(per request id, the logits its tokens were drawn from, in step order, on the device; a
    wrapped `llm.runner.run`; a wrapped `flexsgl.runner.sample`). Installing both records; the
    caller puts the originals back."""
    per_req: dict[int, list[torch.Tensor]] = {}
    step_reqs: list[list[int]] = []
    real_sample, real_run = flexsgl.runner.sample, llm.runner.run

    def run(batch, plan=None):
        step_reqs.append([r.request_id for r, s in zip(batch.requests, batch.samples) if s])
        plan = llm.runner.plan(batch) if plan is None else plan
        plan.keep_logits = True  # under tensor parallelism a greedy step would gather none
        return real_run(batch, plan)

    def sample(logits, st, argmax=None):
        for row, rid in enumerate(step_reqs[-1]):
            per_req.setdefault(rid, []).append(logits[row].detach().clone())
        return real_sample(logits, st, argmax)

    return per_req, run, sample
