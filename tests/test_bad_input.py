"""Bad input to the Python API is refused with a ValueError that says why in one sentence,
and a refused request leaves the engine fit to serve the next one."""

import json
import random

import pytest
from transformers import Qwen3Config

from flexsgl import LLM, SamplingParams
from flexsgl.errors import InputError, PromptError, SamplingParamsError, UnknownRequestError

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


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1, temperature=0.7) == SamplingParams(top_k=0, temperature=0.7)


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.5}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0},
    {"top_k": 2**64}, {"top_k": -2}, {"top_k": 2.0}, {"max_new_tokens": 4.0}, {"max_new_tokens": True},
    {"temperature": "0.5"}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": 1e39},
    {"top_p": "1"}, {"min_p": -0.1}, {"min_p": None}, {"seed": -1}, {"seed": 2**64}, {"seed": 1.5},
    {"stop_token_ids": 5}, {"stop_token_ids": "abc"}, {"stop_token_ids": (None,)}, {"stop_token_ids": (-1,)},
    {"stop_token_ids": (1.0,)}, {"stop_token_ids": (True,)}, {"stop_token_ids": {"a": 1}}, {"ignore_eos": "no"},
], ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_bad_sampling_params(kwargs):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in one_sentence(e)


@pytest.mark.parametrize("temperature", [1e-38, 1e-6, 5e-324])
def test_temperature_below_epsilon_is_greedy(llm, temperature):
    """Dividing logits by such a temperature overflows float32; it samples as temperature 0 does."""
    prompt = [random.randrange(512) for _ in range(random.randrange(3, 20))]
    greedy = llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0))[0].token_ids
    for top_p in (1.0, 0.9):
        out = llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=temperature, top_p=top_p, seed=1))
        assert out[0].token_ids == greedy, f"prompt={prompt}"


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


@pytest.mark.parametrize("args, error, words", [
    ((b"Hello",), PromptError, "bytes"),
    (([b"Hello"],), PromptError, "bytes"),
    (([[1.0, 2.0]],), PromptError, "token id"),
    (([1.5, 2],), PromptError, "token id"),
    (([[1, None]],), PromptError, "token id"),
    (([[1, "2"]],), PromptError, "token id"),
    (([[True, 2]],), PromptError, "token id"),
    (("Hello \udcff",), PromptError, "Unicode"),
    (({"prompt": "Hello"},), PromptError, "dict"),
    ((None,), PromptError, "No prompts"),
    ((42,), PromptError, "int"),
    (("Hello", {"temperature": 0.5}), SamplingParamsError, "dict"),
    (("Hello", "greedy"), SamplingParamsError, "str"),
    ((["Hello", "Hi"], [GREEDY]), SamplingParamsError, "1 SamplingParams for 2"),
    ((["Hello"], [{"max_new_tokens": 3}]), SamplingParamsError, "dict"),
    (("Hello", SamplingParams(stop_token_ids=(512,))), SamplingParamsError, "vocabulary"),
    (("Hello", GREEDY, "print"), InputError, "on_token"),
], ids=["bytes", "list-of-bytes", "float-ids", "float-id-flat", "none-id", "str-id", "bool-id", "lone-surrogate",
        "dict-prompt", "none", "int", "dict-sampling", "str-sampling", "too-few-sampling", "dict-in-list",
        "stop-id-512", "on-token-not-callable"])
def test_bad_call_is_refused_and_the_engine_still_works(llm, reference, args, error, words):
    with pytest.raises(error) as e:
        llm.generate(*args)
    assert words.lower() in one_sentence(e).lower()
    prompt, tokens = reference
    assert llm.generate([prompt], GREEDY)[0].token_ids == tokens, f"prompt={prompt}"
    assert not llm.has_unfinished


@pytest.mark.parametrize("bad", ["no-such-id", None, 1.0, True, -1, "next"],
                         ids=["str", "none", "float", "bool", "negative", "not-handed-out"])
def test_abort_of_an_unknown_id_is_refused_and_of_a_finished_one_does_nothing(llm, reference, bad):
    prompt, tokens = reference
    running = llm.add_request(prompt, GREEDY)
    bad = running + 1 if bad == "next" else bad
    with pytest.raises(UnknownRequestError) as e:
        llm.abort(bad)
    assert isinstance(e.value, ValueError) and "abort" in one_sentence(e)
    outs = {}
    while llm.has_unfinished:
        outs.update((o.request_id, o) for o in llm.step())
    assert list(outs) == [running], f"prompt={prompt}"
    assert outs[running].token_ids == tokens and outs[running].finish_reason == "length", f"prompt={prompt}"
    llm.abort(running)  # finished and returned: nothing happens
    assert not llm.has_unfinished and llm.step() == []


def test_token_ids_of_any_integer_type_are_accepted(llm, reference):
    """numpy and torch integers are token ids, read exactly, not truncated from floats."""
    import numpy as np
    import torch

    prompt, tokens = reference
    for ids in (np.array(prompt), torch.tensor(prompt), [np.int32(t) for t in prompt]):
        assert llm.generate(ids, GREEDY)[0].token_ids == tokens, f"prompt={prompt}"


def test_request_larger_than_the_kv_cache_is_refused_with_a_reason():
    llm = LLM("tiny", device="cpu", max_total_tokens=128, page_size=64)
    refused, ok = llm.generate(["Hello", "Hello"], [SamplingParams(max_new_tokens=n, prompt_logprobs=1, ignore_eos=True)
                                                    for n in (1000, 8)])
    assert refused.finish_reason == "refused" and not refused.token_ids and refused.prompt_logprobs is None
    assert "cache" in refused.error and "\n" not in refused.error and refused.error.endswith(".")
    assert len(ok.token_ids) == 8 and ok.finish_reason == "length"
    assert len(ok.prompt_logprobs) == len(ok.prompt_token_ids) and ok.prompt_logprobs[0] is None
    assert all(lp is not None for lp in ok.prompt_logprobs[1:])
