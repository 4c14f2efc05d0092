"""Where a step's time goes: host phases against device time per step, and the kernels of a few steps.

Runs one `flexsgl bench` workload (throughput or latency, with its sizes, seeds and defaults, on the
engine `flexsgl bench` builds) on one backend: a warm-up pass, then a pass with timers around the
engine's phases and CUDA events around each launched step:

    schedule  the scheduler picks the batch                                        (host)
    plan      the runner lays out the step's inputs on the host (before its launch)  (host)
    launch    runner.run: upload + graph replay or compiled call + sampling launch  (host)
    wait      reading the previous step's tokens: the host blocked on the device
    process   recording tokens in their requests (the scheduler's part)            (host)
    output    the output path: text, stop strings, callbacks                       (host)
    grammar   the grammars taking the tokens of constrained requests               (host)
    mask      filling a constrained step's token mask                              (host)
    gpu       device time from the step's first to its last queued op              (CUDA events)

With --structured json-schema every request is constrained to the serve workload's JSON schema
(flexsgl/bench/serving.py): its steps launch up to their logits, and `launch` then includes the
sampling launched once the mask is filled (the step loop's order: flexsgl/step_loop.py).

It prints ms per step by mode and batch band. With `wait` near zero the host sets the pace (host =
schedule + plan + launch + process + output + grammar + mask); with a large `wait` the device does. Steps whose launch took longer
than --slow seconds (compiles happen there) are listed with their shape; TORCH_LOGS=recompiles says
why they compiled. With --profile-steps N, a third pass runs under torch.profiler from its K-th step
of MODE (--profile-at MODE:K) for N steps of MODE, and its kernels are printed by device time and
by host time, with device time per step (kernels summed) against wall time per step, and each
kernel's share of the critical path (with PDL, kernels overlap and their durations overstate them);
with --positions also each launch of a step in order (which projection of which layer loses time).

    python tools/profile_step.py --model qwen3-0.6b --profile-steps 10     # throughput; decode near batch 228
    python tools/profile_step.py --model qwen3-0.6b --profile-steps 1 --profile-at prefill:3
    python tools/profile_step.py --model qwen3-8b --workload latency --profile-steps 20 --profile-at decode:8
    python tools/profile_step.py --model qwen3-0.6b --structured json-schema --override flex   # constrained steps
    python tools/profile_step.py --model qwen3-8b --tp 2                  # rank 0 of two tensor-parallel ranks
    python tools/profile_step.py --model qwen3-8b --workload latency --quantization fp8 --profile-steps 20 --profile-at decode:8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict

import torch

from flexsgl.config import EngineConfig
from flexsgl.bench import (BenchArgs, build_llm, copy_bandwidth, decode_floor, freeze_heap, plan, random_prompts,
                           sync, throughput_requests)
from flexsgl.bench.critical_path import by_name, by_position, critical_path
from flexsgl.bench.serving import JSON_SCHEMA
from flexsgl.kernels.launch import pdl
from flexsgl import step_loop
from flexsgl.step.output import StepOutput

SIZE_BANDS = (1, 32, 64, 128, 192, 257, 10**9)
PHASES = ("schedule", "plan", "launch", "wait", "process", "output", "grammar", "mask", "wall")
HOST = ("schedule", "plan", "launch", "process", "output", "grammar", "mask")


def band(n: int) -> str:
    return f"{max(b for b in SIZE_BANDS if b <= n)}-{min(b for b in SIZE_BANDS if b > n) - 1}"


class Timers:
    """Per-step phase times; `cur` collects the phases of the step in progress."""

    def __init__(self, llm):
        self.cur: dict = defaultdict(float)
        self.steps: list[dict] = []
        self.events: list[tuple] = []
        self._time(llm.scheduler, "schedule")
        self._time(llm.runner, "plan")
        self._time(llm.scheduler, "process")
        self._time(llm.outputs, "process", key="output")
        self._time(step_loop, "follow_grammars", key="grammar")
        self._time(llm.grammars, "fill_mask", key="mask")
        self._time(StepOutput, "tokens", key="wait")
        runner, cuda = llm.runner, llm.device.type == "cuda"
        run, run_forward, sample = runner.run, runner.run_forward, runner.sample
        deferred = {}  # a step launched up to its logits: its start event, until it is sampled

        def event():
            if not cuda:
                return None
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def launched(batch, t: float) -> None:
            self.cur["launch"] += time.perf_counter() - t
            self.cur.update(mode=batch.mode, n=len(batch.requests), tokens=sum(batch.num_new))

        def timed_run(batch, plan=None):
            start, t = event(), time.perf_counter()
            out = run(batch, plan)
            launched(batch, t)
            self.events.append((start, event()))
            return out

        def timed_run_forward(batch, plan=None):
            start, t = event(), time.perf_counter()
            out = run_forward(batch, plan)
            launched(batch, t)
            deferred[id(out)] = start
            return out

        def timed_sample(step, mask):
            t = time.perf_counter()
            out = sample(step, mask)
            self.cur["launch"] += time.perf_counter() - t
            self.events.append((deferred.pop(id(step)), event()))
            return out

        runner.run, runner.run_forward, runner.sample = timed_run, timed_run_forward, timed_sample

    def _time(self, owner, name: str, key: str | None = None) -> None:
        f = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            self.cur[key or name] += time.perf_counter() - t
            return out

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.steps, self.events = [], []

    def step(self, llm) -> None:
        self.cur = defaultdict(float)
        t = time.perf_counter()
        llm.step()
        self.cur["wall"] = time.perf_counter() - t
        self.steps.append(dict(self.cur))

    def gpu_times(self) -> list[float | None]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 if s is not None else None for s, e in self.events]


def run_pass(llm, timers, prompts, out_lens, label: str, slow: float, profile_steps=0, profile_at=("decode", 1),
             structured=None):
    """Run the requests to completion (each constrained by `structured`, structured_outputs' fields,
    where given), timing every step. With profile_steps, profile from just before the
    profile_at[1]-th step of that mode until profile_steps steps of it ran; returns the profile."""
    from flexsgl import SamplingParams

    for prompt, n in zip(prompts, out_lens):
        llm.add_request(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True,
                                               structured_outputs=structured))
    timers.reset()
    prof, done, mode, k = None, None, *profile_at
    seen: dict = defaultdict(int)
    freeze_heap()  # as flexsgl bench's timed pass does
    sync(llm.device)
    t0 = time.perf_counter()
    while llm.has_unfinished:
        if profile_steps and prof is None and done is None and seen[mode] == k - 1:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
            prof, first, t_prof = profile(activities=acts), len(timers.steps), time.perf_counter()
            prof.__enter__()
        timers.step(llm)
        seen[timers.steps[-1].get("mode")] += 1
        if prof is not None and seen[mode] == k - 1 + profile_steps:
            sync(llm.device)
            prof.__exit__(None, None, None)
            n = len(timers.steps) - first
            done, prof = (prof, n, (time.perf_counter() - t_prof) / n), None
    sync(llm.device)
    wall = time.perf_counter() - t0
    print(f"{label}: {wall:.2f} s, {len(timers.steps)} steps", flush=True)
    for i, s in enumerate(timers.steps):
        if s.get("launch", 0.0) > slow:
            print(f"    step {i} {s['mode']} batch {s['n']}, {s['tokens']} tokens: launch {s['launch']:.2f} s",
                  flush=True)
    return wall, done


def summarize(steps, gpu) -> None:
    rows = defaultdict(list)
    for s, g in zip(steps, gpu):
        if "mode" in s:
            rows[(s["mode"], band(s["n"]) if s["mode"] == "decode" else "-")].append((s, g))
    print(f"\n{'mode':<8} {'batch':>8} {'steps':>6} " + " ".join(f"{k:>8}" for k in PHASES)
          + f" {'host':>8} {'gpu':>8} {'total s':>8}   (ms per step, mean)")
    for (mode, b), items in sorted(rows.items(), key=lambda kv: (kv[0][0], int(kv[0][1].split("-")[0] or 0))):
        mean = {k: 1e3 * statistics.mean(s.get(k, 0.0) for s, _ in items) for k in PHASES}
        g = [x for _, x in items if x is not None]
        gms = 1e3 * statistics.mean(g) if g else float("nan")
        print(f"{mode:<8} {b:>8} {len(items):>6} " + " ".join(f"{mean[k]:>8.3f}" for k in PHASES)
              + f" {sum(mean[k] for k in HOST):>8.3f} {gms:>8.3f}"
              + f" {sum(s['wall'] for s, _ in items):>8.2f}")


def print_profile(llm, done, rows: int, positions: bool = False) -> None:
    prof, n, wall = done
    cuda = llm.device.type == "cuda"
    events = prof.key_averages()
    print(f"\nkernels of {n} profiled steps, by {'device' if cuda else 'host'} time:")
    print(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows,
                       max_name_column_width=70))
    if not cuda:
        return
    print("\nthe same steps by host time (where launching them goes):")
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70))
    kernels = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{llm.backends.label}: device time {kernels / 1e3 / n:.3f} ms per step (kernels summed), "
          f"wall {1e3 * wall:.3f} ms per step under the profiler")
    if pdl(llm.device):
        print("kernels launch with PDL (flexsgl/kernels/launch.py): each starts while the one before runs, so "
              "their durations include that wait and the sum overstates device time; the critical path below "
              "does not")
    print_critical_path(prof, n, rows, positions)


def print_critical_path(prof, n: int, rows: int, positions: bool = False) -> None:
    """Each kernel's share of the device's wall time, summed by name (flexsgl/bench/critical_path.py);
    positions: also each launch of a step in order, averaged over the steps."""
    launches = critical_path((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                             if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\ncritical path of {n} steps (us per step; calls per step):")
    for name, (us, calls) in sorted(by_name(launches).items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"{us / n:>10.1f} {calls / n:>7.1f}  {name[:100]}")
    print(f"{sum(launch.share for launch in launches) / n:>10.1f}          in all")
    if not positions:
        return
    step = by_position(launches, n)
    if step is None:
        print(f"\nlaunches by position: the {n} steps launched different kernels; not averaged")
        return
    print(f"\nlaunches of a step in order (us, mean of {n} steps): position, critical-path share, duration, kernel")
    for i, launch in enumerate(step):
        print(f"{i:>5} {launch.share:>9.1f} {launch.duration:>9.1f}  {launch.name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--override", default="auto")
    ap.add_argument("--workload", choices=["throughput", "latency"], default="throughput")
    for name in ("num-prompts", "batch-size", "max-running-requests", "max-num-batched-tokens", "max-total-tokens"):
        ap.add_argument(f"--{name}", type=int, help="as flexsgl bench's")
    ap.add_argument("--input-len", help="as flexsgl bench's")
    ap.add_argument("--output-len", help="as flexsgl bench's")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--quantization", help="as flexsgl bench's (fp8)")
    ap.add_argument("--kv-cache-dtype", help="as flexsgl bench's (fp8_e4m3)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (rank 0's phases; `launch` "
                    "includes sending the step's plan to the other ranks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow", type=float, default=0.3, help="list steps whose launch took longer (seconds)")
    ap.add_argument("--profile-steps", type=int, default=0, help="steps to profile (0: none)")
    ap.add_argument("--profile-at", default="decode:200", help="MODE:K, the step of MODE the profile starts at")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--positions", action="store_true",
                    help="also every launch of a step in order, its critical-path share and duration")
    ap.add_argument("--structured", choices=["json-schema"], help="constrain every output (module docstring)")
    a = ap.parse_args()
    if a.profile_steps < 0:
        ap.error(f"--profile-steps must be 0 or more, got {a.profile_steps}")
    structured = {"json": JSON_SCHEMA} if a.structured else None
    mode, _, k = a.profile_at.partition(":")
    if mode not in ("decode", "prefill") or not k.isdigit() or int(k) < 1:
        ap.error(f"--profile-at takes decode:K or prefill:K with K >= 1, got {a.profile_at!r}")
    engine = {"model": a.model, "tensor_parallel_size": a.tp, "max_running_requests": a.max_running_requests,
              "max_num_batched_tokens": a.max_num_batched_tokens, "max_total_tokens": a.max_total_tokens,
              "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype}
    try:
        engine = EngineConfig(disable_cuda_graph=a.disable_cuda_graph,
                              **{k: v for k, v in engine.items() if v is not None})
        args = BenchArgs(workload=a.workload, overrides=[a.override], num_prompts=a.num_prompts,
                         input_len=a.input_len, output_len=a.output_len, batch_size=a.batch_size, seed=a.seed,
                         engine=engine)
        p = plan(args)
    except ValueError as e:
        ap.error(str(e))
    llm = build_llm(p, a.override)
    vocab = llm.config.vocab_size
    if a.workload == "throughput":
        in_lens, out_lens, prompts, warm = throughput_requests(a.seed, p.num_prompts, p.input_range, p.output_range,
                                                               vocab)
        third = random_prompts(random.Random(a.seed + 2), in_lens, vocab)
    else:
        b, n_in, n_out = p.batch_size, p.input_range[0], p.output_range[0]
        rng = random.Random(a.seed)
        out_lens = [n_out] * b
        warm, prompts, third = (random_prompts(rng, [n_in] * b, vocab) for _ in range(3))
    timers = Timers(llm)
    run_pass(llm, timers, warm, out_lens, "warm-up pass", a.slow, structured=structured)
    wall, _ = run_pass(llm, timers, prompts, out_lens, "timed pass", a.slow, structured=structured)
    gpu = timers.gpu_times()
    busy = sum(g for g in gpu if g is not None)
    print(f"{sum(out_lens) / wall:,.0f} output tok/s" + (f", device busy {busy:.2f} s ({100 * busy / wall:.0f}% of wall)"
                                                         if busy else ""))
    if a.workload == "latency":
        floor = decode_floor(llm, p.batch_size, n_in + n_out / 2, copy_bandwidth(llm.device))["floor_tpot_s"]
        print(f"decode floor {1e3 * floor:.3f} ms per step (weights and KV read over the copy bandwidth)")
    summarize(timers.steps, gpu)
    if a.profile_steps:
        _, done = run_pass(llm, timers, third, out_lens, "profiled pass", a.slow, a.profile_steps, (mode, int(k)),
                           structured)
        if done is None:
            print(f"the pass ended before step {k} of {mode}: nothing profiled")
        else:
            print_profile(llm, done, a.rows, a.positions)
    llm.shutdown()


if __name__ == "__main__":
    main()
