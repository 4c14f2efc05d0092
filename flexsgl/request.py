"""Requests, their sampling parameters, states and outputs."""

from __future__ import annotations

import enum
import math
import secrets
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy; top_k 0 means no top-k limit."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer of at least 1, got {self.max_new_tokens!r}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}.")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}.")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_new_tokens
    ABORT = "abort"  # aborted by the caller
    REFUSED = "refused"  # can never run here (see RequestOutput.error)


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
    error: str | None = None  # why a refused request was refused

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
    on_token: object = None  # optional callback(request) after each new token

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
        if self.on_token is not None:
            self.on_token(self)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            cached_tokens=self.cached_tokens,
            error=self.error,
        )
