"""Decode time per step with CUDA graphs on and off, per attention backend, in one run.

For each backend and graph setting it builds the engine once, then per batch size times a greedy
run on fresh random prompts (no prefix-cache hits): a 1-token run gives the prefill, a full run
minus it gives the decode steps. Each row also shows the decode floor (weights + KV read per step
over the copy bandwidth this tool measures) and how far above it the step is. Usage:

    python tools/decode_timing.py --model qwen3-0.6b --batch 1 64 --override flex --override fa3 \\
        --graphs on off --new-tokens 128
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from flexsgl import LLM, SamplingParams
from flexsgl.bench_env import copy_bandwidth, decode_floor


def timed(llm, prompts, n):
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    assert all(len(o.token_ids) == n for o in outs)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--override", action="append")
    ap.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for override in args.override or ["auto"]:
        for graphs in args.graphs:
            t0 = time.perf_counter()
            llm = LLM(args.model, device="cuda", load_format="dummy", override=override,
                      cuda_graphs=graphs == "on", graph_batch_sizes=args.batch, max_running=max(args.batch),
                      kv_cache_tokens=args.kv_cache_tokens, progress=lambda m: print("  ", m, flush=True))
            print(f"{override} graphs {graphs}: ready in {time.perf_counter() - t0:.1f}s", flush=True)
            rng = random.Random(0)
            fresh = lambda bs: [[rng.randrange(llm.config.vocab_size) for _ in range(args.prompt_len)]  # noqa: E731
                                for _ in range(bs)]
            for bs in args.batch:
                timed(llm, fresh(bs), 8)  # warm-up: compiles this prefill shape and decode bucket
                first = timed(llm, fresh(bs), 1)
                full = timed(llm, fresh(bs), args.new_tokens)
                step = (full - first) / (args.new_tokens - 1)
                floor = decode_floor(llm, bs, args.prompt_len + args.new_tokens / 2, bandwidth)["floor_tpot_s"]
                rows.append((llm.backends.label, graphs, bs, first, step, bs / step, step / floor))
                print(f"   {llm.backends.label} graphs {graphs} batch {bs}: {step * 1e3:.3f} ms/step, "
                      f"{step / floor:.2f}x floor", flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n{'backend':<22} {'graphs':>6} {'batch':>5} {'prefill s':>9} {'ms/step':>8} {'tok/s':>9} {'x floor':>7}")
    for label, graphs, bs, first, step, tps, x in rows:
        print(f"{label:<22} {graphs:>6} {bs:>5} {first:>9.4f} {step * 1e3:>8.3f} {tps:>9.1f} {x:>7.2f}")


if __name__ == "__main__":
    main()
