"""Qwen3-MoE (the Qwen3 decoder with a mixture of experts for the MLP) against HF transformers'
Qwen3MoeForCausalLM on tiny random checkpoints (float32, CPU): one tensor per expert and stacked
experts, one safetensors file and several, renormalised top-k weights and not, a dense layer among
the MoE layers; which layers are MoE layers; the decode floor's routed experts."""

import json
import random
import re

import pytest
import torch
from safetensors import safe_open

from flexsgl import LLM, SamplingParams
from flexsgl.errors import CheckpointError
from flexsgl.kernels import gemv, moe_layer
from flexsgl.model.config import ModelConfig
from flexsgl.model.presets import PRESETS
from tests.family_parity import check_family, check_two_ranks
from tests.hf_models import assert_matches_hf, capture_logits

PROMPT_WINDOW = 40  # sizes check_family's prompts (Qwen3-MoE has no window)


def make_qwen3_moe(path, seed: int, top_k: int = 2, norm_topk_prob: bool = True, stacked: bool = False,
                   max_shard_size: str | None = None, **overrides):
    """A tiny random Qwen3-MoE (6 experts; layer 1 a dense MLP via mlp_only_layers), saved with one
    tensor per expert as released checkpoints are, or stacked as transformers 5 holds them."""
    import transformers

    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=top_k, moe_intermediate_size=32,
               norm_topk_prob=norm_topk_prob, mlp_only_layers=[1], decoder_sparse_step=1, rms_norm_eps=1e-6,
               max_position_embeddings=2048, initializer_range=0.15, tie_word_embeddings=False, eos_token_id=None,
               bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():  # norms away from 1 so a missed norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, save_original_format=not stacked,
                          **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def tensor_names(path) -> list[str]:
    names = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names += list(st.keys())
    return names


@pytest.mark.parametrize("top_k,norm_topk_prob,stacked,shards", [
    (2, True, False, "100KB"),  # one tensor per expert, in several files
    (3, False, True, None),  # stacked experts, one file
])
def test_qwen3_moe_matches_hf(tmp_path, monkeypatch, top_k, norm_topk_prob, stacked, shards):
    def make(path, seed):
        hf = make_qwen3_moe(path, seed, top_k, norm_topk_prob, stacked, shards)
        names = tensor_names(path)
        per_expert = any(re.search(r"\.mlp\.experts\.\d+\.up_proj\.weight$", n) for n in names)
        assert per_expert != stacked and any(n.endswith(".mlp.experts.gate_up_proj") for n in names) == stacked
        assert (len(list(path.glob("*.safetensors"))) > 1) == (shards is not None), "the checkpoint's files"
        return hf

    llm = check_family(tmp_path, monkeypatch, make, PROMPT_WINDOW)
    kinds = [type(layer.mlp).__name__ for layer in llm.model.model.layers]
    assert kinds == ["MoE", "GatedMLP", "MoE"]


def test_two_ranks_match_hf(tmp_path, monkeypatch):
    """Under tensor parallelism every rank holds every expert's slice of the intermediate dimension
    (and its slice of the dense layer's MLP) and routes alike; one all-reduce after each MLP."""
    check_two_ranks(tmp_path, monkeypatch, make_qwen3_moe, PROMPT_WINDOW)


@pytest.mark.usefixtures("triton_interpreter")
def test_batch_one_decode_kernels_match_hf(tmp_path, monkeypatch):
    """One request, so every decode step is batch 1 and runs as a GPU runs it there: the projections
    through the matrix-vector kernel and each MoE layer in one launch (routing inside it), here
    through Triton's interpreter in float32. Top-1 with norm_topk_prob: HF's weight is then 1."""
    seed = random.randrange(1 << 30)
    hf = make_qwen3_moe(tmp_path, seed, top_k=1, norm_topk_prob=True)
    hf.config._attn_implementation = "eager"
    monkeypatch.setattr(gemv, "applies", lambda x, *_: x.dim() == 2 and x.shape[0] == 1)
    launches = []
    monkeypatch.setattr(moe_layer, "launch", lambda *a, f=moe_layer.launch: launches.append(a[9]) or f(*a))
    prompt = [random.Random(seed).randrange(hf.config.vocab_size) for _ in range(9)]
    llm = LLM(str(tmp_path), device="cpu", page_size=4)
    seen = capture_logits(llm, monkeypatch)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert len(launches) == 7 * 2, "decode's MoE layers did not run as one launch each"  # 7 steps, 2 MoE layers
    assert all(router is not None for router in launches), "the routing did not run inside the launch"
    assert_matches_hf(hf, prompt, out.token_ids, seen[out.request_id], f"seed={seed}", steps=8)


def test_compiled_dense_and_moe_layers_compile_once_each_and_match_hf(tmp_path, monkeypatch):
    """torch.compile on the CPU: of four layers, one dense and three MoE, a prefill step and a decode
    step compile one graph per layer kind each (a MoE layer that recompiled for its own weights
    would add more), and the compiled model's logits and tokens match HF's."""
    seed = random.randrange(1 << 30)
    hf = make_qwen3_moe(tmp_path, seed, top_k=2, num_hidden_layers=4)
    hf.config._attn_implementation = "eager"
    rng = random.Random(seed)
    llm = LLM(str(tmp_path), device="cpu", page_size=16, max_total_tokens=1024, compile=True)
    assert [type(layer.mlp).__name__ for layer in llm.model.model.layers] == ["MoE", "GatedMLP", "MoE", "MoE"]
    seen = capture_logits(llm, monkeypatch)
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    prompt = [rng.randrange(hf.config.vocab_size) for _ in range(rng.randrange(3, 40))]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert graphs["unique_graphs"] - before == 4, f"seed={seed}"  # (prefill, decode) x (dense, MoE)
    assert_matches_hf(hf, prompt, out.token_ids, seen[out.request_id], f"seed={seed}", steps=6)


@pytest.mark.parametrize("layers,step,mlp_only", [(4, 1, []), (6, 2, [3]), (5, 1, [0, 4]), (4, 3, []), (2, 1, [0, 1])])
def test_moe_layers_are_those_hf_builds(layers, step, mlp_only):
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=step,
                                      mlp_only_layers=mlp_only)
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(cfg)
    ours = ModelConfig.from_hf(cfg.to_dict())
    hf_sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [ours.moe is not None and ours.moe.sparse(i) for i in range(layers)] == hf_sparse
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())


def test_decode_floor_counts_the_routed_experts_a_batch_reads(tmp_path):
    """The decode floor of a Qwen3-MoE with a dense layer among its MoE layers, against the bytes
    counted by hand from the config: every weight but the input embedding, less the routed experts
    a batch of B is not expected to pick, 1 - (1 - k/E)^B of them read."""
    from flexsgl.bench.roofline import decode_floor

    config = {**PRESETS["tiny-qwen3-moe"]["config"], "num_hidden_layers": 3, "mlp_only_layers": [1]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", max_total_tokens=640, page_size=64)
    h, inter, vocab, d = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["head_dim"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    e, k, mi = config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
    attention = h * (hq + 2 * hkv) * d + hq * d * h + 2 * d + 2 * h  # q/k/v, o, q/k norms, the layer's two norms
    experts = e * 3 * h * mi  # per MoE layer
    total = 3 * attention + 1 * 3 * h * inter + 2 * (e * h + experts) + h + vocab * h  # lm_head, not the embedding
    for b in (1, 2, 3, 16):
        floor = decode_floor(llm, b, 100.0, bandwidth=1e9)
        unread = 2 * experts * (1 - k / e) ** b
        assert floor["weight_bytes_read"] == pytest.approx(4 * (total - unread)), f"batch {b}"
        assert floor["kv_bytes_read"] == pytest.approx(b * 100.0 * 3 * 2 * hkv * d * 4), f"batch {b}"


@pytest.mark.parametrize("change,message", [
    ({"attention_bias": True}, "sets attention_bias, which flexsgl's Qwen3-MoE does not run"),
    ({"num_experts_per_tok": 129}, "'num_experts_per_tok' (129) is more than 'num_experts' (128)"),
    ({"num_experts": -1}, "'num_experts' must be a non-negative integer, got -1"),
    ({"mlp_only_layers": ["1"]}, "'mlp_only_layers' must be a list of layer indices"),
    ({"moe_intermediate_size": None}, "lacks 'moe_intermediate_size', which the model needs"),
    ({"use_sliding_window": True}, "sets use_sliding_window to True, which flexsgl does not run"),
])
def test_qwen3_moe_configs_flexsgl_cannot_run_are_refused(change, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ModelConfig.from_hf({**PRESETS["qwen3-30b-a3b"]["config"], **change})
