"""Mistral (a sliding window on every layer) against HF transformers' MistralForCausalLM, and the
memory the window frees."""

import math
import random

import torch

from flexsgl import LLM, SamplingParams
from tests.family_parity import PAGE, check_family

WINDOW = 40


def make_mistral(path, seed: int, window: int = WINDOW, head_dim: int = 16):
    import transformers

    cfg = transformers.MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-6,
                                     max_position_embeddings=2048, sliding_window=window, initializer_range=0.15,
                                     eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a missed norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def test_mistral_matches_hf(tmp_path, monkeypatch):
    check_family(tmp_path, monkeypatch, make_mistral, WINDOW)


def test_mistral_compiled_matches_hf(tmp_path, monkeypatch):
    """Compiled on the CPU: the window's block lists, not the dense mask, decide what is read."""
    check_family(tmp_path, monkeypatch, make_mistral, WINDOW, compile=True)


def test_a_long_windowed_generation_holds_only_the_window(tmp_path):
    """Pages wholly behind the window go back to the pool as decoding proceeds: a request never holds
    more than ceil(window / page_size) + 1 pages, and the pages come back to the allocator."""
    seed = random.randrange(1 << 30)
    make_mistral(tmp_path, seed)
    llm = LLM(str(tmp_path), device="cpu", page_size=PAGE)
    held = []
    prompt = [random.Random(seed).randrange(320) for _ in range(5)]
    llm.generate([prompt], SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True),
                 on_token=lambda r: held.append(sum(p != 0 for p in r.pages)))
    assert max(held) <= math.ceil(WINDOW / PAGE) + 1, f"seed={seed}: {max(held)} pages held"
    assert llm.scheduler.counters["window_pages_freed"] >= (405 - WINDOW) // PAGE - 1, f"seed={seed}"
    assert llm.allocator.num_free + llm.scheduler.cache.num_pages == llm.allocator.capacity, f"seed={seed}"


def test_a_chunked_prompt_runs_in_a_pool_of_exactly_what_a_request_may_hold(tmp_path):
    """A prompt many windows long, prefilled in chunks, in a KV pool the size of the engine's own bound
    on what a request holds at once (Scheduler.held_tokens: the window, a chunk and two pages): it
    finishes with HF's tokens. A chunk's pages were taken before the previous chunk's pages behind
    the window were given back, so it needed a window and two chunks, and preempted itself forever."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    window, page, chunk = 12, rng.choice([1, 2, 4]), rng.choice([4, 8, 16])
    hf = make_mistral(tmp_path, seed, window=window)
    prompt = [rng.randrange(320) for _ in range(rng.randrange(60, 120))]
    llm = LLM(str(tmp_path), device="cpu", page_size=page, max_num_batched_tokens=chunk,
              max_total_tokens=window + chunk + 2 * page)
    rid = llm.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    out = None
    for _ in range(4 * len(prompt)):  # a finite number of steps: a request that preempts itself never ends
        out = next((o for o in llm.step() if o.request_id == rid), out)
        if out is not None:
            break
    assert out is not None, f"seed={seed}: unfinished after {4 * len(prompt)} steps, {llm.stats()}"
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert out.token_ids == want, f"seed={seed} page={page} chunk={chunk}"
