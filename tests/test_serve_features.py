"""What vLLM and SGLang users send `flexsgl serve`, against the real server process with the official
`openai` client: structured outputs, tool calls, reasoning, logit_bias, echo and prompt
log-probabilities, /tokenize and /detokenize, the API key, a chat template, the request log, the
metrics, every error route, and a 20 MB prompt that must not stall other clients.

Every response body and stream chunk is checked against the openai package's pydantic types (the
client builds them without checking). One server process serves the module: the embedded model
with --reasoning-parser qwen3, --tool-call-parser hermes, an API key, a chat template file, a
30 MB body limit and the request log. The tiny model's outputs follow a constraint where a test
needs a given text (a tool call, a think block): its own text is whatever it is."""

from __future__ import annotations

import contextlib
import json
import random
import re
import tempfile
import threading
import time
import urllib.error
import urllib.request

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
pytest.importorskip("prometheus_client")

from typing import Dict, List, Literal, Optional  # noqa: E402

from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletionChunk  # noqa: E402
from openai.types.completion_choice import CompletionChoice, Logprobs  # noqa: E402

from flexsgl.model.presets import EMBEDDED  # noqa: E402
from tests.test_serve import TIMEOUT, random_prompt, server_process  # noqa: E402
from tests.test_structured import WORDS, random_schema  # noqa: E402

KEY = "sk-flexsgl-test"
TEMPLATE = ("{% if tools %}[tools] {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] or '' }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>"
            "{% if enable_thinking is defined and enable_thinking %}<think>\n{% else %}<think></think>{% endif %}"
            "{% endif %}")  # thinking only when asked for: the prompt closes the think block otherwise
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@contextlib.contextmanager
def logged_server(*extra: str):
    """A `flexsgl serve` process on the embedded model writing its log to a file; yields (base URL,
    the log's path) once healthy. Its engine computes on one OpenMP thread: on a 2-core machine,
    OpenMP threads on every core, spinning beside the HTTP process and this test's clients, stall
    the CPU engine itself for seconds, which would hide what the stall test measures."""
    with tempfile.NamedTemporaryFile("w+", prefix="flexsgl-serve-", suffix=".log") as log, \
            server_process(*extra, log=log, env={"OMP_NUM_THREADS": "1"}) as (base, _):
        yield base, log.name


def request(method: str, url: str, body: bytes | None = None, key: str | None = KEY,
            content_type: str | None = "application/json", timeout: float = TIMEOUT) -> tuple[int, dict | str]:
    headers = {"Content-Type": content_type} if content_type else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError:
        return 0, ""
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


@pytest.fixture(scope="module")
def server():
    with tempfile.NamedTemporaryFile("w", suffix=".jinja") as template:
        template.write(TEMPLATE)
        template.flush()
        with logged_server("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--api-key", KEY,
                           "--chat-template", template.name, "--max-request-bytes", "30000000",
                           "--enable-log-requests") as (base, log):
            yield base, log


@pytest.fixture(scope="module")
def base(server):
    return server[0]


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(EMBEDDED["tiny-docs"]))


# Two things the legacy completions API sends that the openai package's Completion type does not
# allow: a null finish_reason in a stream's chunks before the last, and with echo a null
# log-probability (and top log-probabilities) for the first prompt token, which no token precedes.
# Completion chunks are checked against this type, the same but for those two fields.
class EchoLogprobs(Logprobs):
    token_logprobs: Optional[List[Optional[float]]] = None
    top_logprobs: Optional[List[Optional[Dict[str, float]]]] = None


class StreamCompletionChoice(CompletionChoice):
    finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None
    logprobs: Optional[EchoLogprobs] = None


class StreamCompletion(Completion):
    choices: List[StreamCompletionChoice]


def checked(obj, as_type=None):
    """`obj` as its pydantic type (or `as_type`) validates it (the client constructs objects
    without checking them)."""
    return (as_type or type(obj)).model_validate(obj.to_dict())


def chat(client, **kw):
    out = client.chat.completions.create(model="tiny-docs", **kw)
    if kw.get("stream"):
        chunks = [checked(c) for c in out]
        assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
        return chunks
    return checked(out)


def complete(client, **kw):
    out = client.completions.create(model="tiny-docs", **kw)
    if kw.get("stream"):
        return [checked(c, StreamCompletion) for c in out]
    assert isinstance(out, Completion)
    return checked(out, StreamCompletion if kw.get("echo") else None)


def assemble_tool_calls(chunks) -> list[dict]:
    """A stream's tool-call deltas put together by index: id, name and the arguments' pieces."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for ch in c.choices:
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                if d.function is not None:
                    call["name"] = call["name"] or d.function.name
                    call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def stream_fields(chunks, field: str) -> str:
    return "".join(getattr(ch.delta, field, None) or "" for c in chunks for ch in c.choices)


def test_json_schema_outputs_parse_and_validate(client):
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    schema = random_schema(rng)
    messages = [{"role": "user", "content": random_prompt(rng)}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    whole = chat(client, messages=messages, response_format=fmt, max_tokens=200, temperature=0.8, seed=seed)
    chunks = chat(client, messages=messages, response_format=fmt, max_tokens=200, temperature=0.8, seed=seed,
                  stream=True)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop", f"seed={seed} {text!r}"
    jsonschema.validate(json.loads(text), schema)
    assert stream_fields(chunks, "content") == text, f"seed={seed}"
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}, {"response_format": fmt}):
        out = complete(client, prompt=random_prompt(rng), max_tokens=200, temperature=0.8, seed=seed,
                       extra_body=extra)
        assert out.choices[0].finish_reason == "stop", f"seed={seed}"
        jsonschema.validate(json.loads(out.choices[0].text), schema)
    obj = chat(client, messages=messages, response_format={"type": "json_object"}, max_tokens=300, temperature=0.5,
               seed=seed)
    content = obj.choices[0].message.content
    assert content.lstrip().startswith("{"), f"seed={seed} {content!r}"  # any object, however far it got
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict), f"seed={seed} {content!r}"


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammar_constraints(client, stream):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    choices = rng.sample(WORDS, 3)
    cases = [({"regex": r"[a-e]{2,6}-[0-9]{1,3}"}, lambda t: re.fullmatch(r"[a-e]{2,6}-[0-9]{1,3}", t)),
             ({"choice": choices}, lambda t: t in choices),
             ({"grammar": 'root ::= "<" word ">" ("," [0-9])?\nword ::= [a-z] [a-z]? [a-z]? [a-z]?'},
              lambda t: re.fullmatch(r"<[a-z]{1,4}>(,[0-9])?", t))]
    for spec, ok in cases:
        for endpoint in ("completions", "chat"):
            kw = dict(max_tokens=40, temperature=1.0, seed=seed, stream=stream, extra_body={"structured_outputs": spec})
            if endpoint == "completions":
                out = complete(client, prompt=random_prompt(rng), **kw)
                text = "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
            else:
                out = chat(client, messages=[{"role": "user", "content": random_prompt(rng)}], **kw)
                text = stream_fields(out, "content") if stream else out.choices[0].message.content
            assert ok(text), (spec, endpoint, text)


@pytest.mark.parametrize("extra, words", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "wrong"}}}}, "JSON schema"),
    ({"guided_grammar": "root ::= undefined_rule"}, "grammar"),
    ({"guided_choice": []}, "choice"),
])
def test_a_constraint_that_cannot_compile_gets_400(client, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-docs", prompt="Return", max_tokens=4, extra_body=extra)
    assert words in e.value.body["message"], e.value.body


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls_have_arguments_that_validate(client, parallel):
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    kw = dict(messages=[{"role": "user", "content": random_prompt(rng)}], tools=TOOLS, tool_choice="required",
              max_tokens=300, temperature=0.9, seed=seed, parallel_tool_calls=parallel)
    whole = chat(client, **kw)
    chunks = chat(client, stream=True, **kw)
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in whole.choices[0].message.tool_calls or []]
    streamed = assemble_tool_calls(chunks)
    for got in (calls, streamed):
        assert got, f"seed={seed}: no tool call"
        for call in got:
            assert call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert [(c["name"], c["arguments"]) for c in calls] == [(c["name"], c["arguments"]) for c in streamed], seed
    if not parallel:
        assert len(calls) == 1 and whole.choices[0].finish_reason == "tool_calls", f"seed={seed}"
    if whole.choices[0].finish_reason != "length":
        assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None


def test_a_named_tool_call_streams_arguments_that_validate(client):
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(messages=[{"role": "user", "content": random_prompt(rng)}], tools=TOOLS, tool_choice=choice,
              max_tokens=200, temperature=0.9, seed=seed)
    whole = chat(client, **kw)
    chunks = chat(client, stream=True, **kw)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and whole.choices[0].finish_reason == "stop", f"seed={seed}"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    (streamed,) = assemble_tool_calls(chunks)
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", call.function.arguments), f"seed={seed}"
    assert sum(1 for c in chunks for ch in c.choices if ch.delta.tool_calls) > 1, "the arguments come in pieces"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed_from_the_models_text(client, stream):
    """tool_choice auto with the hermes parser: the output is held to a tool call's text (a regex),
    and the server finds the call in it."""
    zone = random.choice(["UTC", "CET"])
    regex = r'Sure\.<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "' + zone + r'"\}\}\n</tool_call>'
    kw = dict(messages=[{"role": "user", "content": "What time is it?"}], tools=TOOLS, tool_choice="auto",
              max_tokens=100, temperature=1.0, extra_body={"structured_outputs": {"regex": regex}})
    if stream:
        chunks = chat(client, stream=True, **kw)
        content, calls = stream_fields(chunks, "content"), assemble_tool_calls(chunks)
        reason = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason][-1]
        assert not any("<tool_call" in (ch.delta.content or "") for c in chunks for ch in c.choices)
    else:
        out = chat(client, **kw)
        m = out.choices[0].message
        content, reason = m.content, out.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
    assert content.strip() == "Sure." and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"zone": zone})]


def test_reasoning_goes_to_reasoning_content_streamed_and_whole(client):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    thought, answer = " ".join(rng.sample(WORDS, 2)), rng.choice(WORDS)
    regex = f"<think>\n{thought}\n</think>\n\n{answer}"
    kw = dict(messages=[{"role": "user", "content": random_prompt(rng)}], max_tokens=60, temperature=1.0, seed=seed,
              extra_body={"structured_outputs": {"regex": re.escape(regex)}})
    whole = chat(client, **kw).choices[0].message
    assert (whole.reasoning_content, whole.content) == (f"\n{thought}\n", f"\n\n{answer}")
    chunks = chat(client, stream=True, **kw)
    assert stream_fields(chunks, "reasoning_content") == whole.reasoning_content
    assert stream_fields(chunks, "content") == whole.content
    deltas = [ch.delta for c in chunks for ch in c.choices]
    assert not any("think>" in ((d.content or "") + (getattr(d, "reasoning_content", None) or "")) for d in deltas)
    plain = chat(client, messages=kw["messages"], max_tokens=8, temperature=0).choices[0].message
    assert plain.reasoning_content is None, "an output without <think> is content"


def test_in_thinking_mode_a_constraint_waits_for_the_end_of_the_think_block(client):
    """With enable_thinking the prompt opens <think>: a constrained request's think block is free,
    so the tiny model (which never writes </think>) reasons as it does unconstrained, to max_tokens
    (EOS ignored: it ends about one reply in twenty within 24 tokens), and nothing is forced into
    reasoning_content; with the block closed in the prompt (this template's default) the
    constraint holds from the first token and lands in content."""
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    schema = random_schema(rng)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(messages=[{"role": "user", "content": random_prompt(rng)}], max_tokens=24, temperature=1.0, seed=seed)
    thinking = {"chat_template_kwargs": {"enable_thinking": True}, "ignore_eos": True}
    for extra in ({"response_format": fmt}, {"tools": TOOLS, "tool_choice": "required"},
                  {"tools": TOOLS, "tool_choice": named}):
        unconstrained = {"tools": TOOLS, "tool_choice": "none"} if "tools" in extra else {}
        free = chat(client, extra_body=thinking, **kw, **unconstrained).choices[0]
        assert free.finish_reason == "length" and free.message.reasoning_content, f"seed={seed}"
        out = chat(client, extra_body=thinking, **kw, **extra).choices[0]
        assert (out.message.reasoning_content, out.finish_reason) == (free.message.reasoning_content, "length"), \
            (seed, extra)
        assert not out.message.content and all(c.function.arguments == "" for c in out.message.tool_calls or []), \
            (seed, extra)
    whole = chat(client, response_format=fmt, **{**kw, "max_tokens": 200}).choices[0]
    assert whole.finish_reason == "stop" and whole.message.reasoning_content is None, f"seed={seed}"
    jsonschema.validate(json.loads(whole.message.content), schema)


def test_chat_template_and_enable_thinking_reach_the_prompt(base, tokenizer):
    import jinja2

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "Docs."}, {"role": "user", "content": random_prompt(rng)}]
    for kwargs in ({}, {"enable_thinking": True}):
        status, got = request("POST", base + "/tokenize", json.dumps(
            {"messages": messages, "chat_template_kwargs": kwargs}).encode())
        text = jinja2.Environment().from_string(TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                                  tools=None, **kwargs)
        assert status == 200 and got["tokens"] == tokenizer.encode(text, add_special_tokens=False), (got, text)
        assert text.endswith("<think>\n") == bool(kwargs)


def test_continue_final_message_opens_the_last_message_as_transformers_does(base, client, tokenizer):
    """/tokenize and a chat request with continue_final_message: the prompt transformers' own
    apply_chat_template renders, ending inside the assistant's message; add_generation_prompt
    beside it is a 400."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    messages = [{"role": "user", "content": random_prompt(rng)}, {"role": "assistant", "content": random_prompt(rng, 3)}]
    want = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=False,
                                         continue_final_message=True)
    assert want.endswith(messages[-1]["content"].strip()), want
    status, got = request("POST", base + "/tokenize", json.dumps(
        {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}).encode())
    assert status == 200 and got["tokens"] == tokenizer.encode(want, add_special_tokens=False), (seed, got, want)
    out = client.chat.completions.create(model="tiny-docs", messages=messages, max_tokens=2, temperature=0,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert out.usage.prompt_tokens == len(got["tokens"]), seed
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(model="tiny-docs", messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_tokenize_and_detokenize(base, tokenizer):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompt = random_prompt(rng, 12)
    status, got = request("POST", base + "/tokenize", json.dumps({"prompt": prompt, "return_token_strs": True}).encode())
    ids = tokenizer.encode(prompt)
    assert status == 200 and got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 1024
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)  # the vocabulary's entries, as vLLM's
    ids = [rng.randrange(1, 4096) for _ in range(20)]
    status, got = request("POST", base + "/detokenize", json.dumps({"tokens": ids}).encode())
    assert status == 200 and got["prompt"] == tokenizer.decode(ids)
    status, err = request("POST", base + "/detokenize", json.dumps({"tokens": [99999]}).encode())
    assert status == 400 and "vocabulary" in err["error"]["message"]


def test_logit_bias_steers_the_servers_tokens(client, tokenizer):
    token = random.randrange(1, 4096)
    out = complete(client, prompt="Return the", max_tokens=5, temperature=0, logprobs=0,
                   logit_bias={str(token): 100})
    assert out.choices[0].logprobs.tokens == [tokenizer.decode([token])] * 5, token


def test_echo_and_prompt_logprobs_match_hf_in_float64(base, client, tokenizer):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(EMBEDDED["tiny-docs"]), dtype=torch.float64).eval()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompt = random_prompt(rng, 10)
    ids = tokenizer.encode(prompt)
    resp = complete(client, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    out = resp.choices[0]
    assert out.text.startswith(prompt)
    lp = out.logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    assert lp.tokens[:len(ids)] == [tokenizer.decode([i]) for i in ids] and lp.token_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-3, i
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])] and len(lp.tokens) == len(ids) + resp.usage.completion_tokens
    whole = client.chat.completions.create(model="tiny-docs", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=2, extra_body={"prompt_logprobs": 1})
    checked(whole)
    assert getattr(out, "prompt_logprobs", None) is None, "echo computes them; only a request for them shows them"
    plp = whole.choices[0].prompt_logprobs
    assert plp[0] is None and len(plp) == whole.usage.prompt_tokens and all(len(e) >= 1 for e in plp[1:])
    status, got = request("POST", base + "/tokenize", json.dumps(
        {"model": "tiny-docs", "messages": [{"role": "user", "content": prompt}], "add_generation_prompt": True}).encode())
    chat_ids = got["tokens"]
    assert status == 200 and len(chat_ids) == len(plp), (status, got)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([chat_ids])).logits[0], dim=-1)
    for i in range(1, len(chat_ids)):  # each prompt token's own entry, against HF over the rendered chat
        own = plp[i][str(chat_ids[i])]
        assert abs(own["logprob"] - ref[i - 1, chat_ids[i]].item()) < 1e-3, (i, seed)
        row, v = ref[i - 1], ref[i - 1, chat_ids[i]]  # the rank, tokens within 1e-4 of it either way
        assert int((row > v + 1e-4).sum()) + 1 <= own["rank"] <= int((row > v - 1e-4).sum()), (i, seed, own)


def test_echo_with_max_tokens_0_scores_the_prompt(client, tokenizer):
    """echo, max_tokens 0 and logprobs (lm-evaluation-harness's loglikelihood requests): the prompt
    alone with its tokens' log-probabilities, against HF's float64 ones, streamed or not; no
    completion token counted. max_tokens 0 without echo is still a 400."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(EMBEDDED["tiny-docs"]), dtype=torch.float64).eval()
    seed = random.randrange(1 << 30)
    prompt = random_prompt(random.Random(seed), 10)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    resp = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    out = resp.choices[0]
    assert out.text == prompt and out.finish_reason == "length", (seed, out.text)
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    lp = out.logprobs
    assert lp.tokens == [tokenizer.decode([i]) for i in ids] and lp.token_logprobs[0] is None, seed
    assert all(abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-3 for i in range(1, len(ids))), seed
    stopped = complete(client, prompt=prompt, max_tokens=0, echo=True, temperature=0, stop=["e", " "],
                       extra_body={"stop_token_ids": list(range(4096))})  # its one hidden token stops, unseen
    assert (stopped.choices[0].finish_reason, stopped.choices[0].stop_reason) == ("length", None), seed
    chunks = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == prompt, seed
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens, seed
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        complete(client, prompt=prompt, max_tokens=0)


def test_the_api_key_is_required(base):
    body = json.dumps({"model": "tiny-docs", "prompt": "x", "max_tokens": 1}).encode()
    for key in (None, "wrong"):
        status, err = request("POST", base + "/v1/completions", body, key=key)
        assert status == 401 and err["error"]["code"] == "invalid_api_key" and err["error"]["message"], err
    bare = openai.OpenAI(base_url=base + "/v1", api_key="wrong", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bare.models.list()
    assert request("GET", base + "/health", key=None)[0] == 200
    assert request("GET", base + "/metrics", key=None)[0] == 200


def test_every_error_route_answers_in_openais_format(base):
    def error(status, method, path, body=None, content_type="application/json"):
        got, err = request(method, base + path, body, content_type=content_type)
        assert got == status and set(err["error"]) >= {"message", "type", "param", "code"}, (path, err)
        assert err["error"]["message"].endswith("."), err
        return err["error"]

    e = error(400, "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": ')
    assert "not valid JSON" in e["message"] and e["param"] is None
    assert "not valid JSON" in error(400, "POST", "/v1/chat/completions", b"\xff\xfe")["message"]
    assert "surrogate escape without its pair" in error(400, "POST", "/v1/completions",
                                                        json.dumps({"prompt": "a\ud800"}).encode())["message"]
    assert "JSON object" in error(400, "POST", "/v1/completions", b"[1, 2]")["message"]
    assert "nested too deeply" in error(400, "POST", "/v1/completions", b"[" * 100_000)["message"]
    assert "POST" in error(405, "GET", "/v1/completions")["message"]
    assert "/v1/nope" in error(404, "POST", "/v1/nope", b"{}")["message"]
    assert error(400, "POST", "/v1/completions", json.dumps({"prompt": 5}).encode())["param"] == "prompt"
    assert "model" in error(404, "POST", "/v1/completions", json.dumps({"model": "gpt-4", "prompt": "x"}).encode())["message"]
    big = json.dumps({"prompt": "x" * 31_000_000}).encode()
    assert "30000000" in error(413, "POST", "/v1/completions", big)["message"]


def test_a_20mb_prompt_stalls_no_other_client(base, client):
    """While three 20 MB prompts are sent at once (and refused, being longer than the context can
    hold), /health and another client's stream keep answering within a second."""
    stream = client.completions.create(model="tiny-docs", prompt=random_prompt(random.Random()), max_tokens=600,
                                       temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    arrivals, answers, refused = [], [], []
    done = threading.Event()

    def read_stream():
        try:
            for _ in stream:
                arrivals.append(time.monotonic())
        except openai.APIConnectionError:  # closed below, once the prompts are answered
            pass

    body = json.dumps({"prompt": "word " * 4_000_000, "max_tokens": 4}).encode()  # 20 MB

    def big():
        refused.append(request("POST", base + "/v1/completions", body, timeout=120))

    reader = threading.Thread(target=read_stream)
    reader.start()
    while len(arrivals) < 3:
        time.sleep(0.01)
    senders = [threading.Thread(target=big) for _ in range(3)]
    start = time.monotonic()
    for t in senders:
        t.start()

    def poll():
        while not done.is_set():
            t0 = time.monotonic()
            status = request("GET", base + "/health", key=None, timeout=10)[0]
            answers.append((status, time.monotonic() - t0))
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    for t in senders:
        t.join(120)
    end = time.monotonic()
    done.set()
    poller.join(15)
    stream.close()  # its request is aborted: the next test starts on an idle server
    reader.join(TIMEOUT)
    assert [r[0] for r in refused] == [400] * 3 and all("characters" in r[1]["error"]["message"] for r in refused)
    assert answers and all(s == 200 for s, _ in answers) and max(t for _, t in answers) < 1.0, answers
    during = [t for t in arrivals if start <= t <= end]
    gaps = [b - a for a, b in zip([start] + during, during + [end])]
    assert max(gaps) < 1.0, f"the stream stalled: gaps {sorted(gaps)[-3:]} while the prompts were in"


def test_metrics_count_requests_as_requests(base, client):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = request("GET", base + "/metrics", key=None)[1]
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        assert samples and all(s.labels.get("model_name") == "tiny-docs" for s in samples)
        out = {}
        for s in samples:
            key = (s.name, s.labels.get("finished_reason"), s.labels.get("le"))
            out[key] = out.get(key, 0.0) + s.value
        return out

    deadline = time.monotonic() + TIMEOUT
    while (idle := scrape()).get(("flexsgl:num_requests_running", None, None)) or \
            idle.get(("flexsgl:num_requests_waiting", None, None)):
        assert time.monotonic() < deadline, "the server never became idle"
        time.sleep(0.1)
    before = scrape()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "request_time_per_output_token_seconds_count",
                 "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
                 "request_inference_time_seconds_count"):
        assert any(k[0] == "flexsgl:" + name for k in before), name
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    out = complete(client, prompt=[random_prompt(rng), random_prompt(rng)], n=2, max_tokens=5, temperature=1.0,
                   extra_body={"ignore_eos": True})
    deadline = time.monotonic() + TIMEOUT
    while (after := scrape()).get(("flexsgl:request_success_total", "length", None), 0) == \
            before.get(("flexsgl:request_success_total", "length", None), 0):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    def grew(name, reason=None):
        return after.get((name, reason, None), 0) - before.get((name, reason, None), 0)

    assert grew("flexsgl:request_success_total", "length") == 1, "one HTTP request of 4 choices is one request"
    assert grew("flexsgl:generation_tokens_total") == out.usage.completion_tokens == 20
    assert grew("flexsgl:prompt_tokens_total") == out.usage.prompt_tokens
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_time_per_output_token_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds"):
        assert grew(f"flexsgl:{h}_count") == 1, h
    for h in ("inter_token_latency_seconds", "time_per_output_token_seconds"):  # per token, as vLLM's
        assert grew(f"flexsgl:{h}_count") == 4 * 4, (h, "each choice's gaps between its 5 tokens")
    # the request's phases: admission to first token, first to last, and both together
    prefill, decode, inference = (grew(f"flexsgl:request_{h}_time_seconds_sum") for h in ("prefill", "decode", "inference"))
    assert decode > 0 and inference == pytest.approx(prefill + decode, abs=1e-6), (prefill, decode, inference)
    assert inference <= grew("flexsgl:e2e_request_latency_seconds_sum"), seed


def test_the_request_log_names_each_request_and_its_end(server, client):
    log = server[1]
    out = complete(client, prompt="Return the value", max_tokens=3)
    deadline = time.monotonic() + TIMEOUT
    while f"request {out.id} finished" not in open(log).read():
        assert time.monotonic() < deadline, open(log).read()[-2000:]
        time.sleep(0.05)
    assert f"request {out.id}: prompts 'Return the value'" in open(log).read()


def test_a_client_gone_before_its_body_arrived_logs_no_traceback(server, client):
    """A request whose client closes before the Content-Length it announced has arrived: nothing
    for anyone to read, so no error in the log (it logged two tracebacks), and the server serves on."""
    import socket

    base, log = server
    before = len(open(log).read())
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Authorization: Bearer {KEY}\r\nContent-Length: 500\r\n\r\n{{\"prompt\": \"a").encode())
        time.sleep(0.3)
    assert complete(client, prompt="Return the", max_tokens=2).choices[0].finish_reason in ("stop", "length")
    time.sleep(0.3)
    tail = open(log).read()[before:]
    assert "Traceback" not in tail and "ClientDisconnect" not in tail, tail[-3000:]


def test_schema_keywords_xgrammar_cannot_enforce_get_400_naming_the_field_and_place(client):
    loose = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"},
                                                       "uniqueItems": True}}}
    tools = TOOLS + [{"type": "function", "function": {"name": "tag", "parameters": loose}}]
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": loose}}),
         "response_format.json_schema.schema"),
        (dict(extra_body={"guided_json": loose}), "guided_json"),
        (dict(extra_body={"structured_outputs": {"json": loose}}), "structured_outputs.json"),
        (dict(tools=tools, tool_choice="required"), "tools[2].function.parameters"),
        (dict(tools=tools, tool_choice={"type": "function", "function": {"name": "tag"}}),
         "tools[2].function.parameters"),
    ]
    for kw, where in cases:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, messages=[{"role": "user", "content": "x"}], max_tokens=4, **kw)
        assert e.value.body["message"].startswith(f"{where} uses uniqueItems at properties.tags,"), e.value.body
    out = chat(client, messages=[{"role": "user", "content": "x"}], max_tokens=4, tools=tools, tool_choice="none")
    assert out.choices[0].finish_reason in ("stop", "length"), "a tool schema that constrains nothing is kept"


def test_a_streamed_echo_with_logprobs_matches_the_whole_response(client):
    rng = random.Random(seed := random.randrange(1 << 30))
    kw = dict(prompt=random_prompt(rng, 6), max_tokens=4, temperature=0, echo=True, logprobs=2,
              extra_body={"ignore_eos": True})
    whole = complete(client, **kw).choices[0]
    chunks = [c.choices[0] for c in complete(client, stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text, f"seed={seed}"
    streamed = {field: [x for c in chunks if c.logprobs for x in getattr(c.logprobs, field)]
                for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == {field: getattr(whole.logprobs, field) for field in streamed}, f"seed={seed}"
    assert streamed["token_logprobs"][0] is None, f"seed={seed}"  # the echoed prompt's first token has none
    special = [t for t in streamed["tokens"] if t not in whole.text]  # a special token's text is left out
    assert "".join(t for t in streamed["tokens"] if t not in special) == whole.text, f"seed={seed}"


def test_completion_top_logprobs_hold_the_sampled_token(client):
    """logprobs n: the n most likely tokens and the sampled one (n + 1 entries when it is not among
    them), against the 20 most likely of the same seeded request. A seed whose outputs show a byte
    token is drawn again: every byte token's text is "\ufffd", and OpenAI's format keys them alike."""

    def logprobs(n):
        return complete(client, prompt="Return the", max_tokens=12, temperature=1.5, seed=seed, logprobs=n,
                        extra_body={"ignore_eos": True}).choices[0].logprobs

    for _ in range(50):
        seed = random.randrange(1 << 30)
        ref = logprobs(20)
        if not any("\ufffd" in t for t in ref.tokens + [k for top in ref.top_logprobs for k in top]):
            break
    else:
        pytest.fail("50 seeds each showed a byte token")
    for n in (0, 1, 3):
        lp = logprobs(n)
        assert lp.tokens == ref.tokens, f"seed={seed}"
        for token, logprob, top, wide in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, ref.top_logprobs):
            want = dict(sorted(wide.items(), key=lambda kv: -kv[1])[:n]) | {token: logprob}
            assert top == pytest.approx(want, abs=1e-6), (seed, n, token, top)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, endpoint):
    kw = dict(max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    if endpoint == "chat":
        chunks = chat(client, messages=[{"role": "user", "content": "Return the"}], **kw)
    else:
        chunks = complete(client, prompt="Return the", **kw)
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages) and not chunks[-1].choices, usages
    final = usages[-1]
    assert final.completion_tokens == 5 and final.total_tokens == final.prompt_tokens + 5
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[0] <= 1, counts
    assert all(u.prompt_tokens == final.prompt_tokens for u in usages)


def test_metrics_before_any_request_and_a_bad_max_completion_tokens():
    """A fresh server's KV gauges are the pool's (every page free) before any step; a bad limit
    is refused under the name the client sent."""
    from prometheus_client.parser import text_string_to_metric_families

    with logged_server() as (base, _):
        def gauge(name):
            return sum(s.value for f in text_string_to_metric_families(request("GET", base + "/metrics")[1])
                       for s in f.samples if s.name == "flexsgl:" + name)

        total = gauge("kv_pages_total")
        assert total > 0 and gauge("kv_pages_free") == total and gauge("kv_pages_used") == 0
        status, err = request("POST", base + "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5}).encode(), key=None)
        assert status == 400 and err["error"]["message"].startswith("max_completion_tokens "), err
