"""The engine end to end on tiny HF checkpoints: batching, stopping, loading, tokenizers."""

import json
import random

import pytest
import torch

from flexsgl import LLM, SamplingParams
from tests.hf_models import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    seed = random.randrange(1 << 30)
    return path, make_checkpoint("qwen3", path, seed), seed


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def test_continuous_batching_matches_each_request_alone(checkpoint):
    """Few running slots and a cache too small for all at once: requests wait for pages and slots,
    join as others finish, and each output equals the same request run by itself."""
    path, _, seed = checkpoint
    rng = random.Random(seed)
    n = 14
    prompts = [[rng.randrange(300) for _ in range(rng.randrange(1, 60))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randrange(1, 20), temperature=rng.choice([0.0, 0.9]),
                             top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(1 << 20)) for _ in range(n)]
    llm = LLM(str(path), device="cpu", page_size=16, max_total_tokens=16 * 12, max_running_requests=3,
              max_num_batched_tokens=64)
    llm.allocator.shuffle(seed)
    together = llm.generate(prompts, params)
    assert_no_page_leak(llm)
    for p, sp, out in zip(prompts, params, together):
        alone = llm.generate([p], sp)[0]
        assert out.token_ids == alone.token_ids, f"seed={seed}"
        assert len(out.token_ids) == sp.max_new_tokens and out.finish_reason == "length"
        assert out.prompt_token_ids == p and out.cached_tokens == 0


def test_a_request_added_before_generate_comes_back_from_step(checkpoint):
    """generate() runs every request the engine holds; one queued earlier with add_request finishes in
    it and its output comes back from the next step(), with the tokens it gets alone (it was dropped)."""
    path, _, seed = checkpoint
    rng = random.Random(seed)
    early, mine = ([rng.randrange(300) for _ in range(rng.randrange(1, 30))] for _ in range(2))
    llm = LLM(str(path), device="cpu", page_size=16)
    rid = llm.add_request(early, greedy(12))
    [out] = llm.generate([mine], greedy(3))
    assert out.request_id != rid and len(out.token_ids) == 3, f"seed={seed}"
    [got] = llm.step()
    assert got.request_id == rid, f"seed={seed}"
    assert got.token_ids == llm.generate([early], greedy(12))[0].token_ids, f"seed={seed}"
    assert llm.step() == [], f"seed={seed}"


def test_a_request_preempted_in_its_prefill_reports_no_cached_tokens_of_its_own(checkpoint):
    """cached_tokens counts the prompt tokens the prefix cache held at a request's first admission:
    prompts that share no page, preempted in the middle of their prefills, report 0 (a readmission
    found the request's own computed pages in the cache and counted them)."""
    path, _, seed = checkpoint
    rng = random.Random(seed)
    firsts = rng.sample(range(300), 24)  # a first token each: no two prompts share a page
    prompts = [[f] + [rng.randrange(300) for _ in range(rng.randrange(8, 60))] for f in firsts]
    llm = LLM(str(path), device="cpu", page_size=4, max_total_tokens=128, max_running_requests=8,
              max_num_batched_tokens=16)
    outs = llm.generate(prompts, [greedy(rng.randrange(1, 40)) for _ in prompts])
    assert llm.stats().get("preemptions", 0) > 0, f"seed={seed}: nothing was preempted"
    assert [o.cached_tokens for o in outs] == [0] * len(prompts), f"seed={seed}"
    assert llm.stats()["prefix_hit_tokens"] == 0, f"seed={seed}"


def assert_no_page_leak(llm):
    """At rest every page is free or in the prefix cache, unreferenced."""
    cache = llm.scheduler.cache
    cache.check()
    assert llm.allocator.num_free + cache.num_pages == llm.allocator.capacity, "pages leaked"
    assert cache.num_evictable == cache.num_pages, "a finished request still holds a cache lock"


def test_stop_token_ids_and_eos(checkpoint, tmp_path):
    path, hf, seed = checkpoint
    rng = random.Random(seed)  # the checkpoint's seed rebuilds the prompts too
    llm = LLM(str(path), device="cpu")
    for _ in range(20):  # a prompt whose continuation has a token not seen before it, after two
        prompt = [rng.randrange(300) for _ in range(7)]
        ref = llm.generate([prompt], greedy(12))[0].token_ids
        stop_at = next((i for i in range(2, 12) if ref[i] not in ref[:i]), None)
        if stop_at is not None:
            break
    assert stop_at is not None, "the model repeats itself on every prompt tried"
    out = llm.generate([prompt], SamplingParams(
        max_new_tokens=12, temperature=0.0, stop_token_ids=(ref[stop_at],)))[0]
    assert out.token_ids == ref[:stop_at + 1] and out.finish_reason == "stop"

    # The same token as the model's EOS (config.json), then with ignore_eos.
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": ref[stop_at]}))
    llm = LLM(str(tmp_path), device="cpu")
    out = llm.generate([prompt], greedy(12))[0]
    assert out.token_ids == ref[:stop_at + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_requests_that_cannot_fit_are_refused_while_the_rest_run(tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    hf = make_checkpoint("llama", tmp_path, seed)
    ctx = hf.config.max_position_embeddings
    llm = LLM(str(tmp_path), device="cpu", page_size=64, max_total_tokens=ctx // 2)
    short = [rng.randrange(300) for _ in range(5)]
    long = [rng.randrange(300) for _ in range(ctx * 3 // 4)]
    over_ctx, over_cache, fits = llm.generate([short, long, short], [greedy(ctx), greedy(3), greedy(3)])
    assert over_ctx.finish_reason == "refused" and "context" in over_ctx.error and not over_ctx.token_ids
    assert over_cache.finish_reason == "refused" and "whole cache" in over_cache.error
    assert fits.finish_reason == "length" and len(fits.token_ids) == 3


def test_sharded_checkpoint_loads_the_same_weights(checkpoint, tmp_path):
    path, hf, seed = checkpoint
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    rng = random.Random(seed)
    prompt = [rng.randrange(300) for _ in range(20)]
    a = LLM(str(path), device="cpu").generate([prompt], greedy(8))[0]
    b = LLM(str(tmp_path), device="cpu").generate([prompt], greedy(8))[0]
    assert a.token_ids == b.token_ids, f"seed={seed}"


def test_missing_weight_is_refused(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path, hf, _ = checkpoint
    hf.config.save_pretrained(tmp_path)
    weights = load_file(path / "model.safetensors")
    dropped = "model.layers.1.self_attn.k_proj.weight"
    del weights[dropped]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 weights"):
        LLM(str(tmp_path), device="cpu")


def test_text_prompts_use_the_model_directorys_tokenizer(checkpoint, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path, hf, seed = checkpoint
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun " * 20
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    hf.save_pretrained(tmp_path)
    hf_tok.save_pretrained(tmp_path)

    prompt = "the lazy cat jumps"
    out = LLM(str(tmp_path), device="cpu").generate([prompt], greedy(10))[0]
    ids = hf_tok.encode(prompt)
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        t = torch.tensor([ids])
        ref = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=10, do_sample=False,
                          eos_token_id=hf_tok.eos_token_id, pad_token_id=0)[0, len(ids):].tolist()
    assert out.token_ids == ref, f"seed={seed}"
    assert out.text == hf_tok.decode(ref, skip_special_tokens=True), f"seed={seed}"


def test_a_model_without_a_tokenizer_refuses_what_needs_one(checkpoint):
    """The checkpoint has no tokenizer: token-id prompts run; a text prompt and stop strings (looked
    for in text) are refused in one sentence rather than ignored; an option SamplingParams does not
    have is a SamplingParamsError too."""
    from flexsgl.errors import PromptError, SamplingParamsError

    path, _, seed = checkpoint
    llm = LLM(str(path), device="cpu")
    assert llm.tokenizer is None
    prompt = [random.Random(seed).randrange(1, 320) for _ in range(5)]
    assert len(llm.generate([prompt], greedy(4))[0].token_ids) == 4
    with pytest.raises(PromptError, match="has no tokenizer"):
        llm.generate(["the lazy cat"], greedy(4))
    with pytest.raises(SamplingParamsError, match="stop strings of prompt 0 are looked for in the text"):
        llm.generate([prompt], SamplingParams(max_new_tokens=4, stop=["x"]))
    with pytest.raises(SamplingParamsError, match="has no option 'stop_sequences'"):
        SamplingParams(stop_sequences=["x"])
