"""The server's output parsers (reasoning, tool calls) and the stream detokenizer, on hand-written
outputs cut into deltas at random places: streamed, they give what they give on the whole text,
which is what the text says by construction."""

from __future__ import annotations

import json
import random
import re

import pytest

from flexsgl.serve import reasoning, tools
from flexsgl.serve.message import MessageParser


def cuts(rng: random.Random, text: str) -> list[str]:
    """`text` in random pieces (empty ones included), as a stream may deliver it."""
    points = sorted(rng.randrange(len(text) + 1) for _ in range(rng.randrange(0, len(text) + 2)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def feed_all(parser, pieces):
    a = b = None
    out_a, out_b = "", []
    for p in pieces:
        a, b = parser.feed(p)
        out_a, out_b = out_a + a if isinstance(a, str) else out_a, out_b + (b if isinstance(b, list) else [b])
    a, b = parser.finish()
    return out_a + a, out_b + (b if isinstance(b, list) else [b])


@pytest.mark.parametrize("kind, prompt, text, want", [
    ("qwen3", "", "<think>\nplan </th it</think>\n\nThe answer", ("\nplan </th it", "\n\nThe answer")),
    ("qwen3", "", "No thinking here <think>", ("", "No thinking here <think>")),
    ("qwen3", "", "  <thi", ("", "  <thi")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "opened by the template</think>ok", ("opened by the template", "ok")),
    ("qwen3", "<think>\n\n</think>\n\n", "plain", ("", "plain")),
    ("deepseek_r1", "", "reasoning only, never closed", ("reasoning only, never closed", "")),
    ("deepseek_r1", "", "<think>step</think>done", ("step", "done")),
    ("deepseek_r1", "", "a</think>b</think>c", ("a", "b</think>c")),
    ("deepseek_r1", "<think>\n\n</think>\n\n", '{"a": 1}', ("", '{"a": 1}')),  # thinking off: content
    ("deepseek_r1", "<think>\n\n</think>", "<think>x</think>y", ("x", "y")),
])
def test_reasoning_is_split_the_same_streamed_and_whole(kind, prompt, text, want):
    assert reasoning.split(kind, text, prompt) == want
    for _ in range(30):
        seed = random.randrange(2**31)
        p = reasoning.ReasoningParser(kind, prompt)
        r, c = "", ""
        for piece in cuts(random.Random(seed), text):
            a, b = p.feed(piece)
            r, c = r + a, c + b
            assert "</think>" not in r, f"seed={seed}"
        a, b = p.finish()
        assert (r + a, c + b) == want, f"seed={seed}"


@pytest.mark.parametrize("prompt, kwargs, want", [
    ("<|im_start|>assistant\n", None, True), ("<|assistant|><think>\n", {}, True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None, False), ("assistant:", {"enable_thinking": False}, False),
    ("assistant:", {"thinking": False}, False), ("<think>a</think> user: b\nassistant:", {"enable_thinking": True}, True),
])
def test_thinking_mode_is_off_when_the_kwargs_say_so_or_the_prompt_closed_the_think_block(prompt, kwargs, want):
    assert reasoning.thinks(prompt, kwargs) is want
    if not want:  # deepseek_r1 then reads an output without <think> as content, as qwen3 does
        assert reasoning.split("deepseek_r1", "{}", prompt, kwargs) == ("", "{}")


CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("lookup", {"q": "a } \" ] tricky"}), ("noop", {})]


def hermes_text(calls, before="Let me check. "):
    return before + "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in calls)


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", hermes_text(CALLS), "Let me check. \n\n\n", CALLS),
    ("qwen3", hermes_text(CALLS[:1], ""), "\n", CALLS[:1]),
    ("hermes", "no calls, a < sign and <tool", "no calls, a < sign and <tool", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3_json", "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS), "", CALLS),
    ("llama3_json", "Plain text {with braces}", "Plain text {with braces}", []),
    ("mistral", "Sure. [TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS]), "Sure. ", CALLS),
    ("mistral", "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in CALLS), "", CALLS),
])
def test_tool_calls_are_found_the_same_streamed_and_whole(name, text, content, calls):
    want = (content, [(n, a) for n, a in calls])
    for i in range(30):
        seed = random.randrange(2**31)
        pieces = [text] if i == 0 else cuts(random.Random(seed), text)
        got_content, got_calls = feed_all(tools.PARSERS[name](), pieces)
        assert (got_content, [(c.name, json.loads(c.arguments)) for c in got_calls]) == want, f"seed={seed}"


def test_required_calls_come_out_of_their_json_array_as_each_completes():
    text = json.dumps([{"name": n, "parameters": a} for n, a in CALLS])
    for _ in range(30):
        seed = random.randrange(2**31)
        p = tools.RequiredCalls()
        released, seen = [], ""
        for piece in cuts(random.Random(seed), text):
            seen += piece
            _, calls = p.feed(piece)
            for c in calls:  # a call is released only once its object is in the text seen so far
                assert json.dumps({"name": c.name, "parameters": json.loads(c.arguments)}) in seen, f"seed={seed}"
            released += calls
        assert [(c.name, json.loads(c.arguments)) for c in released] == CALLS, f"seed={seed}"


def test_tool_choice_is_checked():
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert tools.plan([fn], None, None).mode == "none" and tools.plan([fn], None, "hermes").mode == "auto"
    assert tools.plan([fn], {"type": "function", "function": {"name": "f"}}, None).mode == "named"
    for tools_, choice, words in [([fn], "auto", "--tool-call-parser"), ([fn], {"function": {"name": "g"}}, "not among"),
                                  (None, "required", "needs tools"), ([{"type": "x"}], None, "tools[0]"),
                                  ([fn], "sometimes", "tool_choice must")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            tools.plan(tools_, choice, None)


def test_a_named_call_streams_its_arguments_and_a_required_one_ends_as_tool_calls():
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    p = MessageParser(None, tools.plan([fn], {"type": "function", "function": {"name": "f"}}, None), None)
    deltas = [p.feed(x) for x in ['{"a"', ': 1', '}']] + [p.finish()]
    first = deltas[0]["tool_calls"][0]
    assert first["function"]["name"] == "f" and first["id"].startswith("call_") and first["type"] == "function"
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d)
    assert args == '{"a": 1}' and p.message()["tool_calls"][0]["function"]["arguments"] == args
    assert p.message()["content"] is None and p.finish_reason("stop") == "stop"
    r = MessageParser("qwen3", tools.plan([fn], "required", None), None)
    r.feed('[{"name": "f", "parameters": {}}]')
    r.finish()
    assert r.finish_reason("stop") == "tool_calls" and len(r.message()["tool_calls"]) == 1


def test_with_parallel_tool_calls_false_auto_keeps_only_the_first_call_streamed_and_whole():
    fns = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n, _ in CALLS]
    text = hermes_text(CALLS)
    for i in range(30):
        seed = random.randrange(2**31)
        pieces = [text] if i == 0 else cuts(random.Random(seed), text)
        p = MessageParser(None, tools.plan(fns, "auto", "hermes", parallel=False), "hermes")
        deltas = [p.feed(x) for x in pieces] + [p.finish()]
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["index"], c["function"]["name"]) for c in streamed] == [(0, CALLS[0][0])], f"seed={seed}"
        (whole,) = p.message()["tool_calls"]
        assert json.loads(whole["function"]["arguments"]) == CALLS[0][1] and p.finish_reason("stop") == "tool_calls"


def test_a_tool_schema_that_constrains_the_output_is_checked_for_keywords_xgrammar_cannot_enforce():
    ok = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    loose = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    assert tools.plan([ok, loose], "auto", "hermes").mode == "auto"  # not a constraint: nothing to enforce
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        with pytest.raises(ValueError) as e:
            tools.plan([ok, loose], choice, None)
        assert str(e.value).startswith("tools[1].function.parameters uses uniqueItems at properties.tags,"), e.value
    assert tools.plan([ok, loose], {"type": "function", "function": {"name": "f"}}, None).mode == "named"
