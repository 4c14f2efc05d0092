"""tools/fp8_agreement.py: its KL and top-1 figures on hand-computed logits, and end to end on the
embedded model's tiny preset on the CPU."""

import importlib.util
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("fp8_agreement", ROOT / "tools" / "fp8_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kl_and_top1_on_hand_computed_logits(tool):
    # row 0: p = (1/2, 1/2), q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3); argmax 0 both
    # row 1: p = q: KL 0; argmaxes 2 and 2
    # row 2: p = (e^2, 1, 1)/Z, q reversed: argmaxes 0 and 2 disagree
    ref = torch.tensor([[0.0, 0.0, -1e9], [1.0, 2.0, 3.0], [2.0, 0.0, 0.0]])
    other = torch.tensor([[math.log(3), 0.0, -1e9], [1.0, 2.0, 3.0], [0.0, 0.0, 2.0]])
    p = torch.tensor([math.e ** 2, 1, 1]) / (math.e ** 2 + 2)
    kl2 = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), p.flip(0).tolist()))
    got = tool.agreement(ref, other)
    assert got["mean_kl"] == pytest.approx((0.5 * math.log(4 / 3) + kl2) / 3, rel=1e-6)  # the logits are float32
    assert got["max_kl"] == pytest.approx(max(0.5 * math.log(4 / 3), kl2), rel=1e-6)  # the logits are float32
    assert got["top1_agreement"] == pytest.approx(2 / 3) and got["prompts"] == 3


@pytest.mark.parametrize("fp8", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}])
def test_end_to_end_on_the_cpu(tool, fp8):
    """measure() gives the KL and top-1 agreement that float64 numpy computes from the two engines'
    prompt logits (FP8 moves the distributions: KL above 0), and the engine run twice without FP8
    gives the same logits (KL 0, full agreement)."""
    from flexsgl import LLM

    seed = random.randrange(1 << 20)
    engine = {"load_format": "dummy", "device": "cpu", "max_total_tokens": 2048, "random_seed": seed}
    res = tool.measure("tiny", fp8, prompts=6, length=12, seed=seed, engine=engine)
    logits = []
    for options in ({}, fp8):  # the prompts measure() draws from the seed
        llm = LLM("tiny", **engine, **options)
        rng = random.Random(seed)
        batch = [[rng.randrange(1, llm.config.vocab_size) for _ in range(12)] for _ in range(6)]
        logits.append(tool.prompt_logits(llm, batch).double().numpy())
        llm.shutdown()
    ref, other = logits

    def log_softmax(x):
        shifted = x - x.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    p, q = log_softmax(ref), log_softmax(other)
    kl = (np.exp(p) * (p - q)).sum(-1)
    assert kl.mean() > 0, f"seed={seed}: FP8 left every distribution as it was"
    assert res["prompts"] == 6 and res["mean_kl"] == pytest.approx(kl.mean(), rel=1e-9), f"seed={seed}: {res}"
    assert res["max_kl"] == pytest.approx(kl.max(), rel=1e-9), f"seed={seed}: {res}"
    assert res["top1_agreement"] == pytest.approx((ref.argmax(-1) == other.argmax(-1)).mean()), f"seed={seed}"
    llm = LLM("tiny", **engine)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 500) for _ in range(12)] for _ in range(6)]
    a, b = tool.prompt_logits(llm, prompts), tool.prompt_logits(llm, prompts)
    same = tool.agreement(a, b)
    assert same["mean_kl"] == 0.0 and same["top1_agreement"] == 1.0, f"seed={seed}"
