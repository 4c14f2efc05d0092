"""Structured outputs, logit_bias and prompt log-probabilities in the engine, against independent
references: xgrammar's own bitmask kernel and a numpy unpacking of the bits, HF transformers in
float64 decoding greedily under an xgrammar matcher of its own, jsonschema and re.fullmatch on
the outputs, and a float64 log-softmax of HF's logits over the prompt."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from flexsgl import LLM, SamplingParams  # noqa: E402
from flexsgl.errors import SamplingParamsError  # noqa: E402
from flexsgl.model.presets import EMBEDDED  # noqa: E402
from flexsgl.sampling import grammar  # noqa: E402
from flexsgl.sampling.sampler import LogitBias, SamplingTensors, TokenMask, apply_token_mask, sample  # noqa: E402
from flexsgl.sampling.structured import StructuredOutputsParams  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_total_tokens=8192, max_running_requests=16, page_size=16)


@pytest.fixture(scope="module")
def hf():
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(EMBEDDED["tiny-docs"]), dtype=torch.float64).eval()


def random_schema(rng: random.Random) -> dict:
    """An object schema of a few random fields (enums, bounded integers, short strings, booleans)."""
    props = {}
    for name in rng.sample(WORDS, rng.randrange(1, 4)):
        kind = rng.choice(["enum", "integer", "string", "boolean"])
        if kind == "enum":
            props[name] = {"type": "string", "enum": rng.sample(WORDS, 3)}
        elif kind == "integer":
            lo = rng.randrange(-50, 50)
            props[name] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randrange(1, 200)}
        elif kind == "string":
            props[name] = {"type": "string", "maxLength": rng.randrange(1, 8)}
        else:
            props[name] = {"type": "boolean"}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def token_mask(words: torch.Tensor, open_rows: list[bool], vocab: int) -> TokenMask:
    flat = torch.cat([words.flatten(), torch.tensor([-1 if o else 0 for o in open_rows], dtype=torch.int32)])
    return TokenMask(flat, len(open_rows), vocab)


def test_the_token_mask_matches_xgrammars_kernel_and_the_bits():
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 5, 1000 + seed % 37  # a vocabulary that is not a multiple of 32
    logits = torch.randn(rows, vocab, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64).int()
    got = apply_token_mask(logits, token_mask(words, [False] * rows, vocab))
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, words)
    assert torch.equal(got, ref), f"seed={seed}"
    for r in range(rows):  # the bits read by hand: bit j of word w allows token 32 w + j
        allowed = grammar.allowed_tokens(words[r].numpy(), vocab)
        assert np.array_equal(np.flatnonzero(torch.isfinite(got[r]).numpy()), allowed), f"seed={seed}"


def test_a_mask_over_a_smaller_vocabulary_closes_the_rest_in_constrained_rows_only():
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    rows, vocab, grammar_vocab = 4, 700, 256
    logits = torch.randn(rows, vocab, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (rows, 8), generator=g, dtype=torch.int64).int()
    open_rows = [True, False, True, False]
    got = apply_token_mask(logits, token_mask(words, open_rows, grammar_vocab))
    for r in range(rows):
        allowed = set(grammar.allowed_tokens(words[r].numpy(), grammar_vocab).tolist())
        allowed |= set(range(grammar_vocab, vocab)) if open_rows[r] else set()
        want = torch.tensor([logits[r, t].item() if t in allowed else float("-inf") for t in range(vocab)])
        assert torch.equal(got[r], want), f"seed={seed} row {r}"


def test_logit_bias_is_added_before_sampling():
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 64, generator=g)
    rows, ids = torch.tensor([0, 0, 2]), torch.randint(0, 64, (3,), generator=g)
    values = torch.tensor([100.0, -3.5, 100.0])
    st = SamplingTensors(None, None, None, None, None, None, all_greedy=True, any_filter=False,
                         logit_bias=LogitBias(rows, ids, values))
    ref = logits.double().numpy().copy()
    for r, i, v in zip(rows.tolist(), ids.tolist(), values.tolist()):
        ref[r, i] += v
    assert sample(logits, st).tolist() == ref.argmax(axis=1).tolist(), f"seed={seed}"


def hf_constrained_greedy(hf, tokenizer, prompt_ids, spec, steps, eos=0):
    """Greedy decoding in float64 where each step's logits are masked by an xgrammar matcher of the
    constraint, compiled here on its own."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=hf.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar.parse(spec))
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos])
    ids, out = list(prompt_ids), []
    mask = xgr.allocate_token_bitmask(1, hf.config.vocab_size)
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1:].clone()
            matcher.fill_next_token_bitmask(mask)
            allowed = torch.zeros(1, logits.shape[1], dtype=torch.float32)
            xgr.apply_token_bitmask_inplace(allowed, mask)  # float32 only: where the mask allows, 0 stays
            logits[torch.isinf(allowed)] = float("-inf")
            out.append(int(logits[0].argmax()))
            ids.append(out[-1])
            assert matcher.accept_token(out[-1])
            if matcher.is_terminated():
                break
    return out


def test_constrained_greedy_decoding_follows_a_float64_reference(llm, hf):
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    schema = random_schema(rng)
    spec = StructuredOutputsParams(json=schema)
    prompt = [rng.randrange(1, 4096) for _ in range(rng.randrange(3, 20))]
    out = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0, structured_outputs=spec))[0]
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(EMBEDDED["tiny-docs"]))  # the reference's own
    ref = hf_constrained_greedy(hf, tokenizer, prompt, spec, 60)
    assert out.token_ids == ref, f"seed={seed} schema={schema}"
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)


def test_every_kind_of_constraint_is_followed_beside_unconstrained_requests(llm):
    """Constrained and unconstrained requests share steps: each constrained output follows its
    constraint, and the unconstrained ones come out as they do alone."""
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    schema = random_schema(rng)
    choices = rng.sample(WORDS, 3)
    specs = [
        {"json": schema},
        {"regex": r"[a-d]{2,5}-\d{1,3}"},
        {"choice": choices},
        {"grammar": 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'},
        {"json_object": True},
    ]
    plain_prompts = [[rng.randrange(1, 4096) for _ in range(rng.randrange(3, 12))] for _ in range(3)]
    plain = SamplingParams(max_tokens=12, temperature=1.0, seed=rng.randrange(2**31))
    alone = llm.generate(plain_prompts, plain)
    prompts = plain_prompts + ["Return the value of"] * len(specs)
    params = [plain] * 3 + [SamplingParams(max_tokens=40, temperature=0.9, seed=rng.randrange(2**31), n=2,
                                           structured_outputs=s) for s in specs]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in alone], f"seed={seed}"
    done = [o for o in outs[3:] if o.finish_reason == "stop"]
    assert len(done) >= 6, f"seed={seed}: {[(o.text, o.finish_reason) for o in outs[3:]]}"
    for o in done:
        kind = specs[(outs.index(o) - 3) // 2]
        if "json" in kind:
            jsonschema.validate(json.loads(o.text), schema)
        elif "regex" in kind:
            assert re.fullmatch(kind["regex"], o.text), (o.text, seed)
        elif "choice" in kind:
            assert o.text in choices, (o.text, seed)
        elif "grammar" in kind:
            assert re.fullmatch(r"\([0-9x](,[0-9x])*\)", o.text), (o.text, seed)
        else:
            assert isinstance(json.loads(o.text), dict), (o.text, seed)
    for o in outs[3:]:  # an output cut by max_tokens is a prefix the constraint allows
        assert o.finish_reason in ("stop", "length"), (o.error, seed)


def test_the_step_after_a_constrained_one_is_launched_before_the_output_path(llm, monkeypatch):
    """Behind a constrained step's sampling the next step is launched at once, before the step
    before it reaches the output path. A request the output path then ends (here by a stop string)
    also holds a row of that step, whose token is dropped: the plain requests come out as they do
    alone, the constrained ones follow their constraint, and no page is left held."""
    from tests.test_engine import assert_no_page_leak

    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    prompts = [[rng.randrange(1, 4096) for _ in range(rng.randrange(3, 12))] for _ in range(4)]
    free = [SamplingParams(max_tokens=24, temperature=1.0, seed=rng.randrange(2**31)) for _ in prompts]
    texts = [o.text for o in llm.generate(prompts, free)]
    # A stop string from the middle of each free output, so the output path ends it there.
    stops = [t[len(t) // 3:len(t) // 3 + 2] or "x" for t in texts]
    plain = [SamplingParams(max_tokens=24, temperature=1.0, seed=sp.seed, stop=[s]) for sp, s in zip(free, stops)]
    alone = llm.generate(prompts, plain)
    ahead_at_output = []
    real = llm.outputs.process

    def process(events, allowed):
        ahead_at_output.append(llm.loop.ahead is not None)
        return real(events, allowed)

    monkeypatch.setattr(llm.outputs, "process", process)
    choices = rng.sample(WORDS, 3)
    constrained = SamplingParams(max_tokens=30, temperature=0.9, seed=rng.randrange(2**31), n=3,
                                 structured_outputs={"choice": choices})
    outs = llm.generate(prompts + ["Return the value of"], plain + [constrained])
    note = f"seed={seed}, stops={stops}"
    assert any(ahead_at_output), note
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs[:4]] == \
        [(o.token_ids, o.text, o.finish_reason) for o in alone], note
    assert any(o.finish_reason == "stop" for o in alone), note
    for o in outs[4:]:
        assert o.finish_reason == "stop" and o.text in choices, (o.text, note)
    assert not llm.has_unfinished, note
    assert_no_page_leak(llm)


@pytest.mark.gpu
def test_constrained_steps_on_cuda_graphs_match_the_cpu():
    """Constrained and plain requests (stop strings among them) on the GPU, compiled and replayed
    from CUDA graphs with each constrained step's successor launched ahead, give the CPU's tokens
    (float32 both)."""
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    schema = random_schema(rng)
    prompts = [[rng.randrange(1, 4096) for _ in range(rng.randrange(3, 40))] for _ in range(6)] + ["Return the"] * 3
    specs = [{"json": schema}, {"regex": r"[a-d]{2,5}-\d{1,3}"}, {"choice": rng.sample(WORDS, 3)}]
    params = ([SamplingParams(max_tokens=20, temperature=0.8, seed=rng.randrange(2**31), stop=["e", "a "])
               for _ in range(6)]
              + [SamplingParams(max_tokens=40, temperature=0.7, seed=rng.randrange(2**31), n=2, structured_outputs=s)
                 for s in specs])
    outs = {}
    for device in ("cpu", "cuda"):
        engine = LLM(device=device, dtype="float32", page_size=16, max_total_tokens=8192, max_running_requests=16)
        outs[device] = engine.generate(prompts, params)
        del engine
    assert [o.token_ids for o in outs["cuda"]] == [o.token_ids for o in outs["cpu"]], f"seed={seed}"
    assert [o.finish_reason for o in outs["cuda"]] == [o.finish_reason for o in outs["cpu"]], f"seed={seed}"


def test_a_grammar_whose_every_next_token_is_a_stop_token_ends_its_request_saying_so():
    """Stop tokens end a constrained output only once its grammar is complete; where every token
    the grammar could continue with is a stop token (here the first letters of every choice, on
    the byte tokenizer), no token is allowed, and the request ends with that reason."""
    byte_llm = LLM("tiny", device="cpu", page_size=16, max_total_tokens=1024)
    choices = ["ab", "cd"]
    sp = SamplingParams(max_tokens=4, temperature=1.0, seed=random.randrange(2**31), ignore_eos=True,
                        structured_outputs={"choice": choices})
    fine, stuck = byte_llm.generate(["x", "x"], [sp, dataclasses.replace(sp, stop_token_ids=[ord("a"), ord("c")])])
    assert fine.finish_reason == "stop" and fine.text in choices, fine
    assert stuck.finish_reason == "error" and "allows no token" in stuck.error, stuck
    assert stuck.error.endswith(".") and "\n" not in stuck.error


def test_without_a_stop_token_the_grammar_ends_the_output(llm):
    out = llm.generate("Return", SamplingParams(max_tokens=50, temperature=1.0, ignore_eos=True,
                                                structured_outputs={"choice": ["yes", "no"]}))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and 0 not in out.token_ids


def test_a_grammar_that_waits_for_the_end_of_reasoning_leaves_the_text_before_it_free(llm):
    """With reasoning_end the output is free up to the token that completes that text and follows
    its constraint after it: the free tokens are those of the same request unconstrained, and the
    rest validates against the schema; an output that never writes the text is the unconstrained
    one, ended by max_tokens."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(EMBEDDED["tiny-docs"]))
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    schema = random_schema(rng)
    free = SamplingParams(max_tokens=120, temperature=0.7, seed=seed, ignore_eos=True)
    alone, waited, never = llm.generate(["Return the"] * 3, [
        free, free.replace(structured_outputs={"json": schema}, reasoning_end="e"),
        free.replace(structured_outputs={"json": schema}, reasoning_end="</think>")])
    ends = [k for k in range(len(alone.token_ids)) if "e" in tokenizer.decode(alone.token_ids[:k + 1],
                                                                              skip_special_tokens=True)]
    assert ends, f"seed={seed}: the free output never wrote 'e': {alone.text!r}"
    k = ends[0] + 1
    assert waited.token_ids[:k] == alone.token_ids[:k], f"seed={seed}"
    assert waited.finish_reason == "stop", f"seed={seed} {waited.text!r}"
    jsonschema.validate(json.loads(tokenizer.decode(waited.token_ids[k:])), schema)
    assert (never.token_ids, never.finish_reason) == (alone.token_ids, alone.finish_reason), f"seed={seed}"


@pytest.mark.parametrize("spec, words", [
    ({"regex": "[a-"}, "regex"), ({"json": {"type": "nope"}}, "JSON schema"), ({"grammar": "root ::= x"}, "grammar"),
    ({"json": "{not json"}, "not JSON"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({}, "exactly one"),
    ({"choice": []}, "choice"), ({"json_object": "yes"}, "json_object"), ({"jsn": {}}, "no field"),
])
def test_a_constraint_that_cannot_be_used_is_refused_before_it_runs(llm, spec, words):
    with pytest.raises(SamplingParamsError) as e:
        llm.generate("Return", SamplingParams(max_tokens=4, structured_outputs=spec))
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.endswith("."), msg
    assert not llm.has_unfinished


def test_an_aborted_requests_queued_compile_is_dropped_and_a_later_one_runs(monkeypatch):
    """Both compile threads busy: the compile of a request discarded (aborted) while queued never
    runs, one that another request still waits for does, and a later request gets its grammar."""
    import threading
    from types import SimpleNamespace

    from flexsgl.tokenizer import ByteTokenizer

    queue = grammar.GrammarQueue(ByteTokenizer(), 256)
    release, compiled = threading.Event(), []
    real = grammar.GrammarCompiler._compile

    def compile_(self, spec):
        if spec.regex.startswith("busy"):
            release.wait()
        compiled.append(spec.regex)
        return real(self, spec)

    monkeypatch.setattr(grammar.GrammarCompiler, "_compile", compile_)

    def req(regex):
        return SimpleNamespace(sampling=SamplingParams(structured_outputs={"regex": regex}), stop_ids=())

    busy = [req("busy1"), req("busy2")]
    gone, shared, kept, later = req("gone"), req("shared"), req("shared"), req("later")
    for r in busy + [gone, shared, kept]:
        queue.add(r)
    queue.discard(gone)
    queue.discard(shared)
    queue.add(later)
    release.set()
    done = []
    for _ in range(100):  # each wait returns once a compile completes
        queue.wait(5.0)
        ready, failed = queue.ready()
        assert not failed, failed
        done += ready
        if len(done) == 4:
            break
    assert sorted(compiled) == ["busy1", "busy2", "later", "shared"]
    assert {id(r) for r in done} == {id(r) for r in busy + [kept, later]} and all(r.grammar for r in done)
    queue.shutdown()


def test_a_special_tokens_text_ends_the_reasoning_only_where_the_output_keeps_it():
    """reasoning_end watches the output's text: with skip_special_tokens (the default) the text of
    <|endoftext|> (id 0) is not in it, so its "e" does not end the reasoning, a later token's "e"
    does; with skip_special_tokens=False it is, and ends it. (It ended it either way: a constrained
    request's free part then differed from the same request unconstrained.)"""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(EMBEDDED["tiny-docs"]))
    rng = random.Random(seed := random.randrange(1 << 30))
    plain = [i for i in range(1, len(tok)) if "e" not in tok.decode([i]) and "\ufffd" not in tok.decode([i])]
    with_e = [i for i in range(1, len(tok)) if "e" in tok.decode([i])]
    queue = grammar.GrammarQueue(tok, len(tok))
    for skip in (True, False):
        req = SimpleNamespace(sampling=SamplingParams(structured_outputs={"regex": "[0-9]+"}, reasoning_end="e",
                                                      skip_special_tokens=skip), stop_ids=(0,))
        queue.add(req)
        while not (ready := queue.ready()[0]):
            queue.wait(5.0)
        matcher = ready[0].grammar
        grammar.accept_tokens([matcher], [rng.choice(plain)])
        grammar.accept_tokens([matcher], [0])
        assert matcher.constraining == (not skip), (skip, seed)
        grammar.accept_tokens([matcher], [rng.choice(with_e)])
        assert matcher.constraining, (skip, seed)
    queue.shutdown()


INT = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.mark.parametrize("schema, keyword, where", [
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems", ""),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 7}}}}, "contains", "properties.a"),
    ({"type": "array", "items": [INT], "minContains": 2}, "minContains", ""),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}}, "dependentRequired", ""),
    ({"$defs": {"x": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}}}, "dependentSchemas",
     "$defs.x"),
    ({"type": "object", "if": {"properties": {"k": {"const": "a"}}}, "then": {"required": ["v"]}}, "if", ""),
    ({"anyOf": [INT, {"type": "integer", "not": {"const": 0}}]}, "not", "anyOf[1]"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", ""),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength with pattern", ""),
    ({"type": "string", "format": "email", "minLength": 3}, "minLength with format", ""),
    ({"allOf": [INT, {"type": "integer", "maximum": 5}]}, "allOf", ""),
    ({"type": "object", "properties": {"not": INT, "contains": {"type": "array", "items": {"uniqueItems": True}}}},
     "uniqueItems", "properties.contains.items"),
])
def test_json_schema_keywords_xgrammar_cannot_enforce_are_refused_saying_where(llm, schema, keyword, where):
    with pytest.raises(SamplingParamsError) as e:
        llm.generate("Return", SamplingParams(max_tokens=4, structured_outputs={"json": schema}))
    msg = str(e.value)
    assert f"uses {keyword}" in msg and msg.endswith(".") and "\n" not in msg, msg
    assert (f" at {where}," in msg) if where else " at " not in msg, msg


def grammar_samples(schema: dict, rng: random.Random, count: int, max_len: int = 120) -> list:
    """Up to `count` JSON values drawn from `schema`'s grammar over the byte tokenizer, each byte
    picked at random among those the grammar allows, a closing one (`"`, `]`, `}`) as often as not
    where it is allowed past a few bytes, so that unbounded strings end (a walk that runs past
    `max_len` is dropped)."""
    from flexsgl.tokenizer import ByteTokenizer

    compiler = grammar.GrammarCompiler(ByteTokenizer(), 256)
    compiled = compiler.submit(StructuredOutputsParams(json=schema)).result()
    out = []
    for _ in range(count):
        m, text = grammar.Matcher(compiled, ()), b""
        while not m.ended and len(text) < max_len:
            allowed = grammar.allowed_tokens(compiler.fill_mask([m], pinned=False).words[0].numpy(), 256)
            ascii_ = [t for t in allowed if 32 <= t < 127] or list(allowed)
            closing = [t for t in ascii_ if t in b'"]}'] if len(text) >= 8 and rng.random() < 0.5 else []
            token = rng.choice(closing or ascii_)
            assert m.accept(int(token))
            text += bytes([token])
        if m.ended:
            out.append(json.loads(text))
    return out


def test_length_limited_strings_take_no_raw_control_characters():
    """xgrammar lets raw control characters into a string with minLength or maxLength, which makes
    the output invalid JSON; walks over every byte the grammar allows all parse and validate."""
    import jsonschema

    seed = random.randrange(1 << 30)
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 4},
                                               "b": {"type": "string", "maxLength": 3}}, "required": ["a", "b"]}
    rng = random.Random(seed)
    texts = []
    from flexsgl.tokenizer import ByteTokenizer

    compiler = grammar.GrammarCompiler(ByteTokenizer(), 256)
    compiled = compiler.submit(StructuredOutputsParams(json=schema)).result()
    for _ in range(40):
        m, text = grammar.Matcher(compiled, ()), b""
        while not m.ended and len(text) < 60:
            allowed = [int(t) for t in grammar.allowed_tokens(compiler.fill_mask([m], pinned=False).words[0].numpy(), 256)]
            inside = [t for t in allowed if t < 32] if text.count(b'"') % 2 else []  # inside a string: try controls
            token = rng.choice(inside or allowed) if rng.random() < 0.5 else rng.choice(allowed)
            assert m.accept(token)
            text += bytes([token])
        if m.ended:
            texts.append(text)
    assert len(texts) >= 10, f"seed={seed}: too few walks ended"
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^x[0-9]$": INT}, "additionalProperties": False, "maxProperties": 2},
    {"type": "object", "propertyNames": {"pattern": "^[a-c]$"}, "additionalProperties": INT, "maxProperties": 2},
    {"type": "object", "additionalProperties": INT, "minProperties": 1, "maxProperties": 1},
    {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 99},
    {"type": "array", "items": {"type": "string", "format": "uuid"}, "maxItems": 2, "uniqueItems": False},
    {"type": "string", "format": "email"},
    {"type": "object", "properties": {"key": {"type": "string", "format": "password", "maxLength": 4}}, "required": ["key"]},
    {"allOf": [{"type": "string", "pattern": "^[a-z]{2,4}$"}]},
])
def test_json_schema_keywords_xgrammar_enforces_are_followed(schema):
    """The keywords kept are enforced: random walks through the grammar all validate."""
    seed = random.randrange(1 << 30)
    values = grammar_samples(schema, random.Random(seed), 30)
    assert len(values) >= 5, f"seed={seed}: too few walks ended"
    for v in values:
        jsonschema.validate(v, schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("kwargs, words", [
    ({"logit_bias": {5: 101}}, "[-100, 100]"), ({"logit_bias": {-1: 1}}, "token ids"), ({"logit_bias": {"a": 1}}, "token ids"),
    ({"logit_bias": [1, 2]}, "map token ids"), ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"structured_outputs": "json"}, "structured_outputs"),
])
def test_bad_request_features_are_refused_in_one_sentence(kwargs, words):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert words in str(e.value) and str(e.value).endswith("."), str(e.value)


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(SamplingParamsError, match="vocabulary"):
        llm.generate("Return", SamplingParams(max_tokens=2, logit_bias={4096: 1.0}))


def test_logit_bias_steers_greedy_decoding(llm):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    token = rng.randrange(1, 4096)
    out = llm.generate("Return the", SamplingParams(max_tokens=6, temperature=0, logit_bias={token: 100}))[0]
    assert out.token_ids == [token] * 6, token
    plain = llm.generate("Return the", SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    banned = llm.generate("Return the", SamplingParams(max_tokens=1, temperature=0, logit_bias={plain: -100}))[0]
    assert banned.token_ids[0] != plain


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_match_hf_in_float64(hf, chunk):
    llm = LLM(max_total_tokens=4096, max_running_requests=8, page_size=16,
              **({"max_num_batched_tokens": chunk} if chunk else {}))
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    prompt = [rng.randrange(1, 4096) for _ in range(rng.randrange(20, 60))]
    llm.generate([prompt[:18]], SamplingParams(max_tokens=2))  # a cached prefix is not used for them
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None, f"seed={seed}"
    for i in range(1, len(prompt)):
        assert lps[i].token_id == prompt[i]
        assert abs(lps[i].logprob - ref[i - 1, prompt[i]].item()) < 1e-3, f"seed={seed} position {i}"
        top = ref[i - 1].topk(3)
        assert [v for _, v in lps[i].top] == pytest.approx(top.values.tolist(), abs=1e-3), f"seed={seed}"


def test_the_bitmask_allows_the_grammars_tokens_and_every_token_elsewhere():
    """The byte tokenizer's 256-token grammar vocabulary inside a padded model vocabulary: a
    constrained row allows exactly the grammar's next bytes, an unconstrained row everything."""
    from flexsgl.tokenizer import ByteTokenizer

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    vocab = rng.randrange(300, 2000)
    compiler = grammar.GrammarCompiler(ByteTokenizer(), vocab)
    letters = "".join(sorted(rng.sample("abcdefghij", 3)))
    compiled = compiler.submit(StructuredOutputsParams(regex=f"[{letters}]x")).result()
    rows = [grammar.Matcher(compiled, (vocab - 1,)) if i == 0 or rng.random() < 0.6 else None
            for i in range(rng.randrange(1, 40))]
    rng.shuffle(rows)
    mask = compiler.fill_mask(rows, pinned=False)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed))
    masked = apply_token_mask(logits.clone(), mask)
    allowed = torch.isfinite(masked)
    assert torch.equal(masked[allowed], logits[allowed]), "the mask changed an allowed logit"
    for i, m in enumerate(rows):
        want = [ord(c) for c in letters] if m is not None else list(range(vocab))
        assert torch.nonzero(allowed[i]).flatten().tolist() == want, f"vocab={vocab} row {i}"
    m = next(m for m in rows if m is not None)
    assert m.accept(ord(letters[0])) and m.accept(ord("x")) and m.ended, "complete without the stop token in range"
