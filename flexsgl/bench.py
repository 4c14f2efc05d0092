"""`flexsgl bench`: the throughput, latency and prefill workloads, run on one or more attention backends.

- throughput (offline): N requests, input and output lengths drawn uniformly from ranges, random
  token ids from a fixed seed, EOS ignored. One warm-up pass on prompts drawn from another seed
  (so the timed pass gets no prefix-cache hits), then the timed pass.
- latency: one batch of fixed prompt and output length. TTFT, TPOT, tokens/s, and TPOT against the
  decode floor (bytes a decode step must read over the copy bandwidth measured here).
- prefill: time to first token of one long prompt, per prompt length.

How requests are timed: through the engine's step API. `LLM.step()` launches a step and then reads
back the *previous* step's tokens (asynchronously copied), so a token's `on_token` callback fires
when the host reads it: after its step finished on the device and the host launched the next
one. A request's TTFT is that moment for its first token, from just before `add_request`; its
TPOT is (last token - first token) / (tokens - 1). Both therefore include the host's work, as a
caller of the engine sees it. Every pass starts and ends with a device synchronize, and its wall
time is taken after the final synchronize. Repeated passes use fresh prompts, so no pass reuses
another's KV pages through the prefix cache (the JSON reports `cached_tokens` to show it).
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from flexsgl.bench_env import copy_bandwidth, decode_floor, environment, sync
from flexsgl.bench_report import command_line, number, resolved, table_rows

WORKLOADS = ("throughput", "latency", "prefill")
# Defaults sized for a GPU; the tiny preset on a CPU wants small values on the command line.
DEFAULTS = {
    "throughput": {"num_prompts": 256, "input_len": "100:1024", "output_len": "100:1024"},
    "latency": {"batch_size": 1, "input_len": "1024", "output_len": "256", "repeats": 3},
    "prefill": {"input_len": "4096,16384", "repeats": 3},
}
APPLIES = {"num_prompts": ("throughput",), "batch_size": ("latency",), "repeats": ("latency", "prefill"),
           "output_len": ("throughput", "latency")}
DEFAULT_MODEL = "tiny"
BAR_INTERVAL = 0.1 if sys.stderr.isatty() else 10.0  # seconds between progress updates; fewer in a log


@dataclass
class BenchArgs:
    """What the command line gave; None means the workload's default."""

    workload: str = "throughput"
    model: str | None = None
    load_format: str | None = None  # None: dummy for a preset (timings do not depend on weight values)
    device: str | None = None
    dtype: str = "auto"
    num_prompts: int | None = None
    input_len: str | None = None
    output_len: str | None = None
    batch_size: int | None = None
    repeats: int | None = None
    overrides: list[str] = field(default_factory=list)
    page_size: int = 64
    kv_cache_tokens: int | None = None
    max_running: int | None = None
    max_batch_tokens: int | None = None
    compile: bool | None = None
    cuda_graphs: bool | None = None
    seed: int = 0


@dataclass
class Plan:
    """Checked and resolved arguments: everything a run needs, nothing loaded yet."""

    args: BenchArgs
    model: str
    load_format: str
    device: str
    overrides: list[str]  # as given
    backends: list[str]  # what each resolves to here
    num_prompts: int = 0
    input_range: tuple[int, int] = (0, 0)
    output_range: tuple[int, int] = (0, 0)
    prefill_lens: list[int] = field(default_factory=list)
    batch_size: int = 0
    repeats: int = 0


def parse_range(text: str, what: str) -> tuple[int, int]:
    """'MIN:MAX' or 'N' (= N:N) into (MIN, MAX), or ValueError in one sentence."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or lo < 1 or hi < lo:
        raise ValueError(f"{what} {text!r} should be N or MIN:MAX with 1 <= MIN <= MAX, e.g. 100:1024.")
    return lo, hi


def parse_lengths(text: str, what: str) -> list[int]:
    """'4096,16384' into [4096, 16384], or ValueError in one sentence."""
    try:
        lens = [int(p) for p in text.split(",")]
    except ValueError:
        lens = []
    if not lens or min(lens) < 1:
        raise ValueError(f"{what} {text!r} should be one or more positive lengths, e.g. 4096,16384.")
    return lens


def plan(args: BenchArgs) -> Plan:
    """Check every argument and every override before anything loads; ValueError says what is wrong."""
    from flexsgl.attention.registry import resolve_override
    from flexsgl.model.presets import PRESETS
    from flexsgl.model.loader import resolve

    w = args.workload
    if w not in WORKLOADS:
        raise ValueError(f"Unknown workload {w!r}; choose one of {', '.join(WORKLOADS)}.")
    for name, workloads in APPLIES.items():
        if getattr(args, name) is not None and w not in workloads:
            raise ValueError(f"--{name.replace('_', '-')} does not apply to the {w} workload "
                             f"(it applies to {', '.join(workloads)}).")
    for name in ("num_prompts", "batch_size", "repeats", "max_running", "max_batch_tokens", "kv_cache_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
    d = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in DEFAULTS[w].items()}
    model = args.model or DEFAULT_MODEL
    load_format = args.load_format or ("dummy" if model in PRESETS else "auto")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"Unknown device {device!r}; use cpu or cuda.")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("Device 'cuda' was asked for, but this machine has no CUDA GPU.")
    if args.page_size < 1:
        raise ValueError(f"--page-size must be at least 1, got {args.page_size}.")
    overrides = args.overrides or ["auto"]
    # Every override, with this page size, before anything runs: a later one cannot fail after an earlier ran.
    backends = [resolve_override(o, torch.device(device), "gqa", args.page_size).label for o in overrides]
    p = Plan(args, model, load_format, device, overrides, backends)
    if w == "throughput":
        p.num_prompts = d["num_prompts"]
        p.input_range = parse_range(d["input_len"], "--input-len")
        p.output_range = parse_range(d["output_len"], "--output-len")
        longest = p.input_range[1] + p.output_range[1]
    elif w == "latency":
        p.batch_size, p.repeats = d["batch_size"], d["repeats"]
        p.input_range = _fixed(d["input_len"], "--input-len", w)
        p.output_range = _fixed(d["output_len"], "--output-len", w)
        if p.output_range[0] < 2:
            raise ValueError("The latency workload needs --output-len of at least 2 to time decode steps.")
        if args.max_running is not None and args.max_running < p.batch_size:
            raise ValueError(f"--batch-size ({p.batch_size}) is above --max-running ({args.max_running}), "
                             "the most requests that run at once; raise --max-running.")
        longest = p.input_range[1] + p.output_range[1]
    else:
        p.repeats = d["repeats"]
        p.prefill_lens = parse_lengths(d["input_len"], "--input-len")
        longest = max(p.prefill_lens) + 1
    ctx = resolve(model, load_format).config.max_position  # reads a config; loads no weights
    if longest > ctx:
        raise ValueError(f"The longest request ({longest} tokens with its output) exceeds the context of "
                         f"{model} ({ctx} tokens); pass smaller --input-len/--output-len.")
    return p


def _fixed(text: str, what: str, workload: str) -> tuple[int, int]:
    lo, hi = parse_range(text, what)
    if lo != hi:
        raise ValueError(f"The {workload} workload takes one {what}, e.g. 512, not a range ({text!r}).")
    return lo, hi


def run(p: Plan, progress: bool = True) -> dict:
    """Run the plan on each override in turn (one LLM at a time) and return the report."""
    say = (lambda msg: print(f"[flexsgl bench] {msg}", file=sys.stderr)) if progress else (lambda msg: None)
    device = torch.device(p.device)
    say("measuring device copy bandwidth")
    bandwidth = copy_bandwidth(device)
    results = []
    for override, label in zip(p.overrides, p.backends):
        t0 = time.perf_counter()
        llm = build_llm(p, override, say)
        res = {"override": override, "backends": label, "load_s": time.perf_counter() - t0,
               "kv_cache_tokens": (llm.pool.num_pages - 1) * llm.pool.page_size,
               "compile": llm.compile, "dtype": str(llm.dtype).removeprefix("torch.")}
        res.update(WORKLOADS_RUN[p.args.workload](llm, p, bandwidth, progress))
        results.append(res)
        # Each backend's figures as soon as they exist: a run cut short still reports what it measured.
        say(f"{label}: " + ", ".join(f"{name} {number(v)}" for name, v in table_rows(p.args.workload, res)))
        del llm
        free_memory(device)
    return {"workload": p.args.workload, "model": p.model, "load_format": p.load_format,
            "device": p.device, "copy_bandwidth_bytes_per_s": bandwidth,
            "command": command_line(p.args), "args": asdict(p.args), "resolved": resolved(p),
            "environment": environment(device),
            "results": results}


def build_llm(p: Plan, override: str, say):
    from flexsgl import LLM

    a = p.args
    # A latency run's batch is fixed: running, and capturing decode graphs for, more would only cost
    # start-up time (as `flexsgl generate` does for its batch).
    max_running = a.max_running or (p.batch_size if a.workload == "latency" else None)
    opts = {"max_running": max_running, "max_batch_tokens": a.max_batch_tokens, "compile": a.compile,
            "cuda_graphs": a.cuda_graphs, "kv_cache_tokens": a.kv_cache_tokens}
    opts = {k: v for k, v in opts.items() if v is not None}  # else the engine's own defaults
    return LLM(p.model, device=p.device, dtype=a.dtype, override=override, load_format=p.load_format,
               page_size=a.page_size, seed=a.seed, progress=say, **opts)


def free_memory(device: torch.device) -> None:
    """Let the next LLM start clean: drop the last one's memory and compiled graphs."""
    torch._dynamo.reset()  # compiled frames hold the last runner (and its model) alive
    gc.unfreeze()  # what freeze_heap froze can be collected again
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- passes


def freeze_heap() -> None:
    """Collect, then move every object alive now (the model, compiled code, captured graphs, some
    800k objects) out of the garbage collector's reach, as vLLM's engine does after start-up. A full
    collection inside a timed pass then skips them: on the development CPU one took ~130 ms before,
    2 ms after. On the H200 the throughput run did not measurably change (docs/BENCHMARKS.md).
    free_memory unfreezes."""
    gc.collect()
    gc.freeze()


def random_prompts(rng: random.Random, lens: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def throughput_requests(seed: int, n: int, input_range: tuple[int, int], output_range: tuple[int, int],
                        vocab: int):
    """The throughput workload from `seed`: (input lengths, output lengths, prompts, warm-up prompts).
    The warm-up prompts have the same lengths (so the same shapes compile) and other tokens, drawn
    from seed + 1 (so nothing they leave in the prefix cache is hit)."""
    rng = random.Random(seed)
    in_lens = [rng.randint(*input_range) for _ in range(n)]
    out_lens = [rng.randint(*output_range) for _ in range(n)]
    prompts = random_prompts(rng, in_lens, vocab)
    return in_lens, out_lens, prompts, random_prompts(random.Random(seed + 1), in_lens, vocab)


def timed_pass(llm, prompts: list[list[int]], out_lens: list[int], desc: str, progress: bool) -> dict:
    """Run requests to completion through the step API; wall time and per-request token times."""
    from tqdm import tqdm

    from flexsgl import SamplingParams

    first: dict[int, float] = {}
    last: dict[int, float] = {}
    count = [0]

    def on_token(req) -> None:
        now = time.perf_counter()
        first.setdefault(req.request_id, now)
        last[req.request_id] = now
        count[0] += 1

    bar = tqdm(total=sum(out_lens), desc=desc, unit="tok", file=sys.stderr, disable=not progress, leave=False,
               mininterval=BAR_INTERVAL)
    freeze_heap()
    sync(llm.device)
    t0 = time.perf_counter()
    ids = [llm.add_request(pr, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), on_token)
           for pr, n in zip(prompts, out_lens)]
    before = llm.stats()
    outs = {}
    while llm.has_unfinished:
        outs.update((o.request_id, o) for o in llm.step())
        bar.update(count[0] - bar.n)
    sync(llm.device)
    wall = time.perf_counter() - t0
    bar.close()
    after = llm.stats()
    steps = {k: after.get(k, 0) - before.get(k, 0) for k in ("prefill_steps", "decode_steps", "preemptions")}
    outs = [outs[i] for i in ids]
    for o, n in zip(outs, out_lens):
        if o.error:
            raise ValueError(o.error)
        if len(o.token_ids) != n:  # EOS is ignored, so every request runs to its length
            raise RuntimeError(f"request {o.request_id} produced {len(o.token_ids)} tokens, expected {n}")
    return {"wall_s": wall, "outputs": outs, "steps": steps, "ttft_s": [first[i] - t0 for i in ids],
            "tpot_s": [(last[i] - first[i]) / (n - 1) if n > 1 else None for i, n in zip(ids, out_lens)]}


# ---- workloads: each returns the figures of one backend


def throughput(llm, p: Plan, bandwidth: float, progress: bool) -> dict:
    n = p.num_prompts
    in_lens, out_lens, prompts, warm_prompts = throughput_requests(p.args.seed, n, p.input_range, p.output_range,
                                                                   llm.config.vocab_size)
    warm = timed_pass(llm, warm_prompts, out_lens, "warm-up", progress)
    res = timed_pass(llm, prompts, out_lens, "throughput", progress)
    wall, n_in, n_out = res["wall_s"], sum(in_lens), sum(out_lens)
    return {"requests": n, "input_tokens": n_in, "output_tokens": sum(len(o.token_ids) for o in res["outputs"]),
            "requested_output_tokens": n_out, "wall_s": wall, "warmup_s": warm["wall_s"],
            "requests_per_s": n / wall, "output_tokens_per_s": n_out / wall,
            "total_tokens_per_s": (n_in + n_out) / wall,
            "cached_tokens": sum(o.cached_tokens for o in res["outputs"]), **res["steps"]}


def latency(llm, p: Plan, bandwidth: float, progress: bool) -> dict:
    from tqdm import tqdm

    rng = random.Random(p.args.seed)
    b, n_in, n_out = p.batch_size, p.input_range[0], p.output_range[0]
    passes, cached = [], 0
    for r in tqdm(range(p.repeats + 1), desc="latency passes", file=sys.stderr, disable=not progress,
                  mininterval=BAR_INTERVAL):
        res = timed_pass(llm, random_prompts(rng, [n_in] * b, llm.config.vocab_size), [n_out] * b,
                         "warm-up" if r == 0 else f"pass {r}", progress)
        if r:  # pass 0 warms up (compiles this prefill shape and decode batch)
            passes.append(res)
            cached += sum(o.cached_tokens for o in res["outputs"])
    ttft = statistics.median(statistics.mean(r["ttft_s"]) for r in passes)
    tpot = statistics.median(statistics.mean(r["tpot_s"]) for r in passes)
    wall = statistics.median(r["wall_s"] for r in passes)
    # A decode step k (1..n_out-1) attends over n_in + k tokens: the mean context is n_in + n_out / 2.
    floor = decode_floor(llm, b, n_in + n_out / 2, bandwidth)
    return {"batch_size": b, "input_len": n_in, "output_len": n_out, "repeats": p.repeats,
            "output_tokens": sum(len(o.token_ids) for o in passes[-1]["outputs"]),
            "ttft_s": ttft, "tpot_s": tpot, "wall_s": wall, "tokens_per_s": b * n_out / wall,
            "decode_tokens_per_s": b / tpot, **floor, "pct_of_floor": 100.0 * floor["floor_tpot_s"] / tpot,
            "ttft_s_per_pass": [statistics.mean(r["ttft_s"]) for r in passes],
            "tpot_s_per_pass": [statistics.mean(r["tpot_s"]) for r in passes], "cached_tokens": cached,
            "preemptions": sum(r["steps"]["preemptions"] for r in passes)}


def prefill(llm, p: Plan, bandwidth: float, progress: bool) -> dict:
    from tqdm import tqdm

    rng = random.Random(p.args.seed)
    rows, cached = [], 0
    bar = tqdm(total=len(p.prefill_lens) * (p.repeats + 1), desc="prefill passes", file=sys.stderr,
               disable=not progress, mininterval=BAR_INTERVAL)
    for n_in in p.prefill_lens:
        times = []
        for r in range(p.repeats + 1):  # pass 0 warms up this length
            res = timed_pass(llm, random_prompts(rng, [n_in], llm.config.vocab_size), [1], f"prefill {n_in}", False)
            if r:
                times.append(res["ttft_s"][0])
                cached += res["outputs"][0].cached_tokens
            bar.update(1)
        ttft = statistics.median(times)
        rows.append({"input_len": n_in, "ttft_s": ttft, "tokens_per_s": n_in / ttft, "ttft_s_per_pass": times})
    bar.close()
    return {"repeats": p.repeats, "prefill": rows, "cached_tokens": cached}


WORKLOADS_RUN = {"throughput": throughput, "latency": latency, "prefill": prefill}
