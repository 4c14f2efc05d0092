"""The decode matrix-vector kernel (flexsgl/model/gemv.py) against a float64 product, on the GPU.

Shapes cover K a multiple of the tile and not, N not a multiple of the row block, 1 to 4 rows,
bias or none, bfloat16 and float16; the output is poisoned with NaN first so an unwritten element
fails. bf16 operands with a float32 accumulator land well under 1e-2 relative error.
"""

import pytest
import torch

from flexsgl.model import gemv

pytestmark = pytest.mark.gpu

SHAPES = [(6144, 4096), (4100, 1000), (37, 3072), (151936, 1024)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_float64(n, k, m, dtype):
    g = torch.Generator(device="cuda").manual_seed(n * 131 + k * 7 + m)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = (torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype, generator=g) if m % 2 else None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    gemv.launch(x, w, bias, out)
    ref = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    assert not out.isnan().any()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_linear_dispatch():
    """linear() takes the kernel for decode-sized inputs and cuBLAS beyond; both give the product."""
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    assert gemv.applies(x[:4], w) and not gemv.applies(x, w) and not gemv.applies(x[:1].float(), w.float())
    ref = x.double() @ w.double().T
    for rows in (1, 4, 8):
        out = gemv.linear(x[:rows], w)
        err = ((out.double() - ref[:rows]).norm() / ref[:rows].norm()).item()
        assert err < 1e-2
    compiled = torch.compile(gemv.linear, fullgraph=True, dynamic=True)
    out = compiled(x[:2], w)
    assert ((out.double() - ref[:2]).norm() / ref[:2].norm()).item() < 1e-2
