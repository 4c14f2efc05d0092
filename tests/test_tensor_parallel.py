"""Tensor parallelism on the CPU (gloo): ranks spawned by LLM, each with its part of the model.

The reference is the same engine with one rank (whose own parity with HF transformers
tests/test_model_parity.py checks) and HF itself for a checkpoint loaded shard by shard. float32
throughout: the row-parallel all-reduce only reorders a sum, so greedy tokens are identical and
logits agree to float32 rounding. GPU checks (NCCL, CUDA graphs, bf16) are the `gpu` tests below,
run by `tools/gpu.sh tp-tests` on a machine with two GPUs."""

import os
import json
import random
import re
import signal
import time

import pytest
import torch

from flexsgl import LLM, SamplingParams
from flexsgl.distributed import launcher
from flexsgl.distributed.layers import kv_heads, pick_argmax, slice_summary, vocab_rows
from flexsgl.distributed.worker import agree
from flexsgl.errors import EngineDeadError, RankFailedError, TensorParallelError
from flexsgl.model.source import resolve
import flexsgl.runner
from tests.hf_models import assert_matches_hf, capture_logits, make_checkpoint

PAGE = 16
# Small pages and prefill chunks: prompts share cached pages and prefill in several steps.
OPTIONS = dict(device="cpu", compile=False, page_size=PAGE, max_total_tokens=128 * PAGE, max_num_batched_tokens=48,
               max_running_requests=8)


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0)


@pytest.fixture
def sampled_logits(monkeypatch):
    """The logits each step sampled from, `[rows, vocab]` float32 on the CPU, in step order (rank
    0's, the one in this process), for whichever engine runs. Every step keeps its whole logits:
    a greedy step under tensor parallelism would otherwise gather only each row's argmax."""
    steps = []
    real, real_plan = flexsgl.runner.sample, flexsgl.runner.ModelRunner.plan

    def plan(runner, batch):
        made = real_plan(runner, batch)
        made.keep_logits = True
        return made

    def sample(logits, st, argmax=None):
        if logits.shape[0]:  # a prefill chunk that samples no request has no rows
            steps.append(logits.detach().float().cpu())
        return real(logits, st, argmax)

    monkeypatch.setattr(flexsgl.runner, "sample", sample)
    monkeypatch.setattr(flexsgl.runner.ModelRunner, "plan", plan)
    return steps


def ragged_prompts(rng, vocab, n=5):
    shared = [rng.randrange(1, vocab) for _ in range(40)]  # > 2 pages: a prefix-cache hit for later prompts
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randrange(1, 70))] for _ in range(n)]
    return prompts + [shared + [rng.randrange(1, vocab)] for _ in range(2)]


@pytest.fixture(scope="class")
def tiny():
    one = LLM("tiny", load_format="dummy", **OPTIONS)
    two = LLM("tiny", load_format="dummy", tensor_parallel_size=2, **OPTIONS)
    yield one, two
    two.shutdown()


def test_rank_zero_holds_its_share():
    """A rank's part of the model: its q heads, its KV heads, its MLP slice and vocabulary rows;
    the KV pool holds only its KV heads."""
    assert kv_heads(8, 3, 4) == (6, 2) and kv_heads(2, 3, 4) == (1, 1) and kv_heads(2, 1, 4) == (0, 1)
    assert vocab_rows(321, 2) == 161 and vocab_rows(512, 4) == 128


@pytest.mark.parametrize("ranks,vocab", [(2, 321), (4, 512), (3, 50)])
def test_argmax_over_vocabulary_slices_is_row_argmax(ranks, vocab):
    """What the ranks of a greedy step exchange (each slice's maximum, its id, its sum) gives the
    whole row's first argmax and finiteness: rows with ties within and across slices (bf16 logits
    rounded to a few values), a row whose maximum sits in the last rank's padded slice, and rows
    holding NaN or infinity; the padding columns hold values that must not win."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    rows = vocab_rows(vocab, ranks)
    logits = torch.randn(9, vocab, generator=g).mul(2).round().to(torch.bfloat16)  # few values: ties
    logits[1, -1] = 100.0  # the last id, in the last rank's slice
    logits[2, 0] = logits[2, -1] = 50.0  # a tie across ranks: the first id wins
    logits[3, vocab // 2] = float("nan")
    logits[4, 1] = float("inf")
    logits[5, 2] = float("-inf")
    padded = torch.full((9, rows * ranks), 1e4, dtype=torch.bfloat16)  # padding columns past the vocabulary
    padded[:, :vocab] = logits
    every = torch.stack([slice_summary(padded[:, r * rows:(r + 1) * rows], vocab, r) for r in range(ranks)], dim=1)
    tokens, finite = pick_argmax(every)
    want = logits.float().isfinite().all(-1)
    assert torch.equal(finite, want), f"seed={seed}"
    assert torch.equal(tokens[want], logits.float().argmax(-1)[want]), f"seed={seed}"
    assert tokens[1] == vocab - 1 and tokens[2] == 0, f"seed={seed}"


@pytest.mark.parametrize("ranks,vocab", [(2, 321), (4, 512)])
def test_vocabulary_slices_race_to_the_samplers_tokens(ranks, vocab):
    """A step whose rows are greedy or sampled by temperature alone: each rank races its slice
    (l / T - log E with the noise of its own vocab ids) and the ranks exchange maxima; the tokens
    are exactly what the sampler draws from the whole rows. Four steps' noise over the same logits,
    and at least one sampled row off its argmax in one of them (a race returning the argmax fails):
    in a single step all six sampled rows land on their argmax for about one seed in 2,500."""
    from flexsgl.sampling.sampler import race, sample
    from tests.test_sampling import make_st

    seed = random.randrange(1 << 30)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = vocab_rows(vocab, ranks)
    logits = torch.randn(8, vocab, generator=g).mul(3).to(torch.bfloat16)
    padded = torch.full((8, rows * ranks), 1e4, dtype=torch.bfloat16)  # padding past the vocabulary must not win
    padded[:, :vocab] = logits
    off_argmax = False
    for _ in range(4):
        st = make_st(rng, [0.0, 0.7, 1.0, 1.3, 0.0, 0.5, 2.0, 1.0], step=[rng.randrange(50) for _ in range(8)])
        every = torch.stack([slice_summary(race(padded[:, r * rows:(r + 1) * rows], st, r * rows), vocab, r)
                             for r in range(ranks)], dim=1)
        tokens, finite = pick_argmax(every)
        assert finite.all() and torch.equal(tokens, sample(logits, st)), f"seed={seed}"
        off_argmax |= not torch.equal(tokens, logits.float().argmax(-1))
    assert off_argmax, f"seed={seed}: every sampled row at its argmax in four steps"


class TestTwoRanksOfTiny:
    """One engine of each kind shared by these tests (a process holds one tensor-parallel engine at a time)."""

    def test_greedy_tokens_identical_to_one_rank(self, tiny):
        one, two = tiny
        seed = random.randrange(1 << 30)
        prompts = ragged_prompts(random.Random(seed), 512)
        ref = one.generate(prompts, greedy(10))
        out = two.generate(prompts, greedy(10))
        assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"
        again = [prompts[-1][:-1] + [prompts[-1][-1] % 511 + 1]]  # the shared prefix, now in the cache
        ref, out = one.generate(again, greedy(10)), two.generate(again, greedy(10))
        assert out[0].token_ids == ref[0].token_ids, f"seed={seed}"
        assert out[0].cached_tokens >= 2 * PAGE, "the shared prefix was not a cache hit"


    def test_sampled_tokens_identical_with_penalties_and_logprobs(self, tiny):
        """Every rank samples the same token (counter-based noise, the same gathered logits) and keeps
        the same penalty counts; rank 0's read-back carries the log-probabilities."""
        one, two = tiny
        seed = random.randrange(1 << 30)
        prompts = ragged_prompts(random.Random(seed), 512, n=3)
        sp = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=seed % 1000, presence_penalty=0.5,
                            repetition_penalty=1.2, logprobs=2)
        sps = [sp] * (len(prompts) - 1) + [sp.replace(allowed_token_ids=random.Random(seed).sample(range(512), 9))]
        ref, out = one.generate(prompts, sps), two.generate(prompts, sps)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"
        assert set(out[-1].token_ids) <= set(sps[-1].allowed_token_ids), f"seed={seed}"  # one row restricted
        for a, b in zip(out, ref):
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, rel=1e-4, abs=1e-5)
                assert abs(x.rank - y.rank) <= 1, f"seed={seed}"  # a near tie may fall either way


    def test_temperature_sampling_gives_one_ranks_tokens(self, tiny):
        """Requests sampled by temperature alone beside greedy ones: the ranks race their vocabulary
        slices and exchange maxima, and draw exactly one rank's tokens."""
        one, two = tiny
        seed = random.randrange(1 << 30)
        rng = random.Random(seed)
        prompts = ragged_prompts(rng, 512, n=4)
        params = [SamplingParams(max_new_tokens=10, temperature=rng.choice([0.0, 0.6, 1.0, 1.5]), seed=rng.randrange(1000))
                  for _ in prompts]
        ref, out = one.generate(prompts, params), two.generate(prompts, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"


    def test_logits_close_to_one_rank(self, tiny, sampled_logits):
        one, two = tiny
        rng = random.Random(rng_seed := random.randrange(1 << 30))
        prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (30, 3)]
        one.generate(prompts, greedy(6))
        a = list(sampled_logits)
        sampled_logits.clear()
        two.generate(prompts, greedy(6))
        b = list(sampled_logits)
        assert len(a) == len(b) == 6
        for x, y in zip(a, b):
            assert x.shape == y.shape == (2, 512)
            assert x.abs().max() > 0.01  # not a degenerate model
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


    def test_non_finite_logits_end_the_request_with_an_error(self, tiny):
        """A NaN in rank 0's slice of the LM head: a greedy step exchanges each slice's sum beside its
        argmax, so the request ends with an error; with the weight restored it decodes as before."""
        one, two = tiny
        seed = random.randrange(1 << 30)
        rng = random.Random(seed)
        prompt = [rng.randrange(1, 512) for _ in range(20)]
        expected = two.generate([prompt], greedy(4))[0]
        weight = two.runner.model.lm_head.weight
        row = rng.randrange(weight.shape[0])
        saved = weight[row, 0].clone()
        weight[row, 0] = float("nan")
        try:
            got = two.generate([prompt], greedy(4))[0]
        finally:
            weight[row, 0] = saved
        assert got.finish_reason == "error" and "not finite" in got.error, (got, f"seed={seed}")
        assert two.generate([prompt], greedy(4))[0].token_ids == expected.token_ids, f"seed={seed}"


    def test_pool_and_weights_per_rank(self, tiny):
        one, two = tiny
        a, b = one.model.model.layers[0], two.model.model.layers[0]
        assert b.self_attn.qkv_proj.weight.shape[0] * 2 == a.self_attn.qkv_proj.weight.shape[0]
        assert b.mlp.down_proj.weight.shape[1] * 2 == a.mlp.down_proj.weight.shape[1]
        assert two.model.lm_head.weight.shape[0] == 256
        assert two.pool.k[0].shape[1] == 1 and one.pool.k[0].shape[1] == 2
        assert two.pool.num_pages == one.pool.num_pages


def test_mla_dummy_tokens_and_logits_identical_to_one_rank(sampled_logits):
    """DeepSeek-V2 in miniature (MLA, YaRN, a dense layer, then MoE with a shared expert) at TP=2:
    heads split, the latent cache replicated, every expert split along its intermediate dimension;
    ragged prompts, chunked prefill, a prefix-cache hit; tokens equal one rank's, logits to float32
    rounding."""
    seed = random.randrange(1 << 30)
    prompts = ragged_prompts(random.Random(seed), 512, n=4)
    one = LLM("tiny-mla", load_format="dummy", **OPTIONS)
    ref = one.generate(prompts, greedy(8))
    a = list(sampled_logits)
    sampled_logits.clear()
    with LLM("tiny-mla", load_format="dummy", tensor_parallel_size=2, **OPTIONS) as two:
        assert two.model.model.layers[1].mlp.experts.gate_up_proj.shape == (8, 64, 128)  # 2 x 64 / 2 units
        assert two.pool.num_pages == one.pool.num_pages
        out = two.generate(prompts, greedy(8))
        again = two.generate([prompts[-1][:-1] + [prompts[-1][-1] % 511 + 1]], greedy(4))
    b = list(sampled_logits)[:len(a)]
    assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"
    assert again[0].cached_tokens >= 2 * PAGE, "the shared prefix was not a cache hit"
    assert again[0].token_ids == one.generate([prompts[-1][:-1] + [prompts[-1][-1] % 511 + 1]], greedy(4))[0].token_ids
    for x, y in zip(a, b):
        assert x.abs().max() > 0.01
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")


def two_ranks_match_one_and_hf(path, hf, prompts, monkeypatch, seed: int, check_one: bool = False) -> None:
    """The checkpoint at `path` on one rank and on two: six greedy tokens of each prompt equal, and
    each step's logits at TP=2 (and on one rank too, with check_one) within HF's tolerance."""
    one = LLM(str(path), **OPTIONS)
    seen_one = capture_logits(one, monkeypatch) if check_one else None
    ref = one.generate(prompts, greedy(6))
    for prompt, o in zip(prompts, ref if check_one else ()):
        assert_matches_hf(hf, prompt, o.token_ids, seen_one[o.request_id], f"one rank, seed={seed}", steps=6)
    with LLM(str(path), tensor_parallel_size=2, **OPTIONS) as two:
        seen = capture_logits(two, monkeypatch)
        out = two.generate(prompts, greedy(6))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"
    for prompt, o in zip(prompts, out):
        assert_matches_hf(hf, prompt, o.token_ids, seen[o.request_id], f"two ranks, seed={seed}", steps=6)


@pytest.mark.parametrize("q_lora_rank, topk_method", [(None, "greedy"), (24, "group_limited_greedy")])
def test_mla_checkpoint_loaded_shard_by_shard_matches_hf(tmp_path, monkeypatch, q_lora_rank, topk_method):
    """HF's random DeepSeek-V2 checkpoint (one tensor per expert) at TP=2: each rank reads its heads'
    rows of q (or q_b), kv_b and o_proj, every expert's slice; tokens equal one rank's and HF's,
    logits HF's."""
    from tests.hf_models import make_deepseek_checkpoint

    seed = random.randrange(1 << 30)
    hf = make_deepseek_checkpoint(tmp_path, seed, q_lora_rank=q_lora_rank, topk_method=topk_method)
    hf.config._attn_implementation = "eager"
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 320) for _ in range(n)] for n in (3, 21, 40)]
    two_ranks_match_one_and_hf(tmp_path, hf, prompts, monkeypatch, seed)


def test_structured_outputs_follow_their_constraints_as_one_rank():
    """Steps sampled under a token mask: rank 0 fills the mask while every rank runs the forward
    half, then sends it, and every rank samples under it. Constrained requests (sampled) beside
    unconstrained ones (greedy) give one rank's texts, and each follows its constraint."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    schema = {"type": "object", "properties": {"tint": {"enum": ["cyan", "teal"]}, "n": {"enum": [1, 22, 333]}},
              "required": ["tint", "n"], "additionalProperties": False}  # bounded: every draw stops in max_tokens
    specs = [{"regex": r"[a-d]{2,5}-\d{1,3}"}, {"json": schema}, {"choice": ["red", "green", "blue"]}]
    plain = [[rng.randrange(1, 4096) for _ in range(rng.randrange(3, 12))] for _ in range(2)]
    params = [greedy(10)] * 2 + [SamplingParams(max_tokens=30, temperature=0.9, seed=rng.randrange(1 << 30),
                                                structured_outputs=s) for s in specs]
    prompts = plain + ["Return the value of"] * len(specs)
    options = {**OPTIONS, "max_total_tokens": 4096}
    ref = LLM(**options).generate(prompts, params)
    with LLM(tensor_parallel_size=2, **options) as two:
        out = two.generate(prompts, params)
    assert [(o.text, o.finish_reason) for o in out] == [(o.text, o.finish_reason) for o in ref], f"seed={seed}"
    texts = [o.text for o in out[2:] if o.finish_reason == "stop"]
    assert len(texts) == 3, f"seed={seed}: {[(o.text, o.finish_reason) for o in out[2:]]}"
    value = json.loads(texts[1])
    assert re.fullmatch(specs[0]["regex"], texts[0]) and set(value) == {"tint", "n"}, f"seed={seed}: {texts}"
    assert value["tint"] in ("cyan", "teal") and value["n"] in (1, 22, 333), f"seed={seed}: {texts}"
    assert texts[2] in specs[2]["choice"], f"seed={seed}"


def test_embedded_model_tokens_identical():
    prompts = ["def parse(text):", "Return the number of", "The"]
    one = LLM("tiny-docs", **OPTIONS)
    with LLM("tiny-docs", tensor_parallel_size=2, **OPTIONS) as two:
        ref, out = one.generate(prompts, greedy(12)), two.generate(prompts, greedy(12))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert [o.text for o in out] == [o.text for o in ref]


def test_compiled_ranks_tokens_identical():
    """Every rank compiles its decoder layers with the all-reduces inside them (functional
    collectives, traced like any op): tokens equal one compiled rank's."""
    rng = random.Random(seed := random.randrange(1 << 30))
    prompts = [[rng.randrange(1, 512) for _ in range(20)] for _ in range(2)]  # one prefill step: CPU compiles per shape
    options = {**OPTIONS, "compile": True}
    one = LLM("tiny", load_format="dummy", **options)
    ref = one.generate(prompts, greedy(4))
    with LLM("tiny", load_format="dummy", tensor_parallel_size=2, **options) as two:
        out = two.generate(prompts, greedy(4))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_checkpoint_loaded_shard_by_shard_matches_hf(tmp_path, monkeypatch):
    """HF's random checkpoint (tied embeddings, a vocabulary of 321 that pads to 2 x 161 rows): each
    rank reads its slices; tokens equal one rank's and HF's, logits HF's."""
    seed = random.randrange(1 << 30)
    hf = make_checkpoint("qwen3", tmp_path, seed, tie=True, vocab=321)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 321) for _ in range(n)] for n in (5, 23, 41)]
    two_ranks_match_one_and_hf(tmp_path, hf, prompts, monkeypatch, seed)


def test_attention_biases_o_proj_included_match_hf_on_one_and_two_ranks(tmp_path, monkeypatch):
    """Llama with attention_bias: q, k, v and o_proj carry biases, as in transformers; under two ranks
    rank 0 alone adds o_proj's (a row-parallel bias). Tokens equal one rank's, logits HF's."""
    seed = random.randrange(1 << 30)
    hf = make_checkpoint("llama", tmp_path, seed, attention_bias=True)
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, p in hf.named_parameters():
            if name.endswith("_proj.bias"):
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 320) for _ in range(n)] for n in (4, 19, 37)]
    two_ranks_match_one_and_hf(tmp_path, hf, prompts, monkeypatch, seed, check_one=True)


def test_four_ranks_replicate_kv_heads_and_a_killed_rank_stops_the_engine():
    """tp=4 with 2 KV heads: each KV head serves two ranks. Then a worker is killed: rank 0's next
    step raises EngineDeadError naming it, promptly, and so does every later call."""
    seed = random.randrange(1 << 30)
    prompts = ragged_prompts(random.Random(seed), 512, n=3)
    ref = LLM("tiny", load_format="dummy", **OPTIONS).generate(prompts, greedy(8))
    four = LLM("tiny", load_format="dummy", tensor_parallel_size=4, **OPTIONS)
    try:
        assert [o.token_ids for o in four.generate(prompts, greedy(8))] == [o.token_ids for o in ref], f"seed={seed}"
        assert four.pool.k[0].shape[1] == 1
        victim = four._channel.procs[1]  # rank 2
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 2 stopped"):
            four.generate(prompts, greedy(8))
        assert time.monotonic() - t0 < 10
        assert all(not p.is_alive() for p in four._channel.procs), "the other ranks still run"
        with pytest.raises(EngineDeadError, match="rank 2"):
            four.generate(prompts, greedy(2))
    finally:
        four.shutdown()
    assert all(not p.is_alive() for p in four._channel.procs)


def test_shutdown_stops_the_workers():
    llm = LLM("tiny", load_format="dummy", tensor_parallel_size=2, **OPTIONS)
    procs = llm._channel.procs
    assert all(p.is_alive() for p in procs)
    llm.shutdown()
    assert [p.exitcode for p in procs] == [0]
    # gloo's threads end with the groups: left running, they free their last collective's tensors
    # while the interpreter exits, which aborts the process
    assert _gloo_threads() == []
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate([[1, 2]], greedy(1))
    llm.shutdown()  # twice is fine


def _gloo_threads() -> list[str]:
    """The names of this process's threads that gloo runs (Linux)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(n for n in names if "gloo" in n)


def test_failed_start_up_raises_and_stops_the_workers():
    """Every rank fails sizing the KV pool: rank 0 raises its own error, the workers exit, and the
    process can start another tensor-parallel engine."""
    import multiprocessing

    with pytest.raises(ValueError, match="^A KV cache of 1000000000000 tokens needs"):
        LLM("tiny", load_format="dummy", tensor_parallel_size=2, **{**OPTIONS, "max_total_tokens": 10**12})
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("flexsgl-tp")]


def test_worker_that_fails_before_joining_is_reported(monkeypatch):
    monkeypatch.setenv("FLEXSGL_WORKER_LOG_LEVEL", "loud")
    with pytest.raises(RankFailedError, match=r"rank 1 exited before joining: ValueError: Unknown log level 'loud'"):
        LLM("tiny", load_format="dummy", tensor_parallel_size=2, **OPTIONS)


def test_a_killed_process_reads_as_exiting_before_it_is_reaped():
    """Channel.dead counts a worker that is ending as gone: here a killed child not yet waited for."""
    import subprocess
    import sys

    from flexsgl.distributed.worker import exiting

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not exiting(proc.pid) and not exiting(os.getpid())
        proc.kill()
        deadline = time.monotonic() + 10
        while not exiting(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exiting(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not exiting(proc.pid)  # reaped: no such process


def test_agree_raises_the_failed_ranks_reason():
    class Group:
        size = 3

        def __init__(self, reports):
            self.reports = reports

        def gather(self, mine):
            return self.reports

    agree(Group([None, None, None]), None)
    with pytest.raises(RankFailedError, match=r"^Tensor-parallel rank 2 failed: OSError: disk gone\.$"):
        agree(Group([None, None, (False, "OSError: disk gone")]), None)
    with pytest.raises(TensorParallelError, match="rank 1 failed: ValueError: too small"):
        agree(Group([None, (True, "ValueError: too small"), None]), None)
    with pytest.raises(KeyError):  # a rank's own error comes first
        agree(Group([(False, "KeyError"), None, None]), KeyError("x"))


@pytest.mark.parametrize("model, tp, sentence", [
    ("tiny", 3, "The model's 4 attention heads do not split across tensor_parallel_size 3 ranks; use a divisor of 4."),
    ("tiny-mla", 8, "The model's 4 attention heads do not split across tensor_parallel_size 8 ranks; use a divisor "
                    "of 4."),
])
def test_refused_before_loading(model, tp, sentence, monkeypatch):
    import flexsgl.engine_core

    monkeypatch.setattr(flexsgl.engine_core, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(launcher, "spawn", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(TensorParallelError) as e:
        LLM(model, load_format="dummy", tensor_parallel_size=tp, device="cpu", compile=False)
    assert str(e.value) == sentence


def test_refusals(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg = resolve("tiny", "dummy").config

    def refused(mcfg, tp, device=cpu):
        with pytest.raises(TensorParallelError) as e:
            launcher.refuse(_engine(tp), mcfg, device)
        return str(e.value)

    for tp in (1, 2, 4, 8):
        launcher.refuse(_engine(tp), cfg.__class__(**{**cfg.__dict__, "num_heads": 8}), cpu)
    odd_kv = cfg.__class__(**{**cfg.__dict__, "num_heads": 12, "num_kv_heads": 3})
    assert refused(odd_kv, 2) == ("The model's 3 KV heads neither split across nor divide tensor_parallel_size 2; "
                                  "use a divisor or a multiple of 3.")
    wide = cfg.__class__(**{**cfg.__dict__, "intermediate_size": 258})
    assert refused(wide, 4) == "The model's MLP width 258 does not split across tensor_parallel_size 4 ranks."
    mla = resolve("tiny-mla", "dummy").config
    launcher.refuse(_engine(4), mla.__class__(**{**mla.__dict__, "num_kv_heads": 3}), cpu)  # one latent: no KV heads
    odd_experts = mla.__class__(**{**mla.__dict__, "moe": mla.moe.__class__(**{**mla.moe.__dict__,
                                                                              "intermediate_size": 66})})
    assert refused(odd_experts, 4) == "The model's expert width 66 does not split across tensor_parallel_size 4 ranks."
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert refused(cfg, 2, cuda) == "tensor_parallel_size 2 needs 2 GPUs, and this machine has 1."
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert refused(cfg, 2, torch.device("cuda:1")) == ("Tensor parallelism runs on cuda:0 to cuda:1; device "
                                                       "'cuda:1' cannot be given with tensor_parallel_size 2.")
    # torchrun over two hosts of 8 GPUs: 16 ranks, this one the fourth of its host
    wide16 = cfg.__class__(**{**cfg.__dict__, "num_heads": 16})
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    launcher.refuse(_engine(16), wide16, cuda)
    assert not launcher.one_host()
    monkeypatch.setenv("LOCAL_RANK", "8")
    assert refused(wide16, 16, cuda) == ("This process is local rank 8 (LOCAL_RANK) and runs on cuda:8, but this "
                                         "host has 8 GPUs; start at most 8 processes per host.")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launcher.one_host()
    assert refused(cfg, 2) == ("tensor_parallel_size is 2, but this process was started as one of 4 ranks "
                               "(WORLD_SIZE); start as many processes as tensor-parallel ranks.")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer of at least 1, got 0"):
        _engine(0)


def _engine(tp):
    from flexsgl.config import EngineConfig

    return EngineConfig(model="tiny", device="cpu", tensor_parallel_size=tp)


# ---- GPU: NCCL, CUDA graphs, bfloat16 (`tools/gpu.sh tp-tests` runs these on a machine with 2 GPUs)

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _qwen3_8b_layers(path, layers=4):
    """Qwen3-8B's widths (32 q heads, 8 KV heads, 12288 MLP, 151936 vocabulary) with a few layers."""
    import json

    from flexsgl.model.presets import PRESETS

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**PRESETS["qwen3-8b"]["config"], "num_hidden_layers": layers}))
    return str(path)


needs_gpus = {n: pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPUs") for n in (2, 4)}


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [pytest.param(2, marks=needs_gpus[2]), pytest.param(4, marks=needs_gpus[4])])
def test_gpu_ranks_match_one_rank_in_bfloat16(tmp_path, sampled_logits, tp, monkeypatch):
    """All-reduces over symmetric memory (FLEXSGL_ALLREDUCE=symm: decode's small messages; NCCL for
    prefill's) inside compiled steps and captured decode graphs: TP=2's and TP=4's logits agree with
    TP=1's to bf16 rounding (the reduce order differs), at prefill and in the captured decode steps."""
    monkeypatch.setenv("FLEXSGL_ALLREDUCE", "symm")  # the spawned ranks inherit it
    model = _qwen3_8b_layers(tmp_path / "qwen3-8b-4layers")
    opts = dict(load_format="dummy", max_total_tokens=1 << 15, max_running_requests=8, cuda_graph_bs=(1, 2, 4, 8))
    _assert_tp_agrees(model, opts, tp, sampled_logits, vocab=150000, compiled=True)


@pytest.mark.gpu
@needs_gpus[2]
def test_gpu_flashinfer_all_reduce_matches_one_rank(tmp_path, sampled_logits, monkeypatch):
    """FLEXSGL_ALLREDUCE=trtllm (what auto picks where FlashInfer is installed): FlashInfer's
    TensorRT-LLM all-reduce, with the residual add and RMSNorm fused, inside compiled steps and
    captured decode graphs (prefill's larger messages through NCCL) agrees with TP=1 as above."""
    pytest.importorskip("flashinfer.comm")
    monkeypatch.setenv("FLEXSGL_ALLREDUCE", "trtllm")  # the spawned rank inherits it
    model = _qwen3_8b_layers(tmp_path / "qwen3-8b-4layers")
    opts = dict(load_format="dummy", max_total_tokens=1 << 15, max_running_requests=8, cuda_graph_bs=(1, 2, 4, 8))
    from flexsgl.distributed import allreduce

    def used(_):
        assert allreduce._trt is not None and allreduce._trt.takes(torch.empty(8, 4096, dtype=torch.bfloat16))

    _assert_tp_agrees(model, opts, 2, sampled_logits, vocab=150000, compiled=True, check=used)


def _assert_tp_agrees(model, opts, tp, sampled_logits, vocab, compiled, check=None, rounding=None):
    """TP=tp's logits agree with TP=1's to bf16 rounding, on three prompts prefilled in one step and
    decoded 8 steps in CUDA graphs. Prompts of one token each decode the same tokens on both as
    long as their logits agree, so the decode steps are compared only while the tokens agree.
    rounding: options that undo a rounding the ranks each do their own way (FP8 activations,
    quantized per token over each rank's slice): TP=1 without it, prefilled, measures what the
    rounding moves each prompt's logits by; twice that bounds TP=tp's distance where it is larger."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (7, 300, 1500)]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)  # every row runs all 8 steps
    sampled_logits.clear()
    ref = LLM(model, **opts).generate(prompts, sp)
    a = list(sampled_logits)
    width, corr = [0.0] * 3, [0.995] * 3
    if rounding is not None:
        sampled_logits.clear()
        LLM(model, **{**opts, **rounding}).generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0))
        for row, (p, r) in enumerate(zip(a[0], sampled_logits[0])):
            width[row] = 2 * (p - r).abs().max().item()
            corr[row] = min(0.995, 1 - 2 * (1 - torch.corrcoef(torch.stack([p, r]))[0, 1].item()))
    sampled_logits.clear()
    with LLM(model, tensor_parallel_size=tp, **opts) as many:
        assert many.runner.graphs is not None and many.compile == compiled
        out = many.generate(prompts, sp)
        if check is not None:
            check(many)
    b = list(sampled_logits)
    assert len(a) == len(b) == 8
    same = [x.token_ids[:1] == y.token_ids[:1] for x, y in zip(ref, out)]
    for step, (x, y) in enumerate(zip(a, b)):
        for row in range(3):
            if step > 0 and not same[row]:
                continue
            p, q = x[row], y[row]
            assert (q - p).abs().max() <= max(0.05 * p.abs().max(), width[row]), f"step {step}, row {row}, seed={seed}"
            assert torch.corrcoef(torch.stack([p, q]))[0, 1] > corr[row], f"step {step}, row {row}, seed={seed}"
        if step == 0:
            continue
        same = [s and r.token_ids[step] == o.token_ids[step] for s, r, o in zip(same, ref, out)]


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("override", ["flex", "fa3", "fi"])  # auto (the test above) is fa3-prefill,fi-decode,triton-decode
def test_gpu_every_gqa_override_under_two_ranks(tmp_path, sampled_logits, override):
    """Each rank builds its own backends over its heads: every override at TP=2 agrees with itself
    at TP=1 (eager steps, CUDA graphs; the compiled steps are the test above's)."""
    model = _qwen3_8b_layers(tmp_path / "qwen3-8b-4layers", layers=2)
    opts = dict(load_format="dummy", max_total_tokens=1 << 15, max_running_requests=8, cuda_graph_bs=(1, 2, 4),
                override=override, compile=False)
    _assert_tp_agrees(model, opts, 2, sampled_logits, vocab=150000, compiled=False)


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_fp8_weights_under_two_ranks(tmp_path, sampled_logits):
    """`quantization="fp8"` at TP=2: each rank's projections as Fp8Linears over its slice (a
    row-parallel one's weight scales the ranks' maximum), agreeing with FP8 at TP=1. A row-parallel
    projection's activations are quantized per token over each rank's slice (as vLLM's are), so
    their FP8 rounding differs from TP=1's: the bound is twice what FP8 moves TP=1's logits by."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 products need an SM89+ GPU")
    from flexsgl.quant.fp8_linear import Fp8Linear

    model = _qwen3_8b_layers(tmp_path / "qwen3-8b-4layers", layers=2)
    opts = dict(load_format="dummy", max_total_tokens=1 << 15, max_running_requests=8, cuda_graph_bs=(1, 2, 4),
                quantization="fp8", compile=True)

    def kept(two):  # 2 layers' qkv, o, gate_up and down on rank 0
        assert sum(isinstance(m, Fp8Linear) for m in two.runner.model.modules()) == 2 * 4

    _assert_tp_agrees(model, opts, 2, sampled_logits, vocab=150000, compiled=True, check=kept,
                      rounding=dict(quantization=None))


def _deepseek_v2_lite_layers(path, layers=3):
    """DeepSeek-V2-Lite's widths (16 heads, 512 + 64 latent, 64 experts of 1408, 2 shared) with a
    dense layer and a few MoE layers."""
    import json

    from flexsgl.model.presets import PRESETS

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**PRESETS["deepseek-v2-lite"]["config"], "num_hidden_layers": layers}))
    return str(path)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("override, compiled", [("auto", True), ("flex", False)])  # auto: fi-mla, triton-mla<=8
def test_gpu_mla_two_ranks_match_one_rank_in_bfloat16(tmp_path, sampled_logits, override, compiled):
    """DeepSeek-V2 at TP=2 on GPUs: 8 heads a rank over the replicated latent cache, every expert
    split (the batch-1 MoE kernel with rank 1's residual zero), agree with TP=1 to bf16 rounding."""
    model = _deepseek_v2_lite_layers(tmp_path / "deepseek-v2-lite-3layers")
    opts = dict(load_format="dummy", max_total_tokens=1 << 14, max_running_requests=8, cuda_graph_bs=(1, 2, 4),
                override=override, compile=compiled)
    _assert_tp_agrees(model, opts, 2, sampled_logits, vocab=100000, compiled=compiled)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("model", ["tiny", "tiny-docs", "tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-qwen3-moe",
                                   "tiny-gpt-oss"])
def test_gpu_tiny_presets_greedy_tokens(model):
    """Each family at TP=2 on GPUs (NCCL, CUDA graphs, `auto`'s backends) gives one rank's tokens."""
    opts = dict(dtype="float32", max_total_tokens=1 << 14, max_running_requests=8)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    vocab = resolve(model).config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (3, 40, 130)]
    ref = LLM(model, **opts).generate(prompts, greedy(16))
    with LLM(model, tensor_parallel_size=2, **opts) as two:
        out = two.generate(prompts, greedy(16))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"


# ---- every exit path ends every rank (tests/tp_exit_script.py runs the engine in a process of its own)

EXIT_LIMIT_S = 60  # a hang, not a speed: a clean end takes seconds


def _session(sid: int) -> list[int]:
    """The running processes of session `sid` (a zombie, ended but not yet reaped, does not run)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                pids.append(int(entry))
    return pids


def _start(argv: list[str]):
    """A process in a session of its own (its workers join it), with fault stacks on SIGABRT."""
    import subprocess

    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _wait_for_exit(proc, what: str) -> tuple[str, str]:
    """Wait for `proc` and every other process of its session to end, at most EXIT_LIMIT_S each;
    on a hang, SIGABRT to the session (its Python stacks go to stderr) and fail. Returns its output."""
    import subprocess

    try:
        out, err = proc.communicate(timeout=EXIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{what}: the process still ran {EXIT_LIMIT_S} s later:\n{err[-6000:]}")
    deadline = time.monotonic() + EXIT_LIMIT_S
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _session(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{what}: processes {left} (its workers) outlived it by {EXIT_LIMIT_S} s"
    return out, err


def _run_exit_script(mode: str, device: str, signal_to_send=None, tp: int = 2):
    """Run tests/tp_exit_script.py and wait for its session to end; returns (exit code, stdout
    lines, worker pids, stderr)."""
    import sys
    from pathlib import Path

    proc = _start([sys.executable, str(Path(__file__).parent / "tp_exit_script.py"), mode, device, str(tp)])
    lines = []
    try:
        for line in proc.stdout:  # up to "generated": loading, compiling, capturing (no limit of ours)
            lines.append(line.strip())
            if line.startswith("generated"):
                break
        if "generated" not in lines:
            proc.wait(timeout=EXIT_LIMIT_S)
            pytest.fail(f"the engine did not run: {proc.stderr.read()[-3000:]}")
        workers = [int(p) for p in lines[0].split()[1:]]
        if signal_to_send == "ctrl-c":  # a terminal's Ctrl-C: SIGINT to every process of the group
            time.sleep(1.0)
            os.killpg(proc.pid, signal.SIGINT)
        elif signal_to_send == "sigterm":  # `kill PID` of rank 0 alone
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
        out, err = _wait_for_exit(proc, f"{mode} {signal_to_send or ''} on {device}")
        return proc.returncode, lines + out.splitlines(), workers, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


EXIT_MODES = [("exit", None), ("shutdown", None), ("rank-killed", None), ("step-interrupted", None),
              ("load-interrupted", None), ("load-rank-killed", None), ("signal", "ctrl-c"), ("signal", "sigterm")]


@pytest.mark.parametrize("mode, signal_to_send", EXIT_MODES)
def test_every_exit_ends_every_rank(mode, signal_to_send):
    """On the CPU (gloo): a normal end with and without shutdown(), a killed rank, an interrupt half-way
    through a step (rank 1 inside its collectives) or while the model loads (rank 1 then waits for
    rank 0 in a collective; this hung), rank 1 killed while rank 0 loads (RankFailedError naming it,
    not the collective's error), Ctrl-C (after which the engine still runs), and SIGTERM to rank 0
    each end rank 0's process and every worker."""
    _check_exit(*_run_exit_script(mode, "cpu", signal_to_send), mode, signal_to_send)


def _check_exit(code, lines, workers, err, mode, signal_to_send):
    assert len(workers) >= 1
    if signal_to_send != "sigterm":
        assert code == 0, err[-3000:]
    if mode == "rank-killed":
        assert "dead" in lines, err[-3000:]
    if mode in ("step-interrupted", "load-interrupted"):
        assert "interrupted" in lines, err[-3000:]
    if mode == "load-rank-killed":
        assert any(line.startswith("failed") and "rank 1 stopped" in line for line in lines), (lines, err[-3000:])
    if signal_to_send == "ctrl-c":
        assert "interrupted" in lines and "continued" in lines, err[-3000:]


def _serve_and_stop(device: str, how: str, tp: int = 2) -> None:
    """`flexsgl serve --tp` (float32) until healthy; one greedy completion gives one rank's text (the
    LLM API in this process, float32 too); then stopped `how` (ctrl-c: SIGINT to its process group;
    sigterm: to the HTTP process); every process of it ends."""
    import json
    import socket
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = ["--device", "cpu", "--no-compile"] if device == "cpu" else ["--cuda-graph-bs", "1,2"]
    rng = random.Random(seed := random.randrange(1 << 30))
    prompt = [rng.randrange(1, 512) for _ in range(rng.randrange(3, 40))]
    one = LLM("tiny", load_format="dummy", device=device, dtype="float32", compile=False, max_total_tokens=4096,
              max_running_requests=4)
    want = one.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    one.shutdown()
    proc = _start([sys.executable, "-m", "flexsgl", "serve", "tiny", "--load-format", "dummy", "--tp",
                   str(tp), "--port", str(port), "--max-total-tokens", "4096", "--max-running-requests", "4",
                   "--dtype", "float32", "--log-level", "warning", *extra])
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"the server exited: {proc.communicate()[1][-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.5)
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True}).encode()
        ask = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(ask, timeout=120) as r:
            answer = json.load(r)
        assert answer["usage"]["completion_tokens"] == 8, f"seed={seed}"
        assert answer["choices"][0]["text"] == want.text, f"seed={seed}"
        assert len(_session(proc.pid)) >= 3  # the HTTP process, the engine process (rank 0), rank 1
        os.killpg(proc.pid, signal.SIGINT) if how == "ctrl-c" else proc.send_signal(signal.SIGTERM)
        _wait_for_exit(proc, f"serve stopped by {how} on {device}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_server_stop_ends_every_rank():
    """The server's stop (Ctrl-C) ends the HTTP process, the engine process and the other rank."""
    _serve_and_stop("cpu", "ctrl-c")


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("mode, signal_to_send", EXIT_MODES)
def test_gpu_every_exit_ends_every_rank(mode, signal_to_send):
    """NCCL, compiled steps and captured decode graphs holding the all-reduces: every exit path
    ends every rank (destroying a communicator while a graph that captured it lives would hang)."""
    _check_exit(*_run_exit_script(mode, "cuda", signal_to_send), mode, signal_to_send)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_gpu_four_ranks_exit():
    _check_exit(*_run_exit_script("exit", "cuda", None, tp=4), "exit", None)


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_cli_generate_exits():
    """The command of the report: `flexsgl generate ... --tp 2` prints its tokens and exits 0."""
    import sys

    proc = _start([sys.executable, "-m", "flexsgl.cli", "generate", "Return the", "--model", "tiny", "--load-format",
                   "dummy", "--tp", "2", "--max-new-tokens", "8"])
    try:
        proc.wait(timeout=300)  # loading and compiling; its exit is _wait_for_exit's
    except Exception:
        pass
    out, err = _wait_for_exit(proc, "flexsgl generate --tp 2")
    assert proc.returncode == 0, err[-3000:]


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_server_stop_ends_every_rank():
    _serve_and_stop("cuda", "ctrl-c")


def test_unguarded_script_is_told_to_guard_its_top_level(tmp_path):
    """A script that makes a TP engine at its top level, without `if __name__ == "__main__":`: each
    spawned rank re-runs it while starting; the error names that cause in one sentence."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from flexsgl import LLM\n"
                      "llm = LLM('tiny', load_format='dummy', tensor_parallel_size=2, device='cpu', compile=False)\n"
                      "print('started')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "started" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("flexsgl.errors.TensorParallelError: Each spawned tensor-parallel rank re-ran the main script, "
                    "which makes the LLM at its top level; guard that code with `if __name__ == \"__main__\":`."), \
        proc.stderr[-3000:]


def test_a_script_read_from_stdin_is_told_to_be_saved(tmp_path):
    """`python - < script.py`: the spawned ranks cannot re-run a main script that has no file; the
    error says so in one sentence, before any rank starts."""
    import subprocess
    import sys

    script = ("from flexsgl import LLM\n"
              "if __name__ == '__main__':\n"
              "    LLM('tiny', load_format='dummy', tensor_parallel_size=2, device='cpu', compile=False)\n"
              "    print('started')\n")
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode != 0 and "started" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("flexsgl.errors.TensorParallelError: ") and "<stdin> cannot be re-run" in last, \
        proc.stderr[-3000:]


# ---- memory: a rank holds its part of the weights, at every moment of loading

def _peak_cpu_bytes(fn, mapped: tuple[int, ...] = ()):
    """fn()'s result and the most bytes torch's CPU allocator held at once, above what it held
    before, while fn ran (the profiler's memory events). Storages of a size in `mapped` are left
    out: safetensors maps each file whole as one storage, host memory paged in only where read."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        if abs(nbytes) not in mapped:
            live += nbytes
            peak = max(peak, live)
    return result, peak


def _held_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (each tensor once)."""
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


@pytest.mark.parametrize("load_format", ["dummy", "safetensors"])
def test_each_rank_holds_only_its_part_while_loading(tmp_path, monkeypatch, load_format):
    """Rank r of 2 builds its part (bfloat16, on the CPU as on a GPU): the allocator's peak during
    the whole load is the part's bytes plus a few generation blocks and the rotary tables, never a
    float32 copy or a whole parameter; from a checkpoint no tensor read is larger than the part's
    largest parameter."""
    import json

    import flexsgl.model.dummy_weights as dummy
    import flexsgl.model.loader as loader
    from flexsgl.model.presets import PRESETS

    monkeypatch.setattr(dummy, "BLOCK_ELEMENTS", 1 << 12)
    config = {**PRESETS["tiny"]["config"], "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
              "head_dim": 64, "max_position_embeddings": 256, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    src = resolve(str(tmp_path), "dummy")
    if load_format == "safetensors":
        from safetensors.torch import save_file

        one = loader.build_model(src, torch.device("cpu"), torch.float32, seed=1)
        hf = {}
        for name, p in one.named_parameters():  # the fused projections as HF's separate tensors
            if name.endswith("qkv_proj.weight"):
                q, k, v = p.split([4 * 64, 2 * 64, 2 * 64])
                hf |= {name.replace("qkv_proj", "q_proj"): q, name.replace("qkv_proj", "k_proj"): k,
                       name.replace("qkv_proj", "v_proj"): v}
            elif name.endswith("gate_up_proj.weight"):
                gate, up = p.chunk(2)
                hf |= {name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up}
            else:
                hf[name] = p
        save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "model.safetensors"))
        src = resolve(str(tmp_path))
        reads = []
        real_reader = loader._reader
        monkeypatch.setattr(loader, "_reader", lambda st, name: lambda index, out: (
            reads.append(out.numel()), real_reader(st, name)(index, out)))
    for rank in (0, 1):
        files = tuple(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
        model, peak = _peak_cpu_bytes(lambda: loader.build_model(src, torch.device("cpu"), torch.bfloat16, 7, rank, 2),
                                      files)
        part = _held_bytes(model)
        rotary = 2 * model.model.rotary.cos.numel() * 4  # computed in float32 with a temporary or two
        blocks = 8 * dummy.BLOCK_ELEMENTS * 4
        assert part < peak <= part + 2 * rotary + blocks, (rank, part, peak)
        if load_format == "safetensors":
            assert max(reads) <= max(p.numel() for p in model.parameters())
    # The bound would catch a float32 copy of the part, or one whole parameter (the embedding's 2 MB).
    assert min(part, 4096 * 256 * 2) > 2 * rotary + blocks


# ---- torchrun: ranks, devices and the rendezvous from its environment, on one host or several

@pytest.mark.parametrize("hosts", [1, 2])
def test_torchrun_ranks_give_one_ranks_tokens(hosts):
    """torchrun starts the ranks (gloo on the CPU): all on one host (--nproc-per-node 2), or as two
    hosts of one rank each (--nnodes 2 --node-rank 0|1 --rdzv-endpoint, both here: each has
    LOCAL_RANK 0, the ranks and world size come from the rendezvous). Rank 0 prints the tokens of
    one rank's engine; every process exits 0."""
    import json
    import sys
    from pathlib import Path

    from tests.ports import free_port

    rng = random.Random(seed := random.randrange(1 << 30))
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (4, 37)]
    ref = LLM("tiny", load_format="dummy", device="cpu", compile=False, page_size=16, max_total_tokens=2048,
              max_running_requests=8).generate(prompts, greedy(8))
    script = [str(Path(__file__).parent / "tp_torchrun_script.py"), json.dumps(prompts)]
    run = [sys.executable, "-m", "torch.distributed.run", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--local-addr", "127.0.0.1"]
    if hosts == 1:
        commands = [run + ["--nnodes", "1", "--nproc-per-node", "2", *script]]
    else:
        commands = [run + ["--nnodes", "2", "--node-rank", str(h), "--nproc-per-node", "1", *script] for h in (0, 1)]
    procs = [_start(c) for c in commands]
    outs = [_wait_for_exit_within(p, 300) for p in procs]
    assert [p.returncode for p in procs] == [0] * hosts, outs[-1][1][-3000:]
    printed = [line for out, _ in outs for line in out.splitlines() if line.startswith("tokens ")]
    assert len(printed) == 1, "rank 0 alone runs the script past LLM(...)"
    assert json.loads(printed[0].removeprefix("tokens ")) == [o.token_ids for o in ref], f"seed={seed}"


def _wait_for_exit_within(proc, seconds: float) -> tuple[str, str]:
    import subprocess

    try:
        return proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"torchrun did not finish in {seconds} s:\n{err[-6000:]}")


# ---- the all-reduce over symmetric memory (flexsgl/distributed/allreduce.py), on 2 GPUs

def _symm_all_reduce_rank(rank: int, size: int, port: int, seed: int) -> None:
    """One rank of test_gpu_symmetric_all_reduce_equals_nccl (spawned)."""
    import torch.distributed as dist

    from flexsgl.distributed import allreduce, nvlink_allreduce
    from flexsgl.distributed.group import destroy_group, init_group

    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0)
    init_group(rank, size, device, store)
    symm = allreduce._symm
    assert symm is not None, "symmetric memory was not set up (see the log's all-reduce line)"
    gen = torch.Generator(device).manual_seed(seed * 16 + rank)

    def nccl(x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    def close(got, want, what):  # the sum's order differs: bf16 rounding of values of a few units
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.06, msg=f"{what}, seed={seed}")

    for kb in (8, 16, 32, 64, 1024, 4096):
        n = kb * 1024 // 2
        for kind in ("one-shot", "two-shot"):
            if kind == "one-shot" and kb * 1024 > nvlink_allreduce.ONE_SHOT_MAX_BYTES:
                continue
            x = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16)
            close(symm(x, kind), nccl(x), f"{kind} of {kb} KB")
    # The choice by size inside CUDA graphs: rows of a decode batch, as the model all-reduces them.
    for rows in (1, 8, 64, 512):
        static = torch.zeros(rows, 4096, device=device, dtype=torch.bfloat16)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            allreduce.all_reduce(static)  # warm-up outside the graph
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = allreduce.all_reduce(static)
        for _ in range(3):
            static.copy_(torch.randn(static.shape, generator=gen, device=device, dtype=torch.bfloat16))
            graph.replay()
            close(out, nccl(static), f"a graph of {rows} rows ({symm.kind(static)})")
        graph.reset()
    torch.cuda.synchronize(device)
    destroy_group()


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_symmetric_all_reduce_equals_nccl():
    """One-shot and two-shot all-reduces over symmetric memory (multicast off) equal NCCL's to bf16
    rounding, alone at 8 KB to 4 MB and captured in CUDA graphs at decode batch sizes."""
    import torch.multiprocessing as mp

    from tests.ports import free_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    size = min(torch.cuda.device_count(), 4)
    mp.spawn(_symm_all_reduce_rank, args=(size, free_port(), random.randrange(1 << 20)), nprocs=size, join=True)


def test_all_reduce_carrying_the_norms_gives_hfs_tokens_and_logits(tmp_path, monkeypatch):
    """The decoder's path for an all-reduce that also adds the residual and RMSNorms the sum
    (FlashInfer's kARResidualRMSNorm, GPU only; flexsgl/distributed/allreduce.py), with that
    all-reduce stood in by its definition on one rank, and taken only for steps of up to 4 rows so
    that longer prefill chunks mix in the plain path: tokens and logits HF's."""
    from flexsgl.distributed import allreduce
    from flexsgl.distributed import layers as tp_layers

    calls = []

    def add_norm(x, residual, weight, eps):  # the kernel's definition: one rank's sum is its input
        calls.append(x.shape[0])
        s = residual + x
        return s, (s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(s.dtype)

    monkeypatch.setattr(allreduce, "fusing", lambda: True)
    monkeypatch.setattr(allreduce, "fuses_norm", lambda x: x.shape[0] <= 4)
    monkeypatch.setattr(allreduce, "all_reduce_add_norm", add_norm)
    monkeypatch.setattr(tp_layers, "all_reduce", lambda x: x)  # the plain path's all-reduce, on one rank
    seed = random.randrange(1 << 30)
    hf = make_checkpoint("qwen3", tmp_path, seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 320) for _ in range(n)] for n in (3, 23, 41)]
    llm = LLM(str(tmp_path), **OPTIONS)
    seen = capture_logits(llm, monkeypatch)
    out = llm.generate(prompts, greedy(6))
    assert any(n <= 4 for n in calls) and max(calls) <= 4, f"seed={seed}"  # decode steps took it, long chunks did not
    for prompt, o in zip(prompts, out):
        assert_matches_hf(hf, prompt, o.token_ids, seen[o.request_id], f"seed={seed}", steps=6)


def test_second_group_of_a_name_does_without_symmetric_memory(monkeypatch):
    """Torch sets symmetric memory up once per group name and process, and a later engine's group
    has the first one's name: that group is told to use another all-reduce, in one sentence (it
    would otherwise wait forever at the rendezvous); an unknown FLEXSGL_ALLREDUCE is refused."""
    from types import SimpleNamespace

    from flexsgl.distributed import allreduce

    group = SimpleNamespace(device=torch.device("cuda", 0), one_host=True, name=str(random.randrange(1000)))
    monkeypatch.delenv("FLEXSGL_ALLREDUCE", raising=False)
    monkeypatch.setattr(allreduce, "_symm_names", set())
    first = allreduce._symm_unusable(group)
    allreduce._symm_names.add(group.name)
    second = allreduce._symm_unusable(group)
    assert first is None or "lacks" in first  # a torch without the kernels says so instead
    assert second is not None and f"earlier group named {group.name!r}" in second
    monkeypatch.setenv("FLEXSGL_ALLREDUCE", "fast")
    with pytest.raises(ValueError, match="FLEXSGL_ALLREDUCE='fast' is not one of auto, trtllm, symm, nccl"):
        allreduce._symm_unusable(group)


def test_auto_goes_without_flashinfers_all_reduce_until_it_is_built(monkeypatch):
    """auto does not wait minutes for FlashInfer's first build: unbuilt kernels are a reason to go
    without, which names how to build them; FLEXSGL_ALLREDUCE=trtllm builds them, and a failed build
    is its reason (FlashInfer stood in: the CPU has none)."""
    from types import SimpleNamespace

    from flexsgl.distributed import allreduce

    group = SimpleNamespace(one_host=True)
    monkeypatch.setattr(allreduce.importlib, "import_module", lambda name: SimpleNamespace())
    monkeypatch.setattr(allreduce, "flashinfer_comm_built", lambda: False)
    built = []
    monkeypatch.setattr(allreduce, "build_flashinfer_comm", lambda: built.append(1))
    why = allreduce._trtllm_unusable(group, build=False)
    assert why is not None and "FLEXSGL_ALLREDUCE=trtllm builds them" in why and not built
    assert allreduce._trtllm_unusable(group, build=True) is None and built == [1]

    def fails():
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(allreduce, "build_flashinfer_comm", fails)
    assert "did not build (RuntimeError: nvcc not found)" in allreduce._trtllm_unusable(group, build=True)
    assert "several hosts" in allreduce._trtllm_unusable(SimpleNamespace(one_host=False), build=True)


def test_the_start_up_sum_check_accepts_a_right_all_reduce_and_names_a_wrong_one():
    """nvlink_allreduce.check_sum, with two ranks simulated in one process: the right sum passes,
    a sum missing one rank's part is refused with the check's name."""
    from flexsgl.distributed.nvlink_allreduce import check_sum

    shape, cpu = (3, 40), torch.device("cpu")
    idx = torch.arange(120, dtype=torch.float32).view(shape) % 16
    other = (2 + idx).to(torch.bfloat16)  # rank 1's input
    check_sum(lambda x: x + other, shape, 0, 2, torch.bfloat16, "a simulated all-reduce", cpu)
    with pytest.raises(RuntimeError, match="a lossy all-reduce gave a wrong sum"):
        check_sum(lambda x: x, shape, 0, 2, torch.bfloat16, "a lossy all-reduce", cpu)
