"""Incremental detokenization: the text each new token completes, one token at a time.

Two detokenizers with one interface (`step`, `flush`), chosen by `make_detokenizer`:

- StreamDetokenizer, for a fast (Rust) tokenizer without clean-up of tokenization spaces: the
  `tokenizers` library's DecodeStream, one call per token in Rust;
- IncrementalDetokenizer, for any other tokenizer: a short window of token ids decoded per new
  token (the tokens since the last text it released, plus the ones before them as context), so
  the work per token does not grow with the output.

Both start from the last CONTEXT_TOKENS prompt tokens (a word's leading space depends on what
precedes it) and hold text back while it ends in an incomplete UTF-8 character (the tokenizer
shows it as U+FFFD); `flush` releases what is held at the end. They give the same text, with
special tokens' text left out or kept (`skip_special_tokens`). A
request's text as a whole (stop strings, what a stream may show yet) is flexsgl/output.py's
TextState.
"""

from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (a word's leading space)
CHARACTER_TOKENS = 3  # tokens that may hold the start of a UTF-8 character (up to 4 bytes, one at least a token)
MAX_PENDING = 8  # tokens without text an IncrementalDetokenizer's window holds before dropping the older ones


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # window start: context for the tokens not yet shown
        self.read = len(self.ids)  # tokens before this one have been shown as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

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
        if len(text) <= len(shown):
            # Nothing new yet: the tokens stay in the window (the bytes of a character that some
            # tokenizers show as nothing until it is whole; a skipped special token between two
            # words, whose space the window's context decides). A run of them longer than any
            # character's bytes adds no text: it leaves the window, but for the last ones, which
            # may yet begin a character, so each step decodes a few tokens however long the run.
            if len(self.ids) - self.read > MAX_PENDING:
                del self.ids[self.read:len(self.ids) - CHARACTER_TOKENS]
            return ""
        if text.endswith("\ufffd") and not final:  # an incomplete character: wait for the rest of it
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown):]


class StreamDetokenizer:
    """DecodeStream over the tokenizer's Rust backend; what it holds back at the end is flushed as
    IncrementalDetokenizer does, from the tokens since its last text."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.backend = tokenizer, tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.shown = context[-CONTEXT_TOKENS:]  # the last tokens whose text went out (context for flush)
        self.held: list[int] = []  # tokens since the last text
        self.fallback: IncrementalDetokenizer | None = None  # once DecodeStream cannot go on (step)

    def step(self, token: int) -> str:
        if self.fallback is not None:
            return self.fallback.step(token)
        try:
            text = self.stream.step(self.backend, token)
        except Exception as e:
            if "Invalid prefix" not in str(e):
                raise
            # A byte-fallback tokenizer turned text already released into U+FFFD once a later byte
            # made its run invalid (tokenizers' DecodeStream cannot go on): the rest of the output
            # goes through the windowed decode, from the text released so far.
            self.fallback = IncrementalDetokenizer(self.tokenizer, self.shown, self.skip_special_tokens)
            held, self.held = self.held, []
            return "".join(self.fallback.step(t) for t in held + [token])
        if text is None:
            self.held.append(token)
            return ""
        self.shown = (self.shown + self.held + [token])[-CONTEXT_TOKENS:]
        self.held = []
        return text

    def flush(self) -> str:
        if self.fallback is not None:
            return self.fallback.flush()
        if not self.held:
            return ""
        rest = IncrementalDetokenizer(self.tokenizer, self.shown, self.skip_special_tokens)
        for t in self.held:
            rest.ids.append(t)
        self.held = []
        return rest.flush()


def make_detokenizer(tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
    """A StreamDetokenizer where the tokenizer allows one, else an IncrementalDetokenizer (also for
    a prompt whose context ends in an incomplete character, which DecodeStream would release with
    the first output token)."""
    if stream_capable(tokenizer):
        context = tokenizer.decode(list(prompt_ids[-CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens)
        if not context.endswith("\ufffd"):
            return StreamDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)


def stream_capable(tokenizer) -> bool:
    """Whether DecodeStream gives what tokenizer.decode(ids, skip_special_tokens=...) does: a fast
    tokenizer whose decode adds no clean-up of tokenization spaces."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) or not getattr(tokenizer, "is_fast", False):
        return False
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return False
    return isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer)
