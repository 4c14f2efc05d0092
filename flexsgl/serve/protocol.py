"""The OpenAI request bodies the server takes (pydantic models) and how they become SamplingParams.

Types are checked by pydantic, ranges by SamplingParams: either failure is answered with 400 and
an OpenAI error body (errors.py). Fields a client leaves out take the model's defaults (its
generation_config.json), then SamplingParams' own. Besides OpenAI's fields, the fields vLLM and
SGLang take are accepted: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, prompt_logprobs, chat_template_kwargs, flexsgl's
attention_params (values of the attention variants' per-request parameters), and the
structured-output constraints (`structured_outputs` {json, regex, choice, grammar, json_object},
and the older guided_json, guided_regex, guided_grammar, guided_choice); OpenAI's response_format
constrains completions as well as chat, as in vLLM; also allowed_token_ids, truncate_prompt_tokens and
skip_special_tokens. vLLM's fields that flexsgl does not implement (UNSUPPORTED; for chat also
CHAT_UNSUPPORTED) are refused with a 400 naming them when given a value other than their default;
other unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from flexsgl import chat_template
from flexsgl.errors import PromptError, SamplingParamsError, short_repr
from flexsgl.sampling.params import DEFAULT_MAX_NEW_TOKENS, INT64_MAX, SamplingParams
from flexsgl.sampling.structured import StructuredOutputsParams, check_json_schema

Number = StrictFloat  # ints too; not strings or booleans
# vLLM's request fields flexsgl does not implement, with the values that ask nothing of it.
UNSUPPORTED = {"use_beam_search": (False,), "length_penalty": (1, 1.0), "bad_words": ([],),
               "logits_processors": ([],), "return_tokens_as_token_ids": (False,), "priority": (0,),
               "prompt_embeds": (), "spaces_between_special_tokens": (True,)}
CHAT_UNSUPPORTED = {"chat_template": (), "echo": (False,), "documents": ([],), "add_special_tokens": (False,)}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage so far on every chunk (with include_usage)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    json_schema: dict[str, Any] | None = None


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
    skip_special_tokens: StrictBool | None = None
    ignore_eos: StrictBool | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Number] | None = None
    prompt_logprobs: StrictInt | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    response_format: ResponseFormat | None = None
    attention_params: dict[str, StrictInt | StrictFloat] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    truncate_prompt_tokens: StrictInt | None = None
    user: str | None = None
    use_beam_search: Any = None
    length_penalty: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    priority: Any = None
    prompt_embeds: Any = None
    spaces_between_special_tokens: Any = None

    COPIED: ClassVar[tuple[str, ...]] = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
                                         "include_stop_str_in_output", "skip_special_tokens", "ignore_eos",
                                         "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                                         "prompt_logprobs", "attention_params", "allowed_token_ids",
                                         "truncate_prompt_tokens")

    def sampling(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None,
                 structured: StructuredOutputsParams | None = None, reasoning_end: str | None = None) -> SamplingParams:
        """These fields over `defaults`; raises SamplingParamsError (400) for a value out of range.
        `structured`: a constraint the endpoint derived (response_format, tool_choice);
        `reasoning_end`: the text after which a constraint applies (a chat request in thinking mode)."""
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options is only allowed with stream: true.")
        self.refuse_unsupported(UNSUPPORTED)
        given = {name: getattr(self, name) for name in self.COPIED if getattr(self, name) is not None}
        if self.stop is not None:
            given["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if max_tokens is not None:  # checked under OpenAI's name, replacing the model's default
            given.update(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, max_tokens=max_tokens)
        if self.logit_bias:
            given["logit_bias"] = {_token_key(k): v for k, v in self.logit_bias.items()}
        own = self.structured()
        if own is not None and structured is not None:
            raise SamplingParamsError("Give one constraint on the output: structured_outputs (or a guided_ field) "
                                      "cannot be combined with response_format or a required tool call.")
        given["structured_outputs"] = own or structured
        return defaults.replace(logprobs=logprobs, reasoning_end=reasoning_end, **given)

    def refuse_unsupported(self, fields: dict) -> None:
        """SamplingParamsError (400) for the first of `fields` given a value other than its defaults."""
        for name, defaults in fields.items():
            value = getattr(self, name, None)
            if value is not None and not any(value == d and type(value) is type(d) for d in defaults):
                if name == "chat_template":
                    raise SamplingParamsError("chat_template in a request is not accepted (vLLM's default); "
                                              "start the server with --chat-template.")
                raise SamplingParamsError(f"{name} is not supported by this server (vLLM's option; "
                                          f"got {short_repr(value)}).")

    def structured(self) -> StructuredOutputsParams | None:
        """The constraint of structured_outputs or the guided_ fields, if any (one at most)."""
        given = {field: getattr(self, name) for name, field in GUIDED.items() if getattr(self, name) is not None}
        if self.structured_outputs is not None:
            if given:
                raise SamplingParamsError("Give structured_outputs or a guided_ field, not both.")
            return _checked(StructuredOutputsParams.of(self.structured_outputs), "structured_outputs.json")
        if len(given) > 1:
            raise SamplingParamsError(f"Give one guided_ field, got {', '.join('guided_' + k for k in given)}.")
        return _checked(StructuredOutputsParams.of(given), "guided_json") if given else None

    def response_format_constraint(self) -> StructuredOutputsParams | None:
        """response_format as a constraint: json_schema (its `schema`), json_object, or none for text."""
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf.type == "json_schema":
            schema = (rf.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise SamplingParamsError("response_format of type json_schema needs json_schema.schema, "
                                          "a JSON schema object.")
            return _checked(StructuredOutputsParams(json=schema), "response_format.json_schema.schema")
        raise SamplingParamsError(f"response_format type must be text, json_object or json_schema, "
                                  f"got {rf.type[:40]!r}.")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


def _checked(spec: StructuredOutputsParams, where: str) -> StructuredOutputsParams:
    """`spec`, once a JSON schema in it is known to use no keyword xgrammar cannot enforce (400
    naming the keyword and where it is, `where` naming the schema's field)."""
    if spec.kind == "json":
        check_json_schema(spec.json, where)
    return spec


def _token_key(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise SamplingParamsError(f"logit_bias keys must be token ids, got {key[:40]!r}.") from None


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

    @property
    def scores_prompt(self) -> bool:
        """echo with max_tokens 0: the prompt (and its log-probabilities) alone, no new token."""
        return self.echo and self.max_tokens == 0

    def to_sampling(self, defaults: SamplingParams) -> SamplingParams:
        if self.suffix:
            raise SamplingParamsError("suffix is not supported.")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise SamplingParamsError("best_of is not supported (other than equal to n).")
        # echo with max_tokens 0 scores the prompt (vLLM's, lm-evaluation-harness's loglikelihoods): one token
        # is computed, for the prompt's log-probabilities, and left out of the response (responses.Choices)
        sp = self.sampling(defaults, 1 if self.scores_prompt else self.max_tokens, self.logprobs,
                           self.response_format_constraint())
        if self.echo and self.logprobs is not None and sp.prompt_logprobs is None:  # echo shows the prompt's too
            sp = sp.replace(prompt_logprobs=self.logprobs)
        # OpenAI's default for completions is 16 tokens; a model's generation_config may say otherwise.
        return sp


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
    continue_final_message: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: Any = None
    echo: Any = None
    documents: Any = None
    add_special_tokens: Any = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    def to_sampling(self, defaults: SamplingParams, room: int, structured: StructuredOutputsParams | None = None,
                    reasoning_end: str | None = None) -> SamplingParams:
        """`room`: tokens left in the context after the prompt, the default limit (as vLLM);
        `structured`: the constraint a required or named tool call puts on the output;
        `reasoning_end`: the text after which a constraint applies (thinking mode)."""
        self.refuse_unsupported(CHAT_UNSUPPORTED)
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs needs logprobs: true.")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.max_completion_tokens is not None and not 1 <= limit <= INT64_MAX:  # named as the client sent it
            raise SamplingParamsError(f"max_completion_tokens must be None or an integer of at least 1, got {limit}.")
        if limit is None:
            limit = max(1, room)
        formatted = self.response_format_constraint()
        if formatted is not None and structured is not None:
            raise SamplingParamsError("response_format cannot be combined with a required or named tool call.")
        return self.sampling(defaults, limit, (self.top_logprobs or 0) if self.logprobs else None,
                             formatted or structured, reasoning_end)

    def message_dicts(self) -> list[dict]:
        """The messages for apply_chat_template; content given as parts is joined from its text parts."""
        return chat_template.conversation([m.model_dump(exclude_none=True) for m in self.messages])

    def characters(self) -> int:
        """Characters of the messages' text (checked against the context before rendering)."""
        n = 0
        for m in self.messages:
            if isinstance(m.content, str):
                n += len(m.content)
            elif isinstance(m.content, list):
                n += sum(len(p.get("text", "")) for p in m.content if isinstance(p.get("text"), str))
        return n


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]
