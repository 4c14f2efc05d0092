"""flexsgl against HF transformers' own Qwen3ForCausalLM and LlamaForCausalLM (float32, CPU).

Checks every step's logits (prefill's last token, then each decode step) against HF run over the
same sequence, and greedy tokens against HF's own generate, on a batch of prompts of different
lengths, with KV pages handed out in shuffled order.
"""

import random

import pytest
import torch

import flexsgl.runner
from flexsgl import LLM, SamplingParams
from tests.hf_models import make_checkpoint

STEPS = 40


def capture_logits(llm, monkeypatch) -> dict[int, list[torch.Tensor]]:
    """Record, per request id, the logits the sampler saw for it, in step order."""
    per_req: dict[int, list[torch.Tensor]] = {}
    step_reqs = []
    real_sample, real_run = flexsgl.runner.sample, llm.runner.run

    def run(batch):
        step_reqs.append([r.request_id for r, s in zip(batch.requests, batch.samples) if s])
        return real_run(batch)

    def sample(logits, st):
        for row, rid in enumerate(step_reqs[-1]):
            per_req.setdefault(rid, []).append(logits[row].detach().clone())
        return real_sample(logits, st)

    monkeypatch.setattr(llm.runner, "run", run)
    monkeypatch.setattr(flexsgl.runner, "sample", sample)
    return per_req


def hf_reference(hf, prompt, steps):
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: generate would take token 0 for padding
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                          min_new_tokens=steps, pad_token_id=0)[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1:-1]
    return gen, logits


@pytest.mark.parametrize("arch,tie", [("qwen3", False), ("qwen3", True), ("llama", False)])
@pytest.mark.parametrize("page_size,max_batch_tokens", [(16, 8192), (64, 8192), (7, 48)])
def test_greedy_and_logits_match_hf(tmp_path, monkeypatch, arch, tie, page_size, max_batch_tokens):
    seed = random.randrange(1 << 30)
    hf = make_checkpoint(arch, tmp_path, seed, tie=tie)
    hf.config._attn_implementation = "eager"
    rng = random.Random(seed)
    lengths = [1, 5, 16, 17, 33, 70, 129]
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in lengths]

    llm = LLM(str(tmp_path), device="cpu", page_size=page_size, max_batch_tokens=max_batch_tokens,
              shuffle_pages=seed)
    seen = capture_logits(llm, monkeypatch)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=STEPS, temperature=0.0))
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_reference(hf, prompt, STEPS)
        assert outs[i].finish_reason == "length", f"seed={seed}"
        assert outs[i].token_ids == ref_tokens, f"prompt {i} (len {len(prompt)}), seed={seed}"
        ours = torch.stack(seen[outs[i].request_id])
        assert ours.shape == ref_logits.shape
        rel = ((ours - ref_logits).abs().max(-1).values / ref_logits.abs().max(-1).values).max().item()
        assert rel < 1e-4, f"prompt {i}: logits relative error {rel:.2e}, seed={seed}"
