"""GPT-OSS (sinks, alternating sliding and global layers, YaRN, MoE with biases and a clamped SwiGLU)
against HF transformers' GptOssForCausalLM and its modules, on tiny random checkpoints (float32, CPU);
the MXFP4 refusal; and the decode floor `flexsgl bench` reports for it, against a hand-computed case."""

import copy
import json
import random
import re

import pytest
import torch

import flexsgl.model.moe as moe_module
from flexsgl import LLM, SamplingParams
from flexsgl.errors import CheckpointError
from flexsgl.model.config import ModelConfig
from flexsgl.model.presets import PRESETS
from flexsgl.model.weight_loaders import weight_loader
from tests.family_parity import check_family, check_two_ranks
from tests.hf_models import assert_matches_hf, capture_logits

WINDOW = 40
LIMIT = 1.2  # the SwiGLU clamp, low enough that random weights reach it


def hf_config(window: int = WINDOW, head_dim: int = 16):
    import transformers

    # intermediate_size 48: a stack of experts read transposed would not fit (2 * 48 != 64). The modeling
    # code's own experts ("eager"), not the grouped_mm path some transformers versions choose by default.
    return transformers.GptOssConfig(vocab_size=320, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                     num_local_experts=6, num_experts_per_tok=2, sliding_window=window, swiglu_limit=LIMIT,
                                     rms_norm_eps=1e-6, max_position_embeddings=2048, initializer_range=0.15,
                                     eos_token_id=None, bos_token_id=None, pad_token_id=None,
                                     tie_word_embeddings=False, experts_implementation="eager")


def randomize(module: torch.nn.Module) -> None:
    """Norms away from 1, and biases, sinks and the router's bias random rather than HF's zeros."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)


def make_gpt_oss(path, seed: int, window: int = WINDOW, max_shard_size: str | None = None, head_dim: int = 16):
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(hf_config(window, head_dim)).eval()
    randomize(model)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def test_gpt_oss_matches_hf(tmp_path, monkeypatch):
    llm = check_family(tmp_path, monkeypatch, make_gpt_oss, WINDOW)
    attn = [layer.self_attn for layer in llm.model.model.layers]
    assert attn[0].variant is attn[2].variant  # one object per kind of layer
    assert attn[0].variant.window == WINDOW and attn[1].variant.window is None
    assert all(a.sink is a.sinks for a in attn)


def test_gpt_oss_compiled_matches_hf(tmp_path, monkeypatch):
    """Compiled on the CPU: the experts' gathered products, the window's block lists and the sinks
    inside compiled layers."""
    check_family(tmp_path, monkeypatch, make_gpt_oss, WINDOW, compile=True)


def test_two_ranks_match_hf(tmp_path, monkeypatch):
    """Under tensor parallelism: each rank's heads with their q/k/v biases and sinks, every expert's
    slice with its gate/up bias entries, o_proj's and the experts' down biases on rank 0 alone;
    checkpoint tensors spread over several files, each rank reading only its slices."""
    check_two_ranks(tmp_path, monkeypatch, lambda path, seed: make_gpt_oss(path, seed, max_shard_size="60KB"), WINDOW)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


@pytest.mark.gpu
@pytest.mark.parametrize("override,one_at_a_time", [("flex", False), ("flex", True), ("fa3", False)])
def test_bf16_engine_tracks_hf_on_a_gpu(tmp_path, monkeypatch, override, one_at_a_time):
    """Compiled in bfloat16 with decode replayed from CUDA graphs (the experts' grouped products with
    their biases; the sinks through flex's log-sum-exp or FA3's `sinks`; at batch 1 the projections'
    matrix-vector kernel), head_dim 64 as GPT-OSS's, against transformers in float32 and bfloat16."""
    from tests.test_gpu import check_tracks_hf
    from tests.test_gpu_overrides import skip_unless_runs

    skip_unless_runs(override)
    if tuple(int(x) for x in transformers_version().split(".")[:2]) < (5, 24):
        pytest.skip("transformers before 5.24 computes GptOssMLP otherwise on the same weights (the module test "
                    "fails there too); the reference is 5.24's modeling code")
    seed = random.randrange(1 << 30)
    make_gpt_oss(tmp_path, seed, head_dim=64)
    check_tracks_hf(str(tmp_path), monkeypatch, seed, 16, one_at_a_time, max_total_tokens=32768,
                    cuda_graph_bs=[1, 2, 8], override=override)


def test_a_sharded_checkpoint_loads(tmp_path, monkeypatch):
    seed = random.randrange(1 << 30)
    hf = make_gpt_oss(tmp_path, seed, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1, "the checkpoint's files"
    hf.config._attn_implementation = "eager"
    prompt = [random.Random(seed).randrange(hf.config.vocab_size) for _ in range(WINDOW + 9)]
    llm = LLM(str(tmp_path), device="cpu", page_size=16)
    seen = capture_logits(llm, monkeypatch)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert_matches_hf(hf, prompt, out.token_ids, seen[out.request_id], f"seed={seed}")


@pytest.mark.parametrize("grouped", [True, False])
def test_moe_matches_hf_modules(monkeypatch, grouped):
    """The router and experts (grouped products, or gathered), loaded through their weight loaders
    from HF's GptOssMLP parameters (transposed, gate and up interleaved), against that module in
    float64, on inputs large enough that the SwiGLU clamps engage on both sides."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as HFMLP

    from flexsgl.model.gpt_oss import GptOssMLP

    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    hcfg = hf_config()
    hf = HFMLP(hcfg)
    for p in hf.parameters():
        p.data.normal_(0.0, 0.4)
    ours = GptOssMLP(ModelConfig.from_hf({**hcfg.to_dict(), "architectures": ["GptOssForCausalLM"]}))
    params = dict(ours.named_parameters())
    assert params.keys() == dict(hf.named_parameters()).keys()
    for name, t in hf.named_parameters():
        weight_loader(params[name]).load(params[name].data, lambda index, out, t=t.detach(): out.copy_(t), None)
    monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda *a: grouped)
    x = torch.randn(37, hcfg.hidden_size)
    gate_up = x.double() @ hf.experts.gate_up_proj.double() + hf.experts.gate_up_proj_bias.double()[:, None]
    assert (gate_up[..., ::2] > LIMIT).float().mean() > 0.05, f"seed={seed}"
    assert (gate_up[..., 1::2].abs() > LIMIT).float().mean() > 0.05, f"seed={seed}"
    residual = torch.randn_like(x)
    with torch.no_grad():
        ref = residual.double() + hf.double()(x.double()[None])[0][0]
        out = ours(x, lambda h: h, residual)
    rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-5, f"relative error {rel:.2e}, seed={seed}"


def test_rotary_tables_match_hf_yarn():
    """gpt-oss-20b's RoPE (YaRN, factor 32, truncate false, the attention factor) at positions across
    its whole context, against transformers' GptOssRotaryEmbedding."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from flexsgl.model.layers import RotaryEmbedding

    config = {k: v for k, v in copy.deepcopy(PRESETS["gpt-oss-20b"]["config"]).items() if k != "architectures"}
    cfg = ModelConfig.from_hf(PRESETS["gpt-oss-20b"]["config"])
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
    hf = GptOssRotaryEmbedding(transformers.GptOssConfig(**config))
    seed = random.randrange(1 << 30)
    positions = torch.randint(0, cfg.max_position, (512,), generator=torch.Generator().manual_seed(seed))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    assert hf.attention_scaling > 1.3
    torch.testing.assert_close(ours.cos[positions], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[positions], sin[0], rtol=0, atol=1e-6)


def test_an_mxfp4_checkpoint_is_refused_in_one_sentence(tmp_path):
    config = {**PRESETS["gpt-oss-20b"]["config"], "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"], "quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        LLM(str(tmp_path), device="cpu")
    msg = str(e.value)
    assert "MXFP4" in msg and "bfloat16 checkpoint" in msg and "config.json" in msg, msg
    assert "\n" not in msg and msg.count(". ") == 0 and msg.endswith("."), msg


@pytest.mark.parametrize("change,message", [
    ({"num_experts_per_tok": 33}, "'num_experts_per_tok' (33) is more than 'num_local_experts' (32)"),
    ({"layer_types": ["sliding_attention"] * 3}, "'layer_types' must name sliding_attention or full_attention "
                                                 "for each of the 24 layers"),
    ({"rope_theta": None}, "lacks 'rope_theta'"),
    ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096}}, "lacks 'factor'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic' is not supported for "
                                                                "GptOssForCausalLM"),
    ({"swiglu_limit": -1}, "'swiglu_limit' must be a positive number"),
])
def test_gpt_oss_configs_flexsgl_cannot_run_are_refused(change, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ModelConfig.from_hf({**PRESETS["gpt-oss-20b"]["config"], **change})


def test_gpt_oss_presets_have_the_published_shapes():
    small, big = (ModelConfig.from_hf(PRESETS[n]["config"]) for n in ("gpt-oss-20b", "gpt-oss-120b"))
    for cfg, layers, experts in ((small, 24, 32), (big, 36, 128)):
        assert (cfg.num_layers, cfg.moe.n_routed_experts, cfg.moe.top_k) == (layers, experts, 4)
        assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2880, 64, 8, 64)
        assert cfg.layer_types == ("sliding_attention", "full_attention") * (layers // 2)
        own = cfg.attention_variants()
        assert own[0].window == 128 and own[0].sink == "sinks" and own[1].window is None and own[1].sink == "sinks"
        assert len({id(v) for v in own}) == 2
    # The published parameter counts: 20.9B and 116.8B.
    assert round(small.num_params() / 1e8) == 209 and round(big.num_params() / 1e8) == 1168


def test_decode_floor_counts_the_experts_picked_and_the_window():
    """tiny-gpt-oss in float32 (vocabulary 512, hidden 128, 2 layers, 4 q and 2 KV heads of 32, 4
    experts of width 128, top-2, a window of 48 on layer 0), the bytes of a decode step by hand."""
    from flexsgl.bench.roofline import decode_floor

    llm = LLM("tiny-gpt-oss", device="cpu", load_format="dummy", max_total_tokens=1024)
    attention = 128 * 128 * 2 + 128 * 64 * 2 + (128 + 64 + 64 + 128) + 4  # q, o, k, v; their biases; sinks
    experts = 4 * (128 * 256 + 256 + 128 * 128 + 128)  # gate_up and down, with their biases
    layer = attention + 2 * 128 + (4 * 128 + 4) + experts  # norms, router
    total = 2 * layer + 2 * 512 * 128 + 128  # embedding, lm_head, final norm
    assert sum(p.numel() for p in llm.model.parameters()) == total == llm.config.num_params()
    for b in (1, 2, 8):
        floor = decode_floor(llm, b, 100.0, bandwidth=1e9)
        picked = 1 - (1 - 2 / 4) ** b  # the expected share of the 4 experts a batch of b picks, 2 per token
        assert floor["weight_bytes_read"] == pytest.approx(4 * (total - 512 * 128 - 2 * experts * (1 - picked)))
        # K and V of 2 heads of 32 floats per token and layer: the sliding layer reads 48 tokens, the other 100
        assert floor["kv_bytes_read"] == b * (48 + 100) * 2 * 2 * 32 * 4
        assert floor["bytes_per_step"] == pytest.approx(floor["weight_bytes_read"] + floor["kv_bytes_read"])
