"""How far FP8 moves a model's next-token distributions: the mean KL divergence KL(reference || FP8)
and the top-1 agreement over N random prompts, each prompt's distribution after its last token.

Two engines of the same model run one after the other in this process: the reference (the engine's
dtype, bf16 on a GPU) and the same with the FP8 options given (`--quantization fp8`, FP8 weights
quantized as they load; `--kv-cache-dtype fp8_e4m3`, an FP8 KV cache; or both). Each prompt is
prefilled and its first token sampled greedily; the logits that token was drawn from (the whole
vocabulary, gathered under tensor parallelism) are kept in float32 on the host, and KL is computed
in float64 from their log-softmax.

    python tools/fp8_agreement.py --model qwen3-8b --load-format dummy --quantization fp8
    python tools/fp8_agreement.py --model qwen3-8b --load-format dummy --kv-cache-dtype fp8_e4m3
    python tools/fp8_agreement.py --model deepseek-v2-lite --load-format dummy --quantization fp8

With dummy weights (seeded random values) the figures measure FP8's rounding on those weights, not
on a trained checkpoint's: such a model's next-token distributions are nearly flat, so the top-1
agreement is low whatever FP8 does. Run it on a trained checkpoint to judge FP8.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def prompt_logits(llm, prompts: list[list[int]]) -> torch.Tensor:
    """`[len(prompts), vocab]` float32 on the host: the logits each prompt's first token was sampled from."""
    import flexsgl.runner
    from flexsgl import SamplingParams
    from flexsgl.bench.sampled_logits import logit_recorder

    per_req, run, sample = logit_recorder(llm)
    real_run, real_sample = llm.runner.run, flexsgl.runner.sample
    llm.runner.run, flexsgl.runner.sample = run, sample
    try:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0))
    finally:
        llm.runner.run, flexsgl.runner.sample = real_run, real_sample
    for o in outs:
        if o.error is not None:
            raise RuntimeError(f"a prompt failed: {o.error}")
    return torch.stack([per_req[o.request_id][0].float().cpu() for o in outs])


def agreement(ref: torch.Tensor, other: torch.Tensor) -> dict:
    """Mean and largest KL(ref || other) (nats) over the rows, and the share of rows whose argmax agree."""
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "top1_agreement": (ref.argmax(-1) == other.argmax(-1)).double().mean().item(), "prompts": len(ref)}


def measure(model: str, fp8: dict, prompts: int, length: int, seed: int, engine: dict) -> dict:
    """The figures for `model` with the FP8 options `fp8` against the same engine without them."""
    from flexsgl import LLM

    got = []
    for options in ({}, fp8):
        llm = LLM(model, **engine, **options)
        vocab = llm.config.vocab_size
        rng = random.Random(seed)
        batch = [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(prompts)]
        got.append(prompt_logits(llm, batch))
        llm.shutdown()
        del llm
        gc.collect()  # the engine's reference cycles hold its pool and weights until collected
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"model": model, "fp8": fp8, "length": length, "seed": seed, **agreement(*got)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--quantization", choices=["fp8"], help="FP8 weights, quantized as they load")
    ap.add_argument("--kv-cache-dtype", choices=["fp8_e4m3"], help="an FP8 KV cache")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--length", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-total-tokens", type=int, help="as flexsgl's (default: what the prompts fill, at "
                    "least 8,192, so the two engines' pools fit side by side)")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    fp8 = {k: v for k, v in (("quantization", a.quantization), ("kv_cache_dtype", a.kv_cache_dtype)) if v}
    if not fp8:
        ap.error("name what is FP8: --quantization fp8, --kv-cache-dtype fp8_e4m3, or both")
    if a.prompts < 1 or a.length < 1:
        ap.error("--prompts and --length take positive counts")
    engine = {"load_format": a.load_format, "tensor_parallel_size": a.tp}
    engine["max_total_tokens"] = a.max_total_tokens or max(a.prompts * (a.length + 1), 8192)
    res = measure(a.model, fp8, a.prompts, a.length, a.seed, engine)
    print(f"{a.model}, {' and '.join(f'{k}={v}' for k, v in fp8.items())} against the engine's dtype, "
          f"{res['prompts']} prompts of {a.length} tokens: mean KL {res['mean_kl']:.3e} nats "
          f"(largest {res['max_kl']:.3e}), top-1 agreement {100 * res['top1_agreement']:.1f}%")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
