"""Requests, their sampling parameters, states and outputs."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import operator
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from flexsgl.errors import InputError, PromptError, SamplingParamsError, short_repr


# Temperatures below this sample greedily, as in vLLM: dividing logits by less overflows float32,
# and the softmax turns into NaN.
GREEDY_TEMPERATURE = 1e-5
FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1
DEFAULT_MAX_NEW_TOKENS = 16
MAX_N = 128  # samples of one prompt
MAX_LOGPROBS = 20  # top log-probabilities per token, as OpenAI's chat API allows
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. temperature 0 (or below 1e-5) means greedy;
    top_k 0 means no top-k limit. Every field is checked for type and range here; a bad one raises
    SamplingParamsError (a ValueError) that names it.

    - max_tokens: OpenAI's name for max_new_tokens (give either; given both, they must agree).
    - n: samples of the prompt; they share its KV pages (add_requests, generate). Sample i with a
      seed draws with seed + i.
    - stop: strings that end the output once its text holds one (checked on the detokenized text,
      not before min_tokens); the stop string is cut from the text unless include_stop_str_in_output.
    - logprobs: None, or how many of the most likely tokens to report with each output token's own
      log-probability (0: only its own), up to MAX_LOGPROBS; of the model's distribution before
      penalties, temperature and filters.
    - presence_penalty, frequency_penalty (OpenAI, [-2, 2]) lower the logits of tokens the output
      holds, by a constant and per occurrence; repetition_penalty (> 0; 1 is off) divides positive
      and multiplies negative logits of tokens in the prompt or output.
    - min_tokens: EOS and stop_token_ids cannot be sampled before this many output tokens.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self):
        put = partial(object.__setattr__, self)
        put("max_new_tokens", _integer("max_new_tokens", self.max_new_tokens, 1, INT64_MAX,
                                       "an integer of at least 1"))
        if self.max_tokens is not None:
            put("max_tokens", _integer("max_tokens", self.max_tokens, 1, INT64_MAX, "None or an integer of at least 1"))
            if self.max_new_tokens not in (self.max_tokens, DEFAULT_MAX_NEW_TOKENS):
                raise SamplingParamsError(f"max_tokens ({self.max_tokens}) and max_new_tokens ({self.max_new_tokens}) "
                                          "name the same limit; give one of them.")
            put("max_new_tokens", self.max_tokens)
        temperature = _real("temperature", self.temperature, "a finite number >= 0")
        if not 0.0 <= temperature <= FLOAT32_MAX:
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {short_repr(self.temperature)}.")
        put("temperature", 0.0 if temperature < GREEDY_TEMPERATURE else temperature)
        put("top_k", _integer("top_k", self.top_k, 0, INT64_MAX, "an integer >= 0 (0 disables it)"))
        top_p = _real("top_p", self.top_p, "a number in (0, 1]")
        if not 0.0 < top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {short_repr(self.top_p)}.")
        put("top_p", top_p)
        min_p = _real("min_p", self.min_p, "a number in [0, 1]")
        if not 0.0 <= min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {short_repr(self.min_p)}.")
        put("min_p", min_p)
        if self.seed is not None:
            put("seed", _integer("seed", self.seed, 0, INT64_MAX, "None or a non-negative integer below 2**63"))
        put("stop_token_ids", _token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be True or False, got {short_repr(getattr(self, name))}.")
        put("n", _integer("n", self.n, 1, MAX_N, f"an integer from 1 to {MAX_N}"))
        put("stop", _stop_strings(self.stop))
        if self.logprobs is not None:
            put("logprobs", _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS,
                                     f"None or an integer from 0 to {MAX_LOGPROBS}"))
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name), "a number in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {short_repr(getattr(self, name))}.")
            put(name, value)
        repetition = _real("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 is off)")
        if not 0.0 < repetition <= FLOAT32_MAX:
            raise SamplingParamsError(f"repetition_penalty must be a finite number > 0 (1 is off), "
                                      f"got {short_repr(self.repetition_penalty)}.")
        put("repetition_penalty", repetition)
        put("min_tokens", _integer("min_tokens", self.min_tokens, 0, self.max_new_tokens,
                                   f"an integer from 0 to max_new_tokens ({self.max_new_tokens})"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def replace(self, **changes) -> "SamplingParams":
        """A copy with `changes`, checked again (max_tokens is folded into max_new_tokens)."""
        return dataclasses.replace(self, **{"max_tokens": None, **changes})


def _integer(name: str, value, low: int, high: int, what: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not low <= value <= high:
        raise SamplingParamsError(f"{name} must be {what}, got {short_repr(value)}.")
    return int(value)


def _stop_strings(value) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else value
    if isinstance(stops, (bytes, bytearray, Mapping)) or not isinstance(stops, Iterable):
        raise SamplingParamsError(f"stop must be a string or a list of strings, got {short_repr(value)}.")
    stops = tuple(stops)
    if len(stops) > MAX_STOP_STRINGS:
        raise SamplingParamsError(f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed.")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise SamplingParamsError(f"stop must hold non-empty strings, got {short_repr(s)}.")
    return stops


def _real(name: str, value, what: str) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise SamplingParamsError(f"{name} must be {what}, got {short_repr(value)}.")
    return float(value)


def _token_ids(value) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise SamplingParamsError(f"stop_token_ids must be a list of token ids, got {short_repr(value)}.")
    ids = tuple(value)
    for t in ids:
        if token_id(t) is None or token_id(t) < 0:
            raise SamplingParamsError(f"stop_token_ids must hold non-negative integer token ids, got {short_repr(t)}.")
    return tuple(token_id(t) for t in ids)


def token_id(x) -> int | None:
    """x as an int if it is an integer (a Python or numpy int, a 0-d integer tensor), else None:
    a bool, a float or a string is not a token id."""
    if isinstance(x, (bool, float, str, bytes)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def prompt_list(prompts) -> list:
    """generate()'s `prompts` as a list of prompts: one string, one list of token ids, or a list of those."""
    if prompts is None:
        raise PromptError("No prompts given.")
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray, Mapping)) or not isinstance(prompts, Iterable):
        raise PromptError(f"prompts must be a string, a list of token ids, or a list of those, "
                          f"got {type(prompts).__name__}.")
    prompts = list(prompts)
    if not prompts:
        raise PromptError("No prompts given.")
    first = prompts[0]
    one_prompt = token_id(first) is not None or isinstance(first, numbers.Number) or getattr(first, "ndim", None) == 0
    return [prompts] if one_prompt else prompts


def sampling_list(sampling, n: int) -> list:
    """generate()'s `sampling` as one SamplingParams per prompt: None (the defaults), one for all, or a list."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return [SamplingParams() if sampling is None else sampling] * n
    if isinstance(sampling, (str, bytes, Mapping)) or not isinstance(sampling, Sequence):
        raise SamplingParamsError(f"sampling must be a SamplingParams or a list of them, one per prompt, "
                                  f"got {type(sampling).__name__}.")
    if len(sampling) != n:
        raise SamplingParamsError(f"Got {len(sampling)} SamplingParams for {n} prompts.")
    return list(sampling)


def check_callback(on_token) -> None:
    if on_token is not None and not callable(on_token):
        raise InputError(f"on_token must be a function of the request, or None, got {type(on_token).__name__}.")


def check_prompt(prompt, index: int) -> str | list[int]:
    """One prompt as text or a list of token ids, checked for type; raises PromptError saying why not."""
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError(f"Prompt {index} is empty.")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PromptError(f"Prompt {index} is not valid Unicode text: it holds a lone surrogate at character "
                              f"{e.start} (on a command line: bytes that are not UTF-8).") from None
        return prompt
    if isinstance(prompt, (bytes, bytearray)):
        raise PromptError(f"Prompt {index} is bytes; pass text (a str) or a list of token ids.")
    if not isinstance(prompt, Iterable) or isinstance(prompt, Mapping):
        raise PromptError(f"Prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}.")
    try:
        items = list(prompt)
    except TypeError:  # iterable by type but not by value, e.g. a 0-d tensor
        raise PromptError(f"Prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}.") from None
    ids = [token_id(t) for t in items]
    if None in ids:
        pos = ids.index(None)
        raise PromptError(f"Prompt {index} has {short_repr(items[pos])} at position {pos}, where a token "
                          "id (an integer) belongs.")
    if not ids:
        raise PromptError(f"Prompt {index} is empty.")
    return ids


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_new_tokens
    ABORT = "abort"  # aborted by the caller
    REFUSED = "refused"  # can never run here (see RequestOutput.error)
    ERROR = "error"  # a fault while it ran: a failed step or a callback that raised (see RequestOutput.error)


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """One output token's log-probability and the most likely tokens at its position, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability)


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int = 0
    text: str | None = None
    error: str | None = None  # why a request was refused or failed, in one sentence
    index: int = 0  # which of its prompt's n samples
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None  # per output token, when SamplingParams.logprobs is set

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(eq=False)
class Request:
    """One prompt's life in the engine. All fields are host-side bookkeeping.

    `fill_ids` are the tokens to prefill when (re)admitted: the prompt, or after a preemption the
    prompt plus every output so far. `num_computed` counts tokens whose K/V have been scheduled
    into the pool (fill chunks and decode inputs); `num_scheduled_outputs` counts tokens the device
    has been asked to sample, which runs one step ahead of `output_ids` (tokens read back).
    """

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    max_len: int  # prompt + outputs may not pass this (the model's context)
    rng_seed: int = field(default_factory=lambda: secrets.randbits(62))
    state: State = State.WAITING
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_scheduled_outputs: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    slot: int = -1  # row in the runner's per-request device state while running
    prefix_node: object = None  # the radix-cache node this request holds locked
    fill_ids: list[int] = field(default_factory=list)
    on_token: object = None  # optional callback(request) after each new token (the engine calls it)
    index: int = 0  # which of its prompt's n samples
    leader: "Request | None" = None  # sample 0 of its group, whose cached prompt pages it waits for
    shares_prompt: bool = False  # a leader: its prompt pages go to the prefix cache once prefilled
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None
    detokenizer: object = None  # IncrementalDetokenizer, when the engine has a tokenizer
    text: str = ""  # the output's text so far (cut at a stop string)
    new_text: str = ""  # text released with the latest token (held back while it may start a stop string)
    released: int = 0  # characters of `text` released so far
    text_error: str | None = None  # why the output could not be detokenized

    def __post_init__(self):
        if self.sampling.seed is not None:
            self.rng_seed = self.sampling.seed + self.index
        self.fill_ids = self.prompt_ids
        if self.sampling.logprobs is not None:
            self.logprobs = []

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def target_len(self) -> int:
        """The most tokens this request can hold: prompt plus every output it may produce."""
        return self.prompt_len + self.sampling.max_new_tokens

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= len(self.fill_ids)

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end the output: stop_token_ids, and EOS unless ignored."""
        return self.sampling.stop_token_ids + (() if self.sampling.ignore_eos else self.eos_ids)

    def append(self, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """Record a token read back from the device, and finish on a stop condition."""
        self.output_ids.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if token in self.stop_ids:
            self.finish_reason = FinishReason.STOP
            self.stop_reason = token if token in self.sampling.stop_token_ids else None
        elif len(self.output_ids) >= self.sampling.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            cached_tokens=self.cached_tokens,
            error=self.error,
            index=self.index,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )
