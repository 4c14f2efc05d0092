"""Settings read from config.json as transformers' config classes read them: the
dict that wins where both `rope_scaling` and `rope_parameters` are given, the pretraining length of
llama3 and yarn RoPE (a top-level `original_max_position_embeddings` first), Mistral's window where
the key is left out, and GPT-OSS's attention biases where `attention_bias` is; the Gemma 3 RoPE
configs transformers reads otherwise than they say, refused."""

import random

import pytest
import transformers

from flexsgl.errors import CheckpointError
from flexsgl.model.config import ModelConfig

BASE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048}


def llama3(original: int | None) -> dict:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 5e5}
    return rope if original is None else {**rope, "original_max_position_embeddings": original}


def hf_rope(cls, d: dict) -> dict:
    """The RoPE parameters transformers' model of config `d` runs with (building the model
    standardizes them again, now with every config.json key an attribute)."""
    config = cls(**{k: v for k, v in d.items() if k != "architectures"})
    model = getattr(transformers, d["architectures"][0])(config)
    return dict(model.config.rope_parameters)


@pytest.mark.parametrize("case", ["top-level-length", "length-from-max-positions", "rope-scaling-wins"])
def test_llama_rope_reads_as_transformers_reads_it(case):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    original = rng.choice([64, 256, 1024])
    d = {**BASE, "architectures": ["LlamaForCausalLM"]}
    if case == "top-level-length":
        d.update(rope_parameters=llama3(original), original_max_position_embeddings=2 * original)
    elif case == "length-from-max-positions":
        d.update(rope_parameters=llama3(None))
    else:
        d.update(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling=llama3(original))
    ours, want = ModelConfig.from_hf(d, "config.json"), hf_rope(transformers.LlamaConfig, d)
    assert ours.rope_scaling is not None, f"seed={seed}"
    assert want["rope_type"] == ours.rope_scaling["rope_type"] == "llama3", f"seed={seed}"
    assert ours.rope_scaling["original_max_position_embeddings"] == want["original_max_position_embeddings"], \
        f"seed={seed}: {ours.rope_scaling} against {want}"
    assert ours.rope_theta == want["rope_theta"], f"seed={seed}"


def test_gpt_oss_default_rope_takes_a_top_level_pretraining_length():
    d = {**BASE, "architectures": ["GptOssForCausalLM"], "rope_theta": 150000.0, "rms_norm_eps": 1e-5,
         "num_local_experts": 4, "num_experts_per_tok": 2, "original_max_position_embeddings": 512}
    ours, want = ModelConfig.from_hf(d, "config.json"), hf_rope(transformers.GptOssConfig, d)
    assert ours.rope_scaling["original_max_position_embeddings"] == want["original_max_position_embeddings"] == 512


@pytest.mark.parametrize("given", [{}, {"sliding_window": None}, {"sliding_window": 37}])
def test_mistral_window_reads_as_transformers_reads_it(given):
    d = {**BASE, "architectures": ["MistralForCausalLM"], **given}
    want = transformers.MistralConfig(**{k: v for k, v in d.items() if k != "architectures"}).sliding_window
    assert ModelConfig.from_hf(d, "config.json").sliding_window == want


@pytest.mark.parametrize("rope, words", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}, "nested by layer type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "in one of them"),
])
def test_gemma3_rope_that_transformers_reads_otherwise_is_refused(rope, words):
    d = {**BASE, "architectures": ["Gemma3ForCausalLM"], "head_dim": 16, **rope}
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_hf(d, "config.json")
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_gemma3_nested_rope_with_the_same_rope_scaling_loads():
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    d = {**BASE, "architectures": ["Gemma3ForCausalLM"], "rope_scaling": {"rope_type": "linear", "factor": 8.0},
         "rope_parameters": {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert ModelConfig.from_hf(d, "config.json").rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("given", [{}, {"attention_bias": False}])
def test_gpt_oss_attention_bias_reads_as_transformers_reads_it(given):
    d = {**BASE, "architectures": ["GptOssForCausalLM"], "rope_theta": 150000.0, "rms_norm_eps": 1e-5,
         "num_local_experts": 4, "num_experts_per_tok": 2, **given}
    want = transformers.GptOssConfig(**{k: v for k, v in d.items() if k != "architectures"}).attention_bias
    assert ModelConfig.from_hf(d, "config.json").attention_bias == want
