"""Structured outputs through xgrammar: a request's constraint parsed (and checked), compiled for
the tokenizer off the step loop and cached, a matcher per request that follows its tokens, and the
token mask of each step's rows, filled on the host for sampler.apply_token_mask.

- parse(): a StructuredOutputsParams as an xgrammar Grammar; a schema, regex or grammar that does
  not parse, or a schema with a keyword xgrammar cannot enforce (structured.check_json_schema),
  raises SamplingParamsError (the server answers 400). Cached by constraint.
- GrammarCompiler: compiles Grammars for one tokenizer on worker threads (xgrammar's compiler,
  which caches compiled grammars); `submit` returns a Future.
- GrammarQueue: the engine's requests waiting for their grammar, outside the scheduler; `ready()`
  hands back, in the order they came, those whose grammar has compiled (with their Matcher) and
  those whose grammar failed to compile (with the reason). An aborted request's compile is dropped
  while it is still queued and no other request waits for it; one already running cannot be
  stopped, and holds its thread until it completes.
- Matcher: one request's place in its grammar: it accepts each sampled token, and ends the request
  once the grammar is complete (with a stop token, or without one when the request has none). With
  `SamplingParams.reasoning_end` (a chat request in thinking mode, `</think>`), the grammar applies
  only after the output's text holds it (special tokens' text counted only where the request keeps
  it, skip_special_tokens=False): until then the row is unconstrained and the tokens' bytes are only
  watched for it (a request that never writes it ends by its other limits).
- GrammarCompiler.fill_mask(): the TokenMask (sampler.py) of a step's sampled rows; a row without
  a grammar (or whose grammar has ended) allows every token. The live rows are filled in one call
  to xgrammar's batch matcher, on the calling thread: for 256 rows of a JSON schema over the byte
  vocabulary it takes ~0.16 ms on the development CPU, where one call per row took 0.57 ms and the
  batch matcher on two threads 1.3 ms (the rows are ~0.6 µs each, less than a thread's hand-off).

The grammar sees the tokenizer's own vocabulary (for the presets' byte tokenizer, 256 tokens): ids
past it, up to the model's vocab_size (padding rows of the embedding), are never allowed in a
constrained row. The mask holds the grammar's vocabulary only: for a 256-token one, 8 words a row
to fill and upload instead of 4,748 for a padded 152k.

JSON schemas are compiled without free whitespace (`, ` and `: ` separators, no newlines), so a
model cannot wander in whitespace; xgrammar is imported on first use.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from flexsgl.errors import SamplingParamsError
from flexsgl.sampling.sampler import TokenMask
from flexsgl.sampling.structured import StructuredOutputsParams, check_json_schema

if TYPE_CHECKING:  # requests are read and given their matcher here, never made
    from flexsgl.request import Request

COMPILE_THREADS = 2
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+?:\d+:\s*")  # "[06:25:51] /project/cpp/x.cc:83: "


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise SamplingParamsError("Structured outputs need xgrammar: pip install xgrammar.") from None
    return xgrammar


# xgrammar (0.2.9) writes the characters of a JSON string with minLength or maxLength as this class,
# which lets raw control characters (U+0000 to U+001F), invalid inside a JSON string, through; the
# same class without them, as its other strings have it.
LENGTH_STRING_CHARACTERS = r'[^\"\\\r\n]'
JSON_STRING_CHARACTERS = r'[^\0-\x1f\"\\]'


def json_strings_without_raw_controls(grammar):
    """`grammar` (a JSON schema's) with its length-limited strings' characters those JSON allows."""
    text = str(grammar)
    if LENGTH_STRING_CHARACTERS not in text:
        return grammar
    return _xgr().Grammar.from_ebnf(text.replace(LENGTH_STRING_CHARACTERS, JSON_STRING_CHARACTERS))


@functools.lru_cache(maxsize=256)
def parse(spec: StructuredOutputsParams):
    """`spec` as an xgrammar Grammar; one that cannot be parsed raises SamplingParamsError."""
    xgr = _xgr()
    kind = spec.kind
    try:
        if kind == "json":
            try:
                schema = json.loads(spec.json)
            except ValueError as e:
                raise SamplingParamsError(f"The JSON schema is not JSON ({e}).") from None
            if not isinstance(schema, dict):
                raise SamplingParamsError("The JSON schema must be a JSON object.")
            check_json_schema(schema, "The JSON schema")
            return json_strings_without_raw_controls(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except SamplingParamsError:
        raise
    except Exception as e:
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                "grammar": "grammar", "choice": "choice list"}[kind]
        raise SamplingParamsError(f"The {what} of structured_outputs cannot be used: {_message(e)}.") from None


def _message(e: Exception) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    text = _XGRAMMAR_PREFIX.sub("", lines[0] if lines else type(e).__name__).strip().rstrip(".")
    return text[:300]


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of `tokenizer` (at most the model's `vocab_size` tokens): a transformers
    tokenizer's vocabulary, or for the byte tokenizer of the presets, one byte per token id below 256."""
    xgr = _xgr()
    from flexsgl.tokenizer import ByteTokenizer, hf_tokenizer

    if isinstance(tokenizer, ByteTokenizer):
        vocab = [bytes([i]) for i in range(min(256, vocab_size))]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[])
    return xgr.TokenizerInfo.from_huggingface(hf_tokenizer(tokenizer), vocab_size=min(vocab_size, len(tokenizer)))


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids of `tokenizer`'s special tokens (none for the presets' byte tokenizer)."""
    from flexsgl.tokenizer import ByteTokenizer, hf_tokenizer

    return frozenset() if isinstance(tokenizer, ByteTokenizer) else frozenset(hf_tokenizer(tokenizer).all_special_ids)


class GrammarCompiler:
    """Compiles constraints for one tokenizer on COMPILE_THREADS worker threads, one Future per
    distinct constraint (xgrammar caches the compiled grammars too)."""

    def __init__(self, tokenizer, vocab_size: int):
        xgr = _xgr()
        self.vocab_size = vocab_size  # the model's (its logits' width)
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.special_ids = special_token_ids(tokenizer)
        self.grammar_vocab = self.info.vocab_size  # the tokens a grammar sees
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=COMPILE_THREADS)
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="flexsgl-grammar")
        self._futures: dict[StructuredOutputsParams, Future] = {}
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """Each token's bytes, by id (a Matcher waiting for its reasoning's end reads them)."""
        return self.info.decoded_vocab

    @functools.cached_property
    def shown_token_bytes(self) -> list[bytes]:
        """token_bytes with the special tokens' empty, as skip_special_tokens leaves them out of the
        output's text (`<|endoftext|>` would end a reasoning that waits for an "e")."""
        return [b"" if i in self.special_ids else b for i, b in enumerate(self.token_bytes)]

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A Future of `spec` compiled (its exception: SamplingParamsError, saying why)."""
        fut = self._futures.get(spec)
        if fut is None or fut.cancelled() or (fut.done() and fut.exception() is not None):
            fut = self._futures[spec] = self.pool.submit(self._compile, spec)
        return fut

    def _compile(self, spec: StructuredOutputsParams):
        grammar = parse(spec)
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as e:
            raise SamplingParamsError(f"The {spec.kind} of structured_outputs could not be compiled for this "
                                      f"tokenizer: {_message(e)}.") from None

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def fill_mask(self, matchers: list[Matcher | None], pinned: bool) -> TokenMask:
        """The TokenMask of a step's sampled rows, on the host (pinned memory for a CUDA upload):
        each live matcher's allowed tokens, every token in the other rows."""
        rows, words = len(matchers), bitmask_words(self.grammar_vocab)
        flat = torch.empty(rows * words + rows, dtype=torch.int32, pin_memory=pinned)
        host = flat.numpy()
        host.fill(-1)
        mask = TokenMask(flat, rows, self.grammar_vocab)
        live = [(row, m.matcher) for row, m in enumerate(matchers) if m is not None and m.constraining]
        if not live:
            return mask
        host[rows * words + np.fromiter((row for row, _ in live), dtype=np.int64, count=len(live))] = 0
        self.batch.batch_fill_next_token_bitmask([m for _, m in live], mask.words, [row for row, _ in live])
        return mask


class GrammarQueue:
    """Requests waiting for their grammar to compile (the compiler is made for the first one)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.compiler: GrammarCompiler | None = None
        self.waiting: list[tuple[Request, Future]] = []

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, req: Request) -> None:
        if self.compiler is None:
            self.compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        self.waiting.append((req, self.compiler.submit(req.sampling.structured_outputs)))

    def discard(self, req: Request) -> None:
        """Forget a request that is gone (aborted): its compile is dropped if no other request waits
        for it and it has not started (one running cannot be stopped; it completes and is cached)."""
        mine = [f for r, f in self.waiting if r is req]
        self.waiting = [(r, f) for r, f in self.waiting if r is not req]
        for fut in mine:
            if all(f is not fut for _, f in self.waiting):
                fut.cancel()

    def ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(the requests whose grammar compiled, each given its Matcher; the requests whose grammar
        failed, with why), taken off the queue, in the order they came."""
        if not any(f.done() for _, f in self.waiting):
            return [], []
        compiled, failed, still = [], [], []
        for req, fut in self.waiting:
            if not fut.done():
                still.append((req, fut))
            elif fut.exception() is not None:
                failed.append((req, str(fut.exception())))
            else:
                after, watched = req.sampling.reasoning_end, None
                if after:  # the bytes the output's text shows
                    watched = (self.compiler.shown_token_bytes if req.sampling.skip_special_tokens
                               else self.compiler.token_bytes)
                req.grammar = Matcher(fut.result(), req.stop_ids, after, watched)
                compiled.append(req)
        self.waiting = still
        return compiled, failed

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a grammar to compile."""
        if self.waiting:
            concurrent.futures.wait([f for _, f in self.waiting], timeout, concurrent.futures.FIRST_COMPLETED)

    def fill_mask(self, matchers: list[Matcher | None], pinned: bool) -> TokenMask:
        return self.compiler.fill_mask(matchers, pinned)

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()


class Matcher:
    """One request's state in its compiled grammar. `stop_ids`: the request's stop tokens (those in
    the grammar's vocabulary); with none (ignore_eos and no stop_token_ids) the grammar ends the
    output once it is complete. `ended`: the grammar allows nothing more (it took a stop token, or
    is complete without one). `after`: text the output must hold before the grammar applies (the
    end of its reasoning), watched for in the tokens' bytes (`token_bytes`, by id)."""

    def __init__(self, compiled, stop_ids: tuple[int, ...], after: str | None = None,
                 token_bytes: list[bytes] | None = None):
        xgr = _xgr()
        self.vocab = compiled.tokenizer_info.vocab_size
        self.stops = frozenset(t for t in stop_ids if t < self.vocab)
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(self.stops) or None,
                                          terminate_without_stop_token=not self.stops)
        self.ended = False
        self.waiting_for = after.encode() if after else None  # None: the grammar applies
        self.token_bytes = token_bytes
        self._tail = b""  # the output's last bytes while waiting, too few to hold `waiting_for`

    @property
    def constraining(self) -> bool:
        """Whether the grammar masks this request's next token."""
        return self.waiting_for is None and not self.ended

    def watch(self, token: int) -> None:
        """A token sampled before the grammar applies: the grammar applies from the next token on
        once the output's bytes hold `waiting_for`."""
        seen = self._tail + (self.token_bytes[token] if token < len(self.token_bytes) else b"")
        if self.waiting_for in seen:
            self.waiting_for, self._tail = None, b""
        else:
            self._tail = seen[max(0, len(seen) - len(self.waiting_for) + 1):]

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return accept_tokens([self], [token])[0]

    def allows_nothing(self) -> bool:
        """Whether the grammar allows no token at all in its state: every token it could continue
        with is one of the request's stop tokens, which it takes only once complete (so the mask
        closed every token, and whatever was sampled breaks it)."""
        mask = _xgr().allocate_token_bitmask(1, self.vocab)
        self.matcher.fill_next_token_bitmask(mask)
        return not bool(mask.any())


def accept_tokens(matchers: list[Matcher], tokens: list[int]) -> list[bool]:
    """Advance each matcher by its token, in one call into xgrammar (one still waiting for its
    grammar to apply only watches its token); whether each was allowed."""
    ok = [True] * len(matchers)
    live = []
    for i, (m, t) in enumerate(zip(matchers, tokens)):
        if m.waiting_for is None:
            live.append(i)
        else:
            m.watch(t)
    if not live:
        return ok
    accepted = _xgr().BatchGrammarMatcher.batch_accept_token([matchers[i].matcher for i in live],
                                                             [tokens[i] for i in live])
    for i, a in zip(live, accepted):
        m, t, ok[i] = matchers[i], tokens[i], a
        if a:  # with stop tokens the grammar ends on one; without, once it is complete
            m.ended = t in m.stops if m.stops else m.matcher.is_terminated()
    return ok


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a row of mask words allows (xgrammar's layout), below `vocab_size`."""
    bits = np.unpackbits(mask_row.astype("<i4").view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)
