"""`flexsgl bench`'s workloads, run on one or more attention backends, one engine at a time.

- throughput: one warm-up pass on prompts drawn from another seed (so the timed pass gets no
  prefix-cache hits), then the timed pass.
- latency: a warm-up pass, then `repeats` timed passes: TTFT, TPOT, tokens/s, and TPOT against the
  decode floor (bytes a decode step must read over the copy bandwidth measured here).
- prefill: per prompt length, a warm-up pass, then `repeats` timed passes of one prompt.
- serve: a `flexsgl serve` process per backend, under Poisson load (bench/serving.py).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict

from flexsgl.bench.args import Plan
from flexsgl.bench.machine import environment
from flexsgl.bench.passes import BAR_INTERVAL, free_memory, random_prompts, throughput_requests, timed_pass
from flexsgl.bench.report import column_name, command_line, number, resolved, table_rows
from flexsgl.bench.roofline import copy_bandwidth, decode_floor
from flexsgl.bench.serving import serve_workload
from flexsgl.log import logger, progress as log_progress


def run(p: Plan, progress: bool = True) -> dict:
    """Run the plan on each override in turn (one LLM at a time) and return the report."""
    say = logger.info if progress else (lambda msg: None)
    device = p.engine.torch_device
    say("measuring device copy bandwidth")
    bandwidth = copy_bandwidth(device)
    results = []
    for override, label in zip(p.overrides, p.backends):
        for res in _measure(p, override, label, bandwidth, progress):
            results.append(res)
            # Each result as soon as it exists: a run cut short still reports what it measured.
            say(f"{column_name(res)}: " + ", ".join(f"{name} {number(v)}"
                                                  for name, v in table_rows(p.args.workload, res)))
    return {"workload": p.args.workload, "model": p.engine.model, "load_format": p.engine.load_format,
            "device": p.engine.device, "tensor_parallel_size": p.engine.tensor_parallel_size,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "command": command_line(p.args), "args": asdict(p.args), "resolved": resolved(p),
            "environment": environment(device),
            "results": results}


def _measure(p: Plan, override: str, label: str, bandwidth: float, progress: bool) -> list[dict]:
    """The workload's results on one override: one, or for serve one per request rate."""
    if p.args.workload == "serve":  # the engine runs in the server's process
        return [{"override": override, "backends": p.args.base_url or label, **res}
                for res in serve_workload(p, override, progress)]
    llm = build_llm(p, override)
    res = {"override": override, "backends": label, "kv_cache_tokens": (llm.pool.num_pages - 1) * llm.pool.page_size,
           "compile": llm.compile, "dtype": str(llm.dtype).removeprefix("torch.")}
    res.update(WORKLOADS_RUN[p.args.workload](llm, p, bandwidth, progress))
    # Start-up apart from run time: the engine's construction and its phases (LLM.startup_times),
    # and compiling wherever it happened (in capture, and in warm-up passes, which the timed
    # figures above leave out).
    res.update(llm.startup_times())
    llm.shutdown()  # tensor-parallel ranks stop now: the next backend's engine starts its own
    del llm
    free_memory(p.engine.torch_device)
    return [res]


def build_llm(p: Plan, override: str):
    """The engine the plan describes, with `override` as its attention backend."""
    from flexsgl import LLM

    return LLM(p.engine.replace(override=override))


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
    rng = random.Random(p.args.seed)
    b, n_in, n_out = p.batch_size, p.input_range[0], p.output_range[0]
    passes, cached = [], 0
    for r in log_progress(range(p.repeats + 1), desc="latency passes", disable=not progress,
                          mininterval=BAR_INTERVAL):
        res = timed_pass(llm, random_prompts(rng, [n_in] * b, llm.config.vocab_size), [n_out] * b,
                         "warm-up" if r == 0 else f"pass {r}", progress)
        if r:  # pass 0 warms up (compiles this prefill shape and decode batch)
            passes.append(res)
            cached += sum(o.cached_tokens for o in res["outputs"])
    ttft = statistics.median(statistics.mean(r["ttft_s"]) for r in passes)
    # Decode steps only (timed_pass's TPOT, from each request's second token): with prefill_first,
    # each runs the whole batch.
    tpot = statistics.median(statistics.mean(r["tpot_s"]) for r in passes)
    wall = statistics.median(r["wall_s"] for r in passes)
    # The decode step that samples token j attends over n_in + j - 1 tokens; timed are j = 3..n_out,
    # whose mean context is n_in + (n_out + 1) / 2.
    floor = decode_floor(llm, b, n_in + (n_out + 1) / 2, bandwidth)
    return {"batch_size": b, "input_len": n_in, "output_len": n_out, "repeats": p.repeats,
            "output_tokens": sum(len(o.token_ids) for o in passes[-1]["outputs"]),
            "ttft_s": ttft, "tpot_s": tpot, "wall_s": wall, "tokens_per_s": b * n_out / wall,
            "decode_tokens_per_s": b / tpot, **floor, "pct_of_floor": 100.0 * floor["floor_tpot_s"] / tpot,
            "ttft_s_per_pass": [statistics.mean(r["ttft_s"]) for r in passes],
            "tpot_s_per_pass": [statistics.mean(r["tpot_s"]) for r in passes], "cached_tokens": cached,
            "preemptions": sum(r["steps"]["preemptions"] for r in passes)}


def prefill(llm, p: Plan, bandwidth: float, progress: bool) -> dict:
    rng = random.Random(p.args.seed)
    rows, cached = [], 0
    bar = log_progress(total=len(p.prefill_lens) * (p.repeats + 1), desc="prefill passes", disable=not progress,
                       mininterval=BAR_INTERVAL)
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
