"""SamplingParams: how a request picks each next token, every field checked for type and range."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import partial

from flexsgl.errors import SamplingParamsError, short_repr
from flexsgl.sampling.structured import StructuredOutputsParams


# Temperatures below this sample greedily, as in vLLM: dividing logits by less overflows float32,
# and the softmax turns into NaN.
GREEDY_TEMPERATURE = 1e-5
FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1
DEFAULT_MAX_NEW_TOKENS = 16
MAX_N = 128  # samples of one prompt
MAX_LOGPROBS = 20  # top log-probabilities per token, as OpenAI's chat API allows
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_ALLOWED_TOKEN_IDS = 1 << 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. temperature 0 (or below 1e-5) means greedy;
    top_k 0 (or -1, vLLM's and SGLang's) means no top-k limit. Every field is checked for type and range here; a bad one raises
    SamplingParamsError (a ValueError) that names it.

    - max_tokens: OpenAI's name for max_new_tokens (give either; given both, they must agree).
    - n: samples of the prompt; they share its KV pages (add_requests, generate). Sample i with a
      seed draws with seed + i (modulo 2**63).
    - stop: strings that end the output once its text holds one (checked on the detokenized text,
      not before min_tokens); the stop string is cut from the text unless include_stop_str_in_output,
      as is the text of a stop token (EOS, stop_token_ids), which stays among the token ids.
    - logprobs: None, or how many of the most likely tokens to report with each output token's own
      log-probability (0: only its own), up to MAX_LOGPROBS; of the model's distribution before
      penalties, temperature and filters.
    - presence_penalty, frequency_penalty (OpenAI, [-2, 2]) lower the logits of tokens the output
      holds, by a constant and per occurrence; repetition_penalty (> 0; 1 is off) divides positive
      and multiplies negative logits of tokens in the prompt or output.
    - min_p, top_k, top_p filter the tempered distribution in that order (vLLM's): min_p drops tokens
      less likely than min_p times the most likely, top_k keeps the k most likely, and top_p keeps the
      most likely tokens while the renormalised mass of those before them is below top_p.
    - min_tokens: EOS and stop_token_ids cannot be sampled before this many output tokens.
    - attention_params: values of the engine's attention variants' per-request parameters
      (PerRequest, docs/ATTENTION.md), by name.
    - logit_bias: {token id: bias in [-100, 100]} added to those logits before sampling (OpenAI's).
    - structured_outputs: a StructuredOutputsParams (or a mapping of its fields: json, regex,
      choice, grammar, json_object) that the output must follow, enforced by a token mask on the
      device (sampling/grammar.py).
    - reasoning_end: None, or text that ends the output's reasoning (a reasoning parser's `</think>`):
      structured_outputs then constrain only the output after it.
    - prompt_logprobs: None, or how many of the most likely tokens to report with each prompt
      token's own log-probability (the first prompt token has none); up to MAX_LOGPROBS. Such a
      request computes its whole prompt (the prefix cache is not read for it).
    - skip_special_tokens: leave special tokens' text (`<|endoftext|>`, `<|im_end|>`) out of the
      output's text (vLLM's default), or keep it (False); token ids are kept either way.
    - detokenize: False gives token ids alone (the output's text is None), as an engine without a
      tokenizer does, sparing the detokenization; stop strings need the text.
    - allowed_token_ids: None, or the only token ids the output may hold (vLLM's), up to
      MAX_ALLOWED_TOKEN_IDS of them; an EOS or stop token outside them cannot end it.
    - truncate_prompt_tokens: None, or keep only the prompt's last this many tokens (vLLM's; -1:
      as many as the model's context leaves room for with one new token).
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
    attention_params: dict | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    reasoning_end: str | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    allowed_token_ids: tuple[int, ...] | None = None
    truncate_prompt_tokens: int | None = None

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
        top_k = _integer("top_k", self.top_k, -1, INT64_MAX, "an integer >= 0, or -1 (0 and -1 disable it)")
        put("top_k", max(top_k, 0))
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
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be True or False, got {short_repr(getattr(self, name))}.")
        put("n", _integer("n", self.n, 1, MAX_N, f"an integer from 1 to {MAX_N}"))
        put("stop", _stop_strings(self.stop))
        if self.stop and not self.detokenize:
            raise SamplingParamsError("stop strings are looked for in the output's text, which detokenize=False "
                                      "leaves out; give stop_token_ids, or detokenize=True.")
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
        if self.attention_params is not None:
            bad = not isinstance(self.attention_params, dict) or any(
                not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v != v
                for k, v in self.attention_params.items())
            if bad:
                raise SamplingParamsError(f"attention_params must map parameter names to numbers, got "
                                          f"{short_repr(self.attention_params)}.")
        put("logit_bias", _logit_bias(self.logit_bias))
        put("structured_outputs", StructuredOutputsParams.of(self.structured_outputs))
        if self.reasoning_end is not None and (not isinstance(self.reasoning_end, str) or not self.reasoning_end):
            raise SamplingParamsError(f"reasoning_end must be None or a non-empty string, "
                                      f"got {short_repr(self.reasoning_end)}.")
        if self.allowed_token_ids is not None:
            allowed = _token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not allowed or len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                raise SamplingParamsError(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, "
                                          f"got {len(allowed)}.")
            put("allowed_token_ids", tuple(sorted(set(allowed))))
        if self.truncate_prompt_tokens is not None:
            value = _integer("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, INT64_MAX,
                             "None, -1 or a positive integer")
            if value == 0:
                raise SamplingParamsError("truncate_prompt_tokens must be None, -1 or a positive integer, got 0.")
            put("truncate_prompt_tokens", value)
        if self.prompt_logprobs is not None:
            put("prompt_logprobs", _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS,
                                            f"None or an integer from 0 to {MAX_LOGPROBS}"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @functools.cached_property
    def allowed_words(self):
        """allowed_token_ids as a bitmask, numpy int64 words: bit j of word w allows token 64 w + j
        (made once, uploaded each step of the request: sampling/batch.py)."""
        import numpy as np

        ids = np.asarray(self.allowed_token_ids, dtype=np.int64)
        words = np.zeros(int(ids.max()) // 64 + 1, dtype=np.uint64)
        np.bitwise_or.at(words, ids >> 6, np.left_shift(np.uint64(1), (ids & 63).astype(np.uint64)))
        return words.view(np.int64)

    def replace(self, **changes) -> "SamplingParams":
        """A copy with `changes`, checked again (max_tokens is folded into max_new_tokens)."""
        return dataclasses.replace(self, **{"max_tokens": None, **changes})


def _refusing_unknown_options(init):
    """SamplingParams' constructor, an option it does not have refused in one sentence (a
    SamplingParamsError, as every bad value is) rather than a TypeError."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise SamplingParamsError(f"SamplingParams has no option {unknown[0]!r}; its options are "
                                      f"{', '.join(sorted(names))}.")
        init(self, *args, **kwargs)

    return checked


SamplingParams.__init__ = _refusing_unknown_options(SamplingParams.__init__)


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


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or (id, bias) pairs) as sorted pairs, each bias in [-100, 100]."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise SamplingParamsError(f"logit_bias must map token ids to biases, got {short_repr(value)}.")
    else:
        pairs = list(value)
        if not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise SamplingParamsError(f"logit_bias must map token ids to biases, got {short_repr(value)}.")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise SamplingParamsError(f"logit_bias holds {len(pairs)} entries; at most {MAX_LOGIT_BIAS} are allowed.")
    out = {}
    for t, bias in pairs:
        tid = token_id(t)
        if tid is None or tid < 0:
            raise SamplingParamsError(f"logit_bias keys must be non-negative token ids, got {short_repr(t)}.")
        b = _real("logit_bias", bias, "a map of token ids to numbers in [-100, 100]")
        if not -100.0 <= b <= 100.0:
            raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {short_repr(bias)} "
                                      f"for token {tid}.")
        out[tid] = b
    return tuple(sorted(out.items()))


def _real(name: str, value, what: str) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise SamplingParamsError(f"{name} must be {what}, got {short_repr(value)}.")
    return float(value)


def _token_ids(value, name: str = "stop_token_ids") -> tuple[int, ...]:
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise SamplingParamsError(f"{name} must be a list of token ids, got {short_repr(value)}.")
    ids = tuple(value)
    for t in ids:
        if token_id(t) is None or token_id(t) < 0:
            raise SamplingParamsError(f"{name} must hold non-negative integer token ids, got {short_repr(t)}.")
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
