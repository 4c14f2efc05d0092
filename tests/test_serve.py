"""`flexsgl serve` as a client sees it: the real server process on the embedded model (CPU, eager),
driven by the official `openai` client, checked against the offline API (LLM.generate) on the same
model, HF transformers' float64 log-probabilities, and the metrics it exposes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flexsgl import LLM, SamplingParams  # noqa: E402
from flexsgl.model.presets import EMBEDDED  # noqa: E402
from tests.ports import free_port  # noqa: E402

OPTIONS = {"max_total_tokens": 8192, "max_running_requests": 64, "page_size": 16}
TIMEOUT = 60  # seconds for any one client call
STARTUP_TIMEOUT = 300  # seconds for a server to load the model and answer /health (a busy CPU is slow at it)
WORDS = ("Return the value of the given key in a new list of items from the file object with a default "
         "string that names each path").split()


@contextlib.contextmanager
def running_server(*extra: str):
    """A `flexsgl serve` process on the embedded model with OPTIONS (and `extra` flags), once healthy;
    yields its base URL."""
    with server_process(*extra) as (base, _):
        yield base


@contextlib.contextmanager
def server_process(*extra: str, log=None, env: dict | None = None):
    """running_server, yielding its base URL and its process; its output goes to `log` (an open
    file) where given, else to a pipe, and `env` adds to its environment."""
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items()]
    proc = subprocess.Popen([sys.executable, "-m", "flexsgl", "serve", "--port", str(port), *flags, *extra,
                             "--log-level", "warning"], stdout=subprocess.PIPE if log is None else log,
                            stderr=subprocess.STDOUT, text=True, env=None if env is None else {**os.environ, **env})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if proc.poll() is not None:
                if log is not None:
                    log.seek(0)
                pytest.fail(f"the server exited: {(proc.stdout if log is None else log).read()}")
            try:
                if get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not become healthy in {STARTUP_TIMEOUT} s")
            time.sleep(0.2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def proc_stat(pid) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the process name (state, ppid, ...), None once it is gone.
    Read as bytes: a process's name and command line need not be UTF-8."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def engine_pid(server_pid: int) -> int:
    """The server's engine process: its child started by multiprocessing's spawn."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = proc_stat(pid)
        if stat is None or int(stat[1]) != server_pid:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return int(pid)
        except OSError:
            continue
    raise AssertionError("the server has no engine process")


def alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != b"Z"


@pytest.fixture(scope="module")
def server():
    with running_server() as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(**OPTIONS)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(base: str, name: str, **labels) -> float:
    """The sum of /metrics' samples named `name` whose labels include `labels` (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = get(base + "/metrics")[1]
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def random_prompt(rng: random.Random, n: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize()


def test_completion_matches_the_offline_api_streamed_and_not(client, offline):
    rng = random.Random(rng_seed := random.randrange(1 << 30))
    prompt, seed = random_prompt(rng), rng.randrange(2**31)
    ref = offline.generate(prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=seed))[0]
    whole = client.completions.create(model="tiny-docs", prompt=prompt, max_tokens=24, temperature=0.8, seed=seed)
    assert whole.choices[0].text == ref.text and whole.choices[0].finish_reason == ref.finish_reason, seed
    assert whole.usage.prompt_tokens == ref.prompt_tokens and whole.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(prompt=prompt, max_tokens=24, temperature=0.8, seed=seed, stream=True,
                                            stream_options={"include_usage": True}, model="tiny-docs"))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text, seed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids), "the last chunk carries the usage"


def test_two_tensor_parallel_ranks_serve_what_one_rank_does(offline):
    """`flexsgl serve --tp 2`: the engine process starts the second rank (gloo on the CPU)."""
    rng = random.Random(rng_seed := random.randrange(1 << 30))
    prompts, seed = [random_prompt(rng) for _ in range(3)], rng.randrange(2**31)
    ref = offline.generate(prompts, SamplingParams(max_tokens=16, temperature=0.8, seed=seed))
    with running_server("--tp", "2") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        out = client.completions.create(model="tiny-docs", prompt=prompts, max_tokens=16, temperature=0.8, seed=seed)
    assert sorted((c.index, c.text) for c in out.choices) == [(i, r.text) for i, r in enumerate(ref)], seed


def test_chat_uses_the_fallback_template_streamed_and_not(client, offline):
    rng = random.Random(rng_seed := random.randrange(1 << 30))
    question = random_prompt(rng)
    messages = [{"role": "system", "content": "Docs."}, {"role": "user", "content": question}]
    # flexsgl/chat_template.py's documented fallback for a model without a chat template, written out here
    ref = offline.generate(f"system: Docs.\nuser: {question}\nassistant:", SamplingParams(max_tokens=16, temperature=0))[0]
    whole = client.chat.completions.create(model="tiny-docs", messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == ref.text and whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny-docs", messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_n_samples_share_the_prompt_pages_and_match_the_offline_api(server, client, offline):
    rng = random.Random(rng_seed := random.randrange(1 << 30))
    prompt, seed = random_prompt(rng, 40), rng.randrange(2**31)  # > 2 pages of 16 tokens
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, n=2, ignore_eos=True)
    refs = offline.generate(prompt, sp)
    hits = metric(server, "flexsgl:prefix_cache_hits_total")
    out = client.completions.create(model="tiny-docs", prompt=prompt, max_tokens=12, temperature=1.0, seed=seed, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [r.text for r in refs], seed
    full_pages = (refs[0].prompt_tokens - 1) // 16 * 16
    assert refs[1].cached_tokens == full_pages > 0, "offline: sample 1 reuses sample 0's prompt pages"
    assert metric(server, "flexsgl:prefix_cache_hits_total") - hits >= full_pages


def test_stop_strings_cut_the_text(client, offline):
    rng = random.Random(rng_seed := random.randrange(1 << 30))
    prompt = random_prompt(rng)
    full = offline.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].text
    words = re.findall(r" \S+", full)  # space-led words: one after a newline has no space before it
    assert len(words) > 3, full
    stop = words[len(words) // 2]
    cut = full[:full.index(stop)]
    for include in (False, True):
        for stream in (False, True):
            kw = dict(model="tiny-docs", prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00never"],
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
            if stream:
                chunks = list(client.completions.create(stream=True, **kw))
                text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
            else:
                c = client.completions.create(**kw).choices[0]
                text, reason = c.text, c.finish_reason
            assert text == cut + (stop if include else "") and reason == "stop", (stop, include, stream, full)


def test_skip_special_tokens_false_keeps_their_text(client):
    """EOS (ignored as a stop, forced by logit_bias) in the text only with skip_special_tokens false,
    streamed or not."""
    prompt = random_prompt(random.Random(random.randrange(1 << 30)))
    for skip in (True, False):
        for stream in (False, True):
            kw = dict(model="tiny-docs", prompt=prompt, max_tokens=3, temperature=0, logit_bias={"0": 100},
                      extra_body={"ignore_eos": True, "skip_special_tokens": skip})
            if stream:
                text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
            else:
                text = client.completions.create(**kw).choices[0].text
            assert text == ("" if skip else "<|endoftext|>" * 3), (skip, stream, text)


def test_chats_default_limit_fits_a_kv_cache_smaller_than_the_context():
    """A cache of 512 tokens under a 1,024-token context: a chat without max_tokens runs to what the
    cache holds (it was refused: the default asked for the context's room)."""
    with running_server("--max-total-tokens", "512") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        card = client.models.retrieve("tiny-docs")
        assert card.created > 0 and card.max_model_len == 1024
        out = client.chat.completions.create(model="tiny-docs", messages=[{"role": "user", "content": "Return the"}],
                                             extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 512 and out.choices[0].finish_reason == "length"


def test_max_model_len_and_several_served_model_names():
    """--max-model-len (SGLang's --context-length): the model cards report it, a chat without
    max_tokens runs to it, and a request asking past it is a 400 naming it. --served-model-name
    given twice (vLLM's A B): /v1/models lists both, requests may name either and responses carry
    the first; another name is a 404 naming both."""
    ctx = random.randrange(100, 400)
    with running_server("--max-model-len", str(ctx), "--served-model-name", "docs",
                        "--served-model-name", "org/tiny-docs") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["docs", "org/tiny-docs"]
        assert client.models.retrieve("org/tiny-docs").max_model_len == ctx
        out = client.chat.completions.create(model="org/tiny-docs", messages=[{"role": "user", "content": "Return the"}],
                                             extra_body={"ignore_eos": True})
        assert out.usage.prompt_tokens + out.usage.completion_tokens == ctx and out.model == "docs", ctx
        with pytest.raises(openai.BadRequestError, match=f"context of {ctx} tokens"):
            client.completions.create(model="docs", prompt="Return the", max_tokens=ctx)
        with pytest.raises(openai.NotFoundError, match="serves 'docs' or 'org/tiny-docs'"):
            client.completions.create(model="tiny-docs", prompt="Return the", max_tokens=2)


def test_allowed_token_ids_and_truncate_prompt_tokens_as_offline(client, offline):
    """vLLM's allowed_token_ids and truncate_prompt_tokens give what the offline API gives; chat's
    per-request chat_template and echo, and beam search, are refused by name."""
    rng = random.Random(rng_seed := random.randrange(1 << 30))
    prompt = random_prompt(rng, 40)
    allowed = sorted(rng.sample(range(1, 4096), 5))
    sp = SamplingParams(max_tokens=6, temperature=0, allowed_token_ids=allowed, truncate_prompt_tokens=9)
    ref = offline.generate(prompt, sp)[0]
    out = client.completions.create(model="tiny-docs", prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"allowed_token_ids": allowed, "truncate_prompt_tokens": 9})
    assert out.choices[0].text == ref.text and out.usage.prompt_tokens == 9, rng_seed
    assert set(ref.token_ids) <= set(allowed)
    # a text longer than the context can hold, truncated: served, the default limit the room truncation leaves
    long = " ".join(random_prompt(rng, 40) for _ in range(800))
    out = client.completions.create(model="tiny-docs", prompt=long, max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 50})
    assert out.usage.prompt_tokens == 50, rng_seed
    echoed = client.completions.create(model="tiny-docs", prompt=prompt, max_tokens=1, echo=True, logprobs=0,
                                       extra_body={"truncate_prompt_tokens": 9})  # the text of the tokens kept
    kept = "".join(echoed.choices[0].logprobs.tokens[:9])
    assert prompt.endswith(kept) and echoed.choices[0].text.startswith(kept) and len(kept) < len(prompt), rng_seed
    out = client.chat.completions.create(model="tiny-docs", messages=[{"role": "user", "content": long}],
                                         extra_body={"truncate_prompt_tokens": 20, "ignore_eos": True})
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (20, 1024 - 20), rng_seed
    messages = [{"role": "user", "content": "x"}]
    for extra, name in (({"chat_template": "{{ 1 }}"}, "--chat-template"), ({"echo": True}, "echo"),
                        ({"use_beam_search": True}, "use_beam_search")):
        with pytest.raises(openai.BadRequestError, match=name):
            client.chat.completions.create(model="tiny-docs", messages=messages, max_tokens=2, extra_body=extra)


def test_logprobs_match_hf_in_float64(client, offline):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(EMBEDDED['tiny-docs']), dtype=torch.float64).eval()
    rng = random.Random(rng_seed := random.randrange(1 << 30))
    prompt = random_prompt(rng)
    out = client.completions.create(model="tiny-docs", prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model="tiny-docs", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    lp = out.choices[0].logprobs
    tok = transformers.AutoTokenizer.from_pretrained(str(EMBEDDED["tiny-docs"]))
    pieces = [tok.decode([j]) for j in range(len(tok))]

    def hf_logprobs(text: str, params: SamplingParams):
        """The offline engine's greedy tokens for `text`, and HF's float64 log-probabilities at each. The ids
        come from the engine: the text encoded again need not give them back ("\n" "\n" comes back as "\n\n")."""
        done = offline.generate(text, params)[0]
        ids, gen = done.prompt_token_ids, done.token_ids
        with torch.no_grad():
            return gen, torch.log_softmax(hf(torch.tensor([ids + gen])).logits[0, len(ids) - 1:-1], dim=-1)

    gen, ref = hf_logprobs(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert lp.tokens == [pieces[t] for t in gen], (lp.tokens, gen)
    for i, (t, top) in enumerate(zip(gen, lp.top_logprobs)):
        assert abs(lp.token_logprobs[i] - ref[i, t].item()) < 1e-3
        assert list(top.values()) == pytest.approx(ref[i].topk(3).values.tolist(), abs=1e-3)
        for text, value in top.items():  # each listed token is one whose float64 log-probability it gives
            assert any(abs(ref[i, j].item() - value) < 1e-3 for j, piece in enumerate(pieces) if piece == text)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    # the chat's prompt as chat_template.py's documented fallback template renders it
    gen, ref = hf_logprobs(f"user: {prompt}\nassistant:", SamplingParams(max_tokens=4, temperature=0))
    assert [c.token for c in content] == [pieces[t] for t in gen], f"seed={rng_seed}"
    for i, (t, c) in enumerate(zip(gen, content)):
        assert abs(c.logprob - ref[i, t].item()) < 1e-3, f"seed={rng_seed} token {i}"
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(ref[i].topk(2).values.tolist(), abs=1e-3), \
            f"seed={rng_seed} token {i}"


def test_a_disconnect_aborts_the_request_and_frees_its_pages(server, client):
    idle = metric(server, "flexsgl:kv_pages_used")
    aborted = metric(server, "flexsgl:request_success_total", finished_reason="abort")
    stream = client.completions.create(model="tiny-docs", prompt=random_prompt(random.Random()), max_tokens=900,
                                       temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert metric(server, "flexsgl:kv_pages_used") > idle, "the request holds pages while it runs"
    stream.close()
    deadline = time.monotonic() + TIMEOUT
    while metric(server, "flexsgl:request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "the request was not aborted after its client went away"
        time.sleep(0.1)
    assert metric(server, "flexsgl:kv_pages_used") == idle
    assert metric(server, "flexsgl:num_requests_running") == 0


def test_a_client_that_leaves_before_a_whole_response_aborts_its_request(server):
    aborted = metric(server, "flexsgl:request_success_total", finished_reason="abort")
    body = json.dumps({"model": "tiny-docs", "prompt": random_prompt(random.Random()), "max_tokens": 900,
                       "ignore_eos": True}).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + TIMEOUT
        while metric(server, "flexsgl:kv_pages_used") == 0:  # it is running
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + TIMEOUT
    while metric(server, "flexsgl:request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "the request was not aborted after its client went away"
        time.sleep(0.1)
    assert metric(server, "flexsgl:kv_pages_used") == 0


def test_64_concurrent_streams_match_the_offline_api(client, offline):
    rng = random.Random(rng_seed := random.randrange(1 << 30))
    prompts = [random_prompt(rng, rng.randrange(3, 12)) for _ in range(64)]
    seeds = [rng.randrange(2**31) for _ in prompts]
    refs = offline.generate(prompts, [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in seeds])
    texts, errors = [None] * 64, []

    def one(i):
        try:
            chunks = client.completions.create(model="tiny-docs", prompt=prompts[i], max_tokens=16, temperature=1.0,
                                               seed=seeds[i], stream=True)
            texts[i] = "".join(c.choices[0].text for c in chunks)
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT * 2)
    assert not errors, errors[:3]
    assert texts == [r.text for r in refs]


BAD = [
    {"max_tokens": -1}, {"max_tokens": "many"}, {"temperature": -0.5}, {"temperature": "hot"}, {"top_p": 0},
    {"top_p": 1.5}, {"n": 0}, {"n": 100000}, {"presence_penalty": 3}, {"frequency_penalty": -2.5},
    {"repetition_penalty": 0}, {"logprobs": 30}, {"logprobs": -1}, {"stop": [""]}, {"stop": 5}, {"seed": -1},
    {"min_tokens": 50, "max_tokens": 10}, {"top_k": -2}, {"echo": "yes"}, {"logit_bias": {"5": 101}},
    {"logit_bias": {"x": 1}}, {"logit_bias": {"99999": 1}}, {"prompt_logprobs": 21},
    {"structured_outputs": {"regex": "[a-"}}, {"guided_json": {"type": "nope"}}, {"guided_grammar": "root ::= x"},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}}, {"guided_regex": "a", "guided_choice": ["a"]},
    {"prompt": ""}, {"prompt": []}, {"prompt": [99999999]}, {"prompt": 5}, {"max_tokens": 5000},
    {"stream_options": {"include_usage": True}}, {"stop_token_ids": [-3]}, {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
    {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
    {"attention_params": {"window": 4}}, {"attention_params": {"window": "wide"}},
    {"use_beam_search": True}, {"bad_words": ["x"]}, {"priority": 1}, {"logits_processors": ["m.f"]},
    {"allowed_token_ids": []}, {"allowed_token_ids": [99999]}, {"truncate_prompt_tokens": 0},
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: json.dumps(b))
def test_bad_parameters_get_400_and_an_openai_error_body(server, bad):
    body = {"model": "tiny-docs", "prompt": "Return the", "max_tokens": 4, **bad}
    status, err = post(server + "/v1/completions", json.dumps(body).encode())
    assert status == 400 and isinstance(err["error"]["message"], str) and err["error"]["message"], (bad, err)
    if len(bad) == 1 and not any(k.startswith(("guided", "structured", "response")) for k in bad) \
            and "refused" not in err["error"]["message"]:  # the field, as OpenAI names it
        assert (err["error"]["param"] or "").split(".")[0] == next(iter(bad)), (bad, err)


def test_bad_requests_through_the_client_and_by_hand(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-docs", messages=[{"role": "user", "content": "x"}], top_logprobs=3,
                                       max_tokens=2)
    assert e.value.status_code == 400 and "logprobs" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert post(server + "/v1/completions", b"{not json")[0] == 400
    assert post(server + "/v1/chat/completions", json.dumps({"messages": []}).encode())[0] == 400
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-docs"]
    assert client.models.retrieve("tiny-docs").model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize("args", [["no/such-model-dir"], ["--port", "0"], ["--max-total-tokens", "-5"],
                                  ["--override", "nope"], ["--chat-template", "{{ foo"]])
def test_serve_refuses_bad_arguments_with_one_line(args):
    from typer.testing import CliRunner

    from flexsgl.cli import app

    r = CliRunner().invoke(app, ["serve", *args])
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.output, r.output


def test_a_port_in_use_exits_2_with_one_sentence():
    from typer.testing import CliRunner

    from flexsgl.cli import app

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = CliRunner().invoke(app, ["serve", "--port", str(port)])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert f"Port {port}" in lines[0] and "already in use" in lines[0] and "Traceback" not in r.output


def test_an_engine_process_that_dies_ends_every_request_with_an_error():
    """Streams and whole responses in flight end with an error, and the server exits 1 with the
    reason, as vLLM's does (it answered 503 for ever, which no supervisor restarts)."""
    with server_process() as (base, proc):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        rng = random.Random(rng_seed := random.randrange(1 << 30))
        streams = [client.completions.create(model="tiny-docs", prompt=random_prompt(rng), max_tokens=900,
                                             stream=True, extra_body={"ignore_eos": True}) for _ in range(2)]
        for s in streams:
            next(iter(s))  # it runs
        whole = []
        waiting = threading.Thread(target=lambda: whole.append(post(base + "/v1/completions", json.dumps(
            {"model": "tiny-docs", "prompt": random_prompt(rng), "max_tokens": 900, "ignore_eos": True}).encode())))
        waiting.start()
        deadline = time.monotonic() + TIMEOUT
        while metric(base, "flexsgl:num_requests_running") < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(engine_pid(proc.pid), signal.SIGKILL)
        for s in streams:
            with pytest.raises(openai.APIError, match="engine process ended"):
                list(s)
        waiting.join(TIMEOUT)
        assert whole and whole[0][0] == 500 and "engine process ended" in whole[0][1]["error"]["message"]
        assert proc.wait(timeout=TIMEOUT) == 1
        output = proc.stdout.read()
        assert "The engine process ended unexpectedly" in output and "Traceback" not in output, output[-3000:]


def descendants(pid: int) -> list[int]:
    kids = [int(p) for p in filter(str.isdigit, os.listdir("/proc"))
            if (stat := proc_stat(p)) is not None and int(stat[1]) == pid]
    return kids + [d for k in kids for d in descendants(k)]


@pytest.mark.parametrize("case", ["idle", "streaming", "twice", "sigterm-to-both"])
def test_stopping_the_server_ends_its_requests_and_processes(case):
    """Ctrl-C ends the server and every process it started (the engine, multiprocessing's resource
    tracker), without a traceback. A stream in flight ends at once with finish reason "abort", its
    last chunk and [DONE]. "twice": a second Ctrl-C while a request's body is still arriving (so
    uvicorn is waiting on it) makes uvicorn skip the app's shutdown; the engine must end anyway.
    "sigterm-to-both": SIGTERM to the HTTP and the engine process at once, as a service manager
    signals the group, drains as Ctrl-C does (the engine process once exited half-way through a
    step, and the stream ended without its last chunk)."""
    with server_process() as (base, proc):
        kids = descendants(proc.pid)
        assert alive(engine_pid(proc.pid)) and kids
        if case in ("streaming", "sigterm-to-both"):
            body = {"model": "tiny-docs", "prompt": "Return the", "max_tokens": 900, "ignore_eos": True,
                    "stream": True}
            stream = urllib.request.urlopen(urllib.request.Request(
                base + "/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"}), timeout=TIMEOUT)
            assert stream.readline().startswith(b"data: ")  # it runs
        elif case == "twice":
            slow = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=TIMEOUT)
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            time.sleep(0.5)
        if case == "sigterm-to-both":
            os.kill(engine_pid(proc.pid), signal.SIGTERM)
            proc.send_signal(signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGINT)  # Ctrl-C
        if case in ("streaming", "sigterm-to-both"):
            rest = stream.read().decode()
            assert '"finish_reason": "abort"' in rest and rest.endswith("data: [DONE]\n\n"), rest[-300:]
        elif case == "twice":
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=TIMEOUT)
        output = proc.stdout.read()
        assert "Traceback" not in output, output[-3000:]
        if case == "twice":
            slow.close()
    deadline = time.monotonic() + TIMEOUT
    while any(alive(k) for k in kids):
        assert time.monotonic() < deadline, f"processes the server started outlived it: {kids}"
        time.sleep(0.1)


def test_an_engine_that_cannot_start_stops_the_server_with_the_reason():
    """The model's 4 heads do not split across 3 ranks: the engine process refuses while building, and
    the server exits 1 with the reason (it ended by its own SIGTERM, status 143)."""
    proc = subprocess.run([sys.executable, "-m", "flexsgl", "serve", "--port", str(free_port()), "--tp", "3",
                           "--log-level", "warning"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "The engine could not start: TensorParallelError" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_mid_stream_chunks_from_the_template_equal_the_general_encoding(chat, include_usage):
    """responses.py makes a mid-stream token's chunk from a template; it must be the bytes the
    general path (one json.dumps of the whole body) gives, for any text."""
    from flexsgl.serve.responses import Choices

    rng = random.Random(rng_seed := random.randrange(1 << 30))
    choices = Choices(chat, "tiny-docs", None, 3, 5)
    alphabet = 'ab "\\/\n\t\u00e9\u4e2d\U0001f600<>&'
    for _ in range(50):
        i, text = rng.randrange(3), "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12)))
        c = {"index": i, "logprobs": None, "finish_reason": None}
        c.update({"delta": {"content": text}} if chat else {"text": text})
        assert choices._token_chunk(i, text, include_usage) == choices._chunk(c, include_usage)


@pytest.mark.parametrize("enabled", [False, True])
def test_requests_are_logged_only_with_the_request_log_flag(enabled):
    """--enable-log-requests alone decides: the "flexsgl" logger at info (--log-level info) must not
    log prompts without it, and at warning must not hide them with it."""
    import logging

    pytest.importorskip("prometheus_client")
    from flexsgl.config import EngineConfig
    from flexsgl.log import logger
    from flexsgl.serve.app import ServerOptions, build_app, request_log
    from flexsgl.serve.engine_client import EngineClient
    from flexsgl.serve.metrics import Metrics

    before = logger.level
    try:
        for level in (logging.INFO, logging.WARNING):
            logger.setLevel(level)
            build_app(EngineClient(EngineConfig(), Metrics("tiny-docs")), "tiny-docs",
                      ServerOptions(request_log=enabled))
            assert request_log.isEnabledFor(logging.INFO) == enabled, logging.getLevelName(level)
    finally:
        logger.setLevel(before)


def test_a_fault_in_the_engine_reader_makes_the_server_unavailable_not_stuck():
    """The HTTP process's reader of the engine's messages raising (here its on_ready hook) ends with
    the server unavailable, saying why, rather than leaving every request waiting on it."""
    pytest.importorskip("prometheus_client")
    from flexsgl.config import EngineConfig
    from flexsgl.serve.engine_client import EngineClient
    from flexsgl.serve.messages import EngineInfo, Ready
    from flexsgl.serve.metrics import Metrics

    class OnePipe:
        def __init__(self):
            self.sent = [Ready(EngineInfo(None, None, 4), {})]

        def recv(self):
            if self.sent:
                return self.sent.pop()
            raise AssertionError("read past the fault")

    client = EngineClient(EngineConfig(), Metrics("tiny-docs"))
    client.loop = asyncio.new_event_loop()
    client._from_engine = OnePipe()
    client.on_ready = lambda: {}["no such key"]
    try:
        client._read()
        client.loop.run_until_complete(asyncio.sleep(0))
    finally:
        client.loop.close()
    assert not client.serving and "stopped reading the engine (KeyError" in client.failure, client.failure


def test_attention_params_reach_a_users_variant():
    """A server running a user's variant with a per-request window (`--attention module:attr`): a
    request's attention_params give the tokens an offline engine gives with them; a value the
    parameter does not take, or a name no variant takes, is a 400."""
    from tests.test_attention_variants import per_request_window

    spec = "tests.test_attention_variants:per_request_window"
    rng = random.Random(rng_seed := random.randrange(1 << 30))
    prompt, w = random_prompt(rng), rng.randrange(1, 4)
    offline = LLM(**OPTIONS, attention=per_request_window())
    greedy = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    want = offline.generate(prompt, SamplingParams(**greedy, attention_params={"w": w}))[0].text
    full = offline.generate(prompt, SamplingParams(**greedy))[0].text
    assert want != full, f"a window of {w} changes nothing here (seed={rng_seed})"
    with running_server("--attention", spec) as base:
        body = {"model": "tiny-docs", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        status, out = post(base + "/v1/completions", json.dumps({**body, "attention_params": {"w": w}}).encode())
        assert status == 200 and out["choices"][0]["text"] == want, (out, rng_seed)
        for bad in ({"w": 2.5}, {"nope": 1}):
            status, err = post(base + "/v1/completions", json.dumps({**body, "attention_params": bad}).encode())
            assert status == 400 and "attention_params" in err["error"]["message"], err
