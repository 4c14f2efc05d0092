"""Tool calling: the request's `tools` and `tool_choice`, and the parsers that find tool calls in
a chat output, whole or delta by delta.

tool_choice (OpenAI's):
- "none": the tools go to the chat template, the output is text.
- "auto" (the default when tools are given and a parser is set): the model decides; the output
  is parsed by `--tool-call-parser`'s format, and with parallel_tool_calls false only its first
  call is kept (vLLM's maybe_filter_parallel_tool_calls). Without a parser the default is "none",
  and an explicit "auto" is refused.
- "required": the output is constrained (structured outputs) to a JSON array of
  {"name", "parameters"} objects, one of the tools' each, so the calls always parse and their
  arguments follow the tools' schemas; as vLLM does (one call at most with parallel_tool_calls
  false).
- {"type": "function", "function": {"name": ...}}: the output is constrained to that function's
  parameters schema and is its arguments.

A schema that constrains the output (required, named) must use no keyword xgrammar cannot enforce
(structured.check_json_schema): one that does is refused with a 400 naming the tool and keyword.

Parsers (PARSERS), each streaming-safe: text that may begin a tool-call marker is held back, and
each call is released once it is complete (its name and whole arguments in one delta):
- hermes (also qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text around
  the calls is content;
- llama3_json: an output that is JSON objects {"name": ..., "parameters": {...}} (after an
  optional `<|python_tag|>`), separated by `;`;
- mistral: content, then `[TOOL_CALLS]` and a JSON array of {"name", "arguments"} objects, or
  `[TOOL_CALLS]name[ARGS]{...}` per call (newer tokenizers).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from flexsgl.errors import SamplingParamsError
from flexsgl.sampling.structured import StructuredOutputsParams, check_json_schema


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text

    def as_message(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---- the request


@dataclass
class ToolPlan:
    """What a chat request's tools ask of the output: `mode` none, auto, required or named."""

    mode: str
    functions: dict[str, dict]  # name -> the function's JSON schema of parameters
    name: str | None = None  # the named function
    parallel: bool = True  # several calls allowed (parallel_tool_calls)

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=self.functions[self.name])
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.functions, self.parallel))
        return None


def plan(tools: list[dict] | None, tool_choice, parser: str | None, parallel: bool = True) -> ToolPlan:
    """Check `tools` and `tool_choice` (SamplingParamsError, a 400, says what is wrong)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise SamplingParamsError("tool_choice needs tools.")
        return ToolPlan("none", {})
    functions = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise SamplingParamsError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                      "\"parameters\": {...}}}.")
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise SamplingParamsError(f"tools[{i}].function.parameters must be a JSON schema object.")
        functions[f["name"]] = params
    if tool_choice is None:
        return ToolPlan("auto" if parser else "none", functions, parallel=parallel)
    if tool_choice == "auto":
        if not parser:
            raise SamplingParamsError('tool_choice "auto" needs the server to be started with --tool-call-parser.')
        return ToolPlan("auto", functions, parallel=parallel)
    if tool_choice == "none":
        return ToolPlan("none", functions, parallel=parallel)
    if tool_choice == "required":
        _check_parameters(functions, functions)
        return ToolPlan("required", functions, parallel=parallel)
    if isinstance(tool_choice, dict):
        f = tool_choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise SamplingParamsError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                      '"function": {"name": ...}}.')
        if name not in functions:
            raise SamplingParamsError(f"tool_choice names the function {name[:60]!r}, which is not among the tools.")
        _check_parameters(functions, [name])
        return ToolPlan("named", functions, name)
    raise SamplingParamsError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                              '"function": {"name": ...}}.')


def _check_parameters(functions: dict[str, dict], names) -> None:
    """The parameters schemas of the functions `names`, which constrain the output, use no keyword
    xgrammar cannot enforce (SamplingParamsError naming the tool and the keyword)."""
    order = list(functions)
    for name in names:
        check_json_schema(functions[name], f"tools[{order.index(name)}].function.parameters")


def required_schema(functions: dict[str, dict], parallel: bool = True) -> dict:
    """A JSON array of one or more calls (one without `parallel`), each {"name": one of the
    functions, "parameters": its schema}."""
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
         "required": ["name", "parameters"]} for name, params in functions.items()]}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- the output


class ToolParser:
    """feed(text) -> (content, calls) released by a delta; finish() -> what is left at the end."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.buffer, self.in_call = "", False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buffer, self.OPEN)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, calls
                content += self.buffer[:at]
                self.buffer, self.in_call = self.buffer[at + len(self.OPEN):], True
            at = self.buffer.find(self.CLOSE)
            if at < 0:
                return content, calls
            body, self.buffer, self.in_call = self.buffer[:at], self.buffer[at + len(self.CLOSE):], False
            call = _call(body, "arguments")
            if call is None:
                content += self.OPEN + body + self.CLOSE
            else:
                calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        call = _call(rest, "arguments")  # an unclosed call that is whole
        return ("", [call]) if call is not None else (self.OPEN + rest, [])


class JsonCallsParser(ToolParser):
    """Calls written as JSON objects one after another (separated by `separators`), once the output
    has shown it is calls (it begins with `{` or `[` after `prefix`); any other output is content."""

    def __init__(self, prefix: str, args_key: str, separators: str):
        self.prefix, self.args_key, self.separators = prefix, args_key, separators
        self.buffer, self.state = "", "start"  # start, content or calls
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            if self.prefix and head.startswith(self.prefix):
                head = head[len(self.prefix):].lstrip()
            elif self.prefix and self.prefix.startswith(head):
                return "", []
            if not head:
                return "", []
            self.state = "calls" if head[0] in "{[" else "content"
            if self.state == "calls":
                self.buffer = head
        if self.state == "content":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", self._calls()

    def _calls(self) -> list[ToolCall]:
        calls = []
        while True:
            self.buffer = self.buffer.lstrip(self.separators)
            if not self.buffer:
                return calls
            try:
                value, end = self.decoder.raw_decode(self.buffer)
            except ValueError:
                return calls
            self.buffer = self.buffer[end:]
            for item in value if isinstance(value, list) else [value]:
                call = _call(item, self.args_key)
                if call is not None:
                    calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if self.state == "calls":
            return rest.strip(), []
        return rest, []


class Llama3JsonParser(JsonCallsParser):
    def __init__(self):
        super().__init__("<|python_tag|>", "parameters", " \n\t;")


class MistralParser(ToolParser):
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self):
        self.buffer, self.in_calls = "", False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        if self.in_calls:
            return "", []
        at = self.buffer.find(self.MARK)
        if at >= 0:
            content, self.buffer, self.in_calls = self.buffer[:at], self.buffer[at:], True
            return content, []
        keep = _partial_suffix(self.buffer, self.MARK)
        content, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_calls:
            return rest, []
        calls = []
        for part in rest.split(self.MARK)[1:]:
            part = part.strip()
            if part.startswith("["):
                try:
                    value = json.loads(part)
                except ValueError:
                    return rest, []
                calls += [c for c in (_call(v, "arguments") for v in value) if c is not None]
            elif self.ARGS in part:
                name, _, args = part.partition(self.ARGS)
                try:
                    calls.append(ToolCall(name.strip(), json.dumps(json.loads(args), ensure_ascii=False)))
                except ValueError:
                    return rest, []
            elif part:
                return rest, []
        return "", calls


PARSERS = {"hermes": HermesParser, "qwen3": HermesParser, "llama3_json": Llama3JsonParser,
           "mistral": MistralParser}


class RequiredCalls(ToolParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects
    (constrained to it); each call is released once its object is complete."""

    def __init__(self):
        self.buffer, self.decoder = "", json.JSONDecoder()

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        calls = []
        while True:
            self.buffer = self.buffer.lstrip(" \n\t\r,[]")  # the array's own punctuation
            try:
                value, end = self.decoder.raw_decode(self.buffer)
            except ValueError:  # incomplete (or empty)
                return "", calls
            self.buffer = self.buffer[end:]
            call = _call(value, "parameters")
            if call is not None:
                calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return "", []


def _call(body, args_key: str) -> ToolCall | None:
    """A call from a JSON object (or its text) {"name": ..., args_key: {...} or its JSON text}."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = body.get(args_key, body.get("arguments", body.get("parameters", {})))
    if isinstance(args, str):
        return ToolCall(body["name"], args)
    return ToolCall(body["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
