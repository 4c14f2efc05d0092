"""How far FA3's FP8 arithmetic alone moves the logits of tests/test_fp8_kv_cache.py's checkpoints.

FA3 reads an FP8 KV cache only with FP8 queries (overrides/fa3.py rounds them at one scale a step),
and rounds its probabilities to FP8 before multiplying by V. This emulates both in float32 attention
(HF transformers' model, an attention function of its own) over K/V stored in FP8 with the
checkpoint's scales, and compares the logits with the same attention unrounded: the largest
difference per step over the largest logit, as the test measures its engines. Runs on the CPU.

    python tools/fa3_fp8_rounding.py --checkpoints 12
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from tests.hf_models import make_checkpoint  # noqa: E402
from tests.test_fp8_kv_cache import LENGTHS, STEPS, add_kv_scales, fake_quantize  # noqa: E402
from flexsgl.tool_args import positive_int  # noqa: E402

FP8 = torch.float8_e4m3fn
TOP = torch.finfo(FP8).max
ROUNDINGS = {"none": (False, False), "queries": (True, False), "probabilities": (False, True),
             "both": (True, True)}


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x in FP8 at one scale (its absmax / 448), back in float32."""
    scale = x.abs().amax().clamp(min=1e-12) / TOP
    return (x / scale).clamp(-TOP, TOP).to(FP8).float() * scale


def attention_rounding(queries: bool, probabilities: bool):
    """An HF attention function: causal attention over the layer's K/V stored in FP8, each token's
    query (one decode step's) and the probabilities rounded to FP8 as asked."""
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        k_scale, v_scale = module.kv_scales
        key, value = fake_quantize(key, k_scale), fake_quantize(value, v_scale)
        if queries:
            query = torch.stack([rounded(query[:, :, t]) for t in range(query.shape[2])], 2)
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        scores = query @ key.transpose(-1, -2) * scaling
        n_q, n_k = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(n_k, n_k, dtype=torch.bool).tril()[-n_q:], float("-inf"))
        p = torch.exp(scores - scores.amax(-1, keepdim=True))
        total = p.sum(-1, keepdim=True)
        if probabilities:
            p = p.to(FP8).float()
        return ((p @ value) / total).transpose(1, 2).contiguous(), None

    return attend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=positive_int, default=12, help="random checkpoints, as the test makes them")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()

    for name, (q, p) in ROUNDINGS.items():
        AttentionInterface.register(f"fa3_rounding_{name}", attention_rounding(q, p))
    rng = random.Random(args.seed)
    worst: dict[str, list[float]] = {name: [] for name in ROUNDINGS if name != "none"}
    for _ in range(args.checkpoints):
        seed = rng.randrange(1 << 30)
        path = Path(tempfile.mkdtemp())
        make_checkpoint("qwen3", path, seed, head_dim=128)  # the kernels' head size, as the GPU test
        scales = add_kv_scales(path, seed, 3)
        models = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation=f"fa3_rounding_{name}").eval()
                  for name in ROUNDINGS}
        for model in models.values():
            for i, layer in enumerate(model.model.layers):
                layer.self_attn.kv_scales = scales[i]
        prompts = random.Random(seed)
        for n in LENGTHS:
            ids = torch.tensor([[prompts.randrange(320) for _ in range(n + STEPS - 1)]])
            with torch.no_grad():
                logits = {name: model(ids).logits[0, n - 1:] for name, model in models.items()}
            ref = logits["none"]
            for name in worst:
                rel = ((logits[name] - ref).abs().max(-1).values / ref.abs().max(-1).values).max().item()
                worst[name].append(rel)
    print(f"{args.checkpoints} checkpoints x {len(LENGTHS)} prompts: logits moved, largest difference over the "
          f"largest logit")
    for name, values in worst.items():
        values.sort()
        print(f"  {name:<14} median {values[len(values) // 2]:.3f}  max {values[-1]:.3f}")


if __name__ == "__main__":
    main()
