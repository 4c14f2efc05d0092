"""Tiny random HF checkpoints (saved with save_pretrained, so the real loading path runs) and helpers to compare against them."""

from __future__ import annotations

import torch

import flexsgl.runner
from flexsgl.bench.sampled_logits import logit_recorder


def make_checkpoint(arch: str, path, seed: int, tie: bool = False, vocab: int = 320, head_dim: int = 16):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-6,
                  max_position_embeddings=2048, tie_word_embeddings=tie, initializer_range=0.15,
                  eos_token_id=None, bos_token_id=None)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, rope_theta=10000.0)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a missed norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def capture_logits(llm, monkeypatch) -> dict[int, list[torch.Tensor]]:
    """Record, per request id, the logits the sampler saw for it, in step order, until the test ends."""
    per_req, run, sample = logit_recorder(llm)
    monkeypatch.setattr(llm.runner, "run", run)
    monkeypatch.setattr(flexsgl.runner, "sample", sample)
    return per_req


def logits_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest of each step's largest logit difference over that step's largest reference logit."""
    return ((ours - ref).abs().max(-1).values / ref.abs().max(-1).values).max().item()


def hf_reference(hf, prompt, steps):
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: generate would take token 0 for padding
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                          min_new_tokens=steps, pad_token_id=0)[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1:-1]
    return gen, logits


def assert_matches_hf(hf, prompt, out, seen, what: str, tol: float = 1e-4) -> None:
    """An engine's greedy output `out` for `prompt` (its logits captured in `seen`: capture_logits)
    against HF's greedy run of as many tokens: the same tokens, and every step's logits within `tol`
    of HF's, relative to the step's largest; `what` names the case (and its seed) in a failure."""
    ref_tokens, ref_logits = hf_reference(hf, prompt, len(out.token_ids))
    assert out.token_ids == ref_tokens, what
    ours = torch.stack(seen[out.request_id]).to(ref_logits.dtype)
    rel = logits_rel_error(ours, ref_logits)
    assert rel < tol, f"{what}: logits relative error {rel:.2e}"


def make_deepseek_checkpoint(path, seed: int, q_lora_rank: int | None = None, topk_method: str = "greedy",
                             vocab: int = 320, max_shard_size: str | None = None, **overrides):
    """A tiny random DeepSeek-V2 (MLA with YaRN, a dense layer then MoE layers with a shared expert),
    in one safetensors file or, with max_shard_size, several."""
    import transformers

    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, moe_intermediate_size=16,
               first_k_dense_replace=1, routed_scaling_factor=1.5, topk_method=topk_method, n_group=4, topk_group=2,
               rms_norm_eps=1e-6, max_position_embeddings=2048, initializer_range=0.15, tie_word_embeddings=False,
               eos_token_id=None, bos_token_id=None,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7})
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{**cfg, **overrides})).eval()
    with torch.no_grad():  # norms away from 1 so a missed norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model
