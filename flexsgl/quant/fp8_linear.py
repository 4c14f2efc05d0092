"""Fp8Linear: a projection that keeps its weight in FP8 and multiplies with FP8 activations quantized
as they come, on GPUs with FP8 matrix products (SM89+). Elsewhere FP8 weights are dequantized to
the model's dtype as they load and run as any other nn.Linear (flexsgl/quant/apply.py).

Two kinds of scales:

- one float32 scale per output row, `weight_scale` `[N, 1]` (per-channel and per-tensor checkpoints,
  `--quantization fp8`): activations quantized per token, multiplied by flexsgl's FP8 kernel at a
  decode step's rows on SM90 and by `torch._scaled_mm` with rowwise scales elsewhere
  (flexsgl/kernels/fp8_gemm.py, which also adds a residual on the way out: `forward(x, residual)`);
- one per 128 x 128 block, `weight_scale` `[N / 128, K / 128]` (block-wise checkpoints, DeepSeek-V3's
  and Qwen3-FP8's `weight_scale_inv`): activations quantized per token and group of 128 values, and
  `torch._scaled_mm` with those blocks (cuBLAS's 1 x 128 by 128 x 128 recipe, on SM90) where K holds
  a multiple of 4 blocks (SCALED_MM_K); at other K, flexsgl's block kernel
  (flexsgl/kernels/block_fp8_experts.py, one group of every row) on the activations as they are.
  Whether torch's product runs is asked of the GPU once, on a small product checked against the same
  one dequantized (`block_gemm_runs`); where it does not, block-wise weights are dequantized as they
  load.

bfloat16 out either way. It stands where an nn.Linear stood: same in and out features, a `weight`
whose weight loader fills it (in FP8), and `weight_scale`, filled with the weight
(flexsgl/model/loader.py): per-tensor and per-channel checkpoint scales both become one scale per
row, so a fused projection (q, k and v in one) keeps each part's own, and block scales come block
row for block row. On the CPU (where tests force FP8 weights) a block-wise weight multiplies
dequantized.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from flexsgl.kernels import block_fp8_experts, fp8_gemm
from flexsgl.quant.fp8 import FP8, dequantize, quantize_blocks, quantize_groups, quantize_tokens

# torch._scaled_mm takes FP8 operands whose dimensions are multiples of 16.
ALIGN = 16
BLOCK = (128, 128)  # the weight blocks torch._scaled_mm multiplies by
# torch._scaled_mm sums 128 x 128 block-scaled products correctly where K holds a multiple of 4 blocks;
# at K of 2 or 3 blocks it returned wrong sums without an error (an H200, torch 2.11, CUDA 13).
SCALED_MM_K = 4 * BLOCK[1]
# and at 1 and 7 rows it refused (CUBLAS_STATUS_NOT_SUPPORTED) where 32 and 300 ran: rows are padded to
# a multiple of 4, at least 16
SCALED_MM_ROWS = (4, 16)


def fp8_gemm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Fp8Linear runs here: a CUDA GPU of SM89 or later, and a bfloat16 model (the rowwise
    scaled product's output dtype)."""
    return (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (8, 9))


def block_gemm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Fp8Linear runs 128 x 128 block-scaled weights here: an SM90 GPU whose torch._scaled_mm
    multiplies by them (module docstring)."""
    return (fp8_gemm_runs(device, dtype) and torch.cuda.get_device_capability(device)[0] == 9
            and _block_product_checks_out(cuda_index(device)))


def cuda_index(device: torch.device) -> int:
    """The index of CUDA device `device` (the current one where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def checks_out(product, want: torch.Tensor) -> bool:
    """Whether `product()` runs here and gives `want` within 2% of its largest magnitude (an FP8
    product asked of a GPU once, before a model relies on it)."""
    try:
        got = product().float()
    except RuntimeError:
        return False
    return bool(((got - want).abs() <= 0.02 * want.abs().max()).all())


@functools.cache
def _block_product_checks_out(index: int) -> bool:
    """torch._scaled_mm at K of 4 blocks, 7 rows (padded) and 32."""
    device = torch.device("cuda", index)
    g = torch.Generator(device).manual_seed(0)
    weight, scale = quantize_blocks(torch.randn(256, SCALED_MM_K, device=device, generator=g), BLOCK)
    for m in (7, 32):
        x = torch.randn(m, SCALED_MM_K, device=device, generator=g).bfloat16()
        xq, x_scale = quantize_groups(x, BLOCK[1])
        want = dequantize(xq, x_scale, "block", (1, BLOCK[1])) @ dequantize(weight, scale, "block", BLOCK).T
        if not checks_out(lambda: block_product(x, weight, scale, None), want):
            return False
    return True


def block_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x `[M, K]` @ weight.T for an FP8 weight of 128 x 128 block `scale`: where K is a multiple of
    SCALED_MM_K, x quantized per token and group of 128 and torch._scaled_mm (which takes the groups'
    scales M-major, and M padded to SCALED_MM_ROWS); elsewhere flexsgl's block kernel, one group of
    every row, x as it is."""
    m = x.shape[0]
    if x.shape[1] % SCALED_MM_K:
        ends = torch.full((1,), m, dtype=torch.int32, device=x.device)
        out = block_fp8_experts.block_fp8_experts(x, weight[None], scale[None], ends)
    else:
        rows = torch.sym_max(m, SCALED_MM_ROWS[1])  # no guard on M under dynamic shapes
        xq, x_scale = quantize_groups(F.pad(x, (0, 0, 0, rows + (-rows) % SCALED_MM_ROWS[0] - m)), BLOCK[1])
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.t().contiguous().t(), scale_b=scale.t(),
                               out_dtype=x.dtype)[:m]
    return out if bias is None else out + bias


def fits(linear: nn.Linear, block: tuple[int, int] | None = None) -> bool:
    """Whether `linear`'s shape suits torch._scaled_mm (with `block`: its 128 x 128 weight blocks)."""
    if block is not None:
        return block == BLOCK and linear.in_features % BLOCK[1] == 0 and linear.out_features % BLOCK[0] == 0
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


class Fp8Linear(nn.Module):
    adds_residual = True  # forward(x, residual) returns residual + self(x), added in the product's epilogue

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None = None):
        """block: the weight's scale blocks (None: a scale per row)."""
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        scale_shape = (out_features, 1) if block is None else (out_features // block[0], in_features // block[1])
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.weight.keep_dtype = self.weight_scale.keep_dtype = True  # allocate() keeps FP8 and float32
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def replacing(cls, linear: nn.Linear, block: tuple[int, int] | None = None) -> "Fp8Linear":
        """An Fp8Linear of `linear`'s shape, its parameters' weight loaders kept."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, block)
        if hasattr(linear.weight, "weight_loader"):
            new.weight.weight_loader = linear.weight.weight_loader
        if linear.bias is not None and hasattr(linear.bias, "weight_loader"):
            new.bias.weight_loader = linear.bias.weight_loader
        return new

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """self(x), plus `residual` (x's shape but out_features) where given."""
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.block is None:
            xq, x_scale = quantize_tokens(x)
            res = None if residual is None else residual.reshape(-1, self.out_features)
            out = fp8_gemm.fp8_linear(xq, x_scale, self.weight, self.weight_scale, self.bias, res, x.dtype)
            return out.view(*lead, self.out_features)
        if not x.is_cuda:  # the CPU: no block-scaled product there
            weight = dequantize(self.weight, self.weight_scale, "block", self.block).to(x.dtype)
            out = F.linear(x, weight, self.bias)
        else:
            out = block_product(x, self.weight, self.weight_scale, self.bias)
        out = out.view(*lead, self.out_features)
        return out if residual is None else residual + out
