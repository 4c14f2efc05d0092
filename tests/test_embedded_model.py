"""The embedded default model (tools/train_tiny.py's tiny Qwen3 on stdlib docstrings) loads in
transformers and in flexsgl alike, and both continue prompts with the same greedy tokens."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flexsgl import LLM, SamplingParams
from flexsgl.model.presets import DEFAULT_MODEL, EMBEDDED

PATH = EMBEDDED[DEFAULT_MODEL]
PROMPTS = ["Return the", "Create a new", "This module provides", "Raise ValueError if", "The default is",
           "Convert a string to", "If the file"]


@pytest.fixture(scope="module")
def hf():
    tok = AutoTokenizer.from_pretrained(PATH)
    model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32, attn_implementation="eager")
    return tok, model.eval()


def hf_greedy(hf, prompt, n):
    tok, model = hf
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


def test_ships_small_and_complete():
    files = {p.name: p.stat().st_size for p in PATH.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sum(files.values()) <= 8 * 2**20, files


def test_flexsgl_continues_like_transformers(hf):
    llm = LLM(device="cpu")  # no model given: the embedded one
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=24, temperature=0.0))
    for prompt, out in zip(PROMPTS, outs):
        ids, ref = hf_greedy(hf, prompt, 24)
        assert out.prompt_token_ids == ids
        assert out.token_ids == ref, prompt
        assert out.text == hf[0].decode(ref, skip_special_tokens=True)


def test_cli_default_model_prints_the_greedy_continuation(hf):
    run = subprocess.run([sys.executable, "-m", "flexsgl.cli", "generate", "Return the", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    _, ref = hf_greedy(hf, "Return the", 32)
    assert run.stdout == "Return the" + hf[0].decode(ref, skip_special_tokens=True) + "\n"
    assert any(c.isalpha() for c in run.stdout[len("Return the"):])  # words, not noise
