"""The OpenAI request bodies the server takes (pydantic models) and how they become SamplingParams.

Types are checked by pydantic, ranges by SamplingParams: either failure is answered with 400 and
an OpenAI error body (app.py). Fields a client leaves out take the model's defaults (its
generation_config.json), then SamplingParams' own. Besides OpenAI's fields, the sampling fields
vLLM and SGLang take are accepted: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, include_stop_str_in_output. Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from flexsgl.errors import PromptError, SamplingParamsError
from flexsgl.sampling.params import DEFAULT_MAX_NEW_TOKENS, SamplingParams

Number = StrictFloat  # ints too; not strings or booleans


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """The fields both endpoints share; None means "not given"."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    ignore_eos: StrictBool | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Number] | None = None
    user: str | None = None

    COPIED: ClassVar[tuple[str, ...]] = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "include_stop_str_in_output",
              "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")

    def sampling(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """These fields over `defaults`; raises SamplingParamsError (400) for a value out of range."""
        if self.logit_bias:
            raise SamplingParamsError("logit_bias is not supported.")
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options is only allowed with stream: true.")
        given = {name: getattr(self, name) for name in self.COPIED if getattr(self, name) is not None}
        if self.stop is not None:
            given["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if max_tokens is not None:  # checked under OpenAI's name, replacing the model's default
            given.update(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, max_tokens=max_tokens)
        return defaults.replace(logprobs=logprobs, **given)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list:
        """The prompt as a list of prompts (text or token ids)."""
        p = self.prompt
        if not p:
            raise PromptError("The prompt is empty.")
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    def to_sampling(self, defaults: SamplingParams) -> SamplingParams:
        if self.echo:
            raise SamplingParamsError("echo is not supported.")
        if self.suffix:
            raise SamplingParamsError("suffix is not supported.")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise SamplingParamsError("best_of is not supported (other than equal to n).")
        # OpenAI's default for completions is 16 tokens; a model's generation_config may say otherwise.
        return self.sampling(defaults, self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def to_sampling(self, defaults: SamplingParams, room: int) -> SamplingParams:
        """`room`: tokens left in the context after the prompt, the default limit (as vLLM)."""
        if self.tools:
            raise SamplingParamsError("tools are not supported.")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise SamplingParamsError("response_format other than text is not supported.")
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs needs logprobs: true.")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if limit is None:
            limit = max(1, room)
        return self.sampling(defaults, limit, (self.top_logprobs or 0) if self.logprobs else None)

    def message_dicts(self) -> list[dict]:
        """The messages for apply_chat_template; content given as parts is joined from its text parts."""
        out = []
        for m in self.messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise SamplingParamsError("Only text content parts are supported.")
                    texts.append(part["text"])
                d["content"] = "".join(texts)
            out.append(d)
        return out

