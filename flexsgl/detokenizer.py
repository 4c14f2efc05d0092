"""Incremental detokenization: the text each new token completes, one token at a time.

The detokenizer decodes a short window of token ids per new token (the tokens since the last
text it released, plus the ones before them as context), so the work per token does not grow
with the output; it holds text back while the window ends in an incomplete UTF-8 character (the
tokenizer shows it as U+FFFD). A request's text as a whole (stop strings, what a stream may show
yet) is flexsgl/output.py's RequestText.
"""

from __future__ import annotations

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
