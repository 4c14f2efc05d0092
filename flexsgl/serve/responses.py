"""OpenAI response bodies and stream chunks, for completions and chat completions alike.

`Choices` gathers the events of one HTTP request's choices (prompts x n) into text, token ids and
log-probabilities, and turns them into a whole response or into one chunk per event: a chat
choice's text goes through its MessageParser (message.py: reasoning and tool calls), a completion
choice's starts with its prompt when echoed.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Callable

from flexsgl.request import TokenLogprobs
from flexsgl.serve.message import MessageParser
from flexsgl.serve.messages import Event


class Choices:
    """`parser`: makes each chat choice's MessageParser (reasoning, tool calls); `echo`: each
    completion choice's prompt text, put before its output (completions' echo);
    `continuous_usage`: every stream chunk carries the usage so far (stream_options'
    continuous_usage_stats), where chunks carry usage; `prompt_logprobs`: the client asked for
    vLLM's prompt_logprobs (echo with logprobs computes them too, for the echoed prompt's entries);
    `scores_prompt`: echo with max_tokens 0, the one token computed for the prompt's
    log-probabilities left out (its text, log-probabilities and count)."""

    def __init__(self, chat: bool, model: str, tokenizer, n_choices: int, prompt_tokens: int,
                 parser: Callable[[], MessageParser] | None = None, echo: list[str] | None = None,
                 continuous_usage: bool = False, prompt_logprobs: bool = False, scores_prompt: bool = False):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts = [""] * n_choices
        self.tokens = [0] * n_choices  # tokens received, per choice
        self.text_offsets = [0] * n_choices  # a completion stream's next logprobs text_offset, per choice
        self.continuous_usage = continuous_usage
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n_choices)]
        self.outputs = [None] * n_choices
        self.prompt_tokens = prompt_tokens
        self.parser = parser
        self.parsers = [parser() for _ in range(n_choices)] if chat and parser is not None else None
        self.echo = echo
        self.show_prompt_logprobs = prompt_logprobs
        self.scores_prompt = scores_prompt
        self.started: set[int] = set()  # choices whose first chunk (a chat's role, a completion's echo) went out
        self._template: tuple[str, str, str] | None = None  # _token_chunk's pieces, made on first use

    @property
    def done(self) -> bool:
        return all(o is not None for o in self.outputs)

    def shown(self, ev: Event) -> Event:
        """`ev` as the response shows it: where the request scores its prompt, without its token, and
        ending by length whatever that token would have stopped."""
        if not self.scores_prompt:
            return ev
        out = ev.output
        if out is not None and out.finish_reason in ("stop", "length"):
            out = dataclasses.replace(out, finish_reason="length", stop_reason=None)
        return dataclasses.replace(ev, text="", token_ids=[], logprobs=[], output=out)

    def add(self, ev: Event) -> None:
        self.texts[ev.choice] += ev.text
        self.tokens[ev.choice] += len(ev.token_ids)
        self.logprobs[ev.choice] += ev.logprobs
        if ev.output is not None:
            self.outputs[ev.choice] = ev.output

    def usage(self) -> dict:
        """The usage of the tokens so far (every token, once every choice is done)."""
        done = [o for o in self.outputs if o is not None]
        completion = 0 if self.scores_prompt else sum(n if o is None else len(o.token_ids)
                                                      for n, o in zip(self.tokens, self.outputs))
        cached = sum(o.cached_tokens for o in done if o.index == 0)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- whole responses

    def response(self, want_logprobs: bool) -> dict:
        choices = []
        for i, (text, out) in enumerate(zip(self.texts, self.outputs)):
            c = {"index": i, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason, "logprobs": None}
            if self.chat:
                p = self.parser() if self.parser is not None else None
                if p is None:
                    c["message"] = {"role": "assistant", "content": text}
                else:
                    p.feed(text)
                    p.finish()
                    c["message"], c["finish_reason"] = p.message(), p.finish_reason(out.finish_reason)
                if want_logprobs:
                    c["logprobs"] = self._logprobs(self.logprobs[i], 0)
            else:
                echo = self.echo[i] if self.echo else ""
                c["text"] = echo + text
                if want_logprobs:
                    prompt = self._prompt_entries(out.prompt_token_ids, out.prompt_logprobs) if echo else []
                    c["logprobs"] = self._logprobs(self.logprobs[i], 0, prompt)
            if self.show_prompt_logprobs and out.prompt_logprobs is not None:
                c["prompt_logprobs"] = self._prompt_logprobs(out.prompt_logprobs)
            choices.append(c)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    # ---- stream chunks

    def chunk(self, ev: Event, want_logprobs: bool, include_usage: bool) -> list[str]:
        """The SSE lines of one event (a chat choice's first one also sends its role)."""
        out = []
        first = ev.choice not in self.started
        self.started.add(ev.choice)
        if self.chat and first:
            out.append(self._chunk({"index": ev.choice, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}, include_usage))
        text = ev.text
        echo = self.echo[ev.choice] if self.echo and not self.chat else ""
        if first and echo:
            text = echo + text
        delta = None
        if self.parsers is not None:
            p = self.parsers[ev.choice]
            delta = p.feed(ev.text)
            if ev.output is not None:
                delta = _merge(delta, p.finish())
        if not text and not ev.token_ids and ev.output is None:
            return out
        prompt = self._prompt_entries(*ev.prompt) if want_logprobs and first and echo and ev.prompt else None
        mid = ev.output is None and not (want_logprobs and (ev.logprobs or prompt))
        if mid and delta is not None and not delta:  # the parsers hold this token's text back
            return out
        if mid and (delta is None or delta == {"content": text}) and not self.continuous_usage:  # the common chunk
            out.append(self._token_chunk(ev.choice, text, include_usage))
            return out
        lp = None
        if want_logprobs and (ev.logprobs or prompt):  # a completion's first chunk also has its echoed prompt's
            lp = self._logprobs(ev.logprobs, self.text_offsets[ev.choice], prompt)
            if not self.chat:
                self.text_offsets[ev.choice] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        reason = None if ev.output is None else ev.output.finish_reason
        if reason is not None and self.parsers is not None:
            reason = self.parsers[ev.choice].finish_reason(reason)
        c = {"index": ev.choice, "logprobs": lp, "finish_reason": reason}
        if ev.output is not None:
            c["stop_reason"] = ev.output.stop_reason
            if self.show_prompt_logprobs and ev.output.prompt_logprobs is not None:
                c["prompt_logprobs"] = self._prompt_logprobs(ev.output.prompt_logprobs)
        if self.chat:
            c["delta"] = delta if delta is not None else ({"content": text} if text else {})
        else:
            c["text"] = text
        out.append(self._chunk(c, include_usage))
        return out

    def _token_chunk(self, choice: int, text: str, include_usage: bool) -> str:
        """What `_chunk` makes of a mid-stream token without log-probabilities, the same bytes, from
        a template: one JSON encoding of the text instead of the whole body's."""
        if self._template is None:
            head = json.dumps({"id": self.id, "object": self._chunk_object(), "created": self.created,
                               "model": self.model})[:-1]
            tail = "}]" + (', "usage": null' if include_usage else "") + "}\n\n"
            key = '"delta": {"content": ' if self.chat else '"text": '
            self._template = (f'data: {head}, "choices": [{{"index": ', ', "logprobs": null, "finish_reason": null, '
                              + key, ("}" if self.chat else "") + tail)
        start, middle, end = self._template
        if self.chat and not text:
            return self._chunk({"index": choice, "logprobs": None, "finish_reason": None, "delta": {}}, include_usage)
        return f"{start}{choice}{middle}{json.dumps(text)}{end}"

    def usage_chunk(self) -> str:
        return sse({"id": self.id, "object": self._chunk_object(), "created": self.created, "model": self.model,
                    "choices": [], "usage": self.usage()})

    def _chunk(self, choice: dict, include_usage: bool) -> str:
        body = {"id": self.id, "object": self._chunk_object(), "created": self.created, "model": self.model,
                "choices": [choice]}
        if include_usage:
            body["usage"] = self.usage() if self.continuous_usage else None
        return sse(body)

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    # ---- log-probabilities

    def _token(self, token_id: int) -> str:
        return str(token_id) if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _logprobs(self, lps: list[TokenLogprobs], offset: int, prompt: list | None = None) -> dict:
        """OpenAI's logprobs of `lps`; a completion's `prompt` entries ((token, logprob or None,
        top or None) per echoed prompt token) come first. A completion's text_offset is `offset` at
        its first entry and grows by each token's text (as vLLM counts them, a special token's too)."""
        if self.chat:
            def entry(tid: int, lp: float) -> dict:
                text = self._token(tid)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                                for t in lps]}
        prompt = prompt or []
        tokens = [p[0] for p in prompt] + [self._token(t.token_id) for t in lps]
        offsets, at = [], offset
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": [p[1] for p in prompt] + [t.logprob for t in lps],
                "top_logprobs": [p[2] for p in prompt] + [self._top(t) for t in lps],
                "text_offset": offsets}

    def _top(self, lp: TokenLogprobs) -> dict:
        """A completion token's top_logprobs: the top ones and the token itself (up to N + 1 entries,
        as OpenAI's legacy API and vLLM give)."""
        top = {self._token(i): v for i, v in lp.top}
        top.setdefault(self._token(lp.token_id), lp.logprob)
        return top

    def _prompt_entries(self, ids: list[int], lps: list | None) -> list:
        """(token text, its log-probability, its top log-probabilities) per prompt token, for echo."""
        lps = lps or [None] * len(ids)
        return [(self._token(t), None if lp is None else lp.logprob,
                 None if lp is None else self._top(lp)) for t, lp in zip(ids, lps)]

    def _prompt_logprobs(self, lps: list) -> list:
        """vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob,
        rank (where among the top ones), decoded_token}} for the token itself and the top ones."""
        out = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entries = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": self._token(i)}
                       for r, (i, v) in enumerate(lp.top)}
            if str(lp.token_id) not in entries:
                entries[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": self._token(lp.token_id)}
            out.append(entries)
        return out


def _merge(a: dict, b: dict) -> dict:
    """Two deltas of one choice as one."""
    out = dict(a)
    for k, v in b.items():
        if k == "tool_calls":
            out[k] = out.get(k, []) + v
        elif k in out:
            out[k] += v
        else:
            out[k] = v
    return out


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
