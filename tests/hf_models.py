"""Tiny random HF checkpoints, saved with save_pretrained so flexsgl's real loading path runs."""

from __future__ import annotations

import torch


def make_checkpoint(arch: str, path, seed: int, tie: bool = False, vocab: int = 320):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
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
