"""Host time to build one step's inputs (runner.build, no model run): a decode step at a large
batch, or a prefill chunk of many tokens.

Shows what a step costs the host before any kernel runs; with CUDA graphs and a pipelined engine
this bounds the step rate once it exceeds the GPU time. Runs on the CPU:

    python tools/host_step_cost.py --batch 256 --context 840
    python tools/host_step_cost.py --prefill --batch 14 --context 585   # ~8192 tokens, as the throughput run's chunks
"""

from __future__ import annotations

import argparse
import random
import time

from flexsgl import LLM, SamplingParams
from flexsgl.cache.pool import KVPool
from flexsgl.scheduler import ScheduledBatch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=840)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--table-width", type=int, default=640, help="full width of a compiled step (qwen3: 40960/64)")
    ap.add_argument("--prefill", action="store_true", help="a prefill step of --batch prompts of --context tokens")
    args = ap.parse_args()
    pages = KVPool.num_pages_for(args.context + 1, args.page_size)
    llm = LLM("tiny", load_format="dummy", device="cpu", kv_cache_tokens=args.batch * (pages + 1) * args.page_size,
              max_running=args.batch, page_size=args.page_size)
    rng = random.Random(0)
    reqs = []
    for i in range(args.batch):
        prompt = [rng.randrange(500) for _ in range(args.context if args.prefill else 8)]
        r = llm.make_request(prompt, SamplingParams(max_new_tokens=1, temperature=0.0))
        r.pages, r.slot, r.num_scheduled_outputs = llm.allocator.alloc(pages), i, 1
        reqs.append(r)
    if args.prefill:
        batch = ScheduledBatch("prefill", reqs, [0] * args.batch, [args.context] * args.batch, [True] * args.batch)
    else:
        batch = ScheduledBatch("decode", reqs, [args.context] * args.batch, [1] * args.batch, [True] * args.batch)
    run = llm.runner
    run.table_width = args.table_width
    for label, narrow in (("page table at full width", False), ("page table as wide as needed", True)):
        run._narrow_table_ok = lambda decode, bs, n=narrow: n
        run.build(batch)
        t = time.perf_counter()
        for _ in range(20):
            run.build(batch)
        print(f"{label}: {1e3 * (time.perf_counter() - t) / 20:.2f} ms per {batch.mode} step "
              f"(batch {args.batch}, {sum(batch.num_new)} tokens)")


if __name__ == "__main__":
    main()
