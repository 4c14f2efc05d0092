"""Tensor parallelism on the CPU (gloo): ranks spawned by LLM, each with its part of the model.

The reference is the same engine with one rank (whose own parity with HF transformers
tests/test_model_parity.py checks) and HF itself for a checkpoint loaded shard by shard. float32
throughout: the row-parallel all-reduce only reorders a sum, so greedy tokens are identical and
logits agree to float32 rounding. GPU checks (NCCL, CUDA graphs, bf16) are the `gpu` tests below,
run by `tools/gpu.sh tp-tests` on a machine with two GPUs."""

import os
import random
import signal
import time

import pytest
import torch

from flexsgl import LLM, SamplingParams
from flexsgl.distributed import launcher
from flexsgl.distributed.layers import kv_heads, vocab_rows
from flexsgl.distributed.worker import agree
from flexsgl.errors import EngineDeadError, RankFailedError, TensorParallelError
from flexsgl.model.source import resolve
import flexsgl.runner
from tests.hf_models import capture_logits, hf_reference, make_checkpoint

PAGE = 16
# Small pages and prefill chunks: prompts share cached pages and prefill in several steps.
OPTIONS = dict(device="cpu", compile=False, page_size=PAGE, max_total_tokens=128 * PAGE, max_num_batched_tokens=48,
               max_running_requests=8)


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0)


@pytest.fixture
def sampled_logits(monkeypatch):
    """The logits each step sampled from, `[rows, vocab]` float32 on the CPU, in step order (rank
    0's, the one in this process), for whichever engine runs."""
    steps = []
    real = flexsgl.runner.sample

    def sample(logits, st, argmax=None):
        steps.append(logits.detach().float().cpu())
        return real(logits, st, argmax)

    monkeypatch.setattr(flexsgl.runner, "sample", sample)
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
        ref, out = one.generate(prompts, sp), two.generate(prompts, sp)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"
        for a, b in zip(out, ref):
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, rel=1e-4, abs=1e-5)


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


    def test_pool_and_weights_per_rank(self, tiny):
        one, two = tiny
        a, b = one.model.model.layers[0], two.model.model.layers[0]
        assert b.self_attn.qkv_proj.weight.shape[0] * 2 == a.self_attn.qkv_proj.weight.shape[0]
        assert b.mlp.down_proj.weight.shape[1] * 2 == a.mlp.down_proj.weight.shape[1]
        assert two.model.lm_head.weight.shape[0] == 256
        assert two.pool.k[0].shape[1] == 1 and one.pool.k[0].shape[1] == 2
        assert two.pool.num_pages == one.pool.num_pages


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
    one = LLM(str(tmp_path), **OPTIONS)
    ref = one.generate(prompts, greedy(6))
    with LLM(str(tmp_path), tensor_parallel_size=2, **OPTIONS) as two:
        seen = capture_logits(two, monkeypatch)
        out = two.generate(prompts, greedy(6))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"
    for prompt, o in zip(prompts, out):
        tokens, logits = hf_reference(hf, prompt, 6)
        assert o.token_ids == tokens, f"seed={seed}"
        torch.testing.assert_close(torch.stack(seen[o.request_id]), logits, rtol=1e-4, atol=1e-4)


def test_four_ranks_replicate_kv_heads_and_a_killed_rank_stops_the_engine():
    """tp=4 with 2 KV heads: each KV head serves two ranks. Then a worker is killed: rank 0's next
    step raises EngineDeadError naming it, promptly, and so does every later call."""
    prompts = ragged_prompts(random.Random(3), 512, n=3)
    ref = LLM("tiny", load_format="dummy", **OPTIONS).generate(prompts, greedy(8))
    four = LLM("tiny", load_format="dummy", tensor_parallel_size=4, **OPTIONS)
    try:
        assert [o.token_ids for o in four.generate(prompts, greedy(8))] == [o.token_ids for o in ref]
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
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate([[1, 2]], greedy(1))
    llm.shutdown()  # twice is fine


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
    ("tiny-mla", 2, "Tensor parallelism is not supported yet for DeepseekV2ForCausalLM (multi-head latent "
                    "attention); use tensor_parallel_size 1."),
    ("tiny-gpt-oss", 2, "Tensor parallelism is not supported yet for GptOssForCausalLM (mixture of experts); use "
                        "tensor_parallel_size 1."),
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
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert refused(cfg, 2, cuda) == "tensor_parallel_size 2 needs 2 GPUs, and this machine has 1."
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert refused(cfg, 2, torch.device("cuda:1")) == ("Tensor parallelism runs on cuda:0 to cuda:1; device "
                                                       "'cuda:1' cannot be given with tensor_parallel_size 2.")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
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


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_two_ranks_match_one_rank_in_bfloat16(tmp_path, sampled_logits):
    """NCCL all-reduces inside compiled steps and captured decode graphs: TP=2's logits agree with
    TP=1's to bf16 rounding (the reduce order differs), at prefill and in the captured decode
    steps. Prompts of one token each decode the same tokens on both as long as their logits
    agree, so the decode steps are compared token for token only while the tokens agree."""
    model = _qwen3_8b_layers(tmp_path / "qwen3-8b-4layers")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 150000) for _ in range(n)] for n in (7, 300, 1500)]
    opts = dict(load_format="dummy", max_total_tokens=1 << 15, max_running_requests=8, cuda_graph_bs=(1, 2, 4, 8))
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)  # every row runs all 8 steps
    ref = LLM(model, **opts).generate(prompts, sp)
    a = list(sampled_logits)
    sampled_logits.clear()
    with LLM(model, tensor_parallel_size=2, **opts) as two:
        assert two.runner.graphs is not None and two.compile
        out = two.generate(prompts, sp)
    b = list(sampled_logits)
    assert len(a) == len(b) == 8
    same = [x.token_ids[:1] == y.token_ids[:1] for x, y in zip(ref, out)]
    for step, (x, y) in enumerate(zip(a, b)):
        for row in range(3):
            if step > 0 and not same[row]:
                continue
            p, q = x[row], y[row]
            assert (q - p).abs().max() <= 0.05 * p.abs().max(), (step, row)
            assert torch.corrcoef(torch.stack([p, q]))[0, 1] > 0.995, (step, row)
        if step == 0:
            continue
        same = [s and r.token_ids[step] == o.token_ids[step] for s, r, o in zip(same, ref, out)]


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("model", ["tiny", "tiny-docs"])
def test_gpu_tiny_presets_greedy_tokens(model):
    opts = dict(dtype="float32", max_total_tokens=1 << 14, max_running_requests=8)
    rng = random.Random(1)
    vocab = resolve(model).config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (3, 40, 130)]
    ref = LLM(model, **opts).generate(prompts, greedy(16))
    with LLM(model, tensor_parallel_size=2, **opts) as two:
        out = two.generate(prompts, greedy(16))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
