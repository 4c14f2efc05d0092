"""Requests, their sampling parameters, states and outputs."""

from __future__ import annotations

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


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. temperature 0 (or below 1e-5) means greedy; top_k 0 means no
    top-k limit. Every field is checked for type and range here; a bad one raises
    SamplingParamsError (a ValueError) that names it."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        put = partial(object.__setattr__, self)
        put("max_new_tokens", _integer("max_new_tokens", self.max_new_tokens, 1, INT64_MAX,
                                       "an integer of at least 1"))
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
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError(f"ignore_eos must be True or False, got {short_repr(self.ignore_eos)}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _integer(name: str, value, low: int, high: int, what: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not low <= value <= high:
        raise SamplingParamsError(f"{name} must be {what}, got {short_repr(value)}.")
    return int(value)


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
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int = 0
    text: str | None = None
    error: str | None = None  # why a request was refused or failed, in one sentence

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

    def __post_init__(self):
        if self.sampling.seed is not None:
            self.rng_seed = self.sampling.seed
        self.fill_ids = self.prompt_ids

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

    def append(self, token: int) -> None:
        """Record a token read back from the device, and finish on a stop condition."""
        self.output_ids.append(token)
        stops = self.sampling.stop_token_ids + (() if self.sampling.ignore_eos else self.eos_ids)
        if token in stops:
            self.finish_reason = FinishReason.STOP
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
        )
