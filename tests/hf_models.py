"""Tiny random HF checkpoints (saved with save_pretrained, so the real loading path runs) and helpers to compare against them."""

from __future__ import annotations

import torch

import flexsgl.runner
from flexsgl.bench.sampled_logits import logit_recorder


def make_checkpoint(arch: str, path, seed: int, tie: bool = False, vocab: int = 320, head_dim: int = 16,
                    attention_bias: bool = False):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-6,
                  max_position_embeddings=2048, tie_word_embeddings=tie, initializer_range=0.15,
                  attention_bias=attention_bias,
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
    """HF's greedy continuation of `prompt` (`steps` tokens, generate's own loop) and its logits at
    each step."""
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: generate would take token 0 for padding
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                          min_new_tokens=steps, pad_token_id=0)[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1:-1]
    return gen, logits


def assert_matches_hf(hf, prompt, tokens: list[int], logits=None, what: str = "", tol: float = 1e-4,
                      steps: int | None = None) -> None:
    """`tokens`, an engine's greedy continuation of `prompt` (`steps` of them when given), against HF's
    forward over prompt + tokens: each token HF's argmax at its step, or short of it by at most `tol` of
    the step's largest logit (a near-tie that float rounding settles either way, after which both
    continuations are right); and `logits` (one row per token, a tensor or a list of them), when given,
    within `tol` of HF's, relative to each step's largest. `what` names the case (and its seed)."""
    assert tokens and (steps is None or len(tokens) == steps), f"{what}: {len(tokens)} tokens, not {steps}"
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    scale = ref.abs().max(-1).values
    short = (ref.max(-1).values - ref.gather(-1, torch.tensor(tokens)[:, None])[:, 0]) / scale
    step = int(short.argmax())
    assert short[step] <= tol, (f"{what}: step {step} chose token {tokens[step]}, HF's argmax is "
                                f"{int(ref[step].argmax())}, {short[step]:.2e} of the step's largest logit above it")
    if logits is not None:
        ours = (torch.stack(list(logits)) if not torch.is_tensor(logits) else logits).to(ref.device, ref.dtype)
        assert ours.shape == ref.shape, f"{what}: logits of shape {tuple(ours.shape)}, HF's {tuple(ref.shape)}"
        rel = logits_rel_error(ours, ref)
        assert rel < tol, f"{what}: logits relative error {rel:.2e}"


def same_greedy_tokens(got: list[int], ref: list[int], ref_logits, tol: float = 1e-4) -> bool:
    """Whether `got`, a greedy continuation run in one arrangement (batched, chunked, preempted), is
    `ref`, the same request's run in another, whose logits per step are `ref_logits`: equal, or
    equal up to a step where `got`'s token is short of ref's argmax by at most `tol` of the step's
    largest logit (a near-tie that the arrangements' float rounding settles either way, after which
    both continuations are right)."""
    for step, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            row = ref_logits[step].float().view(-1)
            return bool(row.max() - row[a] <= tol * row.abs().max())
    return len(got) == len(ref)


def deepseek_routing_near_tie(hf, ids: list[int], tol: float = 1e-5) -> bool:
    """Whether HF's DeepSeek-V2 routes some token of `ids` by a margin under `tol` (between the last
    chosen and the first left-out group, or expert): float rounding may settle it either way, and a
    token routed otherwise changes every step after it, as a near-tie in the argmax does."""
    c, gaps = hf.config, []

    def gap(module, inputs, output):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
        scores = torch.nn.functional.linear(x, module.weight.float()).softmax(-1)
        if c.topk_method == "group_limited_greedy":
            groups = scores.view(x.shape[0], c.n_group, -1).amax(-1).sort(-1, descending=True).values
            gaps.append((groups[:, c.topk_group - 1] - groups[:, c.topk_group]).min().item())
        ranked = scores.sort(-1, descending=True).values
        gaps.append((ranked[:, c.num_experts_per_tok - 1] - ranked[:, c.num_experts_per_tok]).min().item())

    hooks = [m.register_forward_hook(gap) for m in hf.modules() if type(m).__name__ == "DeepseekV2TopkRouter"]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert hooks, "no DeepseekV2TopkRouter in the model"
    return min(gaps) < tol


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
