"""EngineConfig: every option once, checked with one sentence, old names still taken with a warning,
and a command-line flag for every field."""

import dataclasses
import warnings

import pytest
from typer.testing import CliRunner

from flexsgl import LLM
from flexsgl.cli import app
from flexsgl.config import DEPRECATED, EngineConfig


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
    {"random_seed": -1}, {"override": 3}, {"model": 7},
], ids=lambda o: ",".join(f"{k}={v!r}" for k, v in o.items()))
def test_bad_values_are_refused_in_one_sentence(options):
    with pytest.raises(ValueError) as e:
        EngineConfig(**options)
    assert next(iter(options)).replace("_", " ") in one_sentence(e).replace("_", " ").lower() or \
        repr(next(iter(options.values()))) in str(e.value)


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
