"""flexsgl/kernels/fp8_gemm.py: the FP8 product for decode batches against float64 products of the
same FP8 values and scales, through Triton's interpreter on the CPU and compiled on a GPU; its tiles
against hand-worked cases; and `fp8_linear`, the op Fp8Linear calls, on either side of MAX_ROWS."""

import random

import pytest
import torch

from flexsgl.kernels import fp8_gemm
from flexsgl.quant.fp8 import quantize_rows, quantize_tokens


def operands(m: int, n: int, k: int, seed: int, dtype: torch.dtype, device: str, extras: bool):
    """FP8 activations and weight with their scales, and bias and residual (or None) in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4  # each token its own scale
    w = torch.randn(n, k, generator=g) / k ** 0.5 * (0.5 + torch.rand(n, 1, generator=g))
    xq, xs = quantize_tokens(x)
    wq, ws = quantize_rows(w)
    bias = torch.randn(n, generator=g).to(dtype) if extras else None
    residual = torch.randn(m, n, generator=g).to(dtype) if extras else None
    moved = [t.to(device) if t is not None else None for t in (xq, xs, wq, ws, bias, residual)]
    return moved


def reference(xq, xs, wq, ws, bias, residual) -> torch.Tensor:
    out = (xq.double().cpu() * xs.double().cpu()) @ (wq.double().cpu() * ws.double().cpu()).T
    for extra in (bias, residual):
        if extra is not None:
            out = out + extra.double().cpu()
    return out


def check(m, n, k, extras, dtype, device, block=None, sms=132):
    seed = random.randrange(2**31)
    xq, xs, wq, ws, bias, residual = operands(m, n, k, seed, dtype, device, extras)
    out = torch.empty(m, n, dtype=dtype, device=device)
    fp8_gemm.launch(xq, xs.view(-1), wq, ws.view(-1), bias, residual, out, block, sms)
    want = reference(xq, xs, wq, ws, bias, residual)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
    off = ((out.double().cpu() - want).abs().max() / want.abs().max()).item()
    tiles = block or fp8_gemm.tiles(m, n, k, sms)
    assert off <= tol, f"seed={seed}: {off:.2e} of the largest output off, tiles {tiles}"


@pytest.mark.parametrize("m,n,k", [(1, 96, 128), (7, 64, 256), (33, 128, 384), (64, 32, 128), (100, 192, 256)])
@pytest.mark.parametrize("extras", [False, True], ids=["alone", "bias+residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])  # bf16: see conftest
@pytest.mark.usefixtures("triton_interpreter")
def test_interpreted_kernel_matches_float64(m, n, k, extras, dtype):
    check(m, n, k, extras, dtype, "cpu", sms=8)  # 8 SMs: the widest tiles these sizes allow


@pytest.mark.parametrize("block", [(16, 32, 128), (64, 64, 256), (32, 128, 128), (16, 32, 512)])
@pytest.mark.usefixtures("triton_interpreter")
def test_interpreted_kernel_on_each_tile(block):
    """Each depth of K too: 512 columns a slice sum four ACC_K-column runs of the FP8 accumulator."""
    check(40, 128, 1024, True, torch.float32, "cpu", block=block)


def test_tiles_fill_the_sms():
    """Hand-worked on 132 SMs, at least 66 programs: a Qwen3-0.6B's projections at 224 tokens (4 row
    tiles of 64): gate_up and qkv leave 192 and 128 programs on 128 rows, o_proj and down_proj (1,024
    rows) 128 on 32; at 100 tokens (2 row tiles) 4,096 rows give 64 on 128 rows, 128 on 64; 7 tokens
    make one row tile of 16, and 1,024 rows in 32s only 32 programs: the narrowest; 96 rows divide
    only by 32. K: 16 KiB of weight a slice, 128 x 128, 64 x 256 or 32 x 512, where the depth
    divides K (1,152 only by 128)."""
    assert fp8_gemm.tiles(224, 6144, 1024, 132) == (64, 128, 128)
    assert fp8_gemm.tiles(224, 4096, 1024, 132) == (64, 128, 128)
    assert fp8_gemm.tiles(224, 1024, 3072, 132) == (64, 32, 512)
    assert fp8_gemm.tiles(100, 4096, 4096, 132) == (64, 64, 256)
    assert fp8_gemm.tiles(7, 1024, 2048, 132) == (16, 32, 512)
    assert fp8_gemm.tiles(7, 1024, 768, 132) == (16, 32, 256)
    assert fp8_gemm.tiles(7, 1024, 1152, 132) == (16, 32, 128)
    assert fp8_gemm.tiles(33, 96, 256, 8) == (64, 32, 256)


def test_launch_refuses_tiles_that_do_not_divide():
    xq, xs, wq, ws, *_ = operands(4, 96, 128, 0, torch.float32, "cpu", False)
    with pytest.raises(ValueError, match="tiles of 64 rows"):
        fp8_gemm.launch(xq, xs.view(-1), wq, ws.view(-1), None, None, torch.empty(4, 96), block=(16, 64, 128))
    with pytest.raises(ValueError, match="256 columns"):
        fp8_gemm.launch(xq, xs.view(-1), wq, ws.view(-1), None, None, torch.empty(4, 96), block=(16, 32, 256))


def test_op_off_the_kernel_adds_the_residual():
    """On the CPU `fp8_linear` runs torch._scaled_mm (where this torch has it there) and adds the
    residual and bias itself."""
    from tests.test_fp8_gpu import cpu_rowwise_scaled_mm_runs

    if not cpu_rowwise_scaled_mm_runs():
        pytest.skip(f"torch {torch.__version__} has no FP8 product with per-row scales on the CPU")
    seed = random.randrange(2**31)
    xq, xs, wq, ws, bias, residual = operands(5, 48, 64, seed, torch.bfloat16, "cpu", True)
    out = fp8_gemm.fp8_linear(xq, xs, wq, ws, bias, residual, torch.bfloat16)
    want = reference(xq, xs, wq, ws, bias, residual)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() <= 8e-3, f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 100, 224, 256])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (4096, 4096), (24576, 4096),
                                 (4096, 12288)])
@pytest.mark.parametrize("extras", [False, True], ids=["alone", "bias+residual"])
def test_kernel_matches_float64(m, n, k, extras):
    """The Qwen3-0.6B's projections and three of the 8B's (down_proj's K of 12,288: sums the tensor
    cores' FP8 accumulator alone would carry too far), compiled, bfloat16 out."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 products need an SM89+ GPU")
    check(m, n, k, extras, torch.bfloat16, "cuda", sms=torch.cuda.get_device_properties(0).multi_processor_count)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 256, 257, 600])
def test_op_on_either_side_of_max_rows(m):
    """`fp8_linear` on the GPU: the kernel up to MAX_ROWS tokens on SM90, cuBLAS past them; the same
    sums either way."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 products need an SM89+ GPU")
    seed = random.randrange(2**31)
    xq, xs, wq, ws, bias, residual = operands(m, 1024, 2048, seed, torch.bfloat16, "cuda", True)
    assert fp8_gemm.applies(xq, wq) == (m <= fp8_gemm.MAX_ROWS and torch.cuda.get_device_capability()[0] == 9)
    out = fp8_gemm.fp8_linear(xq, xs, wq, ws, bias, residual, torch.bfloat16)
    want = reference(xq, xs, wq, ws, bias, residual)
    assert ((out.double().cpu() - want).abs().max() / want.abs().max()).item() <= 8e-3, f"seed={seed}"
