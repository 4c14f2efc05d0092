"""`quantization="fp8"` (`--quantization fp8`): an unquantized checkpoint's projections quantized to
FP8 as it loads (per output channel; on the CPU dequantized again, so the numbers are FP8 weights').
The embedded default model keeps its bits per byte within 2% on text like its training data, as the
engine itself computes them (each next token's logits, read from the sampler)."""

import inspect
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from flexsgl import LLM, SamplingParams
from flexsgl.quant.apply import projections
from tests.hf_models import capture_logits


def docstring_text(seed: int) -> str:
    """Docstrings of the standard library (what the embedded model was trained on), a few picked by seed."""
    import collections, json as json_module, pathlib, textwrap  # noqa: E401

    docs = [inspect.getdoc(f) for m in (collections, json_module, pathlib, textwrap) for f in vars(m).values()
            if callable(f) and (inspect.getdoc(f) or "").count(" ") > 30]
    return "\n\n".join(random.Random(seed).sample(docs, 3))[:900]


def bits_per_byte(llm: LLM, ids: list[int], monkeypatch) -> float:
    """-log2 p(ids[i] | ids[:i]) summed over i >= 1, over the UTF-8 bytes of ids[1:], from the engine's
    logits for each prefix (one request per prefix; their shared pages come from the prefix cache)."""
    with monkeypatch.context() as m:
        seen = capture_logits(llm, m)
        outs = llm.generate([ids[:i] for i in range(1, len(ids))], SamplingParams(max_new_tokens=1, temperature=0))
        logits = torch.stack([seen[o.request_id][0] for o in outs]).double().cpu()
    nats = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    return nats / math.log(2) / len(llm.tokenizer.decode(ids[1:]).encode())


def test_fp8_keeps_the_embedded_models_bits_per_byte_within_2_percent(monkeypatch):
    seed = random.randrange(2**31)
    plain = LLM(device="cpu", page_size=16)
    fp8 = LLM(device="cpu", page_size=16, quantization="fp8")
    ids = plain.tokenizer.encode(docstring_text(seed))[:200]
    for name, linear in projections(fp8.runner.model).items():  # every projection's weight moved to FP8 values
        before = projections(plain.runner.model)[name].weight
        assert not torch.equal(linear.weight, before), name
        assert (linear.weight - before).abs().max() <= before.abs().amax(1).max() / 448 * 16, name
    base, quantized = bits_per_byte(plain, ids, monkeypatch), bits_per_byte(fp8, ids, monkeypatch)
    # The model predicts this text (a byte is 8 bits); repetitive text (json's ASCII table) goes below 0.5
    assert 0 < base < 4, f"seed={seed}: {base}"
    assert abs(quantized - base) / base < 0.02, f"seed={seed}: {base:.4f} -> {quantized:.4f} bits per byte"


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="Unknown quantization 'int4'; choose one of fp8."):
        LLM(device="cpu", quantization="int4")


def test_cli_takes_quantization():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flexsgl.cli", "generate", "--device", "cpu", "--model", "tiny", "Hello"]
    procs = [subprocess.Popen(cmd + extra, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for extra in (["--quantization", "fp8", "--max-new-tokens", "3", "--json"],
                           ["--quantization", "int4"],
                           ["--quantization", "fp8", "--max-new-tokens", "3", "--json", "--tp", "2"])]
    (good, _), (bad, bad_err), (tp, tp_err) = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 0, good
    [out] = json.loads(good)
    api = LLM("tiny", device="cpu", quantization="fp8").generate(["Hello"], SamplingParams(max_new_tokens=3,
                                                                                            temperature=0))[0]
    assert out["token_ids"] == api.token_ids and len(api.token_ids) == 3, out
    assert procs[1].returncode == 2 and "error: Unknown quantization 'int4'" in bad_err, bad_err
    assert procs[2].returncode == 0 and "Traceback" not in tp_err, tp_err
    assert json.loads(tp)[0]["token_ids"] == api.token_ids, tp


def test_two_ranks_quantize_as_one_rank():
    """Under tensor parallelism each rank quantizes its slice of each projection. A row-parallel
    one's rows (o_proj, down_proj) run across the ranks' columns, so their scale comes from the
    ranks' maximum: rank 0's FP8 values there are exactly one rank's first columns (a
    column-parallel one's rows are whole on their rank). The tokens are one rank's."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (5, 40)]
    options = dict(device="cpu", compile=False, quantization="fp8", max_total_tokens=4096, random_seed=seed)
    one = LLM("tiny", **options)
    ref = one.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    with LLM("tiny", tensor_parallel_size=2, **options) as two:
        out = two.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
        whole = projections(one.runner.model)
        row_parallel = {n: m for n, m in projections(two.runner.model).items() if n.endswith(("o_proj", "down_proj"))}
        assert len(row_parallel) == 2 * len(two.runner.model.model.layers)
        for name, linear in row_parallel.items():
            cols = linear.weight.shape[1]
            assert torch.equal(linear.weight, whole[name].weight[:, :cols]), f"{name}, seed={seed}"
    assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"


def assert_fp8_rows(got: torch.Tensor, before: torch.Tensor, what: str) -> None:
    """`got` is `before` rounded to FP8 by rows: every value on the FP8 grid of its row's scale (the
    row's absmax / 448) and the point of that grid nearest to its unrounded value."""
    scale = before.double().abs().amax(-1, keepdim=True) / 448
    v, exact = got.double() / scale, before.double() / scale
    grid = v.float().to(torch.float8_e4m3fn).double()
    assert ((v - grid).abs() <= 2.0 ** -20 * grid.abs()).all(), f"{what}: values off the FP8 grid"
    step = 2.0 ** (exact.abs().clamp(min=2.0 ** -6).log2().floor() - 3)  # e4m3's spacing (subnormals 2^-9)
    assert ((v - exact).abs() <= step / 2 * (1 + 1e-6)).all(), f"{what}: not the nearest FP8 value"


def test_routed_experts_are_quantized_too(tmp_path):
    """A Qwen3-MoE checkpoint: every routed expert's gate/up and down rows become FP8 values (on the
    CPU dequantized again), each row on its own scale's grid; the shared parts stay as they were
    (the router)."""
    from tests.test_qwen3_moe import make_qwen3_moe

    seed = random.randrange(2**31)
    make_qwen3_moe(tmp_path, seed)
    plain = LLM(str(tmp_path), device="cpu", page_size=16)
    fp8 = LLM(str(tmp_path), device="cpu", page_size=16, quantization="fp8")
    before = dict(plain.runner.model.named_parameters())
    moved = 0
    for name, p in fp8.runner.model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert not torch.equal(p, before[name]), f"{name}, seed={seed}"
            assert_fp8_rows(p, before[name], f"{name}, seed={seed}")
            moved += 1
        elif name.endswith("mlp.gate.weight"):
            assert torch.equal(p, before[name]), f"{name}, seed={seed}"
    assert moved == 4, f"seed={seed}"  # layers 0 and 2 are MoE layers


def test_two_ranks_quantize_experts_as_one_rank(tmp_path):
    """At two ranks each holds its half of every expert's intermediate units: gate/up rows are whole
    on a rank, down's rows run across the ranks' columns, so down's scales come from the ranks'
    maximum, and rank 0's FP8 values are exactly one rank's first columns. Tokens are one rank's."""
    from tests.test_qwen3_moe import make_qwen3_moe

    seed = random.randrange(2**31)
    make_qwen3_moe(tmp_path, seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 320) for _ in range(n)] for n in (5, 40)]
    options = dict(device="cpu", compile=False, quantization="fp8", max_total_tokens=4096)
    one = LLM(str(tmp_path), **options)
    ref = one.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    whole = dict(one.runner.model.named_parameters())
    with LLM(str(tmp_path), tensor_parallel_size=2, **options) as two:
        out = two.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
        downs = {n: p for n, p in two.runner.model.named_parameters() if n.endswith("experts.down_proj")}
        assert len(downs) == 2, f"seed={seed}"
        for name, p in downs.items():
            assert torch.equal(p, whole[name][..., :p.shape[-1]]), f"{name}, seed={seed}"
    assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"
