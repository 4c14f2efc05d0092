"""Profile a few decode steps of a dummy-weight preset: top kernels, host time, and dynamo recompiles.

    python tools/profile_step.py --model qwen3-0.6b --batch 1 --prompt-len 128 --steps 8
"""

from __future__ import annotations

import argparse
import random

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from flexsgl import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kv-cache-tokens", type=int, default=None)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", kv_cache_tokens=args.kv_cache_tokens, progress=print)
    rng = random.Random(0)
    prompts = [[rng.randrange(llm.config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    sp = SamplingParams(max_new_tokens=args.steps, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sp)  # warm-up and compile
    before = {k: dict(v) for k, v in counters.items()}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        llm.generate(prompts, sp)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
    print("dynamo counters after warm-up:", {k: dict(v) for k, v in counters.items() if dict(v) != before.get(k)})


if __name__ == "__main__":
    main()
