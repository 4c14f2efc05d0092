"""One chat choice's output as OpenAI's message fields: `reasoning_content` (a reasoning parser's),
`content`, and `tool_calls` (a tool parser's, only its first call with parallel_tool_calls false,
or the constrained output of a required or named tool call), delta by delta for streams and whole
for responses."""

from __future__ import annotations

from flexsgl.serve import reasoning, tools


class MessageParser:
    def __init__(self, reasoning_parser: str | None, tool_plan: tools.ToolPlan, tool_parser: str | None,
                 prompt_text: str = "", template_kwargs: dict | None = None):
        self.reasoning = (reasoning.ReasoningParser(reasoning_parser, prompt_text, template_kwargs)
                          if reasoning_parser else None)
        self.mode = tool_plan.mode
        self.parallel = tool_plan.parallel  # false: only the first tool call is kept
        self.named = tool_plan.name if self.mode == "named" else None
        self.tools: tools.ToolParser | None = None
        if self.mode == "required":
            self.tools = tools.RequiredCalls()
        elif self.mode == "auto":
            self.tools = tools.PARSERS[tool_parser]()
        self.content, self.reasoning_text = "", ""
        self.calls: list[dict] = []  # whole tool calls, as in a message
        self.named_args = ""

    def feed(self, text: str) -> dict:
        """The delta fields `text` releases ({} when it releases nothing yet)."""
        r, c = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._delta(r, c, False)

    def finish(self) -> dict:
        """The delta fields held back until the end."""
        r, c = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._delta(r, c, True)

    def _delta(self, r: str, c: str, final: bool) -> dict:
        delta: dict = {}
        calls = []
        if self.named is not None:
            return self._named(r, c, final)
        if self.tools is not None:
            c, calls = self.tools.feed(c)
            if final:
                rest, more = self.tools.finish()
                c, calls = c + rest, calls + more
            if not self.parallel:
                calls = calls[:max(0, 1 - len(self.calls))]
        if r:
            self.reasoning_text += r
            delta["reasoning_content"] = r
        if c:
            self.content += c
            delta["content"] = c
        if calls:
            delta["tool_calls"] = []
            for call in calls:
                index = len(self.calls)
                whole = call.as_message(tools.call_id())
                self.calls.append(whole)
                delta["tool_calls"].append({"index": index, **whole})
        return delta

    def _named(self, r: str, c: str, final: bool) -> dict:
        """A named tool call: the (constrained) content is the function's arguments; the call opens
        with the first of them (after any reasoning), or at the end if there are none."""
        delta: dict = {}
        if r:
            self.reasoning_text += r
            delta["reasoning_content"] = r
        if not self.calls and (c or final):
            cid = tools.call_id()
            self.calls.append({"id": cid, "type": "function", "function": {"name": self.named, "arguments": c}})
            delta["tool_calls"] = [{"index": 0, "id": cid, "type": "function",
                                    "function": {"name": self.named, "arguments": c}}]
        elif c:
            self.calls[0]["function"]["arguments"] += c
            delta["tool_calls"] = [{"index": 0, "function": {"arguments": c}}]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason: "tool_calls" where the model's own choice (auto, required) called tools."""
        if reason == "stop" and self.calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def message(self) -> dict:
        """The whole message, once fed the whole output and finished."""
        m: dict = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            m["reasoning_content"] = self.reasoning_text or None
        if self.calls:
            m["tool_calls"] = self.calls
            if not self.content.strip():
                m["content"] = None
        return m
