"""EngineConfig: every option once, checked with one sentence, old names still taken with a warning,
a command-line flag for every field, and its resolution for a model and a device (defaults made
concrete, rules between options refused before anything loads)."""

import dataclasses
import re
import warnings

import pytest
import torch
from typer.testing import CliRunner

import flexsgl.attention.registry as registry
from flexsgl import LLM
from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.attention.registry import BackendSpec
from flexsgl.cli import app
from flexsgl.config import DEPRECATED, EngineConfig
from flexsgl.model.source import resolve as resolve_source


def one_sentence(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg and msg.endswith("."), f"not a one-sentence message: {msg!r}"
    return msg


@pytest.mark.parametrize("options", [
    {"device": "tpu"}, {"device": 3}, {"dtype": "float64"}, {"load_format": "pickle"}, {"page_size": 0},
    {"page_size": 2.5}, {"page_size": True}, {"max_total_tokens": -1}, {"max_total_tokens": "4096"},
    {"mem_fraction_static": 0.0}, {"mem_fraction_static": 1.5}, {"mem_fraction_static": "0.5"},
    {"max_running_requests": 0}, {"max_num_batched_tokens": 0}, {"compile": "yes"},
    {"disable_cuda_graph": None}, {"cuda_graph_bs": ()}, {"cuda_graph_bs": (1, 0)}, {"cuda_graph_bs": "1,2"},
    {"random_seed": -1}, {"override": 3}, {"model": 7}, {"cuda_graph_max_bs": 0}, {"cuda_graph_max_bs": 2.0},
    {"prefill_first": "maybe"}, {"prefill_first": None}, {"kv_cache_dtype": "int4"}, {"quantization": "awq"},
    {"tensor_parallel_size": 0}, {"context_length": 0}, {"context_length": "4k"},
], ids=lambda o: ",".join(f"{k}={v!r}" for k, v in o.items()))
def test_bad_values_are_refused_in_one_sentence(options):
    with pytest.raises(ValueError) as e:
        EngineConfig(**options)
    assert next(iter(options)).replace("_", " ") in one_sentence(e).replace("_", " ").lower() or \
        repr(next(iter(options.values()))) in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the device exists here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_device_on_a_machine_without_one_is_named_as_given(device):
    with pytest.raises(ValueError) as e:
        EngineConfig(device=device)
    assert f"Device {device!r} was asked for" in one_sentence(e)


def test_unknown_option_is_refused_before_anything_loads():
    with pytest.raises(ValueError) as e:
        LLM("tiny", device="cpu", kv_cache_size=1024)
    assert "Unknown engine option 'kv_cache_size'" in one_sentence(e)


@pytest.mark.parametrize("old", list(DEPRECATED))
def test_old_names_warn_and_set_the_new_option(old):
    new, convert = DEPRECATED[old]
    value = {"cuda_graphs": False, "graph_batch_sizes": [1, 2], "gpu_memory_fraction": 0.5}.get(old, 96)
    with pytest.warns(FutureWarning, match=f"'{old}' is deprecated; use '{new}'"):
        cfg = EngineConfig.from_options("tiny", **{old: value})
    assert getattr(cfg, new) == (tuple(value) if isinstance(value, list) else convert(value))
    assert cfg.model == "tiny"


def test_old_and_new_name_together_are_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError) as e:
            EngineConfig.from_options(kv_cache_tokens=64, max_total_tokens=128)
    assert "not both" in one_sentence(e)


def test_context_length_limits_requests_and_the_kv_caches_default():
    """context_length (vLLM's max_model_len, taken too) cuts the context: a request of exactly that
    many tokens runs, one more is refused naming it, and the CPU's default KV cache is what the
    running requests at that context fill; above the model's own context it is refused."""
    import random

    from flexsgl import SamplingParams

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    ctx = rng.randrange(40, 200)
    llm = LLM("tiny", device="cpu", load_format="dummy", max_model_len=ctx, max_running_requests=4, page_size=16)
    assert llm.config.max_position == ctx and llm.pool.num_pages - 1 == 2 * 4 * -(-ctx // 16), seed
    prompt = [rng.randrange(1, 200) for _ in range(rng.randrange(1, ctx - 1))]
    fits, over = llm.generate([prompt, prompt], [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
                                                 for n in (ctx - len(prompt), ctx - len(prompt) + 1)])
    assert (fits.finish_reason, len(fits.token_ids)) == ("length", ctx - len(prompt)), seed
    assert over.finish_reason == "refused" and f"context of {ctx} tokens" in over.error, (seed, over.error)
    whole = resolve_source("tiny").config.max_position
    with pytest.raises(ValueError) as e:
        LLM("tiny", device="cpu", load_format="dummy", context_length=whole + 1)
    assert f"context_length {whole + 1} exceeds the model's context of {whole} tokens" in one_sentence(e)
    with pytest.raises(ValueError) as e:
        EngineConfig.from_options(context_length=64, max_model_len=64)
    assert "not both" in one_sentence(e)


def test_llm_takes_a_config_or_options_and_keeps_it():
    cfg = EngineConfig(model="tiny", device="cpu", max_total_tokens=512, page_size=16, max_running_requests=3)
    llm = LLM(cfg)
    assert llm.engine_config is cfg
    assert (llm.pool.num_pages - 1) * llm.pool.page_size == 512 and llm.scheduler.max_running == 3
    assert LLM("tiny", device="cpu", max_total_tokens=512, page_size=16, max_running_requests=3).engine_config == cfg
    with pytest.raises(ValueError):
        LLM(cfg, page_size=32)


def test_every_option_has_a_flag_and_old_flags_stay_hidden():
    r = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    for f in dataclasses.fields(EngineConfig):
        assert f"--{f.name.replace('_', '-')}" in r.output, f.name
    for old in DEPRECATED:
        if old != "seed":  # generate's own --seed is the sampling seed
            assert f"--{old.replace('_', '-')} " not in r.output, old
    assert "--log-level" in r.output


@pytest.mark.parametrize("typo, suggested, hidden", [("--max-runing", "--max-running-requests", "--max-running"),
                                                     ("--graph-batch", "--cuda-graph-bs", "--graph-batch-sizes")])
def test_a_mistyped_flag_is_not_pointed_at_a_deprecated_one(typo, suggested, hidden):
    r = CliRunner().invoke(app, ["generate", "hi", typo, "4"], env={"COLUMNS": "300"})
    assert r.exit_code == 2 and suggested in r.output, r.output
    assert not re.search(re.escape(hidden) + r"[,)]", r.output), r.output


# ---- EngineConfig.resolve: every default made concrete, every rule between options checked


TINY = resolve_source("tiny", "dummy").config
CPU, GPU = torch.device("cpu"), torch.device("cuda")  # resolve only reads the GPU's kind: no GPU is needed


class FineBucketFlex(FlexAttentionBackend):
    """Flex under another name, as a backend that compiles once for every batch size (a kernel override)."""

    name = "flex-fine"
    compiles_per_shape = False


@pytest.fixture
def fine_decode(monkeypatch):
    spec = BackendSpec("flex-fine", f"{__name__}:FineBucketFlex", ("decode",), None, None)
    monkeypatch.setitem(registry.SPECS, "flex-fine", spec)


def test_cpu_defaults_resolve_to_float32_eager_no_graphs_and_16k_tokens():
    rc = EngineConfig(model="tiny").resolve(TINY, CPU)
    assert (rc.device, rc.dtype, rc.compile, rc.cuda_graph_bs, rc.max_total_tokens) == \
        (CPU, torch.float32, False, (), 16384)
    assert rc.attention.label == "flex"
    rc = EngineConfig(dtype="bf16", compile=True, max_total_tokens=640).resolve(TINY, CPU)
    assert (rc.dtype, rc.compile, rc.max_total_tokens) == (torch.bfloat16, True, 640)
    for name, dtype in (("half", torch.float16), ("float", torch.float32)):  # vLLM's names
        assert EngineConfig(dtype=name).resolve(TINY, CPU).dtype == dtype


@pytest.mark.parametrize("checkpoint_dtype, dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16),
                                                      ("float32", torch.bfloat16), (None, torch.bfloat16)])
def test_gpu_dtype_auto_is_the_checkpoints_half_type(checkpoint_dtype, dtype):
    model = dataclasses.replace(TINY, torch_dtype=checkpoint_dtype)
    rc = EngineConfig(override="flex").resolve(model, GPU)
    assert rc.dtype == dtype and rc.compile and rc.max_total_tokens is None  # None: sized after the weights load


@pytest.mark.parametrize("preset, requests, given, compiled", [
    ("tiny", 1, None, False),  # generate's one prompt of a small model: uncompiled
    ("tiny", 1, True, True),  # unless asked
    ("tiny", 2, None, True),
    ("qwen3-0.6b", 1, None, True),  # 596M parameters
])
def test_gpu_compile_default_is_off_only_for_one_request_at_a_time_of_a_small_model(preset, requests, given,
                                                                                     compiled):
    model = resolve_source(preset, "dummy").config
    rc = EngineConfig(override="flex", max_running_requests=requests, compile=given).resolve(model, GPU)
    assert rc.compile is compiled


@pytest.mark.parametrize("decode, sizes", [
    ("flex", (1, 2, 4, 8, 16, 32, 40)),  # flex compiles per batch size: few buckets
    ("flex-fine", (1, 2, 4, 8, 16, 24, 32, 40)),  # one compile for all sizes: SGLang's spacing, 8 apart
])
def test_gpu_graph_sizes_default_to_the_decode_buckets(fine_decode, decode, sizes):
    rc = EngineConfig(override=f"flex,{decode}", max_running_requests=40).resolve(TINY, GPU)
    assert rc.cuda_graph_bs == sizes


@pytest.mark.parametrize("decode, max_bs, sizes", [
    ("flex", 10, (1, 2, 4, 8, 10)),  # the buckets below it, and it
    ("flex-fine", 20, (1, 2, 4, 8, 16, 20)),
    ("flex", 32, (1, 2, 4, 8, 16, 32)),
    ("flex", 64, (1, 2, 4, 8, 16, 32, 40)),  # beyond max_running_requests: up to max_running_requests
])
def test_cuda_graph_max_bs_defers_the_larger_sizes(fine_decode, decode, max_bs, sizes):
    rc = EngineConfig(override=f"flex,{decode}", max_running_requests=40, cuda_graph_max_bs=max_bs).resolve(TINY, GPU)
    assert rc.cuda_graph_bs == sizes


def test_given_graph_sizes_are_sorted_once_each_and_off_without_graphs():
    assert EngineConfig(override="flex", cuda_graph_bs=[8, 2, 2, 1]).resolve(TINY, GPU).cuda_graph_bs == (1, 2, 8)
    assert EngineConfig(override="flex", disable_cuda_graph=True).resolve(TINY, GPU).cuda_graph_bs == ()


@pytest.mark.parametrize("options, device, sentence", [
    ({"cuda_graph_bs": (1, 2, 8), "max_running_requests": 4}, GPU,
     "CUDA graph batch sizes go up to max_running_requests (4), got 8."),
    ({"cuda_graph_bs": (1, 2)}, CPU, "cuda_graph_bs was given, but CUDA graphs are off: they need a CUDA device "
                                     "(this engine runs on cpu) and disable_cuda_graph unset."),
    ({"cuda_graph_bs": (1, 2), "disable_cuda_graph": True}, GPU, "cuda_graph_bs was given, but CUDA graphs are "
     "off: they need a CUDA device (this engine runs on cuda) and disable_cuda_graph unset."),
    ({"cuda_graph_max_bs": 8}, CPU, "cuda_graph_max_bs was given, but CUDA graphs are off: they need a CUDA "
                                    "device (this engine runs on cpu) and disable_cuda_graph unset."),
    ({"cuda_graph_bs": (1, 2, 8), "cuda_graph_max_bs": 4}, GPU,
     "CUDA graph batch sizes go up to cuda_graph_max_bs (4), got 8."),
    ({"max_total_tokens": 10}, CPU, "The KV cache must hold at least one page (64 tokens); it would hold 10."),
    ({"max_total_tokens": 31, "page_size": 32}, GPU,
     "The KV cache must hold at least one page (32 tokens); it would hold 31."),
], ids=["graphs-beyond-max-running", "graphs-on-cpu", "graphs-disabled", "max-bs-on-cpu", "graphs-beyond-max-bs",
        "kv-below-a-page", "kv-below-a-page-gpu"])
def test_rules_between_options_are_refused_in_one_sentence(options, device, sentence):
    with pytest.raises(ValueError) as e:
        EngineConfig(override="flex", **options).resolve(TINY, device)
    assert one_sentence(e) == sentence


@pytest.mark.parametrize("options", [{"max_total_tokens": 10}, {"max_total_tokens": 63, "page_size": 64}])
def test_llm_refuses_a_kv_cache_below_a_page_before_loading(monkeypatch, options):
    import flexsgl.engine_core

    monkeypatch.setattr(flexsgl.engine_core, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match=r"^The KV cache must hold at least one page \(64 tokens\)"):
        LLM("tiny", device="cpu", **options)


def test_the_engine_builds_what_the_config_resolves_to():
    llm = LLM("tiny", device="cpu", max_total_tokens=640, page_size=32, dtype="bfloat16")
    assert llm.resolved == llm.engine_config.resolve(llm.config, CPU)
    assert llm.dtype == llm.model.lm_head.weight.dtype == torch.bfloat16 and llm.compile is False
    assert (llm.pool.num_pages - 1) * llm.pool.page_size == 640 and llm.runner.graphs is None
