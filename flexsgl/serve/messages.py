"""What the HTTP process and the engine process say to each other (pickled through pipes), and the
Event a handler receives.

To the engine: Add (requests made and checked by a handler), Abort, Stop. From the engine: Ready
(what the HTTP process needs to make requests) or StartFailed, then one Step per step, or Failed
once the engine cannot run any more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexsgl.request import Request, RequestOutput, TokenLogprobs
from flexsgl.request_factory import RequestFactory
from flexsgl.sampling.params import SamplingParams

# ---- to the engine process


@dataclass
class Add:
    requests: list[Request]  # one HTTP request's (its samples share a leader, so they travel together)


@dataclass
class Abort:
    request_ids: list[int]


@dataclass
class Stop:
    pass


# ---- from the engine process


@dataclass
class EngineInfo:
    requests: RequestFactory  # the engine's, to make and check requests in the HTTP process
    default_sampling: SamplingParams  # the model's generation_config.json over SamplingParams' defaults
    total_pages: int  # KV pages in the pool (the dummy page excluded)

    @property
    def tokenizer(self):
        return self.requests.tokenizer

    @property
    def config(self):
        return self.requests.config


@dataclass
class Ready:
    info: EngineInfo
    stats: dict = field(default_factory=dict)  # LLM.stats() before any step, for /metrics


@dataclass
class StartFailed:
    reason: str


@dataclass
class Step:
    """One step's events: each token as (request id, text delta, token id, its log-probabilities
    or None), then each finished request as (request id, text not yet sent, its output); and
    LLM.stats() after the step, for /metrics. `prompts`: for each request with prompt_logprobs
    whose first token this step carries, (its prompt token ids, their log-probabilities), by id."""

    tokens: list[tuple[int, str, int, TokenLogprobs | None]]
    finished: list[tuple[int, str, RequestOutput]]
    stats: dict
    prompts: dict[int, tuple[list[int], list[TokenLogprobs | None] | None]] = field(default_factory=dict)


@dataclass
class Failed:
    reason: str  # the engine cannot run any more: every request in flight ends with this error


# ---- to a handler


@dataclass
class Event:
    """What one request's handler receives: a token, or its end (`output` set)."""

    choice: int  # the request's place among its HTTP request's choices
    text: str  # text released by this event
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    output: RequestOutput | None = None  # the finished request, on its last event
    prompt: tuple[list[int], list[TokenLogprobs | None] | None] | None = None  # Step.prompts', on the first token
    error: str | None = None  # the engine failed: the server cannot serve any more
