"""What a `flexsgl bench` run is asked for (BenchArgs, as the command line gave it), checked and
resolved into a Plan before anything loads.

- throughput (offline): N requests, input and output lengths drawn uniformly from ranges, random
  token ids from a fixed seed, EOS ignored.
- latency: one batch of fixed prompt and output length.
- prefill: time to first token of one long prompt, per prompt length.
- serve: the throughput workload's requests (or a ShareGPT file's conversations) sent to
  `flexsgl serve`, or any OpenAI-compatible server, with Poisson arrivals at a request rate (and a
  concurrency limit), streamed, optionally constrained to a JSON schema (bench/serving.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from flexsgl.config import EngineConfig
from flexsgl.log import logger

WORKLOADS = ("throughput", "latency", "prefill", "serve")
STRUCTURED = ("json-schema",)  # --structured: what the serve workload's requests are constrained to
# Defaults sized for a GPU; the tiny preset on a CPU wants small values on the command line.
DEFAULTS = {
    "throughput": {"num_prompts": 256, "input_len": "100:1024", "output_len": "100:1024"},
    "latency": {"batch_size": 1, "input_len": "1024", "output_len": "256", "repeats": 3},
    "prefill": {"input_len": "4096,16384", "repeats": 3},
    "serve": {"num_prompts": 256, "input_len": "100:1024", "output_len": "100:1024"},
}
APPLIES = {"num_prompts": ("throughput", "serve"), "batch_size": ("latency",), "repeats": ("latency", "prefill"),
           "output_len": ("throughput", "latency", "serve"), "request_rate": ("serve",),
           "max_concurrency": ("serve",), "base_url": ("serve",), "dataset_path": ("serve",),
           "structured": ("serve",)}


# The engine options a bench of a running server (--base-url) takes: what its requests are made for.
BASE_URL_OPTIONS = ("model", "load_format", "context_length", "device")


@dataclass
class BenchArgs:
    """What the command line gave; None means the workload's default. `engine` holds the engine
    options (its `override` is not used: `overrides` lists the backends to compare, default auto);
    a preset loads dummy weights unless told otherwise (timings do not depend on weight values)."""

    workload: str = "throughput"
    num_prompts: int | None = None
    input_len: str | None = None
    output_len: str | None = None
    batch_size: int | None = None
    repeats: int | None = None
    overrides: list[str] = field(default_factory=list)
    seed: int = 0  # the random prompts and lengths, and dummy weights
    engine: EngineConfig = field(default_factory=EngineConfig)
    request_rate: str | None = None  # serve: requests per second, or inf (default); several: one pass each
    max_concurrency: int | None = None  # serve: most requests in flight (default: no limit)
    base_url: str | None = None  # serve: a running server to measure instead of starting one
    dataset_path: str | None = None  # serve: a ShareGPT-format JSON file of conversations (default: random prompts)
    structured: str | None = None  # serve: constrain each output (STRUCTURED) and compare with unconstrained runs


@dataclass
class Plan:
    """Checked and resolved arguments: everything a run needs, nothing loaded yet."""

    args: BenchArgs
    engine: EngineConfig  # resolved: model, load format, device, seed and latency's running limit set
    overrides: list[str]  # as given
    backends: list[str]  # what each resolves to here
    num_prompts: int = 0
    input_range: tuple[int, int] = (0, 0)
    output_range: tuple[int, int] = (0, 0)
    prefill_lens: list[int] = field(default_factory=list)
    batch_size: int = 0
    repeats: int = 0
    request_rates: list[float] = field(default_factory=lambda: [float("inf")])


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


def parse_rates(text: str) -> list[float]:
    """'8', '0.5,8,inf' or 'inf' into requests per second, or ValueError in one sentence."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = -1.0
        if not rate > 0:
            raise ValueError(f"--request-rate {text!r} should be positive numbers of requests per second (or inf), "
                             "separated by commas.")
        rates.append(rate)
    return rates


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
    from flexsgl.model.source import resolve
    from flexsgl.model.presets import DEFAULT_MODEL, PRESETS

    w = args.workload
    if w not in WORKLOADS:
        raise ValueError(f"Unknown workload {w!r}; choose one of {', '.join(WORKLOADS)}.")
    for name, workloads in APPLIES.items():
        if getattr(args, name) is not None and w not in workloads:
            raise ValueError(f"--{name.replace('_', '-')} does not apply to the {w} workload "
                             f"(it applies to {', '.join(workloads)}).")
    for name in ("num_prompts", "batch_size", "repeats", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
    d = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in DEFAULTS[w].items()}
    e = args.engine
    model = e.model or DEFAULT_MODEL
    load_format = "dummy" if model in PRESETS and e.load_format == "auto" else e.load_format
    engine = e.replace(model=model, load_format=load_format, device=str(e.torch_device), random_seed=args.seed)
    overrides = args.overrides or ["auto"]
    mcfg = resolve(model, load_format, e.context_length).config  # reads a config; loads no weights
    # Every override, for this model's attention and page size, before anything runs: a later one
    # cannot fail after an earlier ran.
    backends = [resolve_override(o, engine.torch_device, mcfg.attention, engine.page_size).label for o in overrides]
    p = Plan(args, engine, overrides, backends)
    if w == "serve":
        p.request_rates = parse_rates(args.request_rate or "inf")
        if args.base_url and args.overrides:
            raise ValueError("--override picks the backend of a server the bench starts; with --base-url the "
                             "server is already running.")
        if args.base_url:  # the model names the tokenizer and the context the requests are made for
            engine_flag = next((f.name for f in fields(EngineConfig) if f.name not in BASE_URL_OPTIONS
                                and getattr(e, f.name) != f.default), None)
            if engine_flag:
                raise ValueError(f"--{engine_flag.replace('_', '-')} configures a server the bench starts; with "
                                 "--base-url the server is already running (pass its --model only).")
        if args.base_url and not args.base_url.startswith("http://"):
            raise ValueError(f"--base-url should look like http://HOST:PORT, got {args.base_url!r}.")
        if args.structured is not None and args.structured not in STRUCTURED:
            raise ValueError(f"--structured {args.structured!r} is not one of {', '.join(STRUCTURED)}.")
        if args.dataset_path is not None:
            import os

            if not os.path.isfile(args.dataset_path):
                raise ValueError(f"--dataset-path {args.dataset_path!r} is not a file.")
            if args.input_len is not None:
                raise ValueError("--input-len does not apply with --dataset-path: the prompts are the dataset's.")
    if w in ("throughput", "serve"):
        p.num_prompts = d["num_prompts"]
        p.input_range = parse_range(d["input_len"], "--input-len")
        p.output_range = parse_range(d["output_len"], "--output-len")
        longest = p.input_range[1] + p.output_range[1]
    elif w == "latency":
        p.batch_size, p.repeats = d["batch_size"], d["repeats"]
        p.input_range = _fixed(d["input_len"], "--input-len", w)
        p.output_range = _fixed(d["output_len"], "--output-len", w)
        if p.output_range[0] < 3:
            raise ValueError("The latency workload needs --output-len of at least 3 to time decode steps (it "
                             "times those after each request's second token).")
        running = e.max_running_requests
        if running != EngineConfig.max_running_requests and running < p.batch_size:
            raise ValueError(f"--batch-size ({p.batch_size}) is above --max-running-requests ({running}), "
                             "the most requests that run at once; raise --max-running-requests.")
        # The batch is fixed: running, and capturing decode graphs for, more would only cost start-up
        # time (as `flexsgl generate` does for its batch).
        if running == EngineConfig.max_running_requests:
            p.engine = engine.replace(max_running_requests=p.batch_size)
        # Every prompt of the batch is prefilled before it decodes: each decode step then runs the whole batch.
        p.engine = p.engine.replace(prefill_first=True)
        longest = p.input_range[1] + p.output_range[1]
    else:
        p.repeats = d["repeats"]
        p.prefill_lens = parse_lengths(d["input_len"], "--input-len")
        longest = max(p.prefill_lens) + 1
    ctx = mcfg.max_position
    if longest > ctx and (args.input_len is None or (args.output_len is None and w != "prefill")):
        longest = _fit_defaults(p, ctx, args.input_len is not None, args.output_len is not None)
    if longest > ctx:
        raise ValueError(f"The longest request ({longest} tokens with its output) exceeds the context of "
                         f"{model} ({ctx} tokens); pass smaller --input-len/--output-len.")
    if w == "latency" and p.output_range[0] < 3:
        raise ValueError(f"--input-len {p.input_range[0]} leaves {p.output_range[0]} output tokens in {model}'s "
                         f"context of {ctx}, and the latency workload needs at least 3; pass a smaller --input-len.")
    if p.engine.torch_device.type == "cpu":
        seconds = cpu_seconds(p, mcfg.num_params())
        if seconds > SLOW_ON_CPU_S:
            logger.warning(f"this {w} run will take about {seconds / 60:.0f} minutes on the CPU (its sizes are "
                           f"made for a GPU); for a quick one: flexsgl bench --workload {w} {QUICK[w]}")
    return p


SLOW_ON_CPU_S = 180
CPU_FLOPS = 5e10  # what a few CPU cores reach on these models' matrix products, generously
# A step's cost beyond the matrix work on the CPU, fixed and per running request: the embedded model
# decoded one request at 3.4 ms a step and 256 at 0.19-0.38 s on a shared 2-core machine
CPU_STEP_S, CPU_REQUEST_STEP_S = 0.003, 0.0008
CPU_BYTES_PER_S = 2e10  # and a step reads every float32 weight once, generously fast
QUICK = {"throughput": "--num-prompts 8 --input-len 16:64 --output-len 16:64",
         "serve": "--num-prompts 8 --input-len 16:64 --output-len 16:64",
         "latency": "--input-len 64 --output-len 16 --repeats 1", "prefill": "--input-len 256 --repeats 1"}


def cpu_seconds(p: Plan, params: int) -> float:
    """A rough estimate of a run's time on the CPU: its tokens' matrix work, and each step's fixed cost,
    its requests' and its read of the weights."""
    passes = 1 + p.repeats if p.args.workload not in ("throughput", "serve") else 2
    if p.args.workload in ("throughput", "serve"):
        tokens = p.num_prompts * (sum(p.input_range) + sum(p.output_range)) / 2
        running = min(p.num_prompts, p.engine.max_running_requests)
        steps = p.output_range[1] * -(-p.num_prompts // running)
    elif p.args.workload == "latency":
        tokens, steps = p.batch_size * (p.input_range[0] + p.output_range[0]), p.output_range[0]
        running = p.batch_size
    else:
        tokens, steps, running = sum(p.prefill_lens), len(p.prefill_lens), 1
    step_s = CPU_STEP_S + running * CPU_REQUEST_STEP_S + 4 * params / CPU_BYTES_PER_S
    return passes * (2 * params * tokens / CPU_FLOPS + steps * step_s) * len(p.overrides)


def _fit_defaults(p: Plan, ctx: int, input_given: bool, output_given: bool) -> int:
    """Cut the default lengths (sized for the presets' long contexts) to fit a model's shorter one:
    both, or the one not given beside one that is; lengths given on the command line are never
    changed. Returns the new longest request."""
    w = p.args.workload
    if w in ("throughput", "serve", "latency") and (input_given or output_given):
        if input_given:  # the output's range gives way, down to one token
            room = max(1, ctx - p.input_range[1])
            p.output_range = tuple(min(n, room) for n in p.output_range)
        else:
            room = max(1, ctx - p.output_range[1])
            p.input_range = tuple(min(n, room) for n in p.input_range)
    elif w in ("throughput", "serve"):
        half = ctx // 2
        p.input_range = tuple(min(n, half) for n in p.input_range)
        p.output_range = tuple(min(n, half) for n in p.output_range)
    elif w == "latency":
        out = min(p.output_range[0], ctx // 4)
        p.output_range, p.input_range = (out, out), (ctx - out, ctx - out)
    else:
        p.prefill_lens = sorted({min(n, ctx - 1) for n in p.prefill_lens})
    logger.info(f"the default lengths are cut to fit {p.engine.model}'s context of {ctx} tokens")
    return p.input_range[1] + p.output_range[1] if w != "prefill" else max(p.prefill_lens) + 1


def _fixed(text: str, what: str, workload: str) -> tuple[int, int]:
    lo, hi = parse_range(text, what)
    if lo != hi:
        raise ValueError(f"The {workload} workload takes one {what}, e.g. 512, not a range ({text!r}).")
    return lo, hi
