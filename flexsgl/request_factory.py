"""Prompts and sampling parameters to Requests: the checks of what a caller passes (one sentence
and a ValueError on bad input), and whether a Request can ever run here.

The LLM makes its requests through a RequestFactory; so does the server's HTTP process, which
holds a copy of the engine's (it pickles without its id counter) and checks input there, so that
bad input is answered at once while the engine process runs steps.
"""

from __future__ import annotations

import itertools
import numbers
import random
from collections.abc import Iterable, Mapping, Sequence

from flexsgl.attention.request_variants import RequestVariants
from flexsgl.cache.pool import KVPool
from flexsgl.errors import InputError, PromptError, SamplingParamsError, short_repr
from flexsgl.request import Request
from flexsgl.sampling.params import SamplingParams, token_id
from flexsgl.tokenizer import encode_prompt


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


def kept_tokens(prompt_len: int, truncate: int | None, ctx: int) -> int:
    """How many of a prompt's tokens, its last ones, truncate_prompt_tokens keeps (vLLM's; -1: as
    many as a context of `ctx` tokens leaves room for with one new token; None: all)."""
    if truncate is None:
        return prompt_len
    return min(prompt_len, ctx - 1 if truncate == -1 else truncate)


class RequestFactory:
    def __init__(self, model_name: str, config, tokenizer, page_size: int, capacity: int,
                 variants: RequestVariants | None = None, held_tokens: int | None = None,
                 no_structured_outputs: str | None = None, whole_prompt_tokens: int | None = None, seed: int = 0,
                 eos_ids: tuple[int, ...] = ()):
        """`config`: the model's ModelConfig; `capacity`: KV pages a request may ever use;
        `variants`: what the engine's attention variants take from a request (None: nothing);
        `held_tokens`: the most KV slots a request holds at once (refusal);
        `no_structured_outputs`: why this engine cannot take structured outputs (None: it can);
        `whole_prompt_tokens`: the longest prompt where prompts are prefilled in one step (refusal);
        `seed`: where the noise seeds of requests without a seed of their own come from, one after
        another (an engine's random_seed: the same seed, the same requests, the same samples);
        `eos_ids`: end tokens besides config.json's and the tokenizer's (generation_config.json's)."""
        self.model_name, self.config, self.tokenizer = model_name, config, tokenizer
        self.page_size, self.capacity = page_size, capacity
        self.variants = RequestVariants([]) if variants is None else variants
        self.held_tokens, self.no_structured_outputs = held_tokens, no_structured_outputs
        self.whole_prompt_tokens = whole_prompt_tokens
        self.seed = seed
        self.extra_eos = tuple(eos_ids)
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        # every end token the model's files name: config.json's, generation_config.json's, the tokenizer's
        self.eos = tuple(i for i in dict.fromkeys([*config.eos_token_ids, *eos_ids,
                                                   *([tokenizer_eos] if isinstance(tokenizer_eos, int) else [])])
                         if i < config.vocab_size)
        self._ids = itertools.count()
        self._seeds = random.Random(seed)

    def __reduce__(self):
        return RequestFactory, (self.model_name, self.config, self.tokenizer, self.page_size, self.capacity,
                                self.variants, self.held_tokens, self.no_structured_outputs, self.whole_prompt_tokens,
                                self.seed, self.extra_eos)

    def make_request(self, prompt: str | Sequence[int], sampling: SamplingParams, index: int = 0) -> Request:
        """Check one prompt and its sampling parameters and turn them into a Request (not queued);
        bad input raises a ValueError (PromptError, SamplingParamsError) that says why."""
        if not isinstance(sampling, SamplingParams):
            raise SamplingParamsError(f"Sampling parameters must be a SamplingParams, got {type(sampling).__name__}.")
        prompt = check_prompt(prompt, index)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError(f"Model {self.model_name!r} has no tokenizer; pass prompts as token ids.")
            ids = encode_prompt(self.tokenizer, prompt, index)
        else:
            ids = prompt
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise PromptError(f"Prompt {index} has token ids outside the vocabulary [0, {vocab}).")
        ctx = self.config.max_position
        ids = list(ids[len(ids) - kept_tokens(len(ids), sampling.truncate_prompt_tokens, ctx):])
        if len(ids) >= ctx:
            raise PromptError(f"Prompt {index} has {len(ids)} tokens; the model's context is {ctx}, "
                              "leaving no room for a new token.")
        if any(t >= vocab for t in sampling.stop_token_ids):
            raise SamplingParamsError(f"stop_token_ids of prompt {index} hold ids outside the vocabulary [0, {vocab}).")
        takes = self.variants.params
        unknown = sorted(set(sampling.attention_params or ()) - set(takes))
        if unknown:
            takes = f"it takes {', '.join(takes)}" if takes else "it takes none"
            raise SamplingParamsError(f"attention_params of prompt {index} name {unknown[0]!r}, which no attention "
                                      f"variant of this engine takes ({takes}).")
        for name, value in (sampling.attention_params or {}).items():
            takes = self.variants.refusal(name, value)
            if takes is not None:
                raise SamplingParamsError(f"attention_params of prompt {index} give {name} {value!r}, and it takes "
                                          f"{takes}.")
        if sampling.stop and self.tokenizer is None:
            raise SamplingParamsError(f"stop strings of prompt {index} are looked for in the text, and model "
                                      f"{self.model_name!r} has no tokenizer to make one; use stop_token_ids.")
        if any(t >= vocab for t, _ in sampling.logit_bias):
            raise SamplingParamsError(f"logit_bias of prompt {index} names ids outside the vocabulary [0, {vocab}).")
        if sampling.allowed_token_ids is not None and sampling.allowed_token_ids[-1] >= vocab:
            raise SamplingParamsError(f"allowed_token_ids of prompt {index} hold ids outside the vocabulary "
                                      f"[0, {vocab}).")
        if sampling.structured_outputs is not None:
            self.check_structured(sampling.structured_outputs)
        eos = self.eos
        if sampling.allowed_token_ids is not None and sampling.min_tokens > 0 and set(sampling.allowed_token_ids) <= \
                set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos)):
            raise SamplingParamsError(f"allowed_token_ids of prompt {index} are all stop tokens, which "
                                      "min_tokens keeps out of the first tokens: no token could be sampled.")
        return Request(next(self._ids), ids, sampling, eos, ctx, rng_seed=self._seeds.getrandbits(62),
                       cache_salt=self.variants.salt(ids, sampling.attention_params))

    def make_requests(self, prompt: str | Sequence[int], sampling: SamplingParams, index: int = 0) -> list[Request]:
        """make_request for each of sampling.n samples: sample 0 leads (its prompt pages go to the
        prefix cache once computed) and the others wait for it, then reuse those pages."""
        first = self.make_request(prompt, sampling, index)
        rest = [Request(next(self._ids), first.prompt_ids, sampling, first.eos_ids, first.max_len, index=i,
                        leader=first, rng_seed=self._seeds.getrandbits(62), cache_salt=first.cache_salt)
                for i in range(1, sampling.n)]
        first.shares_prompt = bool(rest)
        return [first, *rest]

    def check_structured(self, spec) -> None:
        """Raise SamplingParamsError unless this engine can constrain an output to `spec` (parsed
        here, so a schema, regex or grammar that cannot be used is refused before it runs)."""
        if self.no_structured_outputs is not None:
            raise SamplingParamsError(f"Structured outputs cannot be used here: {self.no_structured_outputs}.")
        from flexsgl.sampling import grammar

        grammar.parse(spec)

    def longest(self) -> int:
        """The most tokens (prompt and outputs) a request can have here: the context, or less where
        the whole KV cache holds less and a request keeps every token's K/V (no window)."""
        cache = self.capacity * self.page_size
        if self.held_tokens is not None and self.held_tokens <= cache:
            return self.config.max_position
        return min(self.config.max_position, cache)

    def refusal(self, req: Request) -> str | None:
        """Why `req` can never run here (longer than the context or the whole KV cache), or None."""
        return refusal(req, self.page_size, self.capacity, self.held_tokens, self.whole_prompt_tokens)


def refusal(req: Request, page_size: int, capacity: int, held_tokens: int | None = None,
            whole_prompt_tokens: int | None = None) -> str | None:
    """Why `req` can never run: longer than the context, needing more pages at once than the whole
    cache holds (held_tokens: the most KV slots a request holds at once where every layer attends
    within a window, flexsgl/scheduler.py; None: its whole length), or a prompt longer than a step
    where the attention needs it prefilled in one (whole_prompt_tokens: a step's tokens there)."""
    ctx = req.max_len
    if req.target_len > ctx:
        return (f"the prompt ({req.prompt_len} tokens) plus max_new_tokens ({req.sampling.max_new_tokens}) "
                f"exceeds the model's context of {ctx} tokens")
    if whole_prompt_tokens is not None and req.prompt_len > whole_prompt_tokens:
        return (f"the prompt ({req.prompt_len} tokens) is longer than a prefill step ({whole_prompt_tokens} "
                f"tokens, max_num_batched_tokens), and this engine's attention sees each prompt whole, so it "
                f"prefills a prompt in one step")
    need = KVPool.num_pages_for(req.target_len if held_tokens is None else min(req.target_len, held_tokens),
                                page_size)
    if need > capacity:
        return (f"the prompt plus max_new_tokens needs {need * page_size} KV slots, more than the whole "
                f"cache holds ({capacity * page_size})")
    return None
