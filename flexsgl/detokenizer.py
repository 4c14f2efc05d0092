"""Each request's text, one token at a time: incremental detokenization and stop strings.

The detokenizer decodes a short window of token ids per new token (the tokens since the last
text it released, plus the ones before them as context), so the work per token does not grow
with the output; it holds text back while the window ends in an incomplete UTF-8 character (the
tokenizer shows it as U+FFFD). Stop strings are searched for only in the text that a new token
could have completed. While a request runs, the text that may still turn out to start a stop
string is held back from `Request.new_text`, so a stream never shows what the output then cuts.
"""

from __future__ import annotations

from flexsgl.request import FinishReason, Request

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (a word's leading space)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # window start: context for the tokens not yet shown
        self.read = len(self.ids)  # tokens before this one have been shown as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, token: int) -> str:
        """The text `token` completes ("" while a character is incomplete)."""
        self.ids.append(token)
        return self._release(final=False)

    def flush(self) -> str:
        """Text held back at the end (an incomplete character shows as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        shown = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(shown) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown):]


def advance(req: Request) -> None:
    """Decode req's newest token, end it at a stop string, and set `new_text` to what it releases."""
    before = len(req.text)
    req.text += req.detokenizer.step(req.output_ids[-1])
    stops = req.sampling.stop
    if stops and req.finish_reason in (None, FinishReason.LENGTH) and len(req.output_ids) >= req.sampling.min_tokens:
        _cut_at_stop(req, before)
    if req.finish_reason is not None:
        finish_text(req)
    else:
        hold = max(map(len, stops), default=1) - 1
        _release(req, len(req.text) - hold)


def finish_text(req: Request) -> None:
    """At the end: add what the detokenizer held back (unless a stop string ended the text) and
    release all of it."""
    if req.detokenizer is None:
        return
    if req.stop_reason is None or not isinstance(req.stop_reason, str):
        req.text += req.detokenizer.flush()
    req.detokenizer = None
    _release(req, len(req.text))


def _cut_at_stop(req: Request, before: int) -> None:
    """Find the earliest stop string that the new text completes and end the request there."""
    longest = max(map(len, req.sampling.stop))
    start = max(0, before - longest + 1)
    found = [(at, s) for s in req.sampling.stop if (at := req.text.find(s, start)) >= 0]
    if not found:
        return
    at, stop = min(found)
    req.text = req.text[:at + len(stop) if req.sampling.include_stop_str_in_output else at]
    req.finish_reason, req.stop_reason = FinishReason.STOP, stop


def _release(req: Request, upto: int) -> None:
    upto = max(upto, req.released)
    req.new_text = req.text[req.released:upto]
    req.released = upto
