"""OpenAI response bodies and stream chunks, for completions and chat completions alike.

`Choices` gathers the events of one HTTP request's choices (prompts x n) into text, token ids and
log-probabilities, and turns them into a whole response or into one chunk per event.
"""

from __future__ import annotations

import json
import time
import uuid

from flexsgl.request import TokenLogprobs
from flexsgl.serve.messages import Event


def error_body(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


class Choices:
    def __init__(self, chat: bool, model: str, tokenizer, n_choices: int, prompt_tokens: int):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts = [""] * n_choices
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n_choices)]
        self.outputs = [None] * n_choices
        self.prompt_tokens = prompt_tokens
        self.started: set[int] = set()  # chat choices whose role chunk went out
        self._template: tuple[str, str, str] | None = None  # _token_chunk's pieces, made on first use

    @property
    def done(self) -> bool:
        return all(o is not None for o in self.outputs)

    def add(self, ev: Event) -> None:
        self.texts[ev.choice] += ev.text
        self.logprobs[ev.choice] += ev.logprobs
        if ev.output is not None:
            self.outputs[ev.choice] = ev.output

    def usage(self) -> dict:
        done = [o for o in self.outputs if o is not None]
        completion = sum(len(o.token_ids) for o in done)
        cached = sum(o.cached_tokens for o in done if o.index == 0)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- whole responses

    def response(self, want_logprobs: bool) -> dict:
        choices = []
        for i, (text, out) in enumerate(zip(self.texts, self.outputs)):
            lp = self._logprobs(self.logprobs[i], 0) if want_logprobs else None
            c = {"index": i, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason, "logprobs": lp}
            c.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            choices.append(c)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    # ---- stream chunks

    def chunk(self, ev: Event, want_logprobs: bool, include_usage: bool) -> list[str]:
        """The SSE lines of one event (a chat choice's first one also sends its role)."""
        out = []
        if self.chat and ev.choice not in self.started:
            self.started.add(ev.choice)
            out.append(self._chunk({"index": ev.choice, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}, include_usage))
        if not ev.text and not ev.token_ids and ev.output is None:
            return out
        if ev.output is None and not (want_logprobs and ev.logprobs):  # a token mid-stream: the common chunk
            out.append(self._token_chunk(ev.choice, ev.text, include_usage))
            return out
        offset = len(self.texts[ev.choice]) - len(ev.text)
        lp = self._logprobs(ev.logprobs, offset) if want_logprobs and ev.logprobs else None
        c = {"index": ev.choice, "logprobs": lp,
             "finish_reason": None if ev.output is None else ev.output.finish_reason}
        if ev.output is not None:
            c["stop_reason"] = ev.output.stop_reason
        c.update({"delta": {"content": ev.text} if ev.text else {}} if self.chat else {"text": ev.text})
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
            body["usage"] = None
        return sse(body)

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    # ---- log-probabilities

    def _token(self, token_id: int) -> str:
        return str(token_id) if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _logprobs(self, lps: list[TokenLogprobs], offset: int) -> dict:
        if self.chat:
            def entry(tid: int, lp: float) -> dict:
                text = self._token(tid)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                                for t in lps]}
        tokens = [self._token(t.token_id) for t in lps]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
                "top_logprobs": [{self._token(i): v for i, v in t.top} for t in lps], "text_offset": offsets}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
