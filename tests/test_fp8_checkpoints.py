"""FP8 checkpoints (block-wise and compressed-tensors, per channel and per tensor) load and run on
the CPU, dequantized as they load: the same greedy tokens as HF transformers running the weights
they stand for (dequantized in float32, tests/fp8_checkpoints.py), logits within 1e-4 relative
error; a missing or mis-shaped scale is refused in one sentence."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from flexsgl import LLM, SamplingParams
from flexsgl.errors import CheckpointError
from tests.fp8_checkpoints import make_fp8_checkpoint
from tests.hf_models import assert_matches_hf, capture_logits, make_deepseek_checkpoint

STEPS = 32
LENGTHS = (1, 9, 40)


# Dims of whole 128 x 128 blocks, at one rank and at two: hidden 256, MLP 512, q, k and v 256 each.
BLOCK_DIMS = dict(hidden_size=256, intermediate_size=512, num_key_value_heads=4, head_dim=64)


def make_source(arch: str, path, seed: int, **dims):
    """A tiny HF checkpoint whose dims are not multiples of 128 (hidden 160, MLP 200, q 160, k/v 80),
    or those `dims` give."""
    import transformers

    common = dict(vocab_size=320, hidden_size=160, intermediate_size=200, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=40, rms_norm_eps=1e-6,
                  max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.15,
                  eos_token_id=None, bos_token_id=None)
    common.update(dims)
    if arch == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common, rope_theta=10000.0), transformers.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = transformers.MistralConfig(**common, sliding_window=24), transformers.MistralForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**common, rope_theta=10000.0), transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)


def check_matches_hf(dst, ref, monkeypatch, seed, steps=STEPS):
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(seed)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in LENGTHS]
    llm = LLM(str(dst), device="cpu", page_size=16)
    seen = capture_logits(llm, monkeypatch)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=steps, temperature=0.0))
    for i, prompt in enumerate(prompts):
        assert_matches_hf(hf, prompt, outs[i].token_ids, seen[outs[i].request_id],
                          f"prompt {i} (len {len(prompt)}), seed={seed}")


def run_batch_1_kernels(monkeypatch):
    """One-token steps on the CPU run the batch-1 kernels as on a GPU (through Triton's interpreter),
    the matrix-vector kernel in tiles of 64 rows: fewer programs for the interpreter, and whole 128-row
    weight blocks still."""
    from flexsgl.kernels import gemv

    monkeypatch.setattr(gemv, "applies", lambda x, *_: x.dim() == 2 and x.shape[0] == 1)
    monkeypatch.setattr(gemv, "config_for", lambda *args: (64, 512, 4, 1))


def check_two_prompts(tmp_path, monkeypatch, seed):
    """The FP8 checkpoint at tmp_path/fp8 on the CPU, a one-token prompt and then a 9-token one (so
    one-token steps and a prefill): 8 greedy tokens of each and their logits against HF's on the
    weights it stands for (tmp_path/ref)."""
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(seed)
    llm = LLM(str(tmp_path / "fp8"), device="cpu", page_size=16)
    seen = capture_logits(llm, monkeypatch)
    for prompt in ([rng.randrange(320)], [rng.randrange(320) for _ in range(9)]):
        out = llm.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
        assert_matches_hf(hf, prompt, out.token_ids, seen[out.request_id], f"prompt of {len(prompt)}, seed={seed}")


@pytest.mark.parametrize("arch, fmt, ignore", [
    ("qwen3", "block", ["model.layers.1.mlp.down_proj"]),
    ("llama", "channel", ["model.layers.0.self_attn.o_proj"]),
    ("mistral", "tensor", []),
])
def test_fp8_checkpoint_matches_hf_on_its_dequantized_weights(tmp_path, monkeypatch, arch, fmt, ignore):
    seed = random.randrange(2**31)
    make_source(arch, tmp_path / "src", seed)
    fp8 = make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", fmt, ignore=ignore,
                              input_scales=fmt == "tensor")
    assert len(fp8) == 2 * 7 - len(ignore)
    check_matches_hf(tmp_path / "fp8", tmp_path / "ref", monkeypatch, seed)


def test_deepseek_v2_fp8_checkpoint_with_fp8_experts_matches_hf(tmp_path, monkeypatch):
    """MLA projections, the dense MLP, routed and shared experts in FP8, blocks of 32 x 16 (partial at
    the edges: kv_b_proj is [112, 32], q_proj [96, 64])."""
    seed = random.randrange(2**31)
    make_deepseek_checkpoint(tmp_path / "src", seed)
    fp8 = make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", "block", block=(32, 16))
    assert any(".experts.3.up_proj" in n for n in fp8) and any("kv_b_proj" in n for n in fp8)
    check_matches_hf(tmp_path / "fp8", tmp_path / "ref", monkeypatch, seed, steps=12)


@pytest.mark.parametrize("family, fmt", [("qwen3-moe", "block"), ("gemma3", "channel")])
def test_newer_family_fp8_checkpoint_matches_hf(tmp_path, monkeypatch, family, fmt):
    """The families published in FP8 beyond the dense ones: Qwen3-MoE block-wise, with every expert
    in FP8 (as Qwen3-30B-A3B-FP8), and Gemma 3 in compressed-tensors per channel (softcapped logits,
    sliding and global layers)."""
    from tests.test_gemma import make_gemma3
    from tests.test_qwen3_moe import make_qwen3_moe

    seed = random.randrange(2**31)
    (make_qwen3_moe if family == "qwen3-moe" else make_gemma3)(tmp_path / "src", seed)
    fp8 = make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", fmt, block=(32, 16))
    if family == "qwen3-moe":
        assert any(".mlp.experts.5.down_proj" in n for n in fp8), "every expert in FP8"
    check_matches_hf(tmp_path / "fp8", tmp_path / "ref", monkeypatch, seed, steps=12)


@pytest.mark.parametrize("export", ["naive-quantized", "compression_config"])
def test_older_compressed_tensors_exports_match_hf(tmp_path, monkeypatch, export):
    """compressed-tensors FP8 per channel as older llm-compressor exports write it, of format
    `naive-quantized` or under `compression_config` in config.json: read as float-quantized, HF's
    tokens on the weights it stands for."""
    seed = random.randrange(2**31)
    make_source("llama", tmp_path / "src", seed)
    make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", "channel")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    q = config.pop("quantization_config")
    if export == "naive-quantized":
        config["quantization_config"] = {**q, "format": "naive-quantized"}
    else:
        config["compression_config"] = q
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    check_matches_hf(tmp_path / "fp8", tmp_path / "ref", monkeypatch, seed, steps=8)


@pytest.mark.parametrize("fmt", ["channel", "block", "tensor"])
def test_stacked_fp8_experts_match_hf(tmp_path, monkeypatch, fmt):
    """A Qwen3-MoE checkpoint with stacked experts (transformers 5's `mlp.experts.gate_up_proj`
    [E, 2I, H], `down_proj` [E, H, I]) in FP8, each expert quantized alone and its scales stacked
    ([E, 2I, 1], [E, 2I / 16, H / 16] or [E, 1]): HF's tokens on the weights it stands for."""
    from tests.test_qwen3_moe import make_qwen3_moe

    seed = random.randrange(2**31)
    make_qwen3_moe(tmp_path / "src", seed, stacked=True)
    fp8 = make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", fmt, block=(16, 16))
    assert "model.layers.2.mlp.experts.gate_up_proj" in fp8, f"seed={seed}"
    check_matches_hf(tmp_path / "fp8", tmp_path / "ref", monkeypatch, seed, steps=8)


@pytest.mark.parametrize("fmt", ["channel", "block"])
@pytest.mark.parametrize("kept", [True, False], ids=["kept", "dequantized"])
@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2)])
def test_stacked_fp8_experts_load_as_one_tensor_per_expert_does(tmp_path, monkeypatch, fmt, kept, rank, size):
    """The same FP8 values and scales given stacked or one tensor per expert (per channel, or in
    16 x 16 blocks, which gate's and up's rows fill whole) load into the same model, bit for bit:
    experts kept in FP8 (forced here on the CPU) or dequantized, at one rank and at two."""
    import flexsgl.model.loader as loader
    from flexsgl.model.source import resolve
    from tests.test_qwen3_moe import make_qwen3_moe

    seed = random.randrange(2**31)
    monkeypatch.setattr(loader, "keeps_fp8_experts", lambda *a: kept)
    models = []
    for layout in ("per_expert", "stacked"):
        make_qwen3_moe(tmp_path / layout, seed, stacked=layout == "stacked")
        make_fp8_checkpoint(tmp_path / layout, tmp_path / f"{layout}_fp8", tmp_path / f"{layout}_ref", fmt,
                            block=(16, 16))
        models.append(loader.build_model(resolve(str(tmp_path / f"{layout}_fp8")), torch.device("cpu"),
                                         torch.float32, rank=rank, size=size).state_dict())
    per_expert, stacked = models
    assert per_expert.keys() == stacked.keys(), f"seed={seed}"
    experts = [n for n in per_expert if ".experts." in n]
    assert all(per_expert[n].dtype == (torch.float8_e4m3fn if kept else torch.float32)
               for n in experts if n.endswith("proj")), f"seed={seed}"
    for name in per_expert:
        assert torch.equal(per_expert[name].view(torch.uint8), stacked[name].view(torch.uint8)), f"{name}, seed={seed}"


@pytest.mark.parametrize("fmt", ["channel", "tensor"])
def test_projections_kept_in_fp8_load_the_checkpoints_bits_and_row_scales(tmp_path, monkeypatch, fmt):
    """Where FP8 products run (forced here on the CPU, which runs no forward), each projection whose
    dims suit them keeps the checkpoint's FP8 values as they are, fused parts in order, and one scale
    per row, also in a projection whose weight loader splits columns (o_proj): weight x scale is the
    float32 weight the checkpoint stands for, exactly."""
    import flexsgl.model.loader as loader
    from flexsgl.model.source import resolve
    from flexsgl.quant.fp8_linear import Fp8Linear

    seed = random.randrange(2**31)
    make_source("qwen3", tmp_path / "src", seed)
    make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", fmt)
    monkeypatch.setattr(loader, "keeps_fp8", lambda *a: True)
    model = loader.build_model(resolve(str(tmp_path / "fp8")), torch.device("cpu"), torch.bfloat16)
    ckpt, ref = load_file(tmp_path / "fp8" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    kept = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert {n.rsplit(".", 1)[-1] for n in kept} == {"qkv_proj", "o_proj", "gate_up_proj"}, f"seed={seed}"
    for name, m in kept.items():
        parent, leaf = name.rsplit(".", 1)
        hf = [f"{parent}.{p}.weight" for p in parts.get(leaf, [leaf])]
        assert torch.equal(m.weight.view(torch.uint8), torch.cat([ckpt[h] for h in hf]).view(torch.uint8)), \
            f"{name}, seed={seed}"
        torch.testing.assert_close(m.weight.float() * m.weight_scale, torch.cat([ref[h] for h in hf]),
                                   rtol=0, atol=0, msg=lambda e: f"{name}, seed={seed}: {e}")


@pytest.mark.usefixtures("triton_interpreter")
def test_fp8_projections_at_batch_1_run_the_kernel_and_match_hf(tmp_path, monkeypatch):
    """A one-token prompt, so every step is batch 1 and its projections run flexsgl's matrix-vector
    kernel (here through Triton's interpreter, in float32), the kept ones on their FP8 bytes and row
    scales: 8 greedy tokens equal HF's on the weights the checkpoint stands for, logits within 1e-4."""
    import flexsgl.model.loader as loader
    from flexsgl.kernels import gemv

    seed = random.randrange(2**31)
    make_source("qwen3", tmp_path / "src", seed)
    make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", "channel")
    monkeypatch.setattr(loader, "keeps_fp8", lambda *a: True)
    run_batch_1_kernels(monkeypatch)
    scaled = []
    monkeypatch.setattr(gemv, "launch", lambda *a, f=gemv.launch, **k: scaled.append(k.get("scale") is not None)
                        or f(*a, **k))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32, attn_implementation="eager").eval()
    prompt = [random.Random(seed).randrange(320)]
    llm = LLM(str(tmp_path / "fp8"), device="cpu", page_size=16)
    seen = capture_logits(llm, monkeypatch)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert sum(scaled) == 8 * 2 * 3, f"FP8 launches: {sum(scaled)}, seed={seed}"  # 8 steps, 2 layers: qkv, o, gate_up
    assert_matches_hf(hf, prompt, out.token_ids, seen[out.request_id], f"seed={seed}")


@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_block_wise_projections_kept_in_fp8_load_the_checkpoints_bits_and_block_scales(tmp_path, monkeypatch, rank,
                                                                                         size):
    """Where block-scaled FP8 products run (forced here on the CPU), a block-wise checkpoint of 128 x 128
    blocks keeps every projection in FP8 with its blocks' scales as the checkpoint stores them: fused
    parts in order and, at two ranks, the rank's rows (qkv, gate_up) or columns (o, down) of the
    values and of the blocks; weight x scale is the float32 weight they stand for, exactly."""
    import flexsgl.model.loader as loader
    from flexsgl.model.source import resolve
    from flexsgl.quant.fp8 import dequantize
    from flexsgl.quant.fp8_linear import Fp8Linear

    seed = random.randrange(2**31)
    make_source("qwen3", tmp_path / "src", seed, **BLOCK_DIMS)
    make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", "block")
    monkeypatch.setattr(loader, "keeps_fp8", lambda *a: True)
    model = loader.build_model(resolve(str(tmp_path / "fp8")), torch.device("cpu"), torch.bfloat16, rank=rank,
                               size=size)
    ckpt, ref = load_file(tmp_path / "fp8" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    kept = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(kept) == 4 * 2 and all(m.block == (128, 128) for m in kept.values()), f"seed={seed}: {sorted(kept)}"
    for name, m in kept.items():
        parent, leaf = name.rsplit(".", 1)
        hf = [f"{parent}.{p}.weight" for p in parts.get(leaf, [leaf])]
        rows = leaf in parts  # column-parallel: the rank's rows of each part; row-parallel: its columns

        def mine(t):  # the rank's slice
            n = t.shape[0 if rows else 1] // size
            return t[rank * n:(rank + 1) * n] if rows else t[:, rank * n:(rank + 1) * n]

        want = torch.cat([mine(ckpt[h]) for h in hf])
        assert torch.equal(m.weight.view(torch.uint8), want.view(torch.uint8)), f"{name}, seed={seed}"
        scales = torch.cat([mine(ckpt[h + "_scale_inv"]) for h in hf])
        assert torch.equal(m.weight_scale, scales), f"{name}, seed={seed}"
        torch.testing.assert_close(dequantize(m.weight, m.weight_scale, "block", (128, 128)),
                                   torch.cat([mine(ref[h]) for h in hf]), rtol=0, atol=0,
                                   msg=lambda e: f"{name}, seed={seed}: {e}")


@pytest.mark.usefixtures("triton_interpreter")
def test_block_wise_fp8_projections_run_and_match_hf(tmp_path, monkeypatch):
    """Block-wise FP8 projections kept (forced on the CPU): a 9-token prompt's prefill multiplies by the
    dequantized blocks, and every one-token step runs the matrix-vector kernel on the FP8 bytes and
    block scales (through Triton's interpreter, in float32): 8 greedy tokens of each prompt equal HF's
    on the weights the checkpoint stands for, logits within 1e-4."""
    import flexsgl.model.loader as loader
    from flexsgl.kernels import gemv

    seed = random.randrange(2**31)
    make_source("qwen3", tmp_path / "src", seed, **BLOCK_DIMS)
    make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", "block")
    monkeypatch.setattr(loader, "keeps_fp8", lambda *a: True)
    run_batch_1_kernels(monkeypatch)
    blocks = []
    monkeypatch.setattr(gemv, "launch", lambda *a, f=gemv.launch, **k: blocks.append(
        k.get("scale") is not None and k["scale"].dim() == 2) or f(*a, **k))
    check_two_prompts(tmp_path, monkeypatch, seed)
    assert sum(blocks) == (8 + 7) * 2 * 4, f"block-scaled launches: {sum(blocks)}, seed={seed}"  # 2 layers, 4 each


@pytest.mark.parametrize("fmt", ["channel", "block"])
@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_experts_kept_in_fp8_load_the_checkpoints_bits_and_scales(tmp_path, monkeypatch, rank, size, fmt):
    """Where FP8 expert products run (forced here on the CPU, which runs no forward), a per-channel or
    block-wise (16 x 16) Qwen3-MoE checkpoint's routed experts stay FP8, stacked: each expert's gate
    and up rows (at two ranks, the rank's half of each) and its down rows (every row, the rank's
    columns) hold the checkpoint's FP8 values, their scales the checkpoint's per row or those blocks'
    of them, and weight x scale is the float32 weight they stand for, exactly."""
    import flexsgl.model.loader as loader
    from flexsgl.model.source import resolve
    from flexsgl.quant.fp8 import dequantize
    from tests.test_qwen3_moe import make_qwen3_moe

    seed = random.randrange(2**31)
    make_qwen3_moe(tmp_path / "src", seed)
    make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", fmt, block=(16, 16))
    monkeypatch.setattr(loader, "keeps_fp8", lambda *a: True)
    monkeypatch.setattr(loader, "keeps_fp8_experts", lambda *a: True)
    model = loader.build_model(resolve(str(tmp_path / "fp8")), torch.device("cpu"), torch.bfloat16, rank=rank,
                               size=size)
    ckpt, ref = load_file(tmp_path / "fp8" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    experts = {name: m for name, m in model.named_modules() if hasattr(m, "hold_fp8")}
    assert sorted(experts) == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"], f"seed={seed}"
    units = slice(rank * 32 // size, (rank + 1) * 32 // size)  # the rank's intermediate units of 32
    blocks = slice(units.start // 16, units.stop // 16)
    for name, m in experts.items():
        assert m.gate_up_proj.dtype == m.down_proj.dtype == torch.float8_e4m3fn, name
        assert m.fp8_block == ((16, 16) if fmt == "block" else None), name
        for e in range(6):
            gate_up = [f"{name}.{e}.{p}.weight" for p in ("gate_proj", "up_proj")]
            down = f"{name}.{e}.down_proj.weight"
            for got, scale, want, want_ref, rows in (
                    (m.gate_up_proj[e], m.gate_up_proj_scale[e], torch.cat([ckpt[h][units] for h in gate_up]),
                     torch.cat([ref[h][units] for h in gate_up]), [(h, blocks, slice(None)) for h in gate_up]),
                    (m.down_proj[e], m.down_proj_scale[e], ckpt[down][:, units], ref[down][:, units],
                     [(down, slice(None), blocks)])):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{name}[{e}], seed={seed}"
                if fmt == "block":
                    assert torch.equal(scale, torch.cat([ckpt[h + "_scale_inv"][r, c] for h, r, c in rows]))
                    got = dequantize(got, scale, "block", (16, 16))
                else:
                    got = got.float() * scale
                torch.testing.assert_close(got, want_ref, rtol=0, atol=0,
                                           msg=lambda err: f"{name}[{e}], seed={seed}: {err}")


@pytest.mark.usefixtures("triton_interpreter")
def test_block_wise_fp8_experts_run_the_block_kernel_and_match_hf(tmp_path, monkeypatch):
    """A block-wise Qwen3-MoE checkpoint (32 x 32 blocks) with its experts kept in FP8, as on a GPU
    through the block kernel (here Triton's interpreter, in float32), prefill and one-token steps:
    8 greedy tokens of each prompt equal HF's on the weights the checkpoint stands for, logits
    within 1e-4."""
    import flexsgl.model.loader as loader
    import flexsgl.model.moe as moe_module
    from flexsgl.kernels import block_fp8_experts
    from tests.test_qwen3_moe import make_qwen3_moe

    seed = random.randrange(2**31)
    make_qwen3_moe(tmp_path / "src", seed)
    make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", "block", block=(32, 32))
    monkeypatch.setattr(loader, "keeps_fp8_experts", lambda *a: True)
    monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda *a: True)
    launched = []
    monkeypatch.setattr(block_fp8_experts, "launch", lambda *a, f=block_fp8_experts.launch: launched.append(1) or f(*a))
    check_two_prompts(tmp_path, monkeypatch, seed)
    assert len(launched) == 2 * 2 * 8 * 2, f"block kernel launches: {len(launched)}, seed={seed}"


@pytest.mark.usefixtures("triton_interpreter")
def test_fp8_experts_at_batch_1_run_the_moe_layer_and_match_hf(tmp_path, monkeypatch):
    """A per-channel Qwen3-MoE checkpoint with its projections and experts kept in FP8, one-token
    steps: each MoE layer runs the one-launch layer on the experts' FP8 bytes and row scales (here
    through Triton's interpreter, in float32): 8 greedy tokens equal HF's on the weights the
    checkpoint stands for, logits within 1e-4."""
    import flexsgl.model.loader as loader
    from flexsgl.kernels import moe_layer
    from tests.test_qwen3_moe import make_qwen3_moe

    seed = random.randrange(2**31)
    make_qwen3_moe(tmp_path / "src", seed)
    make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", "channel")
    monkeypatch.setattr(loader, "keeps_fp8", lambda *a: True)
    monkeypatch.setattr(loader, "keeps_fp8_experts", lambda *a: True)
    run_batch_1_kernels(monkeypatch)
    scaled = []
    monkeypatch.setattr(moe_layer, "launch", lambda *a, f=moe_layer.launch: scaled.append(a[15] is not None) or f(*a))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32, attn_implementation="eager").eval()
    prompt = [random.Random(seed).randrange(320)]
    llm = LLM(str(tmp_path / "fp8"), device="cpu", page_size=16)
    seen = capture_logits(llm, monkeypatch)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert scaled == [True] * 8 * 2, f"MoE launches on FP8 experts: {scaled}, seed={seed}"  # 8 steps, 2 MoE layers
    assert_matches_hf(hf, prompt, out.token_ids, seen[out.request_id], f"seed={seed}")


@pytest.mark.parametrize("rank", [0, 1])
def test_projections_kept_in_fp8_hold_their_ranks_slices(tmp_path, monkeypatch, rank):
    """At two ranks (each loaded alone here), a kept projection holds its rank's slice of the
    checkpoint's FP8 values and its rows' scales: of qkv_proj the rank's q, k and v heads' rows, of
    o_proj every row's scale beside the rank's columns; weight x scale the float32 weight's slice.
    gate_up_proj's rank rows (2 x 100) do not suit the FP8 product and load dequantized."""
    import flexsgl.model.loader as loader
    from flexsgl.model.source import resolve
    from flexsgl.quant.fp8_linear import Fp8Linear

    seed = random.randrange(2**31)
    make_source("qwen3", tmp_path / "src", seed)
    make_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", "channel")
    monkeypatch.setattr(loader, "keeps_fp8", lambda *a: True)
    model = loader.build_model(resolve(str(tmp_path / "fp8")), torch.device("cpu"), torch.bfloat16, rank=rank, size=2)
    ckpt, ref = load_file(tmp_path / "fp8" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    q, kv = slice(rank * 80, (rank + 1) * 80), slice(rank * 40, (rank + 1) * 40)  # 2 of 4 q heads, 1 of 2 KV heads
    kept = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert {n.rsplit(".", 1)[-1] for n in kept} == {"qkv_proj", "o_proj"}, f"seed={seed}"
    for name, m in kept.items():
        parent, leaf = name.rsplit(".", 1)
        if leaf == "qkv_proj":
            want = [(f"{parent}.{p}.weight", (rows, slice(None))) for p, rows in (("q_proj", q), ("k_proj", kv),
                                                                                    ("v_proj", kv))]
        else:
            want = [(f"{name}.weight", (slice(None), q))]
        assert torch.equal(m.weight.view(torch.uint8), torch.cat([ckpt[h][i] for h, i in want]).view(torch.uint8)), \
            f"{name}, rank {rank}, seed={seed}"
        torch.testing.assert_close(m.weight.float() * m.weight_scale, torch.cat([ref[h][i] for h, i in want]),
                                   rtol=0, atol=0, msg=lambda e: f"{name}, rank {rank}, seed={seed}: {e}")


@pytest.fixture(scope="module")
def block_checkpoint(tmp_path_factory):
    seed = random.randrange(2**31)
    path = tmp_path_factory.mktemp("fp8")
    make_source("qwen3", path / "src", seed)
    make_fp8_checkpoint(path / "src", path / "fp8", path / "ref", "block")
    return path / "fp8", seed


def refused(path) -> str:
    with pytest.raises(CheckpointError) as e:
        LLM(str(path), device="cpu")
    msg = str(e.value)
    assert msg.endswith(".") and "\n" not in msg, msg
    return msg


def edited(src, dst, edit=None, config_edit=None):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if edit is not None:
        tensors = load_file(src / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors")
    if config_edit is not None:
        config = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config_edit(config)))
    return dst


def test_a_missing_scale_is_refused_naming_it(block_checkpoint, tmp_path):
    src, seed = block_checkpoint
    scale = random.Random(seed).choice(sorted(n for n in load_file(src / "model.safetensors") if "scale_inv" in n))
    msg = refused(edited(src, tmp_path / "x", lambda t: t.pop(scale)))
    assert repr(scale) in msg and "no scale" in msg, msg


def test_a_mis_shaped_scale_is_refused_naming_it(block_checkpoint, tmp_path):
    src, seed = block_checkpoint
    scale = "model.layers.0.self_attn.k_proj.weight_scale_inv"  # [80, 160] in blocks of 128: [1, 2]

    def edit(t):
        t[scale] = torch.rand(2, 2) + 0.1
    msg = refused(edited(src, tmp_path / "x", edit))
    assert repr(scale) in msg and "(2, 2)" in msg and "(1, 2)" in msg, msg


def test_an_fp8_tensor_without_a_quantization_config_is_refused(block_checkpoint, tmp_path):
    src, _ = block_checkpoint
    msg = refused(edited(src, tmp_path / "x", config_edit=lambda c: {k: v for k, v in c.items()
                                                                     if k != "quantization_config"}))
    assert "F8_E4M3" in msg and "quantization_config" in msg, msg


def test_an_fp8_scale_holding_nan_is_refused(block_checkpoint, tmp_path):
    src, _ = block_checkpoint
    scale = "model.layers.1.mlp.up_proj.weight_scale_inv"

    def edit(t):
        t[scale][0, 0] = float("nan")
    msg = refused(edited(src, tmp_path / "x", edit))
    assert repr(scale) in msg and "NaN" in msg, msg


def two_shards(src, dst, twice: str, value: torch.Tensor):
    """The checkpoint at `src` written to `dst` in two files, tensor `twice` in both (`value` in the
    second, its own or twice `value` in the first), the index naming the first for it."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    names = sorted(n for n in tensors if n != twice)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({**{n: tensors[n] for n in names[::2]}, twice: tensors.get(twice, 2 * value)}, dst / first)
    save_file({**{n: tensors[n] for n in names[1::2]}, twice: value}, dst / second)
    weight_map = {n: (first, second)[i % 2] for i, n in enumerate(names)} | {twice: first}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("kind", ["weight_scale_inv", "input_scale", "k_scale", "output_scale", "weight"])
def test_a_tensor_in_two_shards_is_refused_naming_both_files(block_checkpoint, tmp_path, kind):
    """Every tensor the loader reads, weights and their scales, activation and KV cache scales alike,
    given in two files (with other values in the second) is refused, whatever the index says."""
    src, seed = block_checkpoint
    rng = random.Random(seed)
    layer, proj = rng.randrange(2), rng.choice(["self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"])
    name, shape = {"weight_scale_inv": (f"model.layers.{layer}.{proj}.weight_scale_inv", None),
                   "input_scale": (f"model.layers.{layer}.{proj}.input_scale", (1,)),
                   "k_scale": (f"model.layers.{layer}.self_attn.k_scale", ()),
                   "output_scale": (f"model.layers.{layer}.self_attn.v_proj.output_scale", (1,)),
                   "weight": (f"model.layers.{layer}.post_attention_layernorm.weight", None)}[kind]
    if shape is None:
        shape = load_file(src / "model.safetensors")[name].shape
    torch.manual_seed(seed)
    msg = refused(two_shards(src, tmp_path / "x", name, torch.rand(shape) + 0.5))
    assert repr(name) in msg and "model-00001-of-00002" in msg and "model-00002-of-00002" in msg, \
        f"{msg} seed={seed}"


def test_an_fp8_tensor_of_one_dimension_is_refused_naming_it(block_checkpoint, tmp_path):
    src, seed = block_checkpoint
    name = random.Random(seed).choice(["model.norm.weight", "model.layers.0.input_layernorm.weight",
                                       "model.layers.1.post_attention_layernorm.weight"])

    def edit(t):
        t[name] = t[name].to(torch.float8_e4m3fn)
        t[name + "_scale_inv"] = torch.ones(1)
    msg = refused(edited(src, tmp_path / "x", edit))
    assert repr(name) in msg and "(160,)" in msg, f"{msg} seed={seed}"
