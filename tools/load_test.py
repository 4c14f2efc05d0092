"""Load test: many requests with shared prefixes on a KV cache small enough to force eviction and
preemption. Checks every request finishes, no page leaks, and (with --check-alone) that greedy
outputs equal the same requests run one at a time; prints the scheduler's counters.

    python tools/load_test.py --model qwen3-0.6b --requests 500 --max-total-tokens 8192 --check-alone 100

Preemption needs requests that grow by several pages while running (max-new well above the page
size): with --max-new 32 and 64-token pages the admission headroom absorbs all growth and the
cache is only evicted. On the CPU, `--model tiny --requests 40 --max-prompt 64 --max-new 64
--max-total-tokens 256 --page-size 16 --max-running-requests 8 --check-alone 10` preempts 5 times.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from flexsgl import LLM, SamplingParams
from flexsgl.tool_args import parser, positive_int, preset


def workload(rng: random.Random, n: int, vocab: int, max_prompt: int, max_new: int):
    heads = [[rng.randrange(vocab) for _ in range(rng.randrange(16, max_prompt // 2))] for _ in range(8)]
    prompts, params = [], []
    for _ in range(n):
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(1, max_prompt // 2))]
        prompts.append(rng.choice(heads) + tail)
        params.append(SamplingParams(max_new_tokens=rng.randrange(1, max_new + 1), temperature=0.0))
    return prompts, params


def main():
    ap = parser(__doc__)
    ap.add_argument("--model", type=preset, default="qwen3-0.6b")
    ap.add_argument("--dtype", default="float32", help="float32 keeps batched and lone greedy runs comparable")
    ap.add_argument("--requests", type=positive_int, default=500)
    ap.add_argument("--max-prompt", type=positive_int, default=512)
    ap.add_argument("--max-new", type=positive_int, default=128)
    ap.add_argument("--max-total-tokens", type=positive_int, default=8192)
    ap.add_argument("--page-size", type=positive_int, default=64)
    ap.add_argument("--max-running-requests", type=positive_int, default=64)
    ap.add_argument("--check-alone", type=int, default=0, metavar="N",
                    help="compare the first N requests' outputs with lone runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    args = ap.parse_args()
    if args.max_prompt < 34:
        ap.error("--max-prompt must be at least 34 (prompts share 8 heads of 16 tokens or more)")
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, max_total_tokens=args.max_total_tokens,
              page_size=args.page_size, max_running_requests=args.max_running_requests, compile=args.compile)
    prompts, params = workload(random.Random(args.seed), args.requests, llm.config.vocab_size,
                               args.max_prompt, args.max_new)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    stats = llm.stats()
    cache = llm.scheduler.cache
    cache.check()
    leaked = llm.allocator.capacity - llm.allocator.num_free - cache.num_pages
    finished = sum(o.finish_reason in ("length", "stop") for o in outs)
    print(f"{finished}/{len(outs)} finished, {sum(len(o.token_ids) for o in outs)} tokens in {wall:.1f}s, "
          f"leaked pages: {leaked}, locked cache pages: {cache.num_pages - cache.num_evictable}")
    print("stats:", json.dumps(stats))
    if args.check_alone:
        alone = LLM(args.model, load_format="dummy", dtype=args.dtype, page_size=args.page_size, max_running_requests=1,
                    compile=args.compile,
                    max_total_tokens=args.max_prompt + args.max_new + args.page_size)
        n = min(args.check_alone, len(outs))
        diff = [i for i, (p, sp, o) in enumerate(zip(prompts[:n], params[:n], outs[:n]))
                if alone.generate([p], sp)[0].token_ids != o.token_ids]
        print(f"outputs equal to lone runs: {n - len(diff)}/{n}; differing: {diff[:20]}")
    ok = finished == len(outs) and leaked == 0 and stats.get("preemptions", 0) > 0 and stats.get("evicted_pages", 0) > 0
    print("LOAD TEST", "PASS" if ok else "FAIL")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
