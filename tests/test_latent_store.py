"""MLA's fused latent store (flexsgl/kernels/latent_store.py): the Triton kernel against a float64
evaluation of the formulas (RMSNorm of c, DeepSeek's interleaved RoPE of k_pe) and against the
PyTorch expressions it replaces, on the GPU compiled and on the CPU through Triton's interpreter;
the op, compiled, writes the pool in place and only at its slots."""

import random

import pytest
import torch

from flexsgl.kernels import latent_store
from flexsgl.model.deepseek_v2 import InterleavedRotary

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}


def random_case(t, rank, rope_dim, dtype, device, slots_total=512):
    seed = random.randrange(1 << 30)
    g = torch.Generator(device=device).manual_seed(seed)
    rope = InterleavedRotary(rope_dim, 8192, 10000.0, YARN).to(device)
    width = rank + rope_dim
    fused = torch.randn(t, 3 + width, device=device, generator=g).to(dtype)  # a view strided by rows, as in the model
    return dict(latent=fused[:, 3:], norm_weight=(0.5 + torch.rand(rank, device=device, generator=g)).to(dtype),
                eps=1e-6, cos=rope.cos, sin=rope.sin, positions=torch.randint(0, 8192, (t,), device=device, generator=g),
                slots=torch.randperm(slots_total, device=device, generator=g)[:t],
                kv=torch.randn(slots_total, 1, width, device=device, generator=g).to(dtype)), seed


def float64_reference(c):
    x = c["latent"].double()
    rank = c["norm_weight"].shape[0]
    h, k_pe = x[:, :rank], x[:, rank:]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c["eps"]) * c["norm_weight"].double()
    cos, sin = c["cos"].double()[c["positions"]], c["sin"].double()[c["positions"]]
    even, odd = k_pe[:, 0::2], k_pe[:, 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)
    return torch.cat([h, rotated], -1)


def check(c, seed, rel_tol, op):
    before = c["kv"].clone()
    op(**c)
    ours = c["kv"][c["slots"], 0]
    ref = float64_reference(c)
    err = ((ours.double() - ref).norm() / ref.norm()).item()
    assert err < rel_tol, f"relative error {err:.2e} against float64 (seed={seed})"
    plain = latent_store.norm_rope_latent(c["latent"], c["norm_weight"], c["eps"], c["cos"], c["sin"], c["positions"])
    # the kernel rounds where the PyTorch expressions do: a rounding step apart at most
    torch.testing.assert_close(ours, plain.to(ours.dtype), rtol=1e-2, atol=1e-2, msg=lambda m: f"seed={seed}: {m}")
    untouched = torch.ones(c["kv"].shape[0], dtype=torch.bool, device=c["kv"].device)
    untouched[c["slots"]] = False
    assert torch.equal(c["kv"][untouched], before[untouched]), f"written outside its slots (seed={seed})"


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("rank,rope_dim", [(32, 8), (48, 16)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])  # bf16: see conftest
def test_interpreted_kernel_matches_float64_and_pytorch(t, rank, rope_dim, dtype):
    c, seed = random_case(t, rank, rope_dim, dtype, "cpu")
    check(c, seed, 1e-5 if dtype == torch.float32 else 1e-2, latent_store.launch)


def test_compiled_op_writes_the_pool_in_place():
    """On the CPU the op's body is the PyTorch expressions; compiled, it writes the given pool tensor."""
    c, seed = random_case(6, 32, 8, torch.float32, "cpu")
    kv, ptr = c["kv"], c["kv"].data_ptr()
    step = torch.compile(lambda latent, kv: torch.ops.flexsgl.latent_store(
        latent, c["norm_weight"], c["eps"], c["cos"], c["sin"], c["positions"], c["slots"], kv), fullgraph=True)
    check(c, seed, 1e-5, lambda **a: step(a["latent"], a["kv"]))
    assert c["kv"] is kv and kv.data_ptr() == ptr


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("rank,rope_dim", [(512, 64), (32, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_float64_and_pytorch(t, rank, rope_dim, dtype):
    c, seed = random_case(t, rank, rope_dim, dtype, "cuda", slots_total=4096)
    check(c, seed, 1e-2, latent_store.launch)
