"""StepLoop: the engine's step. Each `advance()` schedules and launches the next step, then reads
the step before it back and hands its tokens on, so the host's work on one step runs while the
device computes the next.

    advance:  schedule -> launch step k -> read back step k-1 -> its grammars -> (sample step k) -> its outputs

A step that samples a request with structured outputs is launched up to its logits (the runner's
`run_forward`): its token mask needs step k-1's tokens. Once they are back, the grammars of step
k-1's requests take their tokens, the scheduler records them, step k+1 is scheduled and planned,
the mask of step k is filled and step k sampled, and step k+1 is launched at once behind it (the
step launched ahead: the next `advance()` starts from it). Only then do step k-1's tokens go
through the output path (text, stop strings, callbacks), while the device computes step k+1. So
between a constrained step's forward and the next one the device waits for the upload and launch
alone; the read-back, the grammars, the scheduling and the mask run while step k's forward does.
A request that the output path ends has then been scheduled into step k+1 as well: its token
there is dropped, as a finished request's always is.

Every fault a request can be blamed for ends that request here (flexsgl/engine.py's docstring
lists them); what escapes kills the engine through its Health. The requests that finish are
collected in `done`, for the engine's next `step()` to return.
"""

from __future__ import annotations

import time

from flexsgl.errors import EngineDeadError, Health, describe
from flexsgl.log import logger
from flexsgl.output import OutputProcessor, follow_grammars
from flexsgl.request import FinishReason, Request
from flexsgl.runner import ModelRunner
from flexsgl.step.output import NONFINITE, DeferredStep
from flexsgl.sampling.grammar import GrammarQueue
from flexsgl.scheduler import Scheduler

COMPILE_WAIT_S = 0.01  # how long an idle step waits for a grammar being compiled
NONFINITE_ERROR = ("The model's logits for this request were not finite (NaN or infinity), so no token could be "
                   "sampled from them.")


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor, grammars: GrammarQueue,
                 health: Health, device):
        self.scheduler, self.runner, self.outputs, self.grammars = scheduler, runner, outputs, grammars
        self.health, self.device = health, device
        self.done: list[Request] = []  # finished, to be returned by the engine's next step()
        self.pending = None  # the launched step not yet read back
        # A step launched ahead, right behind a constrained step's sampling, for the next advance():
        # (batch, plan, StepOutput | DeferredStep | None, the reason its requests fail or None).
        self.ahead = None

    @property
    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished or self.pending is not None or self.ahead is not None
                or bool(self.done) or bool(self.grammars))

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.finish(req, reason, error)
        self.done.append(req)

    def finish_all(self, reqs: list[Request], error: str) -> None:
        for r in reqs:
            if not r.finished:
                self.finish(r, FinishReason.ERROR, error)

    def advance(self) -> BaseException | None:
        """Launch the next step (the one launched ahead, if any), then read back and hand out the
        previous one. Returns an interrupt raised by a callback, to be raised once the step is complete."""
        if self.ahead is not None:
            batch, plan, launched, failure = self.ahead
            self.ahead = None
        else:
            batch = self._schedule()
            plan, failure = self._plan(batch)
            launched, failure = self._launch(batch, plan, failure)
        deferred = launched if isinstance(launched, DeferredStep) else None
        pending, self.pending = self.pending, None if deferred is not None else launched
        interrupt = None
        if pending is not None:  # read the previous step while this one runs
            tokens = self._tokens(pending)
            allowed = ({} if tokens is None or not _constrained(pending.batch)
                       else follow_grammars(self._events_of(pending, tokens)))
            events = None if tokens is None else self._record(pending, tokens)
            if deferred is not None:
                nxt = self._schedule()
                nxt_plan, nxt_failure = self._plan(nxt)
                failure = self._sample(deferred, batch) or failure
                deferred = None
                if nxt is not None:
                    self.ahead = (nxt, nxt_plan, *self._launch(nxt, nxt_plan, nxt_failure))
            if events is not None:
                interrupt = self._hand_out(events, allowed)
        elif batch is None and self.scheduler.has_unfinished:
            raise self.health.kill("the scheduler has unfinished requests but nothing it can run")
        if deferred is not None:
            failure = self._sample(deferred, batch) or failure
        if failure is not None:  # after the previous step's tokens, which these requests may have
            self.finish_all(batch.requests, failure)
        if batch is None and pending is None:  # idle (but for grammars being compiled): wait a moment
            self.grammars.wait(COMPILE_WAIT_S)
        return interrupt

    def _schedule(self):
        """The next step's batch (None: nothing to run), once the compiled grammars' requests are queued."""
        self._admit_compiled()
        batch = self.scheduler.schedule()
        if batch is not None and batch.mode == "prefill":
            now = time.monotonic()
            for r in batch.requests:
                if r.scheduled_at is None:
                    r.scheduled_at = now
        return batch

    def _plan(self, batch):
        """(the host side of `batch`'s step, or None; the reason its requests fail, if planning failed)."""
        if batch is None:
            return None, None
        try:
            return self.runner.plan(batch), None
        except Exception as e:
            return None, self._step_failed(batch, e)

    def _launch(self, batch, plan, failure: str | None):
        """(the launched step: a StepOutput, or a DeferredStep where it samples a constrained request,
        or None; the reason its requests fail, if they do)."""
        if batch is None or failure is not None:
            return None, failure
        try:
            if _constrained(batch):
                return self.runner.run_forward(batch, plan), None
            return self.runner.run(batch, plan), None
        except EngineDeadError as e:  # a tensor-parallel rank died, or the ranks parted ways
            raise self.health.kill(str(e)) from e
        except Exception as e:  # uploading the batch, the forward pass, sampling
            return None, self._step_failed(batch, e)

    def _sample(self, deferred: DeferredStep, batch) -> str | None:
        """Fill the token mask of a step launched up to its logits, and sample it; the reason its
        requests fail, if they do."""
        try:
            sampled = [r for r, s in zip(batch.requests, batch.samples) if s]
            mask = self.grammars.fill_mask([r.grammar for r in sampled], self.device.type == "cuda")
            self.pending = self.runner.sample(deferred, mask)
        except Exception as e:
            return self._step_failed(batch, e)
        return None

    def _step_failed(self, batch, e: Exception) -> str:
        self.health.check_device(e, self.device)
        self.scheduler.unschedule(batch)
        logger.debug("step failed for requests %s", [r.request_id for r in batch.requests], exc_info=True)
        return f"The step that ran this request failed: {describe(e)}."

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar has compiled; a grammar that failed to compile ends its
        request with the reason."""
        compiled, failed = self.grammars.ready()
        for req in compiled:
            self.scheduler.add(req)
        for req, error in failed:
            self.scheduler.finish(req, FinishReason.ERROR, error)

    def _tokens(self, pending) -> list[int] | None:
        """A launched step's tokens, waited for; None if they cannot be read back (its requests end).
        A request whose logits were not finite ends here, its pages kept out of the prefix cache."""
        try:
            tokens = pending.tokens()
        except EngineDeadError as e:  # a tensor-parallel rank died while rank 0 waited
            raise self.health.kill(str(e)) from e
        except Exception as e:
            self.health.check_device(e, self.device)
            self.finish_all(pending.batch.requests, f"Reading back the step that ran this request failed: "
                                                    f"{describe(e)}.")
            return None
        for r, token in zip(_sampled(pending.batch), tokens):
            if token == NONFINITE and not r.finished:  # its pages may hold NaN: not cached, and zeroed
                self.runner.clear_pages(self.scheduler.finish(r, FinishReason.ERROR, NONFINITE_ERROR, cache=False))
                self.done.append(r)
        return tokens

    @staticmethod
    def _events_of(pending, tokens: list[int]) -> list[tuple[Request, int]]:
        """(request, token) for each request of the step that a token will reach (not finished)."""
        return [(r, t) for r, t in zip(_sampled(pending.batch), tokens) if not r.finished]

    def _record(self, pending, tokens: list[int]) -> list:
        """Record a step's tokens in their requests (the scheduler's part of handing them out, which
        the next step's scheduling needs): its TokenEvents."""
        batch = pending.batch
        for i, first, lps in pending.prompt_logprobs():
            req = batch.requests[i]
            have = len(req.prompt_logprobs)
            if first <= have:  # recomputed after a preemption: only what is new
                req.prompt_logprobs += lps[have - first:]
        return self.scheduler.process(batch, tokens, pending.logprobs)

    def _hand_out(self, events: list, allowed: dict[int, bool]) -> BaseException | None:
        """Hand a step's recorded tokens to the output path (flexsgl/output.py), its grammars already
        advanced (`allowed`), and finish the requests it ends; returns an interrupt raised by a
        callback."""
        endings, interrupt = self.outputs.process(events, allowed)
        for req, reason, error in endings:
            if not req.finished:
                self.finish(req, reason, error)
        return interrupt


def _sampled(batch) -> list[Request]:
    return [r for r, s in zip(batch.requests, batch.samples) if s]


def _constrained(batch) -> bool:
    return any(r.grammar is not None for r in _sampled(batch))
