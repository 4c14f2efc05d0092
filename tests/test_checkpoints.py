"""A model directory that cannot be served is refused with one sentence that names the file (and
the key or tensor), before any weight is loaded: corrupt configs, corrupt or mismatched weights."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsgl import LLM, SamplingParams
from flexsgl.errors import CheckpointError
from tests.hf_models import assert_matches_hf, make_checkpoint

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A small saved Qwen3 checkpoint, its config dict, its tensors, the seed that made it and HF's
    model of it."""
    path = tmp_path_factory.mktemp("qwen3-source")
    seed = random.randrange(1 << 30)
    hf = make_checkpoint("qwen3", path, seed)
    return path, json.loads((path / "config.json").read_text()), load_file(path / WEIGHTS), seed, hf


def write(tmp_path, config, tensors=None, weights_bytes=None):
    """A model directory with `config` (a dict, or the text of config.json) and weights."""
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "config.json").write_text(text)
    if weights_bytes is not None:
        (tmp_path / WEIGHTS).write_bytes(weights_bytes)
    elif tensors is not None:
        save_file(tensors, tmp_path / WEIGHTS)
    return str(tmp_path)


def refused(path) -> str:
    """The one-sentence message of the CheckpointError that loading `path` raises."""
    with pytest.raises(CheckpointError) as e:
        LLM(path, device="cpu")
    msg = str(e.value)
    assert msg and "\n" not in msg and msg.endswith("."), f"not a one-sentence message: {msg!r}"
    return msg


def test_the_source_checkpoint_loads(source, tmp_path):
    """The unmodified copy loads and generates what HF's model of it does: each case below differs
    from it by one defect."""
    path, config, tensors, seed, hf = source
    rng = random.Random(seed)
    prompt = [rng.randrange(config["vocab_size"]) for _ in range(7)]
    out = LLM(write(tmp_path, config, tensors), device="cpu").generate([prompt], SamplingParams(
        max_new_tokens=4, temperature=0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4, f"seed={seed}"
    assert_matches_hf(hf, prompt, out.token_ids, what=f"seed={seed}")


@pytest.mark.parametrize("edit, words", [
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, ["config.json", "'hidden_size'", "lacks"]),
    (lambda c: {**c, "num_attention_heads": 0}, ["config.json", "'num_attention_heads'", "positive integer"]),
    (lambda c: {**c, "num_key_value_heads": 3}, ["config.json", "'num_key_value_heads'"]),
    (lambda c: {**c, "vocab_size": "320"}, ["config.json", "'vocab_size'", "'320'"]),
    (lambda c: {**c, "rms_norm_eps": -1.0}, ["config.json", "'rms_norm_eps'", "positive number"]),
    (lambda c: {**c, "tie_word_embeddings": "no"}, ["config.json", "'tie_word_embeddings'"]),
    (lambda c: {**c, "eos_token_id": [1, "two"]}, ["config.json", "'eos_token_id'"]),
    (lambda c: {**c, "head_dim": 15}, ["config.json", "'head_dim'", "even"]),
    (lambda c: {**c, "hidden_act": "gelu"}, ["config.json", "hidden_act", "'gelu'"]),
    (lambda c: {**c, "quantization_config": {"quant_method": "awq", "bits": 4}}, ["quantization_config", "'awq'"]),
    (lambda c: {**c, "architectures": ["PhiForCausalLM"]}, ["config.json", "'PhiForCausalLM'", "not supported"]),
    (lambda c: [c], ["config.json", "JSON object", "list"]),
], ids=["no-hidden-size", "zero-heads", "kv-heads-not-dividing", "string-vocab", "negative-eps",
        "string-tie", "string-eos", "odd-head-dim", "gelu", "awq-quantized", "unknown-architecture", "json-list"])
def test_bad_config_is_refused_naming_file_and_key(source, tmp_path, edit, words):
    _, config, tensors, _, _ = source
    msg = refused(write(tmp_path, edit(dict(config)), tensors))
    for w in words:
        assert w in msg, msg


def test_config_with_a_json_syntax_error_names_the_file_and_the_place(source, tmp_path):
    _, config, tensors, _, _ = source
    text = json.dumps(config, indent=1)
    lines = text.splitlines()
    lines[1] = lines[1].rstrip(",") + ",,"  # a doubled comma at the end of the second line
    msg = refused(write(tmp_path, "\n".join(lines), tensors))
    assert "config.json" in msg and "not valid JSON" in msg and "line 2" in msg, msg


def safetensors_bytes(tensors) -> bytes:
    from safetensors.torch import save

    return save(tensors)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "header-only"])
def test_corrupt_safetensors_file_is_reported_as_such(source, tmp_path, damage):
    _, config, tensors, seed, _ = source
    data = safetensors_bytes(tensors)
    rng = random.Random(seed)
    broken = {"truncated": data[: rng.randrange(len(data) // 2, len(data) - 1)],
              "garbage": rng.randbytes(rng.randrange(16, 4096)),
              "empty": b"",
              "header-only": data[:8 + int.from_bytes(data[:8], "little")]}[damage]
    msg = refused(write(tmp_path, config, weights_bytes=broken))
    assert WEIGHTS in msg and "truncated or corrupt" in msg, (msg, f"seed={seed}")


def test_unknown_weight_is_refused(source, tmp_path):
    _, config, tensors, _, _ = source
    extra = "model.layers.3.mlp.down_proj.weight"  # the checkpoint has three layers, 0 to 2
    msg = refused(write(tmp_path, config, {**tensors, extra: tensors["model.layers.0.mlp.down_proj.weight"].clone()}))
    assert extra in msg and "no place" in msg and WEIGHTS in msg, msg


def test_a_tied_config_takes_an_lm_head_equal_to_the_embeddings_and_refuses_another(source, tmp_path):
    """config.json ties the LM head, and the weights hold an lm_head.weight too: the tie written out
    (equal values) loads as HF's tied model; other values are refused, where transformers would untie
    and use them."""
    path, config, tensors, seed, _ = source
    tied = {**config, "tie_word_embeddings": True}
    embed = tensors["model.embed_tokens.weight"]
    llm = LLM(write(tmp_path, tied, {**tensors, "lm_head.weight": embed.clone()}), device="cpu")
    hf = make_checkpoint("qwen3", tmp_path / "hf", seed, tie=True)  # the same seed: the same embeddings
    assert torch.equal(hf.model.embed_tokens.weight, embed), f"seed={seed}"
    prompt = [random.Random(seed).randrange(1, 320) for _ in range(6)]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert_matches_hf(hf, prompt, out.token_ids, what=f"seed={seed}", steps=6)
    other = embed + 0.01 * torch.randn_like(embed)
    (tmp_path / "other").mkdir()
    msg = refused(write(tmp_path / "other", tied, {**tensors, "lm_head.weight": other}))
    assert "tie_word_embeddings" in msg and "lm_head.weight" in msg, msg


def test_missing_weight_is_refused(source, tmp_path):
    _, config, tensors, seed, _ = source
    dropped = random.Random(seed).choice(sorted(tensors))
    msg = refused(write(tmp_path, config, {k: v for k, v in tensors.items() if k != dropped}))
    assert "lacks 1 weights" in msg, (msg, f"seed={seed}")


def test_wrong_shape_is_refused(source, tmp_path):
    _, config, tensors, _, _ = source
    name = "model.layers.1.self_attn.k_proj.weight"
    msg = refused(write(tmp_path, config, {**tensors, name: tensors[name][:-1].clone()}))
    expected = tuple(tensors[name].shape)
    assert name in msg and str(expected) in msg and str((expected[0] - 1, expected[1])) in msg, msg


def test_integer_weight_is_refused_as_quantized(source, tmp_path):
    _, config, tensors, _, _ = source
    name = "model.layers.0.mlp.up_proj.weight"
    msg = refused(write(tmp_path, config, {**tensors, name: tensors[name].to(torch.int8)}))
    assert name in msg and "I8" in msg, msg


def test_weight_given_in_two_shards_is_refused(source, tmp_path):
    _, config, tensors, _, _ = source
    name = "model.norm.weight"
    rest = {k: v for k, v in tensors.items() if k != name}
    save_file(rest, tmp_path / "model-00001-of-00002.safetensors")
    save_file({name: tensors[name], "model.embed_tokens.weight": tensors["model.embed_tokens.weight"]},
              tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in rest},
                  name: "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    msg = refused(write(tmp_path, config))
    assert "'model.embed_tokens.weight'" in msg and "model-00001-of-00002" in msg and "model-00002-of-00002" in msg, msg


@pytest.mark.parametrize("index, words", [
    ("{", "not a safetensors index"),
    (json.dumps({"metadata": {}}), "not a safetensors index"),
    (json.dumps({"weight_map": {"a": "model-00009-of-00009.safetensors"}}), "model-00009-of-00009"),
], ids=["syntax-error", "no-weight-map", "missing-shard"])
def test_bad_index_file_is_refused(source, tmp_path, index, words):
    _, config, tensors, _, _ = source
    (tmp_path / "model.safetensors.index.json").write_text(index)
    msg = refused(write(tmp_path, config, tensors))
    assert "model.safetensors.index.json" in msg and words in msg, msg


def test_corrupt_tokenizer_is_refused(source, tmp_path):
    _, config, tensors, seed, _ = source
    (tmp_path / "tokenizer.json").write_bytes(random.Random(seed).randbytes(300))
    msg = refused(write(tmp_path, config, tensors))
    assert "tokenizer" in msg, (msg, f"seed={seed}")


def test_cli_refuses_a_corrupt_model_directory_with_one_line(source, tmp_path):
    _, config, tensors, _, _ = source
    path = write(tmp_path, {k: v for k, v in config.items() if k != "hidden_size"}, tensors)
    r = subprocess.run([sys.executable, "-m", "flexsgl.cli", "generate", "Hello", "--device", "cpu", "--model", path],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "hidden_size" in errors[0] and "config.json" in errors[0], r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def fuse_qkv(tensors, layer: int) -> dict:
    """`tensors` with layer `layer`'s q, k and v projections given as one fused qkv_proj tensor."""
    prefix = f"model.layers.{layer}.self_attn."
    parts = [tensors.pop(f"{prefix}{p}_proj.weight") for p in "qkv"]
    return {**tensors, f"{prefix}qkv_proj.weight": torch.cat(parts)}


@pytest.mark.parametrize("rank, size", [(0, 1), (0, 2), (1, 2)])
def test_a_fused_tensor_loads_as_its_parts_do(source, tmp_path, rank, size):
    """A checkpoint may give a fused parameter whole (qkv_proj) rather than in parts (q, k, v
    proj): each rank gets the same weights from either."""
    from flexsgl.model.loader import build_model
    from flexsgl.model.source import resolve

    _, config, tensors, seed, _ = source
    (tmp_path / "parts").mkdir()
    (tmp_path / "fused").mkdir()
    layer = random.Random(seed).randrange(3)
    parts = build_model(resolve(write(tmp_path / "parts", config, tensors)), torch.device("cpu"), torch.float32,
                        rank=rank, size=size)
    fused = build_model(resolve(write(tmp_path / "fused", config, fuse_qkv(dict(tensors), layer))),
                        torch.device("cpu"), torch.float32, rank=rank, size=size)
    a, b = parts.state_dict(), fused.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (name, f"seed={seed}")


def test_a_weight_given_whole_and_in_parts_is_refused(source, tmp_path):
    _, config, tensors, seed, _ = source
    name = "model.layers.1.self_attn.qkv_proj.weight"
    msg = refused(write(tmp_path, config, {**tensors, name: fuse_qkv(dict(tensors), 1)[name]}))
    assert name in msg and "same part" in msg and "model.layers.1.self_attn." in msg, (msg, f"seed={seed}")


def test_an_expert_beyond_the_models_is_refused(tmp_path):
    from tests.hf_models import make_deepseek_checkpoint

    seed = random.randrange(1 << 30)
    make_deepseek_checkpoint(tmp_path, seed)  # 8 routed experts
    tensors = load_file(tmp_path / WEIGHTS)
    extra = "model.layers.1.mlp.experts.8.gate_proj.weight"
    tensors[extra] = tensors["model.layers.1.mlp.experts.7.gate_proj.weight"].clone()
    msg = refused(write(tmp_path, json.loads((tmp_path / "config.json").read_text()), tensors))
    assert extra in msg and "no place" in msg, (msg, f"seed={seed}")


@pytest.mark.parametrize("cached", ["config only", "whole", "nothing"])
def test_a_hub_id_cached_in_part_fetches_the_rest(source, tmp_path, monkeypatch, cached):
    """A hub id whose cached snapshot holds only its config (AutoConfig fetched it alone) is fetched
    from the hub again, not refused for want of weights; a whole snapshot is served from the cache
    without asking the hub. (huggingface_hub's snapshot_download stands in for the hub.)"""
    import shutil

    import huggingface_hub

    from flexsgl.model.source import resolve

    path = source[0]
    part, whole = tmp_path / "part", tmp_path / "whole"
    part.mkdir()
    shutil.copy(path / "config.json", part)
    shutil.copytree(path, whole)
    asked = []

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False):
        asked.append(local_files_only)
        if local_files_only:
            if cached == "nothing":
                raise FileNotFoundError("not cached")
            return str(part if cached == "config only" else whole)
        return str(whole)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    src = resolve("someone/tiny-qwen3")
    assert src.path == whole and src.load_format == "safetensors", cached
    assert asked == ([True] if cached == "whole" else [True, False]), cached
