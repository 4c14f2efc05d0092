"""The output path: from the tokens a step sampled to each request's text, its stop, its callback
and, once it has finished, its RequestOutput.

Scheduler.process records each sampled token in its request (`output_ids`) and hands on one
TokenEvent per token; OutputProcessor.process takes them in batch order. For each token:

1. its log-probabilities are kept, when the request asked for them;
2. stop tokens and length: EOS (unless ignore_eos) and stop_token_ids end the output ("stop", with
   the id as `stop_reason` for a stop_token_id), and so does the max_new_tokens-th token
   ("length"). min_tokens needs nothing here: the sampler never picks a stop token before it;
   a request with structured outputs has handed the token to its grammar's matcher before
   (follow_grammars: every such token of the step in one call, done first so that the next
   step's token mask need not wait for the rest of this path), and ends ("stop") once its
   grammar is complete and allows nothing more (a grammar that refuses the token ends it with
   reason "error");
3. the text (TextState) grows by what the token completes; a stop string in that text ends the
   output there ("stop", with the string as `stop_reason`), from the min_tokens-th token on, the
   token that reached max_new_tokens included; a stop token (EOS, stop_token_ids) adds no text of
   its own unless include_stop_str_in_output (as vLLM), and no stop string is looked for after it;
4. the on_token callback runs and sees the decision (`finish_reason`, `stop_reason`). A callback
   may abort requests (LLM.abort): its own ends there with reason "abort"; one it aborts whose token
   comes later in the step takes that token's text and log-probabilities, and nothing more.

The requests that end come back as Endings, for the engine to finish in the scheduler. A callback
that raises ends its own request with reason "error"; a KeyboardInterrupt or SystemExit from a
callback is handed back, to be raised once the step is complete. Text that cannot be decoded
stops the request's text (and its stop strings), not the request: its output reports the error
at the end, with its token ids.
"""

from __future__ import annotations

from typing import NamedTuple

from flexsgl.detokenizer import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer
from flexsgl.errors import describe
from flexsgl.log import logger
from flexsgl.request import FinishReason, Request, RequestOutput, TokenEvent

# Why a request with structured outputs ends where its grammar allows no token (Matcher.allows_nothing).
NO_TOKEN = ("The request's structured-output grammar allows no token here: every token it could continue with "
            "is one of the request's stop tokens (stop_token_ids, and EOS unless ignore_eos), which it takes "
            "only once the output is complete.")


class Ending(NamedTuple):
    """A request that the output path ends, why, and for reason "error" the error."""

    request: Request
    reason: FinishReason
    error: str | None = None


class TextState:
    """One request's text: decoded incrementally, cut at a stop string, and released to streams
    (`new_text`), holding back while the request runs the text that may still begin a stop string.
    Stop strings are looked for only in the text that a new token could have completed."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.detokenizer: IncrementalDetokenizer | StreamDetokenizer | None = make_detokenizer(
            tokenizer, prompt_ids, skip_special_tokens)
        self.text = ""  # the output's text so far (cut at a stop string)
        self.new_text = ""  # the text released with the latest token
        self.released = 0  # characters of `text` released so far
        self.stop: str | None = None  # the stop string that cut the text
        self.error: str | None = None  # why the output could not be detokenized

    @property
    def growing(self) -> bool:
        """Whether tokens still add text (not finished, not failed)."""
        return self.detokenizer is not None

    def add(self, token: int, stops: tuple[str, ...], include_stop: bool) -> str | None:
        """Decode `token`; the earliest of `stops` in the text it completes, with the text cut there
        (after the stop string if include_stop), or None."""
        before = len(self.text)
        self.text += self.detokenizer.step(token)
        if not stops:
            return None
        start = max(0, before - max(map(len, stops)) + 1)
        found = [(at, s) for s in stops if (at := self.text.find(s, start)) >= 0]
        if not found:
            return None
        at, self.stop = min(found)
        self.text = self.text[:at + len(self.stop) if include_stop else at]
        return self.stop

    def release(self, hold: int) -> None:
        """Release the text but for its last `hold` characters."""
        self._release_to(len(self.text) - hold)

    def finish(self) -> None:
        """At the end: add what the detokenizer held back (unless a stop string cut the text) and
        release all of it."""
        if self.detokenizer is None:
            return
        if self.stop is None:
            self.text += self.detokenizer.flush()
        self.detokenizer = None
        self._release_to(len(self.text))

    def fail(self, error: str) -> None:
        self.detokenizer, self.error, self.new_text = None, error, ""

    def _release_to(self, upto: int) -> None:
        upto = max(upto, self.released)
        self.new_text = self.text[self.released:upto]
        self.released = upto


class OutputProcessor:
    """The engine's one owner of token events: log-probabilities, text, stop decisions, callbacks,
    and the RequestOutputs of finished requests."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: outputs carry token ids only

    def start(self, req: Request, on_token) -> None:
        """Give a request that enters the engine its text state (none without a tokenizer or with
        detokenize=False) and its callback."""
        req.on_token = on_token
        sp = req.sampling
        req.text_state = (TextState(self.tokenizer, req.prompt_ids, sp.skip_special_tokens)
                          if self.tokenizer is not None and sp.detokenize else None)

    def process(self, events: list[TokenEvent], allowed: dict[int, bool]) -> tuple[list[Ending], BaseException | None]:
        """Hand each token to its request (see the module docstring), the grammars of those with
        structured outputs already advanced by follow_grammars (`allowed`); returns the requests
        that end, and a KeyboardInterrupt or SystemExit that a callback raised (the first), if any."""
        endings, interrupt = [], None
        for ev in events:
            r = ev.request
            if r.logprobs is not None and ev.logprobs is not None:
                r.logprobs.append(ev.logprobs)
            if r.finished:  # aborted by a callback earlier in this step (LLM.abort): the token joins its text
                if r.text_state is not None and r.text_state.growing:
                    self._add_text(r, ev.token)
                continue
            r.finish_reason, r.stop_reason = _stop_token(r, ev.token)
            if r.grammar is not None:
                if not allowed[r.request_id]:
                    endings.append(Ending(r, FinishReason.ERROR, NO_TOKEN if r.grammar.allows_nothing() else
                                          f"The sampled token {ev.token} breaks the request's structured-output "
                                          "grammar."))
                    continue
                if r.grammar.ended and r.finish_reason is None:  # complete, with no stop token to end it
                    r.finish_reason = FinishReason.STOP
            if r.text_state is not None and r.text_state.growing:
                self._add_text(r, ev.token)
            error, raised = _run_callback(r)
            if interrupt is None:
                interrupt = raised
            if r.finished:  # its own callback aborted it
                continue
            if error is not None:
                endings.append(Ending(r, FinishReason.ERROR, error))
            elif r.finish_reason is not None:
                endings.append(Ending(r, r.finish_reason))
        return endings, interrupt

    def _add_text(self, r: Request, token: int) -> None:
        sp, text = r.sampling, r.text_state
        try:
            if r.finish_reason is FinishReason.STOP and token in r.stop_ids and not sp.include_stop_str_in_output:
                text.finish()  # a stop token's own text is left out, as a stop string's is
                return
            may_stop = r.finish_reason in (None, FinishReason.LENGTH) and len(r.output_ids) >= sp.min_tokens
            stop = text.add(token, sp.stop if may_stop else (), sp.include_stop_str_in_output)
            if stop is not None:
                r.finish_reason, r.stop_reason = FinishReason.STOP, stop
            if r.finish_reason is not None:
                text.finish()
            else:
                text.release(hold=max(map(len, sp.stop), default=1) - 1)
        except Exception as e:
            _text_failed(r, e)

    def request_output(self, req: Request) -> RequestOutput:
        """A finished request's RequestOutput; its text gets what the detokenizer held back, if the
        request ended otherwise than by a token (aborted, failed)."""
        text = req.text_state
        if text is not None:
            try:
                text.finish()
            except Exception as e:
                _text_failed(req, e)
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            cached_tokens=req.cached_tokens,
            text=None if text is None else text.text,
            error=req.error,
            index=req.index,
            stop_reason=req.stop_reason,
            logprobs=None if req.logprobs is None else list(req.logprobs),
            prompt_logprobs=(list(req.prompt_logprobs) if req.prompt_logprobs is not None
                             and len(req.prompt_logprobs) == len(req.prompt_ids) else None),
            time_in_queue=None if req.scheduled_at is None else req.scheduled_at - req.added_at,
        )
        if text is not None and text.error is not None:
            out.text, out.finish_reason, out.error = None, FinishReason.ERROR.value, out.error or text.error
        return out


def _stop_token(r: Request, token: int) -> tuple[FinishReason | None, int | None]:
    """(finish reason, stop reason) that `token`, just appended, gives r: a stop token or the length."""
    if token in r.stop_ids:
        return FinishReason.STOP, token if token in r.sampling.stop_token_ids else None
    if len(r.output_ids) >= r.sampling.max_new_tokens:
        return FinishReason.LENGTH, None
    return None, None


def follow_grammars(tokens: list[tuple[Request, int]]) -> dict[int, bool]:
    """Advance the grammar of each request with structured outputs by its token, all in one call;
    by request id, whether its grammar allowed the token (it refuses none the sampler's token
    mask allowed)."""
    mine = [(r, t) for r, t in tokens if r.grammar is not None]
    if not mine:
        return {}
    from flexsgl.sampling.grammar import accept_tokens

    ok = accept_tokens([r.grammar for r, _ in mine], [t for _, t in mine])
    return {r.request_id: a for (r, _), a in zip(mine, ok)}


def _run_callback(r: Request) -> tuple[str | None, BaseException | None]:
    """Run r's on_token callback: (why r must end with an error, an interrupt it raised)."""
    if r.on_token is None:
        return None, None
    try:
        r.on_token(r)
    except Exception as e:
        logger.debug("on_token callback of request %d raised", r.request_id, exc_info=True)
        return f"The on_token callback raised {describe(e)}.", None
    except BaseException as e:  # KeyboardInterrupt, SystemExit: raised once the step is complete
        return None, e
    return None, None


def _text_failed(r: Request, e: Exception) -> None:
    logger.debug("detokenizing request %d failed", r.request_id, exc_info=True)
    r.text_state.fail(f"Detokenizing the output failed: {describe(e)}.")
