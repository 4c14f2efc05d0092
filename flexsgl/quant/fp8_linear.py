"""Fp8Linear: a projection that keeps its weight in FP8, one float32 scale per output row, and
multiplies with FP8 activations quantized per token as they come (`torch._scaled_mm`, rowwise
scales, bfloat16 out), on GPUs with FP8 matrix products (SM89+). Elsewhere FP8 weights are
dequantized to the model's dtype as they load and run as any other nn.Linear (flexsgl/quant/apply.py).

It stands where an nn.Linear stood: same in and out features, a `weight` whose weight loader fills
it (in FP8), and `weight_scale` `[N, 1]`, filled row for row with the weight (flexsgl/model/loader.py):
per-tensor and per-channel checkpoint scales both become one scale per row, so a fused projection
(q, k and v in one) keeps each part's own."""

from __future__ import annotations

import torch
from torch import nn

from flexsgl.quant.fp8 import FP8, quantize_tokens

# torch._scaled_mm takes FP8 operands whose dimensions are multiples of 16.
ALIGN = 16


def fp8_gemm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Fp8Linear runs here: a CUDA GPU of SM89 or later, and a bfloat16 model (the rowwise
    scaled product's output dtype)."""
    return (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (8, 9))


def fits(linear: nn.Linear) -> bool:
    """Whether `linear`'s shape suits torch._scaled_mm."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
        self.weight.keep_dtype = self.weight_scale.keep_dtype = True  # allocate() keeps FP8 and float32
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def replacing(cls, linear: nn.Linear) -> "Fp8Linear":
        """An Fp8Linear of `linear`'s shape, its parameters' weight loaders kept."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None)
        if hasattr(linear.weight, "weight_loader"):
            new.weight.weight_loader = linear.weight.weight_loader
        if linear.bias is not None and hasattr(linear.bias, "weight_loader"):
            new.bias.weight_loader = linear.bias.weight_loader
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, x_scale = quantize_tokens(x.reshape(-1, self.in_features))
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale.view(1, -1),
                               bias=self.bias, out_dtype=x.dtype)
        return out.view(*lead, self.out_features)
