"""The graph manager's static-buffer path on the CPU: bind once, fill per step, replay.

CUDA graphs need a GPU (tests/test_gpu_overrides.py records real ones); here the manager runs in
`emulate` mode, which skips only the recording. Everything a graph would read comes from the
static buffers written by `fill`, so stale rows from larger batches, padding to captured sizes
and the per-size BlockMask buffers are all exercised. Reference: HF transformers' greedy tokens.
"""

import random

import pytest
import torch

import flexsgl.attention.registry as registry
from flexsgl import LLM, EngineConfig, SamplingParams, step_shape
from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.attention.registry import BackendSpec
from flexsgl.cli import generate_config
from flexsgl.model.source import resolve as resolve_source
from tests.hf_models import assert_matches_hf, make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-graphs")
    seed = random.randrange(1 << 30)
    return str(path), make_checkpoint("qwen3", path, seed), seed


@pytest.mark.parametrize("compiled,table", [(False, "whole"), (False, "narrow"), (True, "whole")],
                         ids=["eager", "eager-narrow-tables", "compiled"])
def test_decode_through_graph_buffers_matches_hf(checkpoint, monkeypatch, compiled, table):
    """table "narrow": every step's page table goes up only as wide as its longest request and is
    copied into the static table's leading columns (as at large batches), the rest left stale."""
    path, hf, seed = checkpoint
    if table == "narrow":
        monkeypatch.setattr(step_shape, "WHOLE_TABLE_ENTRIES", 0)
    rng = random.Random(seed)
    n = 6
    prompts = [[rng.randrange(320) for _ in range(rng.randrange(1, 30))] for _ in range(n)]
    steps = [rng.randrange(2, 14) for _ in range(n)]  # requests finish at different steps: batches shrink
    llm = LLM(path, device="cpu", page_size=4, max_total_tokens=400, max_running_requests=8,
              compile=compiled)
    llm.allocator.shuffle(seed)
    llm.runner.capture_graphs([1, 2, 4, 8] if not compiled else [2, 8], emulate=True)
    assert sorted(llm.runner.graphs.batches) == ([1, 2, 4, 8] if not compiled else [2, 8])
    replays = 0
    real_replay = llm.runner.graphs.replay

    def counting_replay(fb):
        nonlocal replays
        replays += 1
        return real_replay(fb)

    llm.runner.graphs.replay = counting_replay
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=s, temperature=0.0) for s in steps])
    assert replays >= max(steps) - 1, f"seed={seed}"  # every decode step went through the static buffers
    for p, s, o in zip(prompts, steps, outs):
        assert_matches_hf(hf, p, o.token_ids, what=f"seed={seed}", steps=s)


def test_sampled_rows_through_graph_buffers_match_the_direct_path(checkpoint):
    """A recorded step takes every row's argmax and writes it into the token buffer; rows that sample
    (temperature, penalties, min_tokens) overwrite it with their token. Mixed batches that shrink
    through padded sizes give the tokens of the same engine without graphs, and greedy rows HF's."""
    path, hf, seed = checkpoint
    rng = random.Random(seed + 2)
    prompts = [[rng.randrange(320) for _ in range(rng.randrange(1, 30))] for _ in range(7)]
    params = [SamplingParams(max_new_tokens=rng.randrange(3, 12), temperature=0.0) for _ in range(3)]
    params += [SamplingParams(max_new_tokens=rng.randrange(3, 12), temperature=0.9, top_k=20, seed=rng.randrange(99)),
               SamplingParams(max_new_tokens=rng.randrange(3, 12), temperature=0.0, repetition_penalty=1.5),
               SamplingParams(max_new_tokens=rng.randrange(3, 12), temperature=0.0, min_tokens=3),
               SamplingParams(max_new_tokens=rng.randrange(3, 12), temperature=1.1, seed=rng.randrange(99))]
    outs = {}
    for graphed in (False, True):
        llm = LLM(path, device="cpu", page_size=4, max_total_tokens=400, max_running_requests=8, compile=False)
        if graphed:
            llm.runner.capture_graphs([1, 2, 4, 8], emulate=True)
        outs[graphed] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False], f"seed={seed}"
    for p, sp, o in zip(prompts[:3], params[:3], outs[True][:3]):
        assert_matches_hf(hf, p, o, what=f"seed={seed}", steps=sp.max_new_tokens)


def test_graph_sizes_beyond_max_running_are_refused(checkpoint):
    path, _, _ = checkpoint
    llm = LLM(path, device="cpu", page_size=4, max_total_tokens=64, max_running_requests=4)
    with pytest.raises(ValueError, match="max_running"):
        llm.runner.capture_graphs([2, 8], emulate=True)


def test_graph_sizes_on_cpu_are_refused_before_loading(monkeypatch):
    import flexsgl.engine_core

    monkeypatch.setattr(flexsgl.engine_core, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match="CUDA graphs are off: they need a CUDA device"):
        LLM("tiny", load_format="dummy", device="cpu", cuda_graph_bs=[1, 2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_graphs_default_off_on_cpu(checkpoint):
    llm = LLM(checkpoint[0], device="cpu", max_total_tokens=64)
    assert llm.runner.graphs is None


class SmallBatchFlex(FlexAttentionBackend):
    """Flex under another name, counting the decode batch sizes it serves and the graph sizes it owns."""

    name = "flex-small"
    served: list = []
    bound: list = []

    def forward(self, q, cache, fb, *variant_and_sink):
        if cache[0] is self.pool.k[0]:  # the first layer's
            self.served.append(fb.batch_size)
        return super().forward(q, cache, fb, *variant_and_sink)

    def bind_graph(self, bs, fb):
        self.bound.append(bs)
        super().bind_graph(bs, fb)


def test_small_batch_decode_backend_serves_its_sizes(checkpoint, monkeypatch):
    """`PREFILL,DECODE,SMALL<=N`: graphs up to N are bound and replayed by SMALL, larger ones by
    DECODE, and the tokens still match HF as batches shrink through both."""
    path, hf, seed = checkpoint
    spec = BackendSpec("flex-small", f"{__name__}:SmallBatchFlex", ("decode",), None, None)
    monkeypatch.setitem(registry.SPECS, "flex-small", spec)
    monkeypatch.setattr(SmallBatchFlex, "served", [])
    monkeypatch.setattr(SmallBatchFlex, "bound", [])
    rng = random.Random(seed + 1)
    prompts = [[rng.randrange(320) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    steps = [rng.randrange(2, 14) for _ in range(5)]
    steps.append(max(steps) + rng.randrange(3, 6))  # so that the batch shrinks to one request
    llm = LLM(path, device="cpu", page_size=4, max_total_tokens=400, max_running_requests=8,
              compile=False, override="flex,flex,flex-small<=2")
    llm.allocator.shuffle(seed)
    llm.runner.capture_graphs([1, 2, 4, 8], emulate=True)
    assert sorted(SmallBatchFlex.bound) == [1, 2]
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=s, temperature=0.0) for s in steps])
    assert SmallBatchFlex.served and max(SmallBatchFlex.served) <= 2, f"seed={seed}"
    for p, s, o in zip(prompts, steps, outs):
        assert_matches_hf(hf, p, o.token_ids, what=f"seed={seed}", steps=s)


@pytest.mark.parametrize("prompts, n, max_running, sizes", [
    (1, 1, 256, (1,)),  # the README's command: one graph
    (3, 1, 256, (1, 2, 3)),  # flex's decode buckets below 3, and 3
    (2, 3, 256, (1, 2, 4, 6)),  # two prompts sampled three times each: up to 6 running
    (5, 2, 4, (1, 2, 4)),  # capped by max_running_requests
])
def test_generate_captures_only_the_batch_sizes_its_prompts_reach(checkpoint, prompts, n, max_running, sizes):
    """`flexsgl generate` resolves its CUDA graph sizes on a GPU from its prompts times n (the decode
    buckets up to them); on the CPU the graph manager captures those sizes in emulate mode, and every
    decode step of the run replays one of them, the largest included, with HF's greedy tokens."""
    path, hf, seed = checkpoint
    engine = generate_config(EngineConfig(model=path, override="flex", max_running_requests=max_running), prompts * n)
    assert engine.resolve(resolve_source(path, "auto").config, torch.device("cuda")).cuda_graph_bs == sizes
    llm = LLM(engine.replace(device="cpu"))
    llm.runner.capture_graphs(sizes, emulate=True)
    assert sorted(llm.runner.graphs.batches) == list(sizes)
    replayed, unreplayed = [], 0
    real_replay, real_decode = llm.runner.graphs.replay, llm.runner._decode

    def replay(fb):
        replayed.append(fb.batch_size)
        return real_replay(fb)

    def decode(fb):
        nonlocal unreplayed
        unreplayed += 1
        return real_decode(fb)

    llm.runner.graphs.replay, llm.runner._decode = replay, decode
    rng = random.Random(seed + 4)
    texts = [[rng.randrange(320) for _ in range(rng.randrange(1, 30))] for _ in range(prompts)]
    steps = 8
    outs = llm.generate(texts, SamplingParams(max_new_tokens=steps, temperature=0.0, n=n))
    assert unreplayed == 0 and max(replayed) == sizes[-1], f"seed={seed}"
    for i, o in enumerate(outs):
        assert_matches_hf(hf, texts[i // n], o.token_ids, what=f"seed={seed}", steps=steps)
