"""The decode matrix-vector kernel (flexsgl/model/gemv.py) against a float64 product, on the GPU.

Shapes cover K a multiple of the tile and not, N not a multiple of the row block, each tile
configuration the engine picks, bias or none, bfloat16 and float16; the output is poisoned with NaN first so an unwritten element
fails. bf16 operands with a float32 accumulator land well under 1e-2 relative error.
"""

import random

import pytest
import torch

from flexsgl.model import gemv

pytestmark = pytest.mark.gpu

# (N, K): K a multiple of every BLOCK_K or not; N a multiple of BLOCK_N or not; each config_for branch.
SHAPES = [(6144, 4096), (4100, 1000), (37, 3072), (24580, 2048), (4096, 12300), (151936, 1024)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_float64(n, k, bias, dtype):
    seed = random.randrange(1 << 30)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=g)
    w = (torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    out = torch.full((1, n), float("nan"), device="cuda", dtype=dtype)
    gemv.launch(x, w, bias, out)
    ref = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    assert not out.isnan().any(), f"unwritten outputs (seed={seed})"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err:.2e} (seed={seed})"


def test_linear_dispatch():
    """linear() takes the kernel for decode-sized inputs and cuBLAS beyond; both give the product."""
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    assert gemv.applies(x[:1], w) and not gemv.applies(x[:2], w) and not gemv.applies(x[:1].float(), w.float())
    ref = x.double() @ w.double().T
    for rows in (1, 4, 8):
        out = gemv.linear(x[:rows], w)
        err = ((out.double() - ref[:rows]).norm() / ref[:rows].norm()).item()
        assert err < 1e-2
    compiled = torch.compile(gemv.linear, fullgraph=True)
    out = compiled(x[:1], w)
    assert ((out.double() - ref[:1]).norm() / ref[:1].norm()).item() < 1e-2
