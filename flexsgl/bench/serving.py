"""The serve workload: `flexsgl serve` under load, measured as its clients see it.

For each override the bench starts a server process on a free port (or targets --base-url, any
OpenAI-compatible server: flexsgl, vLLM, SGLang; the model name comes from its /v1/models, and
nothing flexsgl-only is needed), waits for /health, runs a warm-up pass (the same lengths, other
tokens, all at once: every shape compiles before the timed passes), then, for each rate of
--request-rate (e.g. 8,32,inf), sends the timed requests with Poisson arrivals at that rate (inf:
all at once), at most --max-concurrency in flight, each a streamed completion with EOS ignored.
Per request: TTFT (send to first token event), TPOT ((last - first) / (tokens - 1)), and every gap
between token events (ITL); reported at p50, p90 and p99, with requests/s and tokens/s over the
pass's wall time.

The requests are random token ids of the throughput workload's lengths, or with --dataset-path a
ShareGPT file's conversations: each prompt a first human turn, its output as long as the reply
(tokenized with the model's tokenizer; --output-len overrides it), shuffled with the seed, the
pairs that do not fit the context left out. --structured json-schema constrains every output to
JSON_SCHEMA (vLLM's `structured_outputs` field), a schema no output completes before its length,
so constrained and unconstrained runs produce the same tokens' worth of work.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import numpy as np

from flexsgl.bench.args import Plan
from flexsgl.bench.passes import random_prompts, throughput_requests
from flexsgl.bench.report import engine_flags
from flexsgl.bench.sse_client import stream_post
from flexsgl.log import logger, progress as log_progress

HEALTH_TIMEOUT_S = 1800  # a large model's load, compile and graph capture on a GPU
# --structured json-schema: records of a few typed fields, far more than any output holds.
JSON_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "minItems": 100000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}
REQUEST_TIMEOUT_S = 3600
PERCENTILES = (50, 90, 99)


def serve_workload(p: Plan, override: str, progress: bool) -> list[dict]:
    """One server for `override`, warmed up once, then one timed pass per rate; a result each."""
    n = p.num_prompts
    src = _source(p)
    vocab = src.config.vocab_size
    in_lens, out_lens, prompts, warm_prompts = throughput_requests(p.args.seed, n, p.input_range, p.output_range,
                                                                   vocab)
    if p.args.dataset_path:
        in_lens, out_lens, prompts = sharegpt_requests(p.args.dataset_path, src, n, p.args.seed,
                                                       p.output_range if p.args.output_len else None)
        warm_prompts = random_prompts(random.Random(p.args.seed + 1), in_lens, vocab)
    extra = {"structured_outputs": {"json": JSON_SCHEMA}} if p.args.structured == "json-schema" else {}
    server = _server(p, override)
    results = []
    with server as base_url:
        model = _model_name(base_url)
        pages = _metric(base_url, "flexsgl:kv_pages_total")
        run = dict(model=model, extra=extra, concurrency=p.args.max_concurrency, seed=p.args.seed, progress=progress)
        t0 = time.perf_counter()
        asyncio.run(_pass(base_url, warm_prompts, out_lens, float("inf"), desc="warm-up", **run))
        warm = time.perf_counter() - t0
        for rate in p.request_rates:
            res = asyncio.run(_pass(base_url, prompts, out_lens, rate, desc=f"serve at {rate:g}/s", **run))
            results.append({"startup_s": server.load_s, "kv_cache_pages": pages, "warmup_s": warm,
                            **_summary(res, rate, in_lens, out_lens, p.args.max_concurrency)})
    return results


def sharegpt_requests(path: str, src, n: int, seed: int, output_range: tuple[int, int] | None):
    """(input lengths, output lengths, prompts) of `n` conversations of a ShareGPT file, shuffled
    with `seed`: each a first human turn and its reply's length in tokens (drawn from
    `output_range` instead, when given); pairs shorter than 4 tokens either way, or longer than the
    context together, are left out. ValueError (one sentence) for a file that does not hold enough."""
    from flexsgl.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(src)
    if tokenizer is None:
        raise ValueError(f"--dataset-path needs a tokenizer, and {src.name!r} has none.")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--dataset-path {path!r} is not a JSON file ({e}).") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path!r} should hold a list of conversations (ShareGPT's format).")
    pairs = [(c[0].get("value"), c[1].get("value")) for d in data if isinstance(d, dict)
             and isinstance(c := d.get("conversations"), list) and len(c) >= 2
             and all(isinstance(t, dict) for t in c[:2])]
    pairs = [(a, b) for a, b in pairs if isinstance(a, str) and isinstance(b, str) and a and b]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    ctx = src.config.max_position
    in_lens, out_lens, prompts = [], [], []
    for prompt, reply in pairs:
        n_in = len(tokenizer.encode(prompt))
        n_out = rng.randint(*output_range) if output_range else len(tokenizer.encode(reply))
        if n_in < 4 or n_out < 4 or n_in + n_out > ctx:
            continue
        in_lens.append(n_in), out_lens.append(n_out), prompts.append(prompt)
        if len(prompts) == n:
            return in_lens, out_lens, prompts
    raise ValueError(f"--dataset-path {path!r} has {len(prompts)} usable conversations (a first turn and a reply "
                     f"of 4 tokens or more that fit the context of {ctx}), fewer than --num-prompts ({n}).")


def _summary(res: dict, rate: float, in_lens: list[int], out_lens: list[int], concurrency: int | None) -> dict:
    n, n_in, n_out = len(in_lens), sum(in_lens), sum(res["output_tokens"])
    wall = res["wall_s"]
    out = {"requests": n, "request_rate": str(rate), "max_concurrency": concurrency,
           "input_tokens": n_in, "output_tokens": n_out, "requested_output_tokens": sum(out_lens),
           "wall_s": wall, "requests_per_s": n / wall, "output_tokens_per_s": n_out / wall,
           "total_tokens_per_s": (n_in + n_out) / wall, "cached_tokens": res["cached_tokens"]}
    for name in ("ttft_s", "tpot_s", "itl_s"):
        values = np.asarray(res[name], dtype=np.float64)
        for q in PERCENTILES:
            out[f"{name[:-2]}_p{q}_s"] = float(np.percentile(values, q)) if values.size else float("nan")
        out[f"{name[:-2]}_mean_s"] = float(values.mean()) if values.size else float("nan")
    return out


async def _pass(base_url: str, prompts, out_lens, rate: float, *, model: str | None, extra: dict,
                concurrency: int | None, seed: int, desc: str, progress: bool) -> dict:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency or len(prompts))
    bar = log_progress(total=len(prompts), desc=desc, unit="req", disable=not progress)
    ttft, tpot, itl, tokens, cached = [], [], [], [], [0]

    async def one(prompt, n_out):
        async with limit:
            body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, **extra}
            start = time.perf_counter()
            events = await stream_post(base_url, "/v1/completions", body, REQUEST_TIMEOUT_S)
        times = [t for t, e in events if e.get("choices") and e["choices"][0].get("finish_reason") is None]
        usage = next((e["usage"] for _, e in events if e.get("usage")), None)
        if usage is None or usage["completion_tokens"] != n_out:
            raise RuntimeError(f"a request produced {usage and usage['completion_tokens']} tokens, expected {n_out}")
        tokens.append(usage["completion_tokens"])
        cached[0] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if times:
            ttft.append(times[0] - start)
            itl.extend(np.diff(times).tolist())
            if len(times) > 1:
                tpot.append((times[-1] - times[0]) / (len(times) - 1))
        bar.update(1)

    tasks = []
    t0 = time.perf_counter()
    for prompt, n_out in zip(prompts, out_lens):
        tasks.append(asyncio.create_task(one(prompt, n_out)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    bar.close()
    return {"wall_s": wall, "ttft_s": ttft, "tpot_s": tpot, "itl_s": itl, "output_tokens": tokens,
            "cached_tokens": cached[0]}


STOPPING = (signal.SIGTERM, signal.SIGHUP)  # signals that end a bench, and with it the server it started


PR_SET_PDEATHSIG = 1  # linux/prctl.h


class _server:
    """The server to measure: --base-url's, or a `flexsgl serve` process for this override."""

    def __init__(self, p: Plan, override: str):
        self.p, self.override, self.proc, self.log = p, override, None, None
        self.previous: dict = {}  # the SIGTERM and SIGHUP handlers while this bench's own server runs
        self.forking, self.pending = False, None  # a signal that came while the server forked
        self.load_s = 0.0  # start to healthy, for a server the bench starts

    def __enter__(self) -> str:
        if self.p.args.base_url:
            return _answering(self.p.args.base_url.rstrip("/"))
        t0 = time.perf_counter()
        if threading.current_thread() is threading.main_thread():  # a SIGTERM to the bench alone, or the
            for sig in STOPPING:  # SIGHUP of a closed terminal, stops its server too
                self.previous[sig] = signal.signal(sig, self._on_signal)
        port = _free_port()
        cmd = [sys.executable, "-m", "flexsgl", "serve", self.p.engine.model, "--port", str(port),
               "--override", self.override, *engine_flags(self.p.engine, skip=("model", "override"))]
        logger.info("starting: " + " ".join(cmd[1:]))
        self.log = tempfile.NamedTemporaryFile("w+", prefix="flexsgl-serve-", suffix=".log", delete=False)
        try:
            self.forking = True  # a signal meanwhile waits until self.proc names the server
            try:
                self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                             preexec_fn=_ended_with_this_process())
            finally:
                self.forking = False
            if self.pending is not None:
                raise SystemExit(128 + self.pending)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + HEALTH_TIMEOUT_S
            while not _healthy(url):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    tail = self.log.read()[-2000:]
                    raise RuntimeError(f"the server did not become healthy (log {self.log.name}):\n{tail}")
                time.sleep(0.5)
        except BaseException:  # a SIGTERM, SIGHUP or Ctrl-C while it starts too: `with` calls no __exit__ here
            self.__exit__()
            raise
        self.load_s = time.perf_counter() - t0
        return url

    def _on_signal(self, signum, frame) -> None:
        """Unwinds through __exit__ (or __enter__'s clean-up), which stops the server."""
        if self.forking:
            self.pending = signum
        else:
            raise SystemExit(128 + signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None


def _ended_with_this_process():
    """A preexec_fn that makes the child get SIGTERM when this process ends, even by SIGKILL, which
    no handler here sees (Linux's PR_SET_PDEATHSIG); None elsewhere. prctl is looked up before the
    fork, so the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # this process ended before the call: no signal will come
            os._exit(1)

    return in_child


def _answering(url: str) -> str:
    """`url` (--base-url) once something answers HTTP there (any status); ValueError if nothing does."""
    try:
        urllib.request.urlopen(url + "/v1/models", timeout=10).close()
    except urllib.error.HTTPError:
        pass  # it answers
    except (OSError, ValueError) as e:
        raise ValueError(f"No server answers at --base-url {url} ({getattr(e, 'reason', e)}).") from None
    return url


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _metric(url: str, name: str) -> int | None:
    """A flexsgl gauge from /metrics (None from another server, or one without it)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def _model_name(url: str) -> str | None:
    """The first model a server lists at /v1/models (None if it lists none)."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            data = json.loads(r.read()).get("data") or []
    except (OSError, ValueError):
        return None
    return data[0].get("id") if data and isinstance(data[0], dict) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _source(p: Plan):
    from flexsgl.model.source import resolve

    return resolve(p.engine.model, p.engine.load_format, p.engine.context_length)
