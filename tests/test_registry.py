"""Backend registry: what each override resolves to, and the one-sentence refusals, on any machine.

GPU facts are faked (SM version, installed packages) so every branch runs on the CPU; the kernels
themselves are checked on the device by tests/test_gpu_overrides.py.
"""

import importlib.util
import subprocess
import sys

import pytest
import torch

import flexsgl.attention.registry as registry
from flexsgl import LLM
from flexsgl.attention.registry import SPECS, resolve_override

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of the given SM with the given kernel packages installed."""

    def make(sm: int, packages=("sgl_kernel", "flashinfer", "triton")):
        monkeypatch.setattr(registry, "sm_version", lambda device: sm if device.type == "cuda" else None)
        real = importlib.util.find_spec
        monkeypatch.setattr(registry.importlib.util, "find_spec",
                            lambda name, *a: object() if name in packages else (
                                None if name in ("sgl_kernel", "flashinfer", "triton") else real(name, *a)))

    return make


def labels(override, device, **kw):
    c = resolve_override(override, device, **kw)
    return c.prefill.name, c.decode.name


def test_cpu_runs_flex_and_refuses_the_kernels():
    assert labels("auto", CPU) == ("flex", "flex")
    assert labels("flex", CPU) == ("flex", "flex")
    for name in ("fa3", "fi", "fi-decode", "fa3-prefill,fi-decode"):
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            resolve_override(name, CPU)


def test_sm90_with_kernels(fake_gpu):
    fake_gpu(90)
    assert labels("auto", GPU, head_dim=128, dtype="bfloat16") == ("fa3-prefill", "fi-decode")
    assert labels("fi-decode", GPU) == ("flex", "fi-decode")  # one phase named: flex runs the other
    assert labels("fa3-prefill", GPU) == ("fa3-prefill", "flex")
    assert labels("fa3", GPU) == ("fa3", "fa3")
    assert labels("fa3-prefill,fi-decode", GPU) == ("fa3-prefill", "fi-decode")
    assert labels("fi,flex", GPU) == ("fi", "flex")


def test_small_batch_decode_backend(fake_gpu):
    fake_gpu(90)
    small = "triton-decode<=64"  # auto's small-batch decode on SM90, as README and BENCHMARKS give it
    c = resolve_override("auto", GPU, head_dim=128, dtype="bfloat16", page_size=64)
    assert c.label == f"fa3-prefill,fi-decode,{small}"
    assert (c.small_decode.name, c.small_decode_max) == (small.split("<=")[0], int(small.split("<=")[1]))
    c = resolve_override("fa3,fa3,triton-decode<=4", GPU)
    assert (c.decode.name, c.small_decode.name, c.small_decode_max) == ("fa3", "triton-decode", 4)
    # auto leaves the small-batch backend out where it cannot run: pages it does not read, no triton
    assert resolve_override("auto", GPU, page_size=8).small_decode is None
    fake_gpu(90, packages=("sgl_kernel", "flashinfer"))
    assert resolve_override("auto", GPU).label == "fa3-prefill,fi-decode"
    with pytest.raises(ValueError, match="'triton-decode' cannot run here: the package 'triton' is not installed"):
        resolve_override("fa3-prefill,fi-decode,triton-decode<=8", GPU)


@pytest.mark.parametrize("kw,reason", [
    ({"dtype": "float32"}, "runs bfloat16 and float16, and this engine runs float32"),
    ({"head_dim": 16}, "head sizes 64/96/128/192/256, and this model's is 16"),
])
def test_auto_falls_back_to_flex_where_the_kernels_cannot_serve(fake_gpu, kw, reason):
    fake_gpu(90)
    assert labels("auto", GPU, **kw) == ("flex", "flex")
    with pytest.raises(ValueError, match=reason):
        resolve_override("fa3", GPU, **kw)


def test_missing_package_is_named_and_auto_falls_back(fake_gpu):
    fake_gpu(90, packages=("flashinfer",))
    with pytest.raises(ValueError, match="the package 'sgl_kernel' is not installed"):
        resolve_override("fa3-prefill,fi-decode", GPU)
    assert labels("auto", GPU) == ("flex", "flex")
    assert labels("fi", GPU) == ("fi", "fi")


def test_trtllm_mla_is_refused_off_blackwell_and_on_gqa_models(fake_gpu):
    fake_gpu(90)
    with pytest.raises(ValueError, match="runs on SM 100, and this GPU is SM 90"):
        resolve_override("trtllm-mla", GPU, attention="mla")
    fake_gpu(100)
    with pytest.raises(ValueError, match="serves MLA models, and this model is GQA"):
        resolve_override("trtllm-mla", GPU)
    with pytest.raises(ValueError, match="reads? pages of 32 or 64 tokens, and page_size is 16"):
        resolve_override("trtllm-mla", GPU, attention="mla", page_size=16)
    with pytest.raises(ValueError, match=r"latent sizes \(kv_lora_rank \+ rope dims\) 576/320, and this model's is 80"):
        resolve_override("trtllm-mla", GPU, attention="mla", head_dim=80)
    assert labels("trtllm-mla", GPU, attention="mla", page_size=64, head_dim=576) == ("flex", "trtllm-mla")


def test_triton_mla_serves_mla_decode_only(fake_gpu):
    fake_gpu(90)
    assert labels("triton-mla", GPU, attention="mla", page_size=64, head_dim=576) == ("flex", "triton-mla")
    three = resolve_override("fi-mla,fi-mla,triton-mla<=8", GPU, attention="mla", page_size=64, head_dim=576)
    assert (three.decode.name, three.small_decode.name, three.small_decode_max) == ("fi-mla", "triton-mla", 8)
    with pytest.raises(ValueError, match="^Override 'triton-mla' cannot run here: it serves MLA models, and this "
                                         "model is GQA.$"):
        resolve_override("triton-mla", GPU)
    with pytest.raises(ValueError, match="power-of-two size from 16 tokens, and the page size is 48"):
        resolve_override("triton-mla", GPU, attention="mla", page_size=48)
    with pytest.raises(ValueError, match="Override 'triton-mla' does not run prefill"):
        resolve_override("triton-mla,flex", GPU, attention="mla")


@pytest.mark.parametrize("name", ["fa3", "fa3-prefill", "fi", "fi-decode", "triton-decode"])
def test_gqa_kernels_are_refused_for_mla_models(fake_gpu, name):
    fake_gpu(90)
    with pytest.raises(ValueError, match=f"^Override '{name}' cannot run here: it serves GQA models, and this "
                                         "model is MLA.$"):
        resolve_override(name, GPU, attention="mla", head_dim=576, dtype="bfloat16")


@pytest.mark.parametrize("sm,expected", [(80, ("fi-mla", "fi-mla")), (90, ("fi-mla", "fi-mla")),
                                         (100, ("fi-mla", "trtllm-mla")), (120, ("flex", "flex"))])
def test_auto_for_mla_models(fake_gpu, sm, expected):
    fake_gpu(sm)
    assert labels("auto", GPU, attention="mla", head_dim=576, dtype="bfloat16", page_size=64) == expected
    small = resolve_override("auto", GPU, attention="mla", head_dim=576, dtype="bfloat16", page_size=64).small_decode
    assert (small.name if small else None) == ("triton-mla" if sm == 90 else None)  # batches up to 8 on SM90
    # Latent sizes the kernels are not built for, or no flashinfer: flex
    assert labels("auto", GPU, attention="mla", head_dim=80, dtype="bfloat16", page_size=64) == ("flex", "flex")
    fake_gpu(sm, packages=("sgl_kernel", "triton"))
    assert labels("auto", GPU, attention="mla", head_dim=576, dtype="bfloat16", page_size=64) == ("flex", "flex")


def test_engine_refuses_a_gqa_kernel_for_an_mla_model_before_loading(monkeypatch, fake_gpu):
    import flexsgl.engine
    import flexsgl.engine_core

    fake_gpu(90)
    monkeypatch.setattr(flexsgl.engine_core, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(flexsgl.engine.EngineConfig, "torch_device", property(lambda self: GPU))
    with pytest.raises(ValueError, match="^Override 'fi-decode' cannot run here: it serves GQA models, and this "
                                         "model is MLA.$"):
        LLM("tiny-mla", load_format="dummy", override="fi-decode")


@pytest.mark.parametrize("override,match", [
    ("nope", "Unknown attention override 'nope'"),
    ("fa3,fi,flex,flex", "one backend, PREFILL,DECODE or PREFILL,DECODE,SMALL_DECODE<=N"),
    ("flex,flex,flex", "the largest batch it takes, e.g. triton-decode<=8"),
    ("flex,flex,flex<=0", "the largest batch it takes"),
    ("flex,flex,fa3-prefill<=8", "'fa3-prefill' does not run decode"),
    ("fi-decode,flex", "'fi-decode' does not run prefill"),
    ("flex,fa3-prefill", "'fa3-prefill' does not run decode"),
    ("flex,", "one backend, PREFILL,DECODE"),
])
def test_malformed_overrides(override, match):
    with pytest.raises(ValueError, match=match):
        resolve_override(override, CPU)


def test_engine_refuses_an_override_before_loading(monkeypatch):
    import flexsgl.engine_core

    monkeypatch.setattr(flexsgl.engine_core, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match="Override 'fa3' cannot run here: it needs a CUDA GPU"):
        LLM("tiny", load_format="dummy", device="cpu", override="fa3")


def test_table_lists_every_backend_with_a_reason():
    rows = {r["name"]: r for r in registry.table(CPU)}
    assert set(rows) == set(SPECS) | {"auto"}
    assert rows["flex"]["models"] == "gqa,mla" and rows["trtllm-mla"]["models"] == "mla"
    assert "untested on hardware" in rows["trtllm-mla"]["about"]
    assert rows["flex"]["runs_here"] and rows["auto"]["runs_here"]
    for name in SPECS:
        if name != "flex":
            assert not rows[name]["runs_here"] and rows[name]["why_not"]


@pytest.mark.parametrize("installed", [True, False])
def test_table_says_whether_flex_prefill_has_its_flash_backend(fake_gpu, monkeypatch, installed):
    """On SM90, flex's row says that prefill runs on FlexAttention's FLASH backend, or how to get it:
    the `flash` extra, which pyproject.toml must define with flash-attn-4."""
    from pathlib import Path

    import flexsgl.attention.flex_options as flex_options

    fake_gpu(90)
    monkeypatch.setattr(flex_options, "_flash_installed", lambda: installed)
    about = {r["name"]: r for r in registry.table(GPU)}["flex"]["about"]
    if installed:
        assert "FLASH backend (flash-attn-4)" in about
    else:
        assert "pip install 'flexsgl[flash]'" in about
        pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
        assert 'flash = ["flash-attn-4==' in pyproject  # the extra (tomllib is Python 3.11+)
    assert flex_options.flash_note(None) == "" == flex_options.flash_note(80)


def test_cli_backends_and_a_refused_override():
    run = lambda *args: subprocess.run([sys.executable, "-m", "flexsgl.cli", *args],  # noqa: E731
                                       capture_output=True, text=True, timeout=120)
    table = run("backends", "--device", "cpu")
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    for name in list(SPECS) + ["auto"]:
        assert any(line.split()[0] == name for line in lines[2:]), name
    refused = run("generate", "Hello", "--device", "cpu", "--model", "tiny", "--override", "fa3")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: Override 'fa3' cannot run here: it needs a CUDA GPU (SM 90), and the device is cpu."]


def test_flashinfer_page_lists_by_hand():
    """The CSR page list FlashInfer is planned with (host logic; the kernels run on the device)."""
    from flexsgl.overrides.flashinfer import csr_pages

    # Page size 4: 1 token on one page; 4 tokens filling one page; 9 tokens on 3 of the 4 pages the
    # request holds (the one allocated ahead is not read); a padding row on the dummy page.
    indptr, last, indices = csr_pages([1, 4, 9, 1], [[7], [3], [5, 2, 8, 6], [0]], 4)
    assert indptr == [0, 1, 2, 5, 6]
    assert last == [1, 4, 1, 1]
    assert indices == [7, 3, 5, 2, 8, 0]


def test_a_users_mod_without_kernel_features_runs_on_flex_only(fake_gpu):
    """A variant with a mask_mod or score_mod and no `kernel=` (the ATTENTION.md way of writing one):
    no kernel override may take it, for the kernels would run plain attention in its place; a
    variant without mods (a window) and one that names its kernel features may go to kernels."""
    from flexsgl.attention.variant import AttentionVariant

    fake_gpu(90)
    kw = dict(head_dim=128, dtype="bfloat16", page_size=64)
    mods = [AttentionVariant("near", mask_mod=lambda b, h, q, kv: q - kv < 8),
            AttentionVariant("halved", score_mod=lambda s, b, h, q, kv: s * 0.5)]
    for v in mods:
        assert v.kernel is None and v.features() is None
        assert resolve_override("auto", GPU, variants=[v], **kw).label == "flex"
        for name in ("fa3", "fi", "fa3-prefill,fi-decode", "flex,triton-decode"):
            with pytest.raises(ValueError, match="whose mods only flex runs"):
                resolve_override(name, GPU, variants=[v], **kw)
    window = AttentionVariant("window", window=8)
    assert window.kernel == {} and resolve_override("fa3", GPU, variants=[window], **kw).label == "fa3"
    capped = AttentionVariant("capped", score_mod=lambda s, b, h, q, kv: s, kernel={"softcap": 30.0})
    assert resolve_override("fa3", GPU, variants=[capped], **kw).label == "fa3"
