"""Requests: Request (what was asked, its scheduling state, its output), the token events a step
hands on, RequestOutput and finish reasons. Prompts are checked and made into Requests in
flexsgl/request_factory.py; SamplingParams lives in flexsgl/sampling/params.py."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flexsgl.sampling.params import SamplingParams

if TYPE_CHECKING:
    from flexsgl.output import TextState


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
    rank: int | None = None  # the tokens at least as likely as it, ties included (vLLM's Logprob.rank)


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int = 0
    text: str | None = None  # None without a tokenizer or with SamplingParams.detokenize False
    error: str | None = None  # why a request was refused or failed, in one sentence
    index: int = 0  # which of its prompt's n samples
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None  # per output token, when SamplingParams.logprobs is set
    # Per prompt token, when SamplingParams.prompt_logprobs is set: None for the first, which no token
    # precedes. None where the prompt was not prefilled whole (refused, or ended before).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    time_in_queue: float | None = None  # seconds from entering the engine to its first step (None: it never ran)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(eq=False)
class Request:
    """One prompt's life in the engine (host-side bookkeeping), in three parts.

    What was asked, fixed once the request is made: the prompt, the sampling parameters, EOS ids,
    the context (`max_len`), the noise seed, for a sample of n its `index` and `leader`, and the
    prefix cache partition its K/V belong to (`cache_salt`, flexsgl/attention/request_variants.py).

    Scheduling state, the scheduler's (the runner reads `pages`, `slot` and `fill_ids`): `fill_ids`
    are the tokens to prefill when (re)admitted, the prompt or, after a preemption, the prompt plus
    every output so far; `num_computed` counts tokens whose K/V have been scheduled into the pool
    (fill chunks and decode inputs); `num_scheduled_outputs` counts tokens the device has been asked
    to sample, which runs one step ahead of `output_ids` (tokens read back). Where every layer attends
    within a window, pages wholly behind it go back to the pool and read as the dummy page in `pages`.

    The output: the tokens read back (`output_ids`, the scheduler's too, since a preempted request
    recomputes them) and their log-probabilities, how it ended, and the output path's
    (flexsgl/output.py) text state and callback.
    """

    # What was asked
    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    max_len: int  # prompt + outputs may not pass this (the model's context)
    index: int = 0  # which of its prompt's n samples
    leader: Request | None = None  # sample 0 of its group, whose cached prompt pages it waits for
    rng_seed: int = field(default_factory=lambda: secrets.randbits(62))
    cache_salt: object = None  # None: its K/V serve every request with the same tokens
    # Scheduling state
    state: State = State.WAITING
    fill_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # row in the runner's per-request device state while running
    prefix_node: object = None  # the radix-cache node this request holds locked
    num_computed: int = 0
    num_scheduled_outputs: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    admitted: bool = False  # admitted once (a preempted request is readmitted)
    shared_pages: int = 0  # leading pages it holds through the prefix cache (since its last admission)
    dropped_pages: int = 0  # leading pages behind every layer's attention window, given back to the pool
    added_at: float = 0.0  # time.monotonic() when the engine took it
    scheduled_at: float | None = None  # time.monotonic() of its first step
    shares_prompt: bool = False  # a leader: its prompt pages go to the prefix cache once prefilled
    # The output
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # per output token, when SamplingParams.logprobs is set
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # why it was refused or failed, in one sentence
    text_state: TextState | None = None  # with a tokenizer, unless detokenize=False (flexsgl/output.py)
    on_token: object = None  # optional callback(request) after each new token (flexsgl/output.py)
    grammar: object = None  # structured outputs: its Matcher (sampling/grammar.py), once its grammar is compiled
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when SamplingParams.prompt_logprobs is set

    def __post_init__(self):
        if self.sampling.seed is not None:  # sample i of n draws with seed + i, wrapped into int64's range
            self.rng_seed = (self.sampling.seed + self.index) % 2**63
        self.fill_ids = self.prompt_ids
        if self.sampling.logprobs is not None:
            self.logprobs = []
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

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

    @property
    def new_text(self) -> str:
        """The text the latest token released, for on_token callbacks ("" without a text state)."""
        return "" if self.text_state is None else self.text_state.new_text


@dataclass
class TokenEvent:
    """A token a step sampled for a request, as Scheduler.process hands it on (already in the
    request's output_ids), with its log-probabilities if the request asked for them."""

    request: Request
    token: int
    logprobs: TokenLogprobs | None = None
