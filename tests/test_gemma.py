"""Gemma 2 and Gemma 3 (text) against HF transformers' Gemma2ForCausalLM and Gemma3ForCausalLM, their
configs against transformers' own config classes, the backends that may serve their attention
variants, and the settings flexsgl refuses for them."""

import json
import random
import re

import pytest
import torch

from flexsgl import LLM, SamplingParams
from flexsgl.attention import flex_meta
from flexsgl.attention.registry import resolve_override
from flexsgl.errors import CheckpointError
from flexsgl.model.config import ModelConfig
from flexsgl.model.presets import PRESETS
from tests.family_parity import PAGE, check_family, check_outputs, check_two_ranks
from tests.hf_models import assert_matches_hf, capture_logits
from tests.test_registry import GPU, fake_gpu  # noqa: F401  (a fixture)

WINDOW = 40
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=2048, initializer_range=0.15,
              eos_token_id=None, bos_token_id=None, pad_token_id=None, sliding_window=WINDOW)

# Bends logits of about 7.5 by 0.5 (15 tanh(7.5 / 15) = 6.9): a missed cap shows, yet the top-2 margins
# stay clear of bf16's error (a cap of 10 left about half of the 128-wide GPU checkpoints' steps decisive).
FINAL_SOFTCAP = 15.0


def _config(head_dim: int) -> dict:
    """COMMON at `head_dim`, with a softmax scale of (1.5 head_dim)**-0.5 (24**-0.5 at 16), not head_dim**-0.5:
    scores as sharp at head_dim 128 as at 16, where a scale that stays at 24**-0.5 puts bf16's own error on
    the logits near their top-2 margins."""
    return {**COMMON, "head_dim": head_dim, "query_pre_attn_scalar": 3 * head_dim // 2}


def _save(model, path, max_shard_size: str | None):
    with torch.no_grad():  # norms away from HF's init of 0, so a missed (or a doubled) 1 + w shows
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # 1 + w in 0.5-1.5: scores no sharper
                p.uniform_(-0.5, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def make_gemma2(path, seed: int, max_shard_size: str | None = None, head_dim: int = 16):
    """Sliding, global, sliding; caps small enough that the scores and logits they bend differ."""
    import transformers

    cfg = transformers.Gemma2Config(**_config(head_dim), num_hidden_layers=3, attn_logit_softcapping=6.0,
                                    final_logit_softcapping=FINAL_SOFTCAP)
    torch.manual_seed(seed)
    return _save(transformers.Gemma2ForCausalLM(cfg).eval(), path, max_shard_size)


def make_gemma3(path, seed: int, head_dim: int = 16, **config):
    """Two local layers and a global one (Gemma 3's five to one, shortened), each kind with its own
    RoPE base, the global one linearly scaled; a final softcap. `config`: keys that replace COMMON's."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        **{**_config(head_dim), **config}, num_hidden_layers=3, final_logit_softcapping=FINAL_SOFTCAP,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}})
    torch.manual_seed(seed)
    return _save(transformers.Gemma3ForCausalLM(cfg).eval(), path, None)


def test_gemma2_matches_hf(tmp_path, monkeypatch):
    check_family(tmp_path, monkeypatch, make_gemma2, WINDOW)


def test_gemma3_matches_hf(tmp_path, monkeypatch):
    check_family(tmp_path, monkeypatch, make_gemma3, WINDOW)


def test_gemma3_compiled_matches_hf(tmp_path, monkeypatch):
    """Compiled on the CPU: one compiled decoder layer per layer kind, each with its own RoPE tables
    and variant; the window's block lists decide what the local layers read."""
    check_family(tmp_path, monkeypatch, make_gemma3, WINDOW, compile=True)


def test_compiled_layers_lay_out_long_prefills_by_their_window(tmp_path, monkeypatch):
    """Compiled, one prefill step of two long requests past cached prefixes lays the global layer's
    queries out as they come and the local layers' (a window of 2,048) each request from a block of
    its own, as a block the two would share reads both windows (flex_blocks.rows_as_they_come): both
    layouts in one step, and its logits and greedy tokens against HF's."""
    seed = random.randrange(1 << 30)
    hf = make_gemma3(tmp_path, seed, sliding_window=2048, max_position_embeddings=4096)
    hf.config._attn_implementation = "eager"
    rng = random.Random(seed)
    prefixes = [[rng.randrange(hf.config.vocab_size) for _ in range(2304)] for _ in range(2)]
    prompts = [p + [rng.randrange(hf.config.vocab_size) for _ in range(1200)] for p in prefixes]
    llm = LLM(str(tmp_path), device="cpu", page_size=PAGE, max_num_batched_tokens=2400, compile=True)
    llm.generate(prefixes, SamplingParams(max_new_tokens=1, temperature=0.0))

    layouts, query_rows = [], flex_meta.query_rows

    def recorded(fb, align, as_they_come):
        layouts.append((len(fb.host_q_lens), as_they_come))
        return query_rows(fb, align, as_they_come)

    monkeypatch.setattr(flex_meta, "query_rows", recorded)
    seen = capture_logits(llm, monkeypatch)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert all(o.cached_tokens >= 2048 for o in outs), f"no prefix-cache hits: seed={seed}"
    assert sorted(come for n, come in layouts if n == 2) == [False, True], f"{layouts}: seed={seed}"
    for i, prompt in enumerate(prompts):
        assert_matches_hf(hf, prompt, outs[i].token_ids, seen[outs[i].request_id], f"prompt {i}, seed={seed}", steps=4)


def test_a_sharded_checkpoint_loads(tmp_path, monkeypatch):
    """Several safetensors files (and no lm_head tensor: the embeddings are tied) load into the same
    logits as HF's."""
    seed = random.randrange(1 << 30)
    hf = make_gemma2(tmp_path, seed, max_shard_size="40KB")
    hf.config._attn_implementation = "eager"
    assert len(list(tmp_path.glob("*.safetensors"))) > 2, f"seed={seed}"
    llm = LLM(str(tmp_path), device="cpu", page_size=PAGE)
    seen = capture_logits(llm, monkeypatch)
    prompts = [[random.Random(seed).randrange(320) for _ in range(WINDOW + 9)]]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.0))
    check_outputs(hf, llm, seen, prompts, outs, seed, "sharded checkpoint")


def _hf_config(d: dict):
    import transformers

    cls = transformers.Gemma2Config if d["model_type"] == "gemma2" else transformers.Gemma3TextConfig
    return cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})


FLAT_GEMMA3 = {  # the keys of configs written before transformers 5: flat RoPE keys, a layer pattern
    **PRESETS["gemma-3-4b"]["config"], "num_hidden_layers": 13, "sliding_window_pattern": 4,
    "rope_theta": 500000.0, "rope_local_base_freq": 2000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.5}}


@pytest.mark.parametrize("config", [
    *(PRESETS[n]["config"] for n in ("gemma-2-9b", "gemma-3-1b", "gemma-3-4b", "tiny-gemma2", "tiny-gemma3")),
    FLAT_GEMMA3, {**PRESETS["gemma-2-9b"]["config"], "final_logit_softcapping": None, "num_hidden_layers": 5},
], ids=["gemma-2-9b", "gemma-3-1b", "gemma-3-4b", "tiny-gemma2", "tiny-gemma3", "flat-gemma3", "no-final-cap"])
def test_configs_read_as_transformers_reads_them(config, tmp_path):
    """Each config, and transformers 5's own rewrite of it (rope_parameters nested per layer kind,
    layer_types written out), gives the layer kinds, window, RoPE per kind, scale and caps that
    transformers' config class gives; the layers of one kind share one variant object."""
    hf = _hf_config(config)
    hf.save_pretrained(tmp_path)
    rewritten = json.loads((tmp_path / "config.json").read_text())
    for d in (config, {**rewritten, "architectures": config["architectures"]}):
        cfg = ModelConfig.from_hf(d)
        assert cfg.layer_types == tuple(hf.layer_types)
        assert cfg.sliding_window == hf.sliding_window
        assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar
        assert cfg.final_softcap == hf.final_logit_softcapping
        assert cfg.tie_word_embeddings is True
        rope = hf.rope_parameters
        if config["model_type"] == "gemma2":
            assert cfg.attn_softcap == hf.attn_logit_softcapping
            assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (rope["rope_theta"], None, None)
        else:
            assert cfg.attn_softcap is None  # transformers' Gemma3Attention never applies one
            full, local = rope["full_attention"], rope["sliding_attention"]
            assert (cfg.rope_theta, cfg.rope_local_theta) == (full["rope_theta"], local["rope_theta"])
            assert local["rope_type"] == "default"
            assert cfg.rope_scaling == (None if full["rope_type"] == "default" else
                                        {"rope_type": full["rope_type"], "factor": full["factor"]})
        variants = cfg.attention_variants()
        local_v = {id(v) for v, t in zip(variants, cfg.layer_types) if t == "sliding_attention"}
        global_v = {id(v) for v, t in zip(variants, cfg.layer_types) if t == "full_attention"}
        assert len(local_v) == 1 and len(global_v) == 1 and local_v != global_v
        local_variant = variants[cfg.layer_types.index("sliding_attention")]
        assert local_variant.window == hf.sliding_window
        scale = None if hf.query_pre_attn_scalar == hf.head_dim else hf.query_pre_attn_scalar ** -0.5
        assert local_variant.scale == scale
        assert local_variant.features() == {"window": hf.sliding_window, **(
            {"softcap": hf.attn_logit_softcapping} if config["model_type"] == "gemma2" else {})}


def test_rope_tables_per_layer_kind():
    """Gemma 3's local layers rotate with the local base, its global layers with the global base
    and its linear scaling, as transformers' Gemma3RotaryEmbedding computes them (far positions too)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from flexsgl.model.gemma import GemmaForCausalLM

    small = {**FLAT_GEMMA3, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64, "head_dim": 16,
             "num_hidden_layers": 4, "sliding_window_pattern": 2, "max_position_embeddings": 50000}
    cfg = ModelConfig.from_hf(small)
    with torch.device("meta"):
        model = GemmaForCausalLM(cfg)
    model.materialize(torch.device("cpu"), torch.float32)
    hf_rope = Gemma3RotaryEmbedding(_hf_config(small))
    positions = torch.tensor([0, 1, 7, 1000, 49999])
    x = torch.zeros(1, dtype=torch.float32)
    for kind, ours in (("sliding_attention", model.model.rotary_local), ("full_attention", model.model.rotary)):
        cos, sin = hf_rope(x, positions[None], kind)
        torch.testing.assert_close(ours.cos[positions], cos[0, :, :8], rtol=0, atol=0)
        torch.testing.assert_close(ours.sin[positions], sin[0, :, :8], rtol=0, atol=0)
    assert not torch.equal(model.model.rotary_local.cos, model.model.rotary.cos)


@pytest.mark.parametrize("change, message", [
    ({"hidden_activation": "gelu"}, "sets hidden_activation to 'gelu'; flexsgl runs Gemma's gelu_pytorch_tanh"),
    ({"use_bidirectional_attention": True}, "sets use_bidirectional_attention to True, which flexsgl does not run"),
    ({"attention_bias": True}, "sets attention_bias to True, which flexsgl does not run for Gemma"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn' is not supported for Gemma3ForCausalLM"),
    ({"rope_scaling": None, "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
     "RoPE type 'dynamic' on Gemma 3's global layers is not supported"),
    ({"rope_scaling": None, "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "RoPE type 'linear' on Gemma 3's sliding-window layers is not supported"),
    ({"layer_types": ["sliding_attention"] * 3}, "'layer_types' must name sliding_attention or full_attention for "
                                                 "each of the 34 layers"),
])
def test_refused_configs(change, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ModelConfig.from_hf({**PRESETS["gemma-3-4b"]["config"], **change})


def test_hidden_act_is_read_only_where_transformers_reads_it():
    """Gemma 2's configs carry `hidden_act` beside `hidden_activation`; transformers reads only the
    latter, and so does flexsgl (for the other architectures hidden_act must still be silu)."""
    assert ModelConfig.from_hf({**PRESETS["gemma-2-9b"]["config"], "hidden_act": "gelu"}).architecture
    with pytest.raises(CheckpointError, match="sets hidden_act to 'gelu'"):
        ModelConfig.from_hf({**PRESETS["qwen3-8b"]["config"], "hidden_act": "gelu"})


@pytest.mark.parametrize("make", [make_gemma2, make_gemma3], ids=["gemma2", "gemma3"])
def test_two_ranks_match_hf(tmp_path, monkeypatch, make):
    """Under tensor parallelism: the embedding and LM head split by vocabulary, heads and the MLP
    by rank, each row-parallel output all-reduced before its post-norm."""
    check_two_ranks(tmp_path, monkeypatch, make, WINDOW)


@pytest.mark.parametrize("preset", ["gemma-2-9b", "tiny-gemma2", "gemma-3-1b"])
def test_backends_for_the_gemma_variants(preset, fake_gpu):  # noqa: F811
    """`auto` on the CPU is flex; on an SM90 GPU FA3 takes the window, the softcap and the scale, and
    FlashInfer's decode, which takes none of them, is refused in a sentence naming the variant."""
    cfg = ModelConfig.from_hf(PRESETS[preset]["config"])
    variants = cfg.attention_variants()
    kw = dict(head_dim=cfg.head_dim, dtype="bfloat16", variants=variants)
    cpu = resolve_override("auto", torch.device("cpu"), **kw)
    assert (cpu.prefill.name, cpu.decode.name) == ("flex", "flex")
    fake_gpu(90)
    fa3 = resolve_override("fa3", GPU, **kw)
    assert (fa3.prefill.name, fa3.decode.name) == ("fa3", "fa3")
    local = variants[0]
    with pytest.raises(ValueError) as e:
        resolve_override("fi-decode", GPU, **kw)
    assert f"Override 'fi-decode' cannot run here: it does not take the attention variant {local.name!r}'s " \
           in str(e.value)
    auto = resolve_override("auto", GPU, **kw)
    # auto never picks one that cannot serve them: FA3 prefill, flex decode, no small-batch decode kernel
    assert (auto.prefill.name, auto.decode.name, auto.small_decode) == ("fa3-prefill", "flex", None)


@pytest.mark.parametrize("model", ["tiny-gemma2", "tiny-gemma3"])
def test_tiny_presets_generate(model, tmp_path):
    """The tiny presets build with dummy weights and decode past their window; their configs, as
    transformers builds them with random weights, give HF's greedy tokens there."""
    import transformers

    llm = LLM(model, device="cpu", load_format="dummy", page_size=PAGE)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"
    seed = random.randrange(1 << 30)
    config = PRESETS[model]["config"]
    cls = transformers.Gemma2ForCausalLM if config["model_type"] == "gemma2" else transformers.Gemma3ForCausalLM
    torch.manual_seed(seed)
    hf = _save(cls(_hf_config(config)).eval(), tmp_path, None)
    rng = random.Random(seed)
    prompt = [rng.randrange(config["vocab_size"]) for _ in range(config["sliding_window"] + 9)]
    out = LLM(str(tmp_path), device="cpu", page_size=PAGE).generate(
        [prompt], SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True))[0]
    assert_matches_hf(hf, prompt, out.token_ids, what=f"{model} seed={seed}")
