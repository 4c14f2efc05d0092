"""flexsgl against the peer a user would otherwise pick, on one workload: HF transformers.

The workload (PEER in common.py): a batch of random prompts of one length, a fixed number of new
tokens each, EOS ignored, greedy. The runs, grouped so pytest-benchmark prints them side by side:

- flexsgl: `LLM.generate` (through `timed_pass`, the step API with a synchronize at both ends);
- transformers `model.generate(..., cache_implementation="static")`, which compiles the forward
  on CUDA (transformers' auto-compile for static caches);
- transformers continuous batching, `model.generate_batch` (transformers 5.x; skipped if absent).

On a CPU the models are a tiny random HF Qwen3 checkpoint (tests/hf_models.py) that flexsgl loads
from the same directory; on CUDA, Qwen3-0.6B's shapes with random weights on both sides.
"""

from __future__ import annotations

import itertools
import logging
import random

import pytest
import torch
from common import CUDA, DEVICE, PEER, ROUNDS, free_memory, sync

from flexsgl.bench import random_prompts, timed_pass

B, N_IN, N_OUT = PEER["batch_size"], PEER["input_len"], PEER["output_len"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(flexsgl model name, HF model) of the same shapes."""
    import transformers

    if CUDA:
        from flexsgl.model.presets import PRESETS

        cfg = {k: v for k, v in PRESETS["qwen3-0.6b"]["config"].items() if k not in ("architectures", "model_type", "torch_dtype")}
        cfg.update(eos_token_id=None, bos_token_id=None)
        torch.manual_seed(0)
        with torch.device(DEVICE):
            hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).to(torch.bfloat16)
        return "qwen3-0.6b", hf.eval()
    from tests.hf_models import make_checkpoint

    path = tmp_path_factory.mktemp("qwen3-tiny")
    return str(path), make_checkpoint("qwen3", path, seed=0)


def fresh_prompts(vocab: int):
    """Setup for each round: new random prompts (no cache can reuse the last round's)."""
    seeds = itertools.count(1)
    return lambda: random_prompts(random.Random(next(seeds)), [N_IN] * B, vocab)


def test_flexsgl(benchmark, checkpoint):
    from flexsgl import LLM

    name, _ = checkpoint
    benchmark.group = f"peers {B}x{N_IN}+{N_OUT}"
    llm = LLM(name, device=DEVICE.type, load_format="dummy" if CUDA else "auto")
    prompts = fresh_prompts(llm.config.vocab_size)
    res = benchmark.pedantic(lambda: timed_pass(llm, prompts(), [N_OUT] * B, "", False),
                             rounds=ROUNDS, warmup_rounds=1)
    assert [len(o.token_ids) for o in res["outputs"]] == [N_OUT] * B
    benchmark.extra_info.update({"engine": "flexsgl", "output_tokens_per_s": B * N_OUT / res["wall_s"]})
    del llm
    free_memory()


def test_hf_generate_static(benchmark, checkpoint):
    _, hf = checkpoint
    benchmark.group = f"peers {B}x{N_IN}+{N_OUT}"
    prompts = fresh_prompts(hf.config.vocab_size)

    def run():
        ids = torch.tensor(prompts(), device=DEVICE)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_OUT,
                              min_new_tokens=N_OUT, do_sample=False, cache_implementation="static",
                              pad_token_id=0)
        sync()
        return out

    out = benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    assert out.shape == (B, N_IN + N_OUT)
    benchmark.extra_info.update({"engine": "transformers generate (static cache" + (", compiled)" if CUDA else ")"),
                                 "transformers": __import__("transformers").__version__})


def test_hf_generate_batch(benchmark, checkpoint):
    import transformers

    _, hf = checkpoint
    if not hasattr(hf, "generate_batch"):
        pytest.skip(f"transformers {transformers.__version__} has no continuous batching (model.generate_batch)")
    benchmark.group = f"peers {B}x{N_IN}+{N_OUT}"
    prompts = fresh_prompts(hf.config.vocab_size)
    gen = transformers.GenerationConfig(max_new_tokens=N_OUT, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = None
    if not CUDA:  # sized from free memory otherwise, which takes seconds on a CPU
        from transformers import ContinuousBatchingConfig

        cb = ContinuousBatchingConfig(num_blocks=4 * B, max_batch_tokens=B * N_IN)
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # "install psutil"

    def run():
        out = hf.generate_batch(inputs=prompts(), generation_config=gen, continuous_batching_config=cb,
                                progress_bar=False)
        sync()
        return out

    out = benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    assert sorted(len(o.generated_tokens) for o in out.values()) == [N_OUT] * B
    benchmark.extra_info.update({"engine": "transformers generate_batch (continuous batching)",
                                 "transformers": transformers.__version__})
