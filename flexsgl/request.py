"""Requests: prompt checks, states and outputs. SamplingParams lives in flexsgl/sampling/params.py."""

from __future__ import annotations

import enum
import numbers
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flexsgl.errors import InputError, PromptError, SamplingParamsError, short_repr
from flexsgl.sampling.params import SamplingParams, token_id


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
