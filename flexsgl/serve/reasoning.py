"""Reasoning parsers (`--reasoning-parser`): a chat output's `<think>...</think>` text goes to
`reasoning_content`, the rest to `content`, in whole responses and, delta by delta, in streams.

A request is in thinking mode (`thinks`) unless its chat_template_kwargs turn thinking off
(`enable_thinking` or `thinking` false) or its prompt ends with a closed think block (as Qwen3's
template writes for enable_thinking false). In thinking mode a structured-output constraint applies
only after the output's `</think>` (SamplingParams.reasoning_end, as vLLM's reasoning parsers'
end of reasoning), so the think block is free and the constrained text is the content.

- qwen3: the output reasons when it begins with `<think>` (or the prompt ends with an open
  `<think>`, as a template that opens it writes); otherwise it is all content.
- deepseek_r1: in thinking mode the output reasons from its start (the template opens `<think>`;
  a `<think>` the model writes itself is dropped) up to `</think>`, and without one it is all
  reasoning; out of thinking mode it reads as qwen3's.

Streaming-safe: text that may be the start of a tag split across deltas is held back until the
next delta (or the end) shows what it is.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def thinks(prompt_text: str, template_kwargs: dict | None = None) -> bool:
    """Whether a chat request with this prompt and chat_template_kwargs is in thinking mode."""
    kwargs = template_kwargs or {}
    if kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False:
        return False
    return not prompt_text.rstrip().endswith(END)


class ReasoningParser:
    def __init__(self, kind: str, prompt_text: str = "", template_kwargs: dict | None = None):
        self.kind = kind
        opened = prompt_text.rstrip().endswith(START)
        reasons = opened or (kind == "deepseek_r1" and thinks(prompt_text, template_kwargs))
        # "start": deciding whether the output opens with <think>; "reasoning"; "content".
        self.state = "reasoning" if reasons else "start"
        self.strip_start = reasons  # a <think> at the very start is dropped too
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) released by this delta."""
        self.buffer += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(START):
                    self.buffer, self.state = head[len(START):], "reasoning"
                    continue
                if START.startswith(head):  # may still become <think>
                    return reasoning, content
                self.state = "content"
                continue
            if self.state == "content":
                content += self.buffer
                self.buffer = ""
                return reasoning, content
            if self.strip_start:  # deepseek_r1, or a template-opened think: a leading <think> is not reasoning
                head = self.buffer.lstrip()
                if head.startswith(START):
                    self.buffer, self.strip_start = head[len(START):], False
                elif not START.startswith(head):
                    self.strip_start = False
                else:
                    return reasoning, content
            at = self.buffer.find(END)
            if at >= 0:
                reasoning += self.buffer[:at]
                self.buffer, self.state = self.buffer[at + len(END):], "content"
                continue
            keep = _partial_suffix(self.buffer, END)
            reasoning += self.buffer[:len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back at the end."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def split(kind: str, text: str, prompt_text: str = "", template_kwargs: dict | None = None) -> tuple[str, str]:
    """A whole output's (reasoning, content)."""
    p = ReasoningParser(kind, prompt_text, template_kwargs)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return r1 + r2, c1 + c2


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
