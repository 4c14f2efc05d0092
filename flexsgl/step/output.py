"""A launched step on its way to the host: its sampled tokens (and log-probabilities) copied back
asynchronously (StepOutput), or, for a step sampled under a token mask, its forward half waiting for
the mask (DeferredStep). flexsgl/runner.py makes both; flexsgl/step_loop.py reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from flexsgl.request import TokenLogprobs
from flexsgl.scheduler import ScheduledBatch
from flexsgl.step.inputs import StepInputs
from flexsgl.step.plan import StepPlan

# The token read back for a row whose logits held NaN or infinity: no token could be sampled from them.
NONFINITE = -1


@dataclass
class StepOutput:
    """A launched step's sampled tokens on their way to the host: token ids [S] int64, or, when a
    request asked for log-probabilities, token_logprobs' packed rows [S, 3 + 2k] float32."""

    batch: ScheduledBatch
    host_tokens: torch.Tensor
    ready: torch.cuda.Event | None
    logprobs: list[TokenLogprobs | None] | None = None  # per sampled row, set by tokens()
    wait: Callable[[torch.cuda.Event], None] | None = None  # how to wait for `ready` (default: synchronize)
    host_prompt: torch.Tensor | None = None  # prompt tokens' packed token_logprobs rows [P, 3 + 2k]
    plan: StepPlan | None = None  # where host_prompt's rows belong

    def prompt_logprobs(self) -> list[tuple[int, int, list[TokenLogprobs]]]:
        """After tokens(): per request asking for them, (its index in the batch, the index of its first
        prompt token here, their TokenLogprobs)."""
        if self.host_prompt is None:
            return []
        rows, k, out, at = self.host_prompt.tolist(), self.plan.prompt_k, [], 0
        for i, first, n in self.plan.prompt_spans:
            want = self.batch.requests[i].sampling.prompt_logprobs
            out.append((i, first, [_token_logprobs(row, k, want) for row in rows[at:at + n]]))
            at += n
        return out

    def tokens(self) -> list[int]:
        """Wait for the step (the one read-back per step) and return its tokens."""
        if self.ready is not None:
            self.ready.synchronize() if self.wait is None else self.wait(self.ready)
        if self.host_tokens.dim() == 1:
            return self.host_tokens.tolist()
        rows = self.host_tokens.tolist()
        k = (len(rows[0]) - 3) // 2
        sampled = [r for r, s in zip(self.batch.requests, self.batch.samples) if s]
        self.logprobs = [None if r.sampling.logprobs is None else _token_logprobs(row, k, r.sampling.logprobs)
                         for r, row in zip(sampled, rows)]
        return [int(row[0]) for row in rows]


def _token_logprobs(row: list[float], k: int, want: int) -> TokenLogprobs:
    """One packed token_logprobs row (k top entries) as TokenLogprobs with the `want` most likely."""
    return TokenLogprobs(int(row[0]), row[1], [(int(t), v) for t, v in zip(row[2 + k:2 + k + want], row[2:])],
                         int(row[2 + 2 * k]))


@dataclass
class DeferredStep:
    """A step launched up to its logits (ModelRunner.run_forward), to be sampled once its token mask
    is filled (ModelRunner.sample)."""

    batch: ScheduledBatch
    plan: StepPlan
    step: StepInputs
    logits: torch.Tensor
    greedy: torch.Tensor | None
