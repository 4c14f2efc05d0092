"""flexsgl's DeepSeek-V2 (MLA over the latent pool, flex absorbed attention, grouped MoE) against HF
transformers' own DeepseekV2ForCausalLM on tiny random checkpoints (float32, CPU).

Every step's logits (prefill's last token, then each decode step) are compared with HF over the
same sequence, and each greedy token with HF's argmax there (tests/hf_models.assert_matches_hf):
ragged batches, shuffled pages, chunked prefill, and a second round of prompts that extend the
first round's, served from the prefix cache.
"""

import random
import re

import pytest

from flexsgl import LLM, SamplingParams
from flexsgl.kernels import gemv, latent_query, moe_layer
from tests.hf_models import assert_matches_hf, capture_logits, deepseek_routing_near_tie, make_deepseek_checkpoint

STEPS = 32


@pytest.mark.parametrize("q_lora_rank,topk_method,page_size,max_batch_tokens,shards", [
    (None, "greedy", 16, 8192, None),
    (24, "group_limited_greedy", 7, 48, "200KB"),  # chunked prefill, pages of 7, a sharded checkpoint
])
def test_deepseek_v2_matches_hf(tmp_path, monkeypatch, q_lora_rank, topk_method, page_size, max_batch_tokens, shards):
    seed = random.randrange(1 << 30)
    hf = make_deepseek_checkpoint(tmp_path, seed, q_lora_rank=q_lora_rank, topk_method=topk_method,
                                  max_shard_size=shards)
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == (shards is not None), "the checkpoint's files"
    hf.config._attn_implementation = "eager"
    rng = random.Random(seed)
    first = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (1, 5, 17, 33, 70)]
    # Second round: longer prompts starting with the first round's prompts and outputs (prefix hits).
    llm = LLM(str(tmp_path), device="cpu", page_size=page_size, max_num_batched_tokens=max_batch_tokens)
    llm.allocator.shuffle(seed)
    seen = capture_logits(llm, monkeypatch)
    greedy = SamplingParams(max_new_tokens=STEPS, temperature=0.0)
    outs = llm.generate(first, greedy)
    second = [p + o.token_ids + [rng.randrange(hf.config.vocab_size) for _ in range(3)]
              for p, o in zip(first[2:], outs[2:])]
    outs2 = llm.generate(second, greedy)
    assert sum(o.cached_tokens for o in outs2) >= page_size * len(second), f"no prefix-cache hits, seed={seed}"
    checked = 0
    for prompt, out in zip(first + second, outs + outs2):
        if deepseek_routing_near_tie(hf, prompt + out.token_ids):
            continue  # a token's experts are a float rounding's choice: either continuation is right
        assert_matches_hf(hf, prompt, out.token_ids, seen[out.request_id],
                          f"prompt of {len(prompt)} tokens, seed={seed}", steps=STEPS)
        checked += 1
    assert checked >= len(first), f"seed={seed}: routing near-ties in {len(first + second) - checked} prompts"


@pytest.mark.usefixtures("triton_interpreter")
def test_batch_one_decode_kernels_match_hf(tmp_path, monkeypatch):
    """One request, so every decode step is batch 1 and runs as a GPU runs it there: the projections
    and each head's W_UV through the matrix-vector kernel, each MoE layer in one launch, the latent
    query with the latent's store in one launch; here through Triton's interpreter in float32."""
    seed = random.randrange(1 << 30)
    hf = make_deepseek_checkpoint(tmp_path, seed)
    hf.config._attn_implementation = "eager"
    one_row = lambda x, *_: x.dim() == 2 and x.shape[0] == 1  # noqa: E731
    monkeypatch.setattr(gemv, "applies", one_row)
    monkeypatch.setattr(latent_query, "applies", lambda q, w_uk: q.shape[0] == 1)
    routed, stored = [], []
    monkeypatch.setattr(moe_layer, "launch", lambda *a, f=moe_layer.launch: routed.append(1) or f(*a))
    monkeypatch.setattr(latent_query, "launch", lambda *a, f=latent_query.launch: stored.append(len(a) > 5) or f(*a))
    prompt = [random.Random(seed).randrange(hf.config.vocab_size) for _ in range(9)]
    llm = LLM(str(tmp_path), device="cpu", page_size=4)
    seen = capture_logits(llm, monkeypatch)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert len(routed) == 7 * 2, "decode's MoE layers did not run as one launch each"  # 7 steps, 2 layers
    assert sum(stored) >= 7 * 3, "decode's latents were not stored in the query's launch"  # 7 steps, 3 layers
    assert_matches_hf(hf, prompt, out.token_ids, seen[out.request_id], f"seed={seed}", steps=8)


def test_compiled_mla_through_graph_buffers_matches_hf(tmp_path):
    """torch.compile on the CPU (flex's block-sparse kernel over the latent pool) with decode steps
    through the CUDA-graph manager's static buffers (emulated: no recording on the CPU)."""
    seed = random.randrange(1 << 30)
    hf = make_deepseek_checkpoint(tmp_path, seed, q_lora_rank=24)
    hf.config._attn_implementation = "eager"
    rng = random.Random(seed)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (3, 20, 41)]
    steps = [6, 9, 12]  # requests finish at different steps: batches shrink
    llm = LLM(str(tmp_path), device="cpu", page_size=8, max_total_tokens=400, max_running_requests=4, compile=True)
    llm.allocator.shuffle(seed)
    llm.runner.capture_graphs([2, 4], emulate=True)
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=s, temperature=0.0) for s in steps])
    for p, s, o in zip(prompts, steps, outs):
        assert_matches_hf(hf, p, o.token_ids, what=f"seed={seed}", steps=s)


def test_latent_pool_sizes_and_decode_floor():
    """The pool holds one latent vector per token and layer; sizing and the decode floor count
    latent bytes, and the floor counts only the routed experts a batch is expected to read."""
    from flexsgl.bench.roofline import decode_floor

    llm = LLM("tiny-mla", device="cpu", load_format="dummy", max_total_tokens=640, page_size=64)
    cfg, mla, moe = llm.config, llm.config.mla, llm.config.moe
    assert [tuple(t.shape) for t in llm.pool.kv] == [(11 * 64, 1, 64 + 16)] * cfg.num_layers  # + the dummy page
    assert cfg.kv_bytes_per_token(4) == cfg.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    params = sum(p.numel() for p in llm.model.parameters())
    assert cfg.num_params() == params
    h, e, i = cfg.hidden_size, moe.n_routed_experts, moe.intermediate_size
    routed = (cfg.num_layers - moe.first_k_dense_replace) * e * 3 * h * i * 4
    for b in (1, 2, 16):
        floor = decode_floor(llm, b, 100.0, bandwidth=1e9)
        read = 1 - (1 - moe.top_k / e) ** b  # the expected share of experts a batch of b picks
        assert floor["weight_bytes_read"] == pytest.approx(4 * (params - cfg.vocab_size * h) - routed * (1 - read))
        assert floor["kv_bytes_read"] == b * 100.0 * cfg.kv_bytes_per_token(4)


@pytest.mark.parametrize("change,message", [
    ({"topk_method": "noaux_tc"}, "sets topk_method to 'noaux_tc', which flexsgl does not run"),
    ({"scoring_func": "sigmoid"}, "sets scoring_func to 'sigmoid'; flexsgl runs softmax"),
    ({"n_group": 3}, "'n_routed_experts' (64) must split into 'n_group' (3) groups"),
    ({"num_experts_per_tok": 65}, "'num_experts_per_tok' (65) is more than 'n_routed_experts' (64)"),
    ({"moe_layer_freq": 2}, "sets moe_layer_freq to 2, which flexsgl does not run"),
    ({"attention_bias": True}, "sets attention_bias, which flexsgl's DeepSeek-V2 does not run"),
    ({"kv_lora_rank": None}, "lacks 'kv_lora_rank', which the model needs"),
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}, "lacks 'factor'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic' is not supported for "
                                                           "DeepseekV2ForCausalLM; flexsgl runs 'default' and 'yarn'"),
])
def test_deepseek_configs_flexsgl_cannot_run_are_refused(change, message):
    from flexsgl.errors import CheckpointError
    from flexsgl.model.config import ModelConfig
    from flexsgl.model.presets import PRESETS

    with pytest.raises(CheckpointError, match=re.escape(message)):
        ModelConfig.from_hf({**PRESETS["deepseek-v2-lite"]["config"], **change})
