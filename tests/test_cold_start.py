"""`auto` and FlashInfer's first-use compile: for a small model, auto leaves fi and fi-decode out
while their kernel is neither installed (flashinfer-jit-cache, an AOT build of flashinfer) nor in
FlashInfer's JIT cache, and says why; larger models and named overrides keep FlashInfer.

The GPU (its SM), the installed packages and FlashInfer's files are faked in a temporary folder, so
this runs on the CPU. The module names are written out by hand from FlashInfer's naming
(flashinfer/jit/attention/modules.py); tests/test_gpu_overrides.py checks them against the files a
real fi-decode run leaves.
"""

import dataclasses
import importlib.machinery
import importlib.metadata
import importlib.util

import pytest
import torch

import flexsgl.attention.registry as registry
from flexsgl.config import EngineConfig
from flexsgl.model.presets import DEFAULT_MODEL
from flexsgl.model.source import resolve as resolve_source
from flexsgl.overrides import flashinfer_kernels

GPU = torch.device("cuda")
SMALL = resolve_source(DEFAULT_MODEL, "auto").config  # 3.4M parameters, 4 query heads on 2 KV heads of 64 dims
LARGE = resolve_source("qwen3-0.6b", "dummy").config
VERSION = "0.6.18.post1"
# fi-decode's kernel for SMALL in bfloat16: on tensor cores (grouped KV heads), FlashInfer's FA2 batch prefill module.
GQA_DECODE = ("batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_64_"
              "head_dim_vo_64_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False")
MHA_DECODE = ("batch_decode_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_64_"
              "head_dim_vo_64_posenc_0_use_swa_False_use_logits_cap_False")
AUTO_SM90 = "fa3-prefill,fi-decode,triton-decode<=64"


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A GPU of SM `sm` with `packages` importable, flashinfer-python VERSION's metadata, FlashInfer's
    workspace under tmp_path/home, and the packages flashinfer and flashinfer_jit_cache in tmp_path/site."""
    site, home = tmp_path / "site", tmp_path / "home"
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(home))
    real_spec, real_version = importlib.util.find_spec, importlib.metadata.version

    def make(sm: int, packages=("sgl_kernel", "flashinfer", "triton")):
        monkeypatch.setattr(registry, "sm_version", lambda device: sm if device.type == "cuda" else None)

        def find_spec(name, *a):
            if name in ("flashinfer", "flashinfer_jit_cache") and name in packages:
                spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
                spec.submodule_search_locations = [str(site / name)]
                return spec
            if name in ("sgl_kernel", "flashinfer", "flashinfer_jit_cache", "triton"):
                return object() if name in packages else None
            return real_spec(name, *a)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda dist: VERSION if dist == "flashinfer-python" else real_version(dist))

    make.site, make.home = site, home
    return make


def put(folder, module: str) -> None:
    (folder / module).mkdir(parents=True)
    (folder / module / f"{module}.so").write_bytes(b"\x7fELF")


def jit_cache(home, version=VERSION, archs="90a"):
    return home / ".cache" / "flashinfer" / version / archs / "cached_ops"


def resolved(model=SMALL, override="auto", **options):
    return EngineConfig(override=override, **options).resolve(model, GPU).attention


def test_a_small_model_without_a_compiled_kernel_decodes_on_triton_and_says_why(machine):
    machine(90)
    c = resolved()
    assert c.label == "fa3-prefill,triton-decode" and c.small_decode is None
    assert c.note == (f"auto took fa3-prefill,triton-decode over {AUTO_SM90}: FlashInfer has no compiled kernel for "
                      f"this model's shapes ({GQA_DECODE}: no flashinfer-jit-cache of its version holds it, nor its "
                      f"JIT cache), and compiling it (~25 s) is longer than this 3.4M-parameter model needs to "
                      f"start; --override {AUTO_SM90} compiles it once")


@pytest.mark.parametrize("where", ["jit-cache", "aot", "jit-cache-of-two-archs"])
def test_a_compiled_kernel_keeps_flashinfer(machine, where):
    machine(90, packages=("sgl_kernel", "flashinfer", "flashinfer_jit_cache", "triton"))
    folder = {"jit-cache": jit_cache(machine.home), "jit-cache-of-two-archs": jit_cache(machine.home, archs="80_90a"),
              "aot": machine.site / "flashinfer_jit_cache" / "jit_cache"}[where]
    put(folder, GQA_DECODE)
    c = resolved()
    assert (c.label, c.note) == (AUTO_SM90, "")


@pytest.mark.parametrize("where", ["another-version", "another-arch", "another-dtype", "another-head-size"])
def test_a_kernel_compiled_for_something_else_does_not_count(machine, where):
    machine(90)
    if where == "another-version":
        put(jit_cache(machine.home, version="0.6.17"), GQA_DECODE)
    elif where == "another-arch":
        put(jit_cache(machine.home, archs="80"), GQA_DECODE)
    elif where == "another-dtype":
        put(jit_cache(machine.home), GQA_DECODE.replace("bf16", "f16"))
    else:
        put(jit_cache(machine.home), GQA_DECODE.replace("_64_", "_128_"))
    assert resolved().label == "fa3-prefill,triton-decode"


def test_an_mha_model_needs_flashinfers_decode_module(machine):
    machine(90)
    mha = dataclasses.replace(SMALL, num_kv_heads=SMALL.num_heads)
    put(jit_cache(machine.home), GQA_DECODE)  # the tensor-core module: not what MHA decode runs
    assert resolved(mha).label == "fa3-prefill,triton-decode"
    put(jit_cache(machine.home), MHA_DECODE)
    assert resolved(mha).label == AUTO_SM90


def test_without_triton_decode_goes_to_flex(machine):
    machine(90, packages=("sgl_kernel", "flashinfer"))
    assert resolved().label == "fa3-prefill,flex"


def test_fi_on_sm100_needs_its_prefill_and_decode_modules(machine):
    machine(100)
    c = resolved()
    assert c.label == "flex,triton-decode" and c.note.startswith("auto took flex,triton-decode over fi: ")
    put(jit_cache(machine.home, archs="100a"), GQA_DECODE)  # FA2 on SM100: one module serves both phases
    assert resolved().label == "fi"


@pytest.mark.parametrize("sm", [90, 100])
def test_flashinfer_stays_where_flex_cannot_take_its_place(machine, sm):
    """Pages of 8 tokens: FlashInfer and FA3 take them, flex and triton-decode do not on a GPU (so auto
    itself drops triton-decode's small batches on SM90)."""
    machine(sm)
    c = resolved(page_size=8)
    assert (c.label, c.note) == ({90: "fa3-prefill,fi-decode", 100: "fi"}[sm], ""), c.label
    assert resolved(page_size=16).label == {90: "fa3-prefill,triton-decode", 100: "flex,triton-decode"}[sm]


def test_larger_models_and_named_overrides_keep_flashinfer_cold(machine):
    machine(90)
    assert LARGE.num_params() > 100e6 and resolved(LARGE).label == AUTO_SM90
    assert resolved(override="fa3-prefill,fi-decode").label == "fa3-prefill,fi-decode"
    assert resolved(override=AUTO_SM90).label == AUTO_SM90


def test_the_module_names_follow_flashinfers_naming():
    assert flashinfer_kernels.modules("fi-decode", "bfloat16", 64, True, 90) == [GQA_DECODE]
    assert flashinfer_kernels.modules("fi-decode", "bfloat16", 64, False, 90) == [MHA_DECODE]
    assert flashinfer_kernels.modules("fi", "float16", 128, True, 90) == [
        GQA_DECODE.replace("bf16", "f16").replace("_64_", "_128_"),
        GQA_DECODE.replace("bf16", "f16").replace("_64_", "_128_") + "_sm90"]
    assert flashinfer_kernels.modules("fi", "bfloat16", 64, True, 100) == [GQA_DECODE]


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)])  # tensor cores (the embedded model's shape), and MHA
def test_the_lookup_finds_the_module_a_fi_decode_run_leaves(hq, hkv):
    """On the device: once fi-decode has run (compiling its kernel, or loading a compiled one), the
    lookup finds that module under the name flashinfer_kernels gives it, in one of the places
    FlashInfer itself loads it from."""
    from flexsgl.attention.registry import SPECS, backend_class, why_not
    from tests.test_flex_attention import CASES, run_backend_case

    reason = why_not(SPECS["fi-decode"], GPU)
    if reason:
        pytest.skip(f"fi-decode: {reason}")
    from flashinfer.jit import env as jit_env

    run_backend_case(CASES["decode"], 64, None, "cuda", torch.bfloat16, rtol=1e-2, atol=1e-2, hq=hq, hkv=hkv, d=64,
                     backend_cls=backend_class(SPECS["fi-decode"]))
    module = flashinfer_kernels.decode_module("bfloat16", 64, grouped=hq != hkv)
    found = flashinfer_kernels.compiled(module, registry.sm_version(GPU))
    assert found in (jit_env.FLASHINFER_AOT_DIR / module / f"{module}.so",
                     jit_env.FLASHINFER_JIT_DIR / module / f"{module}.so"), found
