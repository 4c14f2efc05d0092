"""Where a throughput run's time goes: host work, waiting on the device, and device time, per step.

Runs `flexsgl bench`'s throughput workload (same lengths and seeds; one warm-up pass) with timers
around the engine's phases, and CUDA events around each launched step:

    schedule  the scheduler picks the batch            (host)
    build     the runner packs and uploads its inputs   (host, inside launch)
    launch    runner.run: build + graph fill/replay or compiled call + sampling launch (host)
    wait      reading the previous step's tokens: the host blocked on the device
    process   handing tokens to requests                (host)
    gpu       device time from the step's first to its last queued op (CUDA events)

If `wait` is near zero the run is host-bound and `host` (schedule + launch + process) sets the
pace; if `wait` is large the device does. Then, optionally, profiles `--profile-steps` steps of
a third pass from its N-th step of MODE on (`--profile-at MODE:N`, default decode:200, where the
batch is near full; prefill:3 for a full prefill chunk) and prints the kernels they ran. It also
counts the garbage collector's pauses in the timed pass.

    python tools/step_breakdown.py --model qwen3-0.6b --override auto --profile-steps 20
    python tools/step_breakdown.py --model qwen3-0.6b --override auto --profile-steps 1 --profile-at prefill:3
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import defaultdict

import torch

from flexsgl import LLM, SamplingParams
from flexsgl.bench import freeze_heap, parse_range, random_prompts, throughput_requests
from flexsgl.runner import StepOutput

SIZE_BANDS = (1, 32, 64, 128, 192, 257, 10**9)


def band(n: int) -> str:
    lo = max(b for b in SIZE_BANDS if b <= n)
    hi = min(b for b in SIZE_BANDS if b > n) - 1
    return f"{lo}-{hi}"


class Timers:
    """Per-step phase times; `cur` collects the phases of the step in progress."""

    def __init__(self, llm: LLM):
        self.cur: dict[str, float] = defaultdict(float)
        self.steps: list[dict] = []
        self.events: list[tuple] = []
        self._wrap(llm.scheduler, "schedule", "schedule")
        self._wrap(llm.runner, "build", "build")
        self._wrap(llm.scheduler, "process", "process")
        run = llm.runner.run
        cuda = llm.device.type == "cuda"

        def timed_run(batch):
            start = end = None
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            out = run(batch)
            self.cur["launch"] += time.perf_counter() - t
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            self.cur["mode"], self.cur["n"] = batch.mode, len(batch.requests)
            self.events.append((start, end))
            return out

        llm.runner.run = timed_run
        tokens = StepOutput.tokens

        def timed_tokens(so):
            t = time.perf_counter()
            out = tokens(so)
            self.cur["wait"] += time.perf_counter() - t
            return out

        StepOutput.tokens = timed_tokens

    def _wrap(self, obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            self.cur[key] += time.perf_counter() - t
            return out

        setattr(obj, name, timed)

    def step(self, llm: LLM):
        self.cur = defaultdict(float)
        t = time.perf_counter()
        out = llm.step()
        self.cur["wall"] = time.perf_counter() - t
        self.steps.append(dict(self.cur))
        return out

    def gpu_times(self) -> list[float | None]:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 if s is not None else None for s, e in self.events]


class GCPauses:
    """Garbage-collector pauses while active: (count, seconds) per generation."""

    def __init__(self):
        self.by_gen: dict[int, list[float]] = defaultdict(list)
        self._t = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.by_gen[info["generation"]].append(time.perf_counter() - self._t)

    def stop(self) -> None:
        gc.callbacks.remove(self._on)

    def report(self) -> str:
        return ", ".join(f"gen {g}: {len(v)} x, {1e3 * sum(v):.1f} ms (max {1e3 * max(v):.1f})"
                         for g, v in sorted(self.by_gen.items())) or "none"


def run_pass(llm, timers, prompts, out_lens, profile_steps=0, profile_at=("decode", 200)):
    """Run the requests to completion. With profile_steps, profile from just after the (N-1)-th step
    of MODE until profile_steps steps of MODE have run (other steps in between are profiled too).
    Returns (wall, profile, (first, last) profiled step)."""
    for prompt, out_len in zip(prompts, out_lens):
        llm.add_request(prompt, SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True))
    prof = prof_done = None
    window = (0, 0)
    mode, n = profile_at
    seen = defaultdict(int)
    freeze_heap()
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while llm.has_unfinished:
        if profile_steps and prof is None and prof_done is None and seen[mode] == n - 1:
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
            window = (len(timers.steps), 0)
        timers.step(llm)
        seen[timers.steps[-1].get("mode")] += 1
        if prof is not None and seen[mode] == n - 1 + profile_steps:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            prof_done, prof = prof, None
            window = (window[0], len(timers.steps))
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return wall, prof_done, window


def summarize(steps, gpu):
    rows = defaultdict(list)
    for s, g in zip(steps, gpu):
        if "mode" in s:
            rows[(s["mode"], band(s["n"]) if s["mode"] == "decode" else "-")].append((s, g))
    keys = ("schedule", "build", "launch", "process", "wait", "wall")
    print(f"\n{'mode':<8} {'batch':>8} {'steps':>6} " + " ".join(f"{k:>8}" for k in keys)
          + f" {'host':>8} {'gpu':>8} {'total s':>8}   (ms per step, mean)")
    for (mode, b), items in sorted(rows.items(), key=lambda kv: (kv[0][0], int(kv[0][1].split("-")[0] or 0))):
        mean = {k: 1e3 * statistics.mean(s.get(k, 0.0) for s, _ in items) for k in keys}
        host = mean["schedule"] + mean["launch"] + mean["process"]
        g = [x for _, x in items if x is not None]
        gms = 1e3 * statistics.mean(g) if g else float("nan")
        total = sum(s["wall"] for s, _ in items)
        print(f"{mode:<8} {b:>8} {len(items):>6} " + " ".join(f"{mean[k]:>8.3f}" for k in keys)
              + f" {host:>8.3f} {gms:>8.3f} {total:>8.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--override", default="auto")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", default="100:1024")
    ap.add_argument("--output-len", default="100:1024")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--profile-at", default="decode:200", help="MODE:N, the step of MODE in the third pass the profile starts at")
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args()
    mode, _, n = args.profile_at.partition(":")
    if mode not in ("decode", "prefill") or not n.isdigit() or int(n) < 1:
        ap.error(f"--profile-at takes decode:N or prefill:N with N >= 1, got {args.profile_at!r}")
    llm = LLM(args.model, load_format="dummy", override=args.override, max_running=args.max_running,
              max_batch_tokens=args.max_batch_tokens, progress=lambda m: print("  ", m, flush=True))
    in_lens, out_lens, prompts, warm = throughput_requests(
        args.seed, args.num_prompts, parse_range(args.input_len, "--input-len"),
        parse_range(args.output_len, "--output-len"), llm.config.vocab_size)
    timers = Timers(llm)
    t = time.perf_counter()
    run_pass(llm, timers, warm, out_lens)
    print(f"warm-up pass: {time.perf_counter() - t:.1f} s", flush=True)
    timers.steps, timers.events = [], []
    pauses = GCPauses()
    wall, _, _ = run_pass(llm, timers, prompts, out_lens)
    pauses.stop()
    gpu = timers.gpu_times() if llm.device.type == "cuda" else [None] * len(timers.steps)
    busy = sum(g for g in gpu if g is not None)
    print(f"\ntimed pass: {wall:.2f} s, {sum(out_lens) / wall:,.0f} output tok/s, {len(timers.steps)} steps, "
          f"device busy {busy:.2f} s ({100 * busy / wall:.0f}% of wall)")
    print(f"garbage-collector pauses in it (heap frozen before it): {pauses.report()}")
    summarize(timers.steps, gpu)
    if args.profile_steps and llm.device.type == "cuda":
        timers.steps, timers.events = [], []
        prompts = random_prompts(random.Random(args.seed + 2), in_lens, llm.config.vocab_size)
        _, prof, (first, last) = run_pass(llm, timers, prompts, out_lens, args.profile_steps, (mode, int(n)))
        if prof is not None:
            window = [st.get("mode") for st in timers.steps[first:last]]
            print(f"\nkernels of {len(window)} steps ({', '.join(f'{window.count(m)} {m}' for m in set(window))}) "
                  f"from {mode} step {n} of a third pass (CUDA time, all steps together):")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows,
                                            max_name_column_width=70))
            print("\nthe same steps by host time (where launching them goes):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                            max_name_column_width=70))


if __name__ == "__main__":
    main()
