"""Non-finite numbers: a checkpoint tensor holding NaN or infinity is refused at load, naming it, and a
request whose logits are not finite ends with an error (not an empty text), greedy or sampled, and
leaves nothing behind that harms the requests after it."""

import random

import pytest
from safetensors.torch import load_file, save_file

from flexsgl import LLM, SamplingParams
from flexsgl.errors import CheckpointError
from tests.hf_models import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    seed = random.randrange(2**31)
    path = tmp_path_factory.mktemp("qwen3")
    make_checkpoint("qwen3", path, seed)
    return path, seed


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_weight_holding_non_finite_values_is_refused_naming_it(checkpoint, tmp_path, bad):
    src, seed = checkpoint
    rng = random.Random(seed)
    tensors = load_file(src / "model.safetensors")
    name = rng.choice(sorted(tensors))
    flat = tensors[name].view(-1)
    flat[rng.randrange(flat.numel())] = bad
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        LLM(str(tmp_path), device="cpu")
    msg = str(e.value)
    assert repr(name) in msg and "NaN or infinite" in msg and "\n" not in msg, (msg, f"seed={seed}")


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_request_whose_logits_are_not_finite_ends_with_an_error(checkpoint, temperature):
    """Token `poison`'s embedding row is NaN: a prompt holding it has NaN logits. The engine serves on:
    its pages were zeroed (masked slots still enter attention as 0 * v), so a clean prompt after it, whose
    last page is one of them, decodes as before."""
    path, seed = checkpoint
    rng = random.Random(seed + 1)
    clean = [rng.randrange(320) for _ in range(70)]
    params = SamplingParams(max_new_tokens=6, temperature=temperature, seed=seed, ignore_eos=True)
    llm = LLM(str(path), device="cpu", page_size=16)
    expected = llm.generate([clean], params)[0]
    # a token neither the clean prompt nor its output holds, so the clean request never reads its row
    poison = rng.choice(sorted(set(range(1, 320)) - set(clean) - set(expected.token_ids)))
    bad = clean[:66] + [poison] + clean[66:]
    llm.runner.model.model.embed_tokens.weight[poison] = float("nan")
    got = llm.generate([bad], params)[0]
    assert got.finish_reason == "error", (got, f"seed={seed}")
    assert "not finite" in got.error and got.token_ids == [], (got, f"seed={seed}")
    again = llm.generate([clean], params)[0]
    assert (again.finish_reason, again.token_ids) == ("length", expected.token_ids), f"seed={seed}"


def test_logprobs_requests_end_with_an_error_too(checkpoint):
    path, seed = checkpoint
    llm = LLM(str(path), device="cpu")
    rng = random.Random(seed)
    llm.runner.model.lm_head.weight[rng.randrange(320), 0] = float("nan")
    prompt = [rng.randrange(320) for _ in range(rng.randrange(1, 12))]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=2))[0]
    assert out.finish_reason == "error" and "not finite" in out.error, (out, f"seed={seed}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_request_with_nan_in_attention_ends_alone_in_a_shared_step(checkpoint, device):
    """A prompt holding a NaN embedding row prefilled in one step with two clean ones (uncompiled,
    the CPU's attention reads every request's keys at once), and a variant whose score_mod makes a
    NaN score for the requests that ask: the poisoned request ends with an error, the others give
    the tokens they give alone."""
    import torch

    from flexsgl import AttentionVariant, PerRequest

    path, seed = checkpoint
    rng = random.Random(seed + 2)
    clean = [[rng.randrange(1, 320) for _ in range(rng.randrange(20, 60))] for _ in range(2)]
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), device=device, page_size=16)
    alone = [llm.generate([p], params)[0].token_ids for p in clean]
    poison = rng.choice(sorted(set(range(1, 320)) - {t for p in clean for t in p} - {t for a in alone for t in a}))
    llm.runner.model.model.embed_tokens.weight[poison] = float("nan")
    bad = [rng.randrange(1, 320) for _ in range(rng.randrange(2, 30))] + [poison]
    outs = llm.generate([clean[0], bad, clean[1]], params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"], f"seed={seed}"
    assert [outs[0].token_ids, outs[2].token_ids] == alone, f"seed={seed}"

    def nan_past(score, b, h, q_pos, kv_pos, p):
        return torch.where(kv_pos > p.cut[b], float("nan"), score)

    variant = AttentionVariant("nan_past", score_mod=nan_past, params={"cut": PerRequest(1 << 20)})
    llm = LLM(str(path), device=device, page_size=16, attention=variant)
    alone = [llm.generate([p], params)[0].token_ids for p in clean]
    outs = llm.generate(clean + clean[:1], [params, params, params.replace(attention_params={"cut": 3})])
    assert [o.finish_reason for o in outs] == ["length", "length", "error"], f"seed={seed}"
    assert [outs[0].token_ids, outs[1].token_ids] == alone, f"seed={seed}"
