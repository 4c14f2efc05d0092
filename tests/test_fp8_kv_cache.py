"""An FP8 KV cache (kv_cache_dtype fp8_e4m3): K and V stored in float8_e4m3fn divided by per-layer
scales (the checkpoint's k_scale / v_scale), read by flex as they are.

The reference is HF transformers running the same checkpoint with its attention over the K and V
the engine stored, dequantized with the checkpoint's scales, in float32; the stored values
themselves are checked against HF's own K and V quantized (check_against_hf)."""

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsgl import LLM, SamplingParams
from flexsgl.attention.registry import SPECS, why_not
from flexsgl.errors import CheckpointError
from tests.hf_models import capture_logits, make_checkpoint, logits_rel_error

FP8 = torch.float8_e4m3fn
STEPS = 24
LENGTHS = (1, 9, 40)


def fake_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    top = torch.finfo(FP8).max
    return (x / scale).clamp(-top, top).to(FP8).to(x.dtype) * scale


def add_kv_scales(path, seed: int, layers: int, name: str = "{}_scale") -> dict[int, tuple[float, float]]:
    """Write per-layer k_scale and v_scale tensors (`name` of "k" or "v" under `self_attn.`) into
    the checkpoint at `path`; returns them. The scales are small, so that K/V divided by them spread
    over FP8's range and its rounding shows."""
    rng = random.Random(seed)
    scales = {i: (rng.uniform(0.01, 0.05), rng.uniform(0.005, 0.03)) for i in range(layers)}
    f = path / "model.safetensors"
    tensors = load_file(f)
    for i, (k, v) in scales.items():
        tensors[f"model.layers.{i}.self_attn.{name.format('k')}"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.{name.format('v')}"] = torch.tensor(v)
    save_file(tensors, f, metadata={"format": "pt"})
    return scales


class HFOverStoredKV:
    """The HF model of `path` in float32, its attention over given K and V per layer (`use`: each
    [1, Hkv, S, D]) in place of its own, which it records (`own`)."""

    def __init__(self, path):
        from transformers import AttentionInterface, AutoModelForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.use, self.own = {}, {}

        def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
            self.own[module.layer_idx] = key, value
            key, value = self.use[module.layer_idx]
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kw)

        AttentionInterface.register("flexsgl_stored_kv", attention)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="flexsgl_stored_kv").eval()


def scaled_checkpoint(tmp_path_factory, head_dim: int = 16):
    seed = random.randrange(1 << 30)
    path = tmp_path_factory.mktemp("fp8kv")
    hf = make_checkpoint("qwen3", path, seed, head_dim=head_dim)
    scales = add_kv_scales(path, seed, hf.config.num_hidden_layers)
    return path, seed, scales, hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return scaled_checkpoint(tmp_path_factory)


def check_against_hf(path, seed, scales, plain_hf, monkeypatch, tol: float, distinct: bool = True,
                     neighbours: float = 2e-3, noise: float = 0.0, entrywise_layers: int | None = None,
                     hf_path=None, **options) -> LLM:
    """Each prompt alone on a fresh engine (its pages are then 1, 2, ... in order: position p sits in
    slot page_size + p). HF runs the prompt and the engine's tokens over the K/V the engine stored,
    dequantized with the checkpoint's scales: its logits are the engine's within `tol`, and (with
    `distinct`, where `tol` is far below FP8's rounding) far from the unquantized model's. The stored
    FP8 values are HF's own K/V quantized, but for the fraction `neighbours` of entries that float32
    noise (bfloat16's, in a bfloat16 engine) rounded to another FP8 value: one FP8 step away, or
    (`noise`) up to that fraction of its head vector's largest entry away, as a bfloat16 projection,
    norm and rotation leave a small entry's error proportional to its vector's size. That holds
    entry by entry in the first `entrywise_layers` layers (all when None). Deeper in a bfloat16
    engine, each layer's K/V comes from the attention before it, which differs from HF's by the
    kernel's own rounding: there, the stored values' least-squares scale against HF's quantized ones
    is within 5% of 1 (a wrong scale is off by the ratio of two) and their relative distance under
    0.25 (an FP8 step is at most 1/8 of a value; another position's K/V is ~1.4 away). HF reads
    `hf_path` where given (the same weights, with a config transformers loads alone)."""
    hf = HFOverStoredKV(hf_path or path)
    rng = random.Random(seed)
    prompts = [[rng.randrange(plain_hf.config.vocab_size) for _ in range(n)] for n in LENGTHS]
    for i, prompt in enumerate(prompts):
        llm = LLM(str(path), kv_cache_dtype="fp8_e4m3", **options)
        with monkeypatch.context() as patch:  # this engine's capture only
            seen = capture_logits(llm, patch)
            out = llm.generate([prompt], SamplingParams(max_new_tokens=STEPS, temperature=0.0))[0]
        assert out.error is None, out.error
        ids = prompt + out.token_ids[:-1]  # the last token sampled is never stored
        pool, ps = llm.runner.pool, llm.runner.pool.page_size
        slots = slice(ps, ps + len(ids))
        stored = {layer: [t[slots].float().cpu().transpose(0, 1)[None] for t in pool.layer_cache(layer)]
                  for layer in scales}
        hf.use = {layer: (k * scales[layer][0], v * scales[layer][1]) for layer, (k, v) in stored.items()}
        with torch.no_grad():
            ref = hf.model(torch.tensor([ids])).logits[0, len(prompt) - 1:]
            plain = plain_hf(torch.tensor([ids])).logits[0, len(prompt) - 1:]
        ours = torch.stack(seen[out.request_id]).float().cpu()
        rel = logits_rel_error(ours, ref)
        assert rel < tol, f"prompt {i} (len {len(prompt)}): logits relative error {rel:.2e}, seed={seed}"
        off = logits_rel_error(ours, plain)
        assert off > 10 * tol or not distinct, f"prompt {i}: the FP8 rounding does not show ({off:.2e}), seed={seed}"
        top2 = ref.topk(2, dim=-1).values
        margin = max(1e-3, 2 * tol * ref.abs().max().item())
        clear = (top2[:, 0] - top2[:, 1]) > margin  # steps whose argmax no rounding can flip
        assert (torch.tensor(out.token_ids)[clear] == ref.argmax(-1)[clear]).all(), f"prompt {i}, seed={seed}"
        for layer, (k_scale, v_scale) in scales.items():
            for own, kept, scale in zip(hf.own[layer], stored[layer], (k_scale, v_scale)):
                top = torch.finfo(FP8).max
                want = (own / scale).clamp(-top, top).to(FP8).float()
                if entrywise_layers is not None and layer >= entrywise_layers:
                    fit = ((kept * want).sum() / (want * want).sum()).item()
                    far = ((kept - want).norm() / want.norm()).item()
                    assert abs(fit - 1) < 0.05 and far < 0.25, \
                        f"layer {layer}: scale {fit:.3f}, distance {far:.3f}, seed={seed}"
                    continue
                differ = want != kept
                assert differ.float().mean() < neighbours, f"layer {layer}: {int(differ.sum())} entries, seed={seed}"
                # one FP8 step apart: 1/8 of the value for normals, 2**-9 below 2**-6 (subnormals)
                atol = 2.0**-9 + noise * (own / scale).abs().amax(-1, keepdim=True).expand_as(own)
                apart = (want - kept).abs() - 0.13 * kept.abs() - atol
                assert (apart[differ] <= 0).all(), f"layer {layer}: {apart.max().item():.3g} beyond, seed={seed}"
    return llm


def test_fp8_cache_matches_hf_attending_over_the_stored_kv(checkpoint, monkeypatch):
    path, seed, scales, plain_hf = checkpoint
    llm = check_against_hf(path, seed, scales, plain_hf, monkeypatch, tol=1e-4, device="cpu", page_size=16,
                           max_num_batched_tokens=16)
    pool = llm.runner.pool
    assert pool.k[0].dtype == pool.v[0].dtype == FP8
    for i, layer in enumerate(llm.model.model.layers):  # the checkpoint's scales, layer by layer
        assert layer.self_attn.kv_scales.tolist() == pytest.approx(scales[i], rel=1e-6)


@pytest.mark.parametrize("groups, name", [({}, "{}_scale"), ({"group_0": {"targets": []}}, "{}_proj.output_scale")],
                         ids=["no-groups-k_scale", "empty-group-output_scale"])
def test_a_kv_cache_only_checkpoint_gives_the_fp8_cache_its_scales(tmp_path, monkeypatch, groups, name):
    """A compressed-tensors checkpoint that quantizes its KV cache alone (unquantized weights, a
    kv_cache_scheme and config_groups of nothing, as llm-compressor writes them), its scales named
    `self_attn.k_scale` or the older `self_attn.k_proj.output_scale`: the weights load as they are
    and an FP8 cache takes the scales, matching HF over the stored K/V."""
    import json
    import shutil

    seed = random.randrange(1 << 30)
    plain_hf = make_checkpoint("qwen3", tmp_path / "ref", seed)
    scales = add_kv_scales(tmp_path / "ref", seed, plain_hf.config.num_hidden_layers, name)
    path = shutil.copytree(tmp_path / "ref", tmp_path / "kv")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": groups, "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}
    (path / "config.json").write_text(json.dumps(config))
    llm = check_against_hf(path, seed, scales, plain_hf, monkeypatch, tol=1e-4, hf_path=tmp_path / "ref",
                           device="cpu", page_size=16, max_num_batched_tokens=16)
    for i, layer in enumerate(llm.model.model.layers):
        assert layer.self_attn.kv_scales.tolist() == pytest.approx(scales[i], rel=1e-6), f"seed={seed}"


def test_a_kv_scale_given_under_two_names_is_refused(checkpoint, tmp_path):
    import shutil

    path, seed, *_ = checkpoint
    shutil.copytree(path, tmp_path / "bad")
    f = tmp_path / "bad" / "model.safetensors"
    tensors = load_file(f)
    layer = random.Random(seed).randrange(3)
    tensors[f"model.layers.{layer}.self_attn.v_proj.output_scale"] = torch.tensor([0.02])
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        LLM(str(tmp_path / "bad"), device="cpu", kv_cache_dtype="fp8")
    msg = str(e.value)
    assert f"model.layers.{layer}.self_attn.v_proj.output_scale" in msg and f"layers.{layer}.self_attn.v_scale" in msg \
        and "\n" not in msg, f"{msg} seed={seed}"


def test_the_pool_holds_twice_the_tokens_in_the_same_bytes(checkpoint):
    path, *_ = checkpoint
    fp8 = LLM(str(path), device="cpu", max_total_tokens=1024, kv_cache_dtype="fp8")
    full = LLM(str(path), device="cpu", max_total_tokens=1024)
    k8, k32 = fp8.runner.pool.k[0], full.runner.pool.k[0]
    assert k8.shape == k32.shape and k8.element_size() * 4 == k32.element_size()  # float32 on the CPU


@pytest.mark.parametrize("bad, why", [(torch.tensor([0.1, 0.2]), "shape"), (torch.tensor(float("nan")), "positive"),
                                      (torch.tensor(0.0), "positive")])
def test_a_bad_kv_scale_is_refused_naming_it(checkpoint, tmp_path, bad, why):
    import shutil

    path, *_ = checkpoint
    shutil.copytree(path, tmp_path / "bad")
    f = tmp_path / "bad" / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.1.self_attn.v_scale"] = bad
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"model\.layers\.1\.self_attn\.v_scale.*{why}"):
        LLM(str(tmp_path / "bad"), device="cpu", kv_cache_dtype="fp8")


def test_refusals_before_loading():
    with pytest.raises(ValueError, match="caches MLA latents"):
        LLM("tiny-mla", device="cpu", load_format="dummy", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv cache dtype 'fp16'"):
        LLM(device="cpu", kv_cache_dtype="fp16")
    cpu = torch.device("cpu")
    assert why_not(SPECS["flex"], cpu, kv_dtype="float8_e4m3fn") is None
    import dataclasses

    for name in ("fa3", "fa3-prefill", "fi", "fi-decode", "triton-decode"):  # as if they ran here: all read it
        spec = dataclasses.replace(SPECS[name], sm=None, package=None)
        assert why_not(spec, cpu, kv_dtype="float8_e4m3fn") is None, name
    from flexsgl.attention import registry

    with pytest.MonkeyPatch.context() as m:  # on an H100 `auto` takes flex for an FP8 cache
        m.setattr(registry, "sm_version", lambda device: 90)
        assert registry.auto_choice(cpu, kv_dtype="float8_e4m3fn") == "flex"
    spec = dataclasses.replace(SPECS["triton-mla"], sm=None, package=None)  # a latent cache stays unquantized
    assert "does not read a float8_e4m3fn KV cache" in why_not(spec, cpu, "mla", kv_dtype="float8_e4m3fn")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run with -m gpu on the device machine")
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_compiled_and_graphed_fp8_cache_matches_hf(checkpoint, monkeypatch, page_size):
    """flex's Triton kernels read the FP8 K/V as they are (FlexAttention casts K and V to the query's
    dtype as it loads them), in compiled steps and CUDA graphs."""
    path, seed, scales, plain_hf = checkpoint
    llm = check_against_hf(path, seed, scales, plain_hf, monkeypatch, tol=1e-3, device="cuda", dtype="float32",
                           page_size=page_size, max_num_batched_tokens=48, cuda_graph_bs=(1,), max_total_tokens=4096)
    assert llm.runner.graphs is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run with -m gpu on the device machine")
@pytest.mark.parametrize("override", ["fa3", "fi", "fa3-prefill,fi-decode", "fa3-prefill,triton-decode"])
def test_gpu_overrides_read_the_fp8_cache(tmp_path_factory, monkeypatch, override):
    """FA3, FlashInfer and triton-decode over the FP8 cache in the bfloat16 engine, compiled and
    graphed: HF in float32 over the stored K/V within 3% of the largest logit (bfloat16's error), or
    12% where FA3 serves a step. FA3 reads FP8 K/V only with FP8 queries, and rounds its
    probabilities to FP8 too: float32 attention that rounds both as FA3 does moves these checkpoints'
    logits by up to 12% of the largest (`python tools/fa3_fp8_rounding.py`, on the CPU). A wrong
    scale or page is off by far more. The stored K/V is checked entry by entry in layer 0 only: a
    bfloat16 engine computes deeper layers' K/V from its own attention (check_against_hf)."""
    from tests.test_gpu_overrides import skip_unless_runs

    for name in override.split(","):
        skip_unless_runs(name)
    path, seed, scales, plain_hf = scaled_checkpoint(tmp_path_factory, head_dim=128)  # the kernels' head size
    # bfloat16's K/V, 2^-8 off float32's, round to FP8 (steps of 2^-3) as float32's would but for ~6%
    llm = check_against_hf(path, seed, scales, plain_hf, monkeypatch, tol=0.12 if "fa3" in override else 3e-2,
                           distinct=False, neighbours=0.15, noise=2.0**-6, entrywise_layers=1, device="cuda",
                           dtype="bfloat16", override=override, page_size=64, cuda_graph_bs=(1,), max_total_tokens=4096)
    assert llm.runner.pool.k[0].dtype == FP8


def test_two_ranks_give_one_ranks_tokens():
    """Under tensor parallelism each rank's pool holds its KV heads in FP8, quantized as one rank's."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    opts = dict(load_format="dummy", device="cpu", kv_cache_dtype="fp8_e4m3", max_total_tokens=2048, page_size=16,
                random_seed=seed)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (3, 40, 70)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    ref = LLM("tiny", **opts).generate(prompts, greedy)
    with LLM("tiny", tensor_parallel_size=2, **opts) as two:
        assert two.runner.pool.k[0].dtype == FP8
        out = two.generate(prompts, greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref], f"seed={seed}"
