"""Time greedy generation on a dummy-weight preset: prefill, then per decode step.

A quick figure for the engine core; `flexsgl bench` is the full tool. Usage:
    python tools/decode_timing.py --model qwen3-0.6b --batch 1 64 --prompt-len 128 --new-tokens 128
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from flexsgl import LLM, SamplingParams


def timed(llm, prompts, n):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    assert all(len(o.token_ids) == n for o in outs)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, load_format="dummy", progress=print)
    rng = random.Random(0)
    print(f"{'batch':>5} {'prefill s':>10} {'ms/step':>8} {'decode tok/s':>12}")
    fresh = lambda bs: [[rng.randrange(llm.config.vocab_size) for _ in range(args.prompt_len)]  # noqa: E731
                        for _ in range(bs)]  # new prompts each run: no prefix-cache hits
    for bs in args.batch:
        timed(llm, fresh(bs), 8)  # warm-up: compiles this prefill shape and decode bucket
        first = timed(llm, fresh(bs), 1)
        full = timed(llm, fresh(bs), args.new_tokens)
        step = (full - first) / (args.new_tokens - 1)
        print(f"{bs:>5} {first:>10.4f} {step * 1e3:>8.2f} {bs / step:>12.1f}")


if __name__ == "__main__":
    main()
