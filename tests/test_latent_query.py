"""MLA's batch-1 query kernel (flexsgl/kernels/latent_query.py): each head's W_UK^T q_nope and its
rotated q_pe, against float64 and against the PyTorch expressions it replaces, on the GPU and on
the CPU through Triton's interpreter; with the token's latent stored in the same launch, the slot
written against float64 and latent_store's PyTorch expressions, and every other slot untouched."""

import random

import pytest
import torch

from flexsgl.kernels import latent_query
from flexsgl.kernels.latent_store import norm_rope_latent
from flexsgl.model.deepseek_v2 import InterleavedRotary

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}


def check(t, heads, nope, rope_dim, rank, dtype, device, rel_tol, store=False):
    seed = random.randrange(1 << 30)
    g = torch.Generator(device=device).manual_seed(seed)
    rope = InterleavedRotary(rope_dim, 8192, 10000.0, YARN).to(device)
    q = torch.randn(t, heads * (nope + rope_dim), device=device, generator=g).to(dtype).view(t, heads, -1)
    # W_UK as the model takes it: a view of kv_b_proj's weight, heads of (nope + v) rows
    w_kv = (torch.randn(heads, nope + 24, rank, device=device, generator=g) / nope ** 0.5).to(dtype)
    w_uk = w_kv[:, :nope]
    positions = torch.randint(0, 8192, (t,), device=device, generator=g)
    fused = None
    if store:  # the latent as the model hands it: a row view of the fused projection's output
        row = torch.randn(t, 40 + rank + rope_dim, device=device, generator=g).to(dtype)
        latent = row[:, 40:]
        norm_weight = (0.5 + torch.rand(rank, device=device, generator=g)).to(dtype)
        kv = torch.randn(9, 1, rank + rope_dim, device=device, generator=g).to(dtype)
        slots = torch.tensor([5], device=device)
        before = kv.clone()
        fused = (latent, norm_weight, 1e-6, slots, kv)
    ours = latent_query.launch(q, w_uk, rope.cos, rope.sin, positions, fused)
    if store:
        ld = latent.double()
        c, k_pe = ld[:, :rank], ld[:, rank:]
        pos = positions.long()
        cos_k, sin_k = rope.cos.double()[pos], rope.sin.double()[pos]
        want = torch.cat([c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight.double(),
                          torch.stack((k_pe[:, ::2] * cos_k - k_pe[:, 1::2] * sin_k,
                                       k_pe[:, 1::2] * cos_k + k_pe[:, ::2] * sin_k), -1).flatten(-2)], -1)
        got = kv[5, 0].double()
        err = ((got - want[0]).norm() / want.norm()).item()
        assert err < rel_tol, f"stored latent: relative error {err:.2e} against float64 (seed={seed})"
        torch.testing.assert_close(kv[5, 0], norm_rope_latent(latent, norm_weight, 1e-6, rope.cos, rope.sin,
                                                              positions)[0], rtol=1e-2, atol=1e-2)
        others = torch.arange(9, device=device) != 5
        assert torch.equal(kv[others], before[others]), f"other slots written (seed={seed})"
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


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("heads,nope,rope_dim,rank", [(2, 16, 8, 32), (3, 24, 16, 80)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_interpreted_kernel_with_the_store_matches_float64(heads, nope, rope_dim, rank, dtype):
    check(1, heads, nope, rope_dim, rank, dtype, "cpu", 1e-5 if dtype == torch.float32 else 1e-2, store=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,nope,rope_dim,rank", [(16, 128, 64, 512), (4, 16, 8, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("store", [False, True], ids=["query", "query+store"])
def test_kernel_matches_float64_and_pytorch(heads, nope, rope_dim, rank, dtype, store):
    check(1, heads, nope, rope_dim, rank, dtype, "cuda", 1e-2, store)
