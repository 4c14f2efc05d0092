"""MLA's batch-1 query kernel (flexsgl/kernels/latent_query.py): each head's W_UK^T q_nope and its
rotated q_pe, against float64 and against the PyTorch expressions it replaces, on the GPU and on
the CPU through Triton's interpreter."""

import random

import pytest
import torch

from flexsgl.kernels import latent_query
from flexsgl.model.deepseek_v2 import InterleavedRotary

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}


def check(t, heads, nope, rope_dim, rank, dtype, device, rel_tol):
    seed = random.randrange(1 << 30)
    g = torch.Generator(device=device).manual_seed(seed)
    rope = InterleavedRotary(rope_dim, 8192, 10000.0, YARN).to(device)
    q = torch.randn(t, heads * (nope + rope_dim), device=device, generator=g).to(dtype).view(t, heads, -1)
    # W_UK as the model takes it: a view of kv_b_proj's weight, heads of (nope + v) rows
    w_kv = (torch.randn(heads, nope + 24, rank, device=device, generator=g) / nope ** 0.5).to(dtype)
    w_uk = w_kv[:, :nope]
    positions = torch.randint(0, 8192, (t,), device=device, generator=g)
    ours = latent_query.launch(q, w_uk, rope.cos, rope.sin, positions)
    qd = q.double()
    cos, sin = rope.cos.double()[positions][:, None], rope.sin.double()[positions][:, None]
    even, odd = qd[..., nope::2], qd[..., nope + 1::2]
    ref = torch.cat([torch.einsum("thn,hnr->thr", qd[..., :nope], w_uk.double()),
                     torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)], -1)
    err = ((ours.double() - ref).norm() / ref.norm()).item()
    assert err < rel_tol, f"relative error {err:.2e} against float64 (seed={seed})"
    plain = latent_query.latent_query_reference(q, w_uk, rope.cos, rope.sin, positions)
    torch.testing.assert_close(ours, plain, rtol=1e-2, atol=1e-2, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("heads,nope,rope_dim,rank", [(2, 16, 8, 32), (3, 24, 16, 80)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])  # bf16: see conftest
def test_interpreted_kernel_matches_float64_and_pytorch(t, heads, nope, rope_dim, rank, dtype):
    check(t, heads, nope, rope_dim, rank, dtype, "cpu", 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,nope,rope_dim,rank", [(16, 128, 64, 512), (4, 16, 8, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_float64_and_pytorch(heads, nope, rope_dim, rank, dtype):
    check(1, heads, nope, rope_dim, rank, dtype, "cuda", 1e-2)
