"""The request features serving needs, against float64 and hand-computed references: penalties,
log-probabilities, min_tokens, stop strings on incrementally detokenized text, max_tokens, and the
model's generation_config.json defaults."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from flexsgl import LLM, SamplingParams
from flexsgl.errors import CheckpointError, SamplingParamsError
from flexsgl.detokenizer import MAX_PENDING
from flexsgl.model.presets import EMBEDDED
from flexsgl.output import OutputProcessor
from flexsgl.request import Request, TokenEvent
from flexsgl.sampling.sampler import MinTokens, Penalties, apply_penalties, block_stop_tokens, token_logprobs
from flexsgl.tokenizer import ByteTokenizer
from tests.hf_models import make_checkpoint


def penalized_reference(logits, counts, in_prompt, presence, frequency, repetition):
    """The penalties written out per row and token in float64 (vLLM's order: repetition, then
    frequency and presence)."""
    out = logits.astype(np.float64).copy()
    for s in range(out.shape[0]):
        for v in range(out.shape[1]):
            if counts[s, v] > 0 or in_prompt[s, v]:
                out[s, v] = out[s, v] / repetition[s] if out[s, v] > 0 else out[s, v] * repetition[s]
            out[s, v] -= frequency[s] * counts[s, v] + presence[s] * (counts[s, v] > 0)
    return out


def test_penalties_match_a_float64_reference():
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    S, V = 6, 50
    logits = torch.randn(S, V, generator=g) * 3
    counts = torch.randint(0, 4, (S, V), generator=g, dtype=torch.int32) * (torch.rand(S, V, generator=g) < 0.3)
    in_prompt = torch.rand(S, V, generator=g) < 0.2
    presence, frequency = torch.rand(S, generator=g) * 4 - 2, torch.rand(S, generator=g) * 4 - 2
    repetition = torch.rand(S, generator=g) * 1.5 + 0.5
    got = apply_penalties(logits, Penalties(presence, frequency, repetition, counts.int(), in_prompt))
    ref = penalized_reference(logits.numpy(), counts.numpy(), in_prompt.numpy(), presence.double().numpy(),
                              frequency.double().numpy(), repetition.double().numpy())
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")


def test_logprobs_match_a_float64_log_softmax():
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(5, 300, generator=g) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 300, (5,), generator=g)
    packed = token_logprobs(logits, tokens, 4)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert packed[:, 0].long().tolist() == tokens.tolist()
    np.testing.assert_allclose(packed[:, 1].numpy(), ref.gather(1, tokens[:, None])[:, 0].numpy(), atol=1e-5)
    top = ref.topk(4, dim=-1)
    np.testing.assert_allclose(packed[:, 2:6].numpy(), top.values.numpy(), atol=1e-5, err_msg=f"seed={seed}")
    assert packed[:, 6:10].long().tolist() == top.indices.tolist(), f"seed={seed}"
    own = ref.gather(1, tokens[:, None])
    assert packed[:, 10].long().tolist() == (ref >= own).sum(-1).tolist(), f"seed={seed}: ranks (ties in bf16)"


def test_min_tokens_blocks_each_rows_stop_tokens_until_its_output_is_long_enough():
    logits = torch.randn(3, 10)
    m = MinTokens(min_tokens=torch.tensor([2, 2, 0]), stop_ids=torch.tensor([[3, 7], [5, 5], [3, 3]]),
                  has_stops=torch.tensor([True, True, True]))
    got = block_stop_tokens(logits, m, step=torch.tensor([1, 2, 0]))
    expected = logits.clone()
    expected[0, 3] = expected[0, 7] = float("-inf")  # row 0: step 1 < 2; rows 1 and 2 are past their minimum
    assert torch.equal(got, expected)


@pytest.fixture(scope="module")
def tiny_docs():
    return LLM(max_total_tokens=4096, max_running_requests=8, page_size=16)


@pytest.fixture(scope="module")
def hf():
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(EMBEDDED["tiny-docs"]), dtype=torch.float64).eval()


def hf_greedy(hf, prompt, steps, penalties=(0.0, 0.0, 1.0), min_tokens=0, eos=0):
    """Greedy decoding in float64 with the penalties and min_tokens applied by penalized_reference."""
    presence, frequency, repetition = penalties
    ids, out = list(prompt), []
    in_prompt = np.zeros((1, hf.config.vocab_size), dtype=bool)
    in_prompt[0, prompt] = True
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1:].numpy()
            counts = np.bincount(out, minlength=logits.shape[1])[None, :]
            logits = penalized_reference(logits, counts, in_prompt, [presence], [frequency], [repetition])
            if len(out) < min_tokens:
                logits[0, eos] = -np.inf
            out.append(int(logits[0].argmax()))
            ids.append(out[-1])
            if out[-1] == eos:
                break
    return out


def test_engine_penalties_follow_a_float64_greedy_reference(tiny_docs, hf):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 4096) for _ in range(rng.randrange(5, 40))]
    pen = (rng.uniform(0.5, 2.0), rng.uniform(0.2, 1.0), rng.uniform(1.1, 1.6))
    out = tiny_docs.generate([prompt], SamplingParams(max_tokens=16, temperature=0, presence_penalty=pen[0],
                                                      frequency_penalty=pen[1], repetition_penalty=pen[2]))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 16, pen), f"seed={seed}"


def test_allowed_token_ids_follow_a_float64_greedy_reference_and_bound_samples(tiny_docs, hf):
    """Greedy: each token the float64 argmax over the allowed ids alone; sampled: every token among
    them (the EOS not among them cannot end the output)."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 4096) for _ in range(rng.randrange(5, 30))]
    allowed = sorted(rng.sample(range(1, 4096), 6))
    ids, want = list(prompt), []
    with torch.no_grad():
        for _ in range(8):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            want.append(allowed[int(logits[allowed].argmax())])
            ids.append(want[-1])
    greedy, sampled = tiny_docs.generate([prompt, prompt], [
        SamplingParams(max_new_tokens=8, temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(max_new_tokens=40, temperature=1.5, seed=seed, allowed_token_ids=allowed)])
    assert greedy.token_ids == want, f"seed={seed}"
    assert len(sampled.token_ids) == 40 and set(sampled.token_ids) <= set(allowed), f"seed={seed}"
    with pytest.raises(SamplingParamsError, match="outside the vocabulary"):
        tiny_docs.generate([prompt], SamplingParams(allowed_token_ids=[5, 4096]))
    with pytest.raises(SamplingParamsError, match="all stop tokens"):  # EOS is 0
        tiny_docs.generate([prompt], SamplingParams(allowed_token_ids=[0, 11], stop_token_ids=[11], min_tokens=2))
    for bad in ([], [-1], "ab", [1.5]):
        with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_docs):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 4096) for _ in range(rng.randrange(20, 60))]
    keep = rng.randrange(1, 20)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    cut, whole = tiny_docs.generate([prompt, prompt[-keep:]], [greedy.replace(truncate_prompt_tokens=keep), greedy])
    assert cut.prompt_token_ids == prompt[-keep:] and cut.token_ids == whole.token_ids, f"seed={seed}"
    long = [rng.randrange(1, 4096) for _ in range(tiny_docs.config.max_position + 5)]
    out = tiny_docs.generate([long], greedy.replace(truncate_prompt_tokens=-1, max_new_tokens=1))[0]
    assert out.prompt_token_ids == long[-(tiny_docs.config.max_position - 1):] and out.finish_reason == "length"
    for bad in (0, -2, 1.5):
        with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_sample_i_of_the_largest_seed_wraps_and_fails_no_request(tiny_docs, hf):
    """Sample i of n draws with seed + i modulo 2**63: with seed 2**63 - 1, sample 1 draws as seed 0 does,
    and the greedy request beside it is untouched (an int64 overflow used to fail the whole step)."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 4096) for _ in range(rng.randrange(5, 20))]
    wide = SamplingParams(max_tokens=8, temperature=1.0, seed=2**63 - 1, n=2)
    greedy, first, second = tiny_docs.generate([prompt, prompt], [SamplingParams(max_tokens=8, temperature=0), wide])
    zero = tiny_docs.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=0))[0]
    assert all(o.error is None for o in (greedy, first, second)), f"seed={seed}"
    assert second.token_ids == zero.token_ids, f"seed={seed}"
    assert greedy.token_ids == hf_greedy(hf, prompt, 8), f"seed={seed}"


def test_requests_without_a_seed_sample_as_the_engines_random_seed_says():
    """As vLLM's LLM(seed=...): two engines of one random_seed draw the same samples for the same
    unseeded requests, in order; another random_seed draws others."""
    seed = random.randrange(2**31)
    prompts = ["Return the", "The function", "import os"]
    sp = SamplingParams(max_tokens=24, temperature=1.0, n=2, ignore_eos=True)
    runs = [[o.token_ids for o in LLM(random_seed=s).generate(prompts, sp)] for s in (seed, seed, seed + 1)]
    assert runs[0] == runs[1], f"seed={seed}"
    assert runs[0] != runs[2], f"seed={seed}"
    assert len({tuple(t) for t in runs[0]}) == len(runs[0]), f"seed={seed}: two requests drew alike"


def test_min_tokens_keeps_eos_out_until_then(tiny_docs, hf):
    plain = tiny_docs.generate(["Return the"], SamplingParams(max_tokens=40, temperature=0))[0]
    assert plain.finish_reason == "stop", "the embedded model ends this prompt with EOS"
    n = len(plain.token_ids) + 3
    out = tiny_docs.generate(["Return the"], SamplingParams(max_tokens=40, temperature=0, min_tokens=n))[0]
    assert len(out.token_ids) >= n and 0 not in out.token_ids[:n]
    assert out.token_ids == hf_greedy(hf, plain.prompt_token_ids, 40, min_tokens=n)


def stream_text(tokenizer, prompt_ids, tokens, **sampling):
    """Feed `tokens` one at a time as the engine does (the scheduler records each in the request,
    the output path takes its event); the released deltas, the request."""
    req = Request(0, prompt_ids, SamplingParams(max_tokens=len(tokens) + 1, **sampling), (), 10_000)
    outputs = OutputProcessor(tokenizer)
    outputs.start(req, None)
    deltas = []
    for t in tokens:
        req.output_ids.append(t)
        outputs.process([TokenEvent(req, t)], {})
        deltas.append(req.new_text)
        if req.finish_reason is not None:
            break
    req.text_state.finish()
    deltas.append(req.new_text if req.finish_reason is None else "")
    return deltas, req


def test_incremental_text_never_breaks_a_character_and_matches_a_whole_decode():
    text = "naïve café → 日本語 😀 done"
    tok = ByteTokenizer()
    deltas, req = stream_text(tok, [65], list(text.encode("utf-8")))
    assert "".join(deltas) == req.text_state.text == text
    assert all("\ufffd" not in d for d in deltas), deltas


def test_tokens_without_text_do_not_widen_the_decoded_window():
    """A byte tokenizer's ids past 255 decode to nothing (a dummy model samples mostly those): the
    window each step decodes stays a few tokens wide, and the text is the whole decode's."""
    from flexsgl.detokenizer import IncrementalDetokenizer

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    text = "naïve → 日本語 😀 "
    ids = [t for ch in text * 20 for t in list(ch.encode("utf-8")) + [rng.randrange(256, 5000)] * rng.randrange(0, 50)]
    tok, widest = ByteTokenizer(), 0
    d = IncrementalDetokenizer(tok, [65])
    out = ""
    for t in ids:
        out += d.step(t)
        widest = max(widest, len(d.ids) - d.prefix)
    out += d.flush()
    assert out == tok.decode(ids) == text * 20, f"seed={seed}"
    # the last text's tokens (up to MAX_PENDING without text and a character's 4 bytes) and those since
    assert widest <= (MAX_PENDING + 4) + (MAX_PENDING + 1), f"seed={seed}: a window of {widest} tokens"


class DroppingByteTokenizer(ByteTokenizer):
    """Bytes, an incomplete character decoded as nothing (ByT5's slow tokenizer does so) rather than U+FFFD."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="ignore")


def test_a_character_whose_bytes_show_as_nothing_until_whole_is_kept():
    """Each byte of a character held in the window until the character is whole (this lost every
    character of 3 or more bytes from a ByT5 model's text), runs of ids without text between them."""
    from flexsgl.detokenizer import IncrementalDetokenizer

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    text = "中文 🙂 naïve → ok "
    ids = [t for ch in text * 5 for t in list(ch.encode("utf-8")) + [rng.randrange(256, 5000)] * rng.randrange(0, 12)]
    d = IncrementalDetokenizer(DroppingByteTokenizer(), [65])
    assert "".join([d.step(t) for t in ids] + [d.flush()]) == text * 5, f"seed={seed}"


def test_a_skipped_special_token_between_words_keeps_the_space():
    """A SentencePiece-style tokenizer (Metaspace, which strips the first word's space) with <s>
    between two words: the windowed decode gives what the whole decode in context gives (it gave
    'thethe': the window moved past <s> and lost the context)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flexsgl.detokenizer import IncrementalDetokenizer, make_detokenizer

    backend = Tokenizer(models.WordLevel({"<s>": 0, "<unk>": 1, "\u2581the": 2, "\u2581a": 3, "b": 4}, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    backend.add_special_tokens(["<s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(30):
        prompt = [rng.choice([2, 3]) for _ in range(rng.randrange(1, 4))]
        ids = [rng.choice([0, 0, 2, 3, 4]) for _ in range(rng.randrange(1, 12))]
        want = tok.decode(prompt + ids, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]
        for d in (IncrementalDetokenizer(tok, prompt), make_detokenizer(tok, prompt)):
            assert "".join([d.step(t) for t in ids] + [d.flush()]) == want, (seed, prompt, ids, type(d).__name__)


def test_incremental_text_of_the_embedded_tokenizer_matches_a_whole_decode(tiny_docs):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    ids = [rng.randrange(1, 4096) for _ in range(200)]
    deltas, req = stream_text(tiny_docs.tokenizer, [5, 6], ids)
    assert "".join(deltas) == req.text_state.text == tiny_docs.tokenizer.decode(ids, skip_special_tokens=True), f"seed={seed}"


def test_the_stream_detokenizer_gives_the_windowed_decodes_text(tiny_docs):
    """DecodeStream (the embedded model's fast tokenizer) against the windowed decode, delta by
    delta, on random token sequences heavy in tokens of partial UTF-8 characters."""
    from flexsgl.detokenizer import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer

    tok = tiny_docs.tokenizer
    vocab = len(tok)
    partial = [i for i in range(vocab) if "\ufffd" in tok.decode([i])]
    assert partial, "the vocabulary has byte tokens"
    assert isinstance(make_detokenizer(tok, [5, 6]), StreamDetokenizer)
    for _ in range(100):
        seed = random.randrange(2**31)
        rng = random.Random(seed)
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 8))]
        ids = [rng.choice(partial) if rng.random() < 0.4 else rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        got, ref = make_detokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
        assert [got.step(t) for t in ids] + [got.flush()] == [ref.step(t) for t in ids] + [ref.flush()], f"seed={seed}"


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
def test_special_tokens_text_is_left_out_or_kept_as_asked(tiny_docs, skip):
    """skip_special_tokens through both detokenizers, delta by delta, on random tokens heavy in the
    embedded tokenizer's special token (<|endoftext|>, id 0) and in partial characters: the text is
    the tokenizer's whole decode with the same setting."""
    from flexsgl.detokenizer import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer

    tok = tiny_docs.tokenizer
    special = [i for i in range(len(tok)) if tok.decode([i], skip_special_tokens=True) == ""
               and tok.decode([i], skip_special_tokens=False) != ""]
    assert special == [0], special
    whole = [i for i in range(1, len(tok)) if "\ufffd" not in tok.decode([i])]  # whole characters
    for _ in range(50):
        seed = random.randrange(2**31)
        rng = random.Random(seed)
        prompt = [rng.choice([0, rng.randrange(1, len(tok))]) for _ in range(rng.randrange(1, 8))]
        ids = [0 if rng.random() < 0.3 else rng.randrange(1, len(tok)) for _ in range(rng.randrange(1, 40))]
        if tok.decode(prompt, skip_special_tokens=skip).endswith("\ufffd"):
            # A byte the prompt leaves open: an output byte after it decodes with it, in the prompt's
            # text, where the output's decode alone shows it; so the output starts whole.
            ids[0] = rng.choice(whole)
        want = tok.decode(ids, skip_special_tokens=skip)
        for d in (make_detokenizer(tok, prompt, skip), IncrementalDetokenizer(tok, prompt, skip)):
            assert "".join([d.step(t) for t in ids] + [d.flush()]) == want, f"seed={seed} {type(d).__name__}"
        assert isinstance(make_detokenizer(tok, prompt, skip), StreamDetokenizer) or \
            tok.decode(prompt[-5:], skip_special_tokens=skip).endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
def test_the_engine_keeps_special_tokens_text_only_when_asked(tiny_docs, skip):
    """An output of EOS tokens (ignored as a stop, forced by logit_bias) between ordinary ones."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 4096) for _ in range(8)]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={0: 100.0},
                        skip_special_tokens=skip)
    out = tiny_docs.generate([prompt], sp)[0]
    assert out.token_ids == [0] * 6, f"seed={seed}: {out.token_ids}"
    assert out.text == ("" if skip else "<|endoftext|>" * 6), f"seed={seed}: {out.text!r}"


def test_detokenize_false_gives_token_ids_alone(tiny_docs):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 4096) for _ in range(8)]
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    with_text, ids_only = tiny_docs.generate([prompt, prompt], [greedy, greedy.replace(detokenize=False)])
    assert ids_only.text is None and with_text.text == tiny_docs.tokenizer.decode(with_text.token_ids,
                                                                                  skip_special_tokens=True)
    assert ids_only.token_ids == with_text.token_ids, f"seed={seed}"
    with pytest.raises(SamplingParamsError, match="detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_ends_the_text_and_is_never_streamed(include):
    text = "alpha beta STOP gamma"
    stop = "a STO"  # spans the tokens "alph|a", " ", "STO" (one byte each)
    deltas, req = stream_text(ByteTokenizer(), [65], list(text.encode()), stop=["zzz", stop],
                              include_stop_str_in_output=include)
    want = "alpha bet" + (stop if include else "")
    assert req.text_state.text == want and req.finish_reason.value == "stop" and req.stop_reason == stop
    assert "".join(deltas) == want
    assert not include or all("S" not in d for d in deltas[:-2]), "held back until the stop string was settled"
    assert len(req.output_ids) == len("alpha beta STO"), "the token that completed it is the last"


def test_min_tokens_defers_stop_strings():
    deltas, req = stream_text(ByteTokenizer(), [65], list(b"ab ab ab"), stop=["ab"], min_tokens=4)
    assert req.text_state.text == "ab " and "".join(deltas) == "ab "  # the first "ab" came before token 4


def run_output_path(tokens: bytes, eos=(), on_token=None, **sampling):
    """Byte tokens (id = byte) through the output path until it ends the request: (its output, the
    Ending, a callback's interrupt)."""
    req = Request(0, [65], SamplingParams(**sampling), eos, 10_000)
    outputs = OutputProcessor(ByteTokenizer())
    outputs.start(req, on_token)
    ending = interrupt = None
    for t in tokens:
        req.output_ids.append(t)
        endings, interrupt = outputs.process([TokenEvent(req, t)], {})
        if endings or interrupt:
            ending = endings[0] if endings else None
            break
    return outputs.request_output(req), ending, interrupt


@pytest.mark.parametrize("tokens, eos, sampling, want", [
    (b"abXcd", (), dict(stop_token_ids=[ord("X")]), (b"abX", "ab", "stop", ord("X"))),
    (b"abXcd", (), dict(stop_token_ids=[ord("X")], include_stop_str_in_output=True), (b"abX", "abX", "stop", ord("X"))),
    (b"ab!cd", (ord("!"),), {}, (b"ab!", "ab", "stop", None)),
    (b"ab!cd", (ord("!"),), dict(ignore_eos=True, max_tokens=4), (b"ab!c", "ab!c", "length", None)),
    (b"abcd", (), dict(max_tokens=3, stop="bc"), (b"abc", "a", "stop", "bc")),
    (b"abcd", (), dict(max_tokens=3, stop="bc", include_stop_str_in_output=True), (b"abc", "abc", "stop", "bc")),
    (b"aabab", (), dict(min_tokens=3, stop="a"), (b"aaba", "aab", "stop", "a")),
    (b"abcd", (), dict(stop_token_ids=[ord("c")], stop="bc"), (b"abc", "ab", "stop", ord("c"))),
], ids=["stop-token-id", "stop-token-id-kept", "eos", "ignore-eos", "stop-string-on-the-last-token", "include-stop-string",
        "min-tokens-then-stop-string", "stop-token-before-stop-string"])
def test_output_path_stop_decisions(tokens, eos, sampling, want):
    """Each stop rule of flexsgl/output.py on a hand-worked byte sequence."""
    out, ending, _ = run_output_path(tokens, eos, **{"max_tokens": 10, **sampling})
    assert (bytes(out.token_ids), out.text, out.finish_reason, out.stop_reason) == want
    assert ending.reason.value == out.finish_reason and ending.error is None


def test_a_callback_may_abort_its_own_request_and_others(tiny_docs):
    """on_token aborting its own request, a later one of the same step and one that ended earlier
    in it (a stop criterion of the user's): the first two end "abort" with 3 tokens and the text of
    exactly those, the ended one keeps its reason, another request runs on as it would alone; each
    raised KeyError out of step() or left the later one unfinished."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 4096) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    alone = tiny_docs.generate([prompts[1]], greedy)[0]
    ids = []

    def stop_others(req):
        if req.request_id == ids[1] and len(req.output_ids) == 3:
            for i in (1, 3, 0):  # itself, a later one, and one that ended earlier in this step (a no-op)
                tiny_docs.abort(ids[i])

    ids.append(tiny_docs.add_request(prompts[3], greedy.replace(max_new_tokens=3), on_token=stop_others))
    ids += [tiny_docs.add_request(p, greedy, on_token=stop_others) for p in prompts[:3]]
    outs = {}
    while len(outs) < 4:
        outs.update((o.request_id, o) for o in tiny_docs.step())
    d, a, b, c = (outs[i] for i in ids)
    assert (a.finish_reason, c.finish_reason, b.finish_reason) == ("abort", "abort", "length"), f"seed={seed}"
    assert d.finish_reason == "length" and len(d.token_ids) == 3, f"seed={seed}"
    assert len(a.token_ids) == len(c.token_ids) == 3 and b.token_ids == alone.token_ids, f"seed={seed}"
    for o in (a, c):
        assert o.text == tiny_docs.tokenizer.decode(o.token_ids, skip_special_tokens=True), f"seed={seed}"
    assert not tiny_docs.has_unfinished


def test_output_path_callback_faults():
    def fails_at_2(req):
        if len(req.output_ids) == 2:
            raise ValueError("no")
    out, ending, interrupt = run_output_path(b"abcd", on_token=fails_at_2)
    assert ending.reason.value == "error" and ending.error == "The on_token callback raised ValueError: no."
    assert bytes(out.token_ids) == b"ab" and interrupt is None

    def interrupts_at_3(req):
        if len(req.output_ids) == 3:
            raise KeyboardInterrupt
    out, ending, interrupt = run_output_path(b"abcd", on_token=interrupts_at_3)
    assert isinstance(interrupt, KeyboardInterrupt) and ending is None and out.finish_reason is None


def test_text_that_cannot_be_decoded_stops_the_text_not_the_request(monkeypatch):
    """After a failed decode the request runs on, streams no more text, and reports the error."""
    deltas = []
    tok = ByteTokenizer()
    req = Request(0, [65], SamplingParams(max_tokens=5), (), 10_000)
    outputs = OutputProcessor(tok)
    outputs.start(req, lambda r: deltas.append(r.new_text))
    real = tok.decode
    for t in b"abcde":
        if t == ord("c"):
            monkeypatch.setattr(tok, "decode", lambda ids, skip_special_tokens=True: 1 / 0)
        req.output_ids.append(t)
        endings, _ = outputs.process([TokenEvent(req, t)], {})
    monkeypatch.setattr(tok, "decode", real)
    out = outputs.request_output(req)
    assert [e.reason.value for e in endings] == ["length"] and out.token_ids == list(b"abcde")
    assert deltas == ["a", "b", "", "", ""]
    assert out.text is None and out.finish_reason == "error" and "ZeroDivisionError" in out.error


def test_max_tokens_is_max_new_tokens():
    assert SamplingParams(max_tokens=7).max_new_tokens == 7
    assert SamplingParams(max_tokens=7, max_new_tokens=7).max_new_tokens == 7
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=7, max_new_tokens=9)
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(SamplingParamsError, match="add_requests"):
        LLM.add_request(None, [1], SamplingParams(n=2))


def test_generation_config_sets_the_defaults(tmp_path):
    make_checkpoint("qwen3", tmp_path, seed=random.randrange(2**31))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5,
                                                                  "max_new_tokens": 3, "repetition_penalty": 1.3}))
    llm = LLM(str(tmp_path), max_total_tokens=256, max_running_requests=2)
    d = llm.default_sampling
    assert (d.temperature, d.top_k, d.max_new_tokens, d.repetition_penalty) == (0.0, 5, 3, 1.3)
    out = llm.generate([[1, 2, 3]])[0]
    assert len(out.token_ids) == 3
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 5}))
    with pytest.raises(CheckpointError, match="top_p"):
        LLM(str(tmp_path), max_total_tokens=256)


def test_generation_configs_end_tokens_end_outputs(tmp_path):
    """generation_config.json's eos_token_id list (a chat model's end of turn often stands only
    there, as HF's generate and vLLM read it): a token of it ends a greedy output where it first
    comes; it was ignored."""
    seed = random.randrange(2**31)
    make_checkpoint("qwen3", tmp_path, seed=seed)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    llm = LLM(str(tmp_path), max_total_tokens=256, max_running_requests=2)
    free = llm.generate([[1, 2, 3]], greedy.replace(ignore_eos=True))[0].token_ids
    end = free[len(free) // 2]
    config_eos = list(llm.config.eos_token_ids)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": config_eos + [end]}))
    out = LLM(str(tmp_path), max_total_tokens=256, max_running_requests=2).generate([[1, 2, 3]], greedy)[0]
    first = free.index(end)
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop", f"seed={seed}: {free}, {end}"
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(CheckpointError, match="eos_token_id"):
        LLM(str(tmp_path), max_total_tokens=256)


@pytest.mark.gpu
def test_penalties_logprobs_and_n_on_cuda_graphs_match_the_cpu(tmp_path):
    """The request features through CUDA graphs and torch.compile give the CPU's tokens and logprobs.
    Both load one checkpoint: dummy weights are drawn on the model's device, so they differ by device."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)  # the seed in a failure's message gives its prompts too
    make_checkpoint("qwen3", tmp_path, seed, head_dim=32)
    prompts = [[rng.randrange(320) for _ in range(rng.randrange(20, 90))] for _ in range(6)]
    sp = SamplingParams(max_tokens=12, temperature=0.7, seed=seed, n=2, presence_penalty=0.8, frequency_penalty=0.3,
                        repetition_penalty=1.2, min_tokens=4, logprobs=3, ignore_eos=True)
    allowed = sp.replace(allowed_token_ids=rng.sample(range(320), 7), n=1)  # beside unrestricted rows
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tmp_path), device=device, dtype="float32", page_size=16, max_total_tokens=8192,
                  max_running_requests=16)
        outs[device] = llm.generate(prompts, [sp] * 4 + [allowed] * 2)
        del llm
    for a, b in zip(outs["cpu"], outs["cuda"]):
        assert a.token_ids == b.token_ids, f"seed={seed}"
        assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-3)
        assert [[i for i, _ in t.top] for t in a.logprobs] == [[i for i, _ in t.top] for t in b.logprobs]
        for t in b.logprobs:  # the rank against the top ones: all those at least as likely are among them,
            at_least = sum(v >= t.logprob for _, v in t.top)  # unless it ties the last, or is past them
            assert t.rank == at_least if t.logprob > t.top[-1][1] else t.rank >= at_least, f"seed={seed}"
    assert all(set(o.token_ids) <= set(allowed.allowed_token_ids) for o in outs["cuda"][-2:]), f"seed={seed}"
