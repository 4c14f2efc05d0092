"""Profile decode steps of a dummy-weight preset: the kernels one step runs, and host vs device time.

Prefill and warm-up stay outside the profiled window: it opens once every request has decoded a
few tokens and covers `--steps` decode steps. The table lists kernels by device time; the summary
gives device time per step (kernels summed) against wall time per step.

    python tools/profile_step.py --model qwen3-8b --override fa3-prefill,fi-decode --batch 1 --steps 20
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flexsgl import LLM, SamplingParams
from flexsgl.kernels.launch import pdl


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--override", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--graphs", choices=["on", "off"], default="on")
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    llm = LLM(args.model, load_format="dummy", override=args.override, kv_cache_tokens=args.kv_cache_tokens,
              max_running=args.batch, graph_batch_sizes=[args.batch] if cuda and args.graphs == "on" else None,
              cuda_graphs=cuda and args.graphs == "on", progress=lambda m: print("  ", m, flush=True))
    rng = random.Random(0)
    fresh = lambda: [[rng.randrange(llm.config.vocab_size) for _ in range(args.prompt_len)]  # noqa: E731
                     for _ in range(args.batch)]
    llm.generate(fresh(), SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))  # compile
    sp = SamplingParams(max_new_tokens=args.steps + 16, temperature=0.0, ignore_eos=True)
    ids = [llm.add_request(p, sp) for p in fresh()]
    for _ in range(8):  # prefill, then a few decode steps
        llm.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            llm.step()
        sync()
        wall = time.perf_counter() - t
    while llm.has_unfinished:
        llm.step()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    print(events.table(sort_by=key, row_limit=args.rows, max_name_column_width=80))
    if cuda:
        kernels = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"{llm.backends.label}, graphs {args.graphs}, batch {args.batch}, context ~{args.prompt_len}: "
              f"device time {kernels / 1e3 / args.steps:.3f} ms per step (kernels summed), "
              f"wall {1e3 * wall / args.steps:.3f} ms per step under the profiler, {len(ids)} requests")
        if pdl(torch.device("cuda")):
            print("flexsgl's kernels launched with PDL (flexsgl/kernels/launch.py): each starts while the one before "
                  "runs, so their durations include that wait and the sum overstates device time; "
                  "FLEXSGL_PDL=0 gives a per-kernel breakdown")


if __name__ == "__main__":
    main()
