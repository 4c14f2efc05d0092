"""Where a benchmark pass's time goes, step by step: the engine suite's sequence on one engine.

For each --override: one engine (the suite's model, dummy weights), then the suite's throughput
rounds and its latency rounds (benchmarks/common.py's workloads; fresh prompts each round). Each round prints
its wall time, the time from its last token to its end, and every step whose launch (compiles
happen there) or read-back took longer than --slow seconds, with the batch's shape. A step that
raises prints the whole exception chain, so an error that a compile failure masks shows up.
Run it with TORCH_LOGS=recompiles to see why a step compiled.

    python tools/step_trace.py --override flex --override fi-decode
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import DEVICE, LATENCY, MODEL, THROUGHPUT  # noqa: E402 - the suite's workloads, not a copy

from flexsgl import LLM, SamplingParams  # noqa: E402
from flexsgl.bench import free_memory, freeze_heap, random_prompts  # noqa: E402
from flexsgl.bench_env import sync  # noqa: E402


def traced_pass(llm, prompts, out_lens, label: str, slow: float) -> None:
    runner = llm.runner
    slow_steps, last_token = [], [0.0]
    run, step_no = runner.run, [0]

    def timed_run(batch):
        t = time.perf_counter()
        out = run(batch)
        dt = time.perf_counter() - t
        step_no[0] += 1
        if dt > slow:
            slow_steps.append(f"launch #{step_no[0]} {batch.mode} bs={len(batch.requests)} "
                              f"tokens={sum(batch.num_new)} max_q={max(batch.num_new)}: {dt:.2f} s")
        return out

    def on_token(req) -> None:
        last_token[0] = time.perf_counter()

    runner.run = timed_run
    try:
        freeze_heap()  # as timed_pass does
        sync(llm.device)
        t0 = time.perf_counter()
        for pr, n in zip(prompts, out_lens):
            llm.add_request(pr, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), on_token)
        while llm.has_unfinished:
            t = time.perf_counter()
            llm.step()
            dt = time.perf_counter() - t
            if dt > slow:
                slow_steps.append(f"step() after launch #{step_no[0]}: {dt:.2f} s")
        sync(llm.device)
        end = time.perf_counter()
    finally:
        runner.run = run
    print(f"{label}: {end - t0:.3f} s, {step_no[0]} steps, last token to end {1e3 * (end - last_token[0]):.1f} ms",
          flush=True)
    for line in slow_steps:
        print("    " + line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--override", action="append", default=None)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--throughput-rounds", type=int, default=2)
    ap.add_argument("--latency-rounds", type=int, default=4)
    ap.add_argument("--slow", type=float, default=0.3)
    a = ap.parse_args()
    rng = random.Random(0)  # the lengths test_engine.test_throughput draws
    n = THROUGHPUT["num_prompts"]
    in_lens = [rng.randint(*THROUGHPUT["input_len"]) for _ in range(n)]
    out_lens = [rng.randint(*THROUGHPUT["output_len"]) for _ in range(n)]
    b, n_in, n_out = LATENCY["batch_size"], LATENCY["input_len"], LATENCY["output_len"]
    for override in a.override or ["flex"]:
        print(f"== {override}", flush=True)
        llm = LLM(a.model, device=DEVICE.type, load_format="dummy", override=override)
        seeds = itertools.count(1)
        try:
            for r in range(a.throughput_rounds):
                prompts = random_prompts(random.Random(next(seeds)), in_lens, llm.config.vocab_size)
                traced_pass(llm, prompts, out_lens, f"throughput round {r}", a.slow)
            for r in range(a.latency_rounds):
                prompts = random_prompts(random.Random(next(seeds)), [n_in] * b, llm.config.vocab_size)
                traced_pass(llm, prompts, [n_out] * b, f"latency round {r}", a.slow)
        except Exception:  # noqa: BLE001 - a diagnostic: show the whole chain, then go on to the next backend
            traceback.print_exc()
        del llm
        free_memory(DEVICE)

if __name__ == "__main__":
    main()
