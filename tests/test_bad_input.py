"""Bad input to the Python API is refused with a ValueError that says why in one sentence,
and a refused request leaves the engine fit to serve the next one."""

import json
import random

import pytest
from transformers import Qwen3Config

from flexsgl import LLM, SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


def one_sentence(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg and msg.endswith("."), f"not a one-sentence message: {msg!r}"
    return msg


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu")


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy tokens of a random prompt, taken before any bad request reaches the engine."""
    prompt = [random.randrange(512) for _ in range(random.randrange(3, 40))]
    return prompt, llm.generate([prompt], GREEDY)[0].token_ids


def tiny_config_dir(path):
    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    return path


@pytest.mark.parametrize("kwargs, words", [
    ({"model": "no-such-model"}, "Unknown model"),
    ({"dtype": "float64"}, "dtype"),
    ({"load_format": "pickle"}, "load format"),
    ({"override": "nope"}, "override"),
], ids=["model", "dtype", "load-format", "override"])
def test_bad_llm_arguments(kwargs, words):
    with pytest.raises(ValueError) as e:
        LLM(**{"model": "tiny", "device": "cpu", **kwargs})
    assert words.lower() in one_sentence(e).lower()


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path), device="cpu")
    assert "config.json" in one_sentence(e)


def test_directory_without_weights(tmp_path):
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_config_dir(tmp_path)), device="cpu")
    assert "safetensors" in one_sentence(e)
    # The same directory runs with random weights when asked to.
    assert LLM(str(tmp_path), device="cpu", load_format="dummy").generate([[1, 2, 3]], GREEDY)[0].token_ids


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.5}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in one_sentence(e)


@pytest.mark.parametrize("prompts, words", [
    ("", "empty"),
    ([""], "empty"),
    ([[]], "empty"),
    ([], "No prompts"),
    ([[1] * 4096], "context"),
    (["x" * 5000], "context"),
    ([[1, 2, 512]], "vocabulary"),
    ([[1, -1, 2]], "vocabulary"),
    (["Hello", [3, 4, 99999]], "vocabulary"),
], ids=["empty-str", "list-empty-str", "empty-ids", "no-prompts", "4096-ids", "5000-chars",
        "id-512", "id-minus-1", "second-prompt-bad"])
def test_bad_prompts_then_engine_still_works(llm, reference, prompts, words):
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, GREEDY)
    assert words.lower() in one_sentence(e).lower()
    prompt, tokens = reference
    assert llm.generate([prompt], GREEDY)[0].token_ids == tokens, f"prompt={prompt}"


def test_request_larger_than_the_kv_cache_is_refused_with_a_reason():
    llm = LLM("tiny", device="cpu", kv_cache_tokens=128, page_size=64)
    refused, ok = llm.generate(["Hello", "Hello"], [SamplingParams(max_new_tokens=1000), SamplingParams(max_new_tokens=8)])
    assert refused.finish_reason == "refused" and not refused.token_ids
    assert "cache" in refused.error and "\n" not in refused.error and refused.error.endswith(".")
    assert len(ok.token_ids) == 8 and ok.finish_reason == "length"
