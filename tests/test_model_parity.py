"""flexsgl against HF transformers' own Qwen3ForCausalLM and LlamaForCausalLM (float32, CPU).

Checks every step's logits (prefill's last token, then each decode step) against HF run over the
same sequence, and each greedy token against HF's argmax there (assert_matches_hf), on a batch of
prompts of different lengths, with KV pages handed out in shuffled order.
"""

import random

import pytest
import torch

from flexsgl import LLM, SamplingParams
from flexsgl.attention import flex_meta
from flexsgl.kernels import rope_store
from tests.hf_models import assert_matches_hf, capture_logits, make_checkpoint

STEPS = 40


@pytest.mark.parametrize("arch,tie", [("qwen3", False), ("qwen3", True), ("llama", False)])
@pytest.mark.parametrize("page_size,max_batch_tokens", [(16, 8192), (64, 8192), (7, 48)])
def test_greedy_and_logits_match_hf(tmp_path, monkeypatch, arch, tie, page_size, max_batch_tokens):
    check_against_hf(tmp_path, monkeypatch, arch, tie, page_size, max_batch_tokens, compile=False, steps=STEPS)


def test_compiled_engine_on_cpu_matches_hf(tmp_path, monkeypatch):
    """torch.compile on the CPU: the block-sparse kernel, so the page-table BlockMasks really count."""
    check_against_hf(tmp_path, monkeypatch, "qwen3", False, 16, 8192, compile=True, steps=12)


def test_one_compile_serves_every_layer():
    """torch.compile compiles decoder layers, and the first layer's graph serves the others: a
    prefill step and a decode step of new shapes compile one graph each, whatever the layer count
    (a layer that recompiled for its own weights or cache, or a graph break, would add more)."""
    llm = LLM("tiny", load_format="dummy", device="cpu", compile=True, max_total_tokens=1024)
    assert llm.config.num_layers > 1
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    llm.generate([[rng.randrange(llm.config.vocab_size) for _ in range(rng.randrange(3, 40))]],
                 SamplingParams(max_new_tokens=2, temperature=0.0))
    assert graphs["unique_graphs"] - before == 2, f"seed={seed}"


def test_compiled_lone_prompt_matches_hf(tmp_path, monkeypatch):
    """One prompt in chunks of 48 tokens: compiled prefill steps of a lone request, one of which
    samples nothing, which the runner pads with a dummy request and dummy logits rows."""
    check_against_hf(tmp_path, monkeypatch, "qwen3", False, 16, 48, compile=True, steps=6, lengths=[70])


def test_compiled_long_prompts_as_they_come_match_hf(tmp_path, monkeypatch):
    """Prompts long enough that compiled prefill reads the tokens as they come, two requests sharing
    a query block at each boundary (flex_blocks.query_rows), then decode."""
    layouts, query_rows = [], flex_meta.query_rows

    def recorded(fb, align, as_they_come):
        qr = query_rows(fb, align, as_they_come)
        layouts.append(qr.rows)
        return qr

    monkeypatch.setattr(flex_meta, "query_rows", recorded)
    check_against_hf(tmp_path, monkeypatch, "qwen3", False, 16, 4096, compile=True, steps=4, lengths=[600, 530, 700])
    assert layouts and layouts[0] is None, "the first prefill step's queries were copied into rows"


@pytest.mark.parametrize("arch,compile", [("qwen3", True), ("llama", False)])
def test_fused_rope_store_path_matches_hf(tmp_path, monkeypatch, arch, compile):
    """The store path CUDA takes: q/k norm, RoPE and the K/V store in one custom op (its PyTorch body
    here; the Triton kernel is checked in tests/test_rope_store.py)."""
    monkeypatch.setattr(rope_store, "applies", lambda device, head_dim: True)
    check_against_hf(tmp_path, monkeypatch, arch, False, 16, 8192, compile=compile, steps=12)


def check_against_hf(tmp_path, monkeypatch, arch, tie, page_size, max_batch_tokens, compile, steps,
                     lengths=(1, 5, 16, 17, 33, 70, 129)):
    seed = random.randrange(1 << 30)
    hf = make_checkpoint(arch, tmp_path, seed, tie=tie)
    hf.config._attn_implementation = "eager"
    rng = random.Random(seed)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in lengths]

    llm = LLM(str(tmp_path), device="cpu", page_size=page_size, max_num_batched_tokens=max_batch_tokens, compile=compile)
    llm.allocator.shuffle(seed)
    seen = capture_logits(llm, monkeypatch)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=steps, temperature=0.0))
    for i, prompt in enumerate(prompts):
        assert outs[i].finish_reason == "length", f"seed={seed}"
        assert_matches_hf(hf, prompt, outs[i].token_ids, seen[outs[i].request_id],
                          f"prompt {i} (len {len(prompt)}), seed={seed}", steps=steps)
