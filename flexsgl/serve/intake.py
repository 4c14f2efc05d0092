"""A request's work before the engine, kept off the event loop, so that no request stalls another.

Rendering chat templates, tokenizing, and parsing structured-output constraints run on a pool of
threads (the tokenizers release the GIL while they encode). Before any of it, the text's length
is checked: a text needs at least one token per `max_token_chars` characters (the longest token of
the vocabulary), so one longer than the context times that (times CHAR_MARGIN, for normalizers
that merge characters) cannot fit and is refused at once, without tokenizing it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from flexsgl.errors import PromptError

THREADS = 4
CHAR_MARGIN = 2


class Intake:
    def __init__(self, threads: int = THREADS):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="flexsgl-intake")
        self._max_chars: int | None = None

    async def run(self, fn, *args):
        """fn(*args) on the pool; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def check_chars(self, chars: int, info, what: str) -> None:
        """Refuse (PromptError, 400) a text of `chars` characters that cannot fit the context."""
        limit = self.max_chars(info)
        if chars > limit:
            raise PromptError(f"{what} has {chars} characters, more than can fit the model's context of "
                              f"{info.config.max_position} tokens (at most {limit} characters).")

    def max_chars(self, info) -> int:
        if self._max_chars is None:
            self._max_chars = info.config.max_position * max_token_chars(info.tokenizer) * CHAR_MARGIN
        return self._max_chars

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def max_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for (an upper bound): the longest entry of
    the vocabulary (a byte-level or byte-fallback entry is at least as long as its text)."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return 1  # the byte tokenizer: a token per byte, at least one per character
    return max((len(t) for t in vocab()), default=1) or 1
