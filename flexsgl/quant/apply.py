"""What FP8 does to a model's projections and routed experts: which keep FP8 weights on a GPU with
FP8 matrix products, and `--quantization fp8`, which quantizes an unquantized checkpoint's as it loads.

The projections are the attention's and the dense MLPs' linear layers (`qkv_proj`, `o_proj`,
`gate_up_proj`, `down_proj`, and DeepSeek-V2's `qkv_a_proj` and `q_b_proj`); kept, each becomes an
Fp8Linear. The routed experts (flexsgl/model/moe.py Experts: the modules with `hold_fp8`) keep
their stacked weights in FP8: one scale per row where torch._scaled_grouped_mm runs (SM90), and a
block-wise checkpoint's block scales on GPUs with FP8 products (flexsgl/kernels/block_fp8_experts.py). Not
quantized: the embedding and the LM head, MoE routers, the shared experts (the one-token MoE kernel
reads them in the model's dtype), and MLA's `kv_b_proj` (whose weight attention reads per head);
FP8 checkpoint tensors of those are dequantized as they load.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from flexsgl.distributed.group import all_reduce_max_
from flexsgl.distributed.layers import ROW_PARALLEL
from flexsgl.kernels import block_fp8_experts
from flexsgl.quant.fp8 import FP8, dequantize, quantize_rows
from flexsgl.quant.fp8_linear import ALIGN, Fp8Linear, block_gemm_runs, checks_out, cuda_index, fits, fp8_gemm_runs

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "qkv_a_proj", "q_b_proj")
QUANTIZATIONS = ("fp8",)  # what --quantization takes


def projections(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's projections that FP8 applies to (module docstring), by module name."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS and ".shared_experts." not in name}


def experts(model: nn.Module) -> dict[str, nn.Module]:
    """The model's stacked routed experts (modules that can hold FP8 weights), by module name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "hold_fp8")}


def experts_fit(m: nn.Module, block: tuple[int, int] | None = None) -> bool:
    """Whether experts `m`'s shapes (this rank's) suit torch._scaled_grouped_mm (every dimension a
    multiple of 16), or with `block` scales the block kernel: gate's and up's rows, down's rows and
    every projection's columns whole blocks."""
    (_, two_i, h), (_, _, i) = m.gate_up_proj.shape, m.down_proj.shape
    if block is not None:
        bn, bk = block
        return block_fp8_experts.runs(block) and (two_i // 2) % bn == 0 and h % bn == 0 and h % bk == 0 \
            and i % bk == 0
    return all(n % ALIGN == 0 for n in (two_i, h, i))


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)


def keep_fp8(model: nn.Module, fp8_weights: set[str], with_projections: bool, with_experts: bool,
             block: tuple[int, int] | None = None, whole_blocks=lambda linear: True) -> list[str]:
    """Make Fp8Linears (on the meta device, before allocation) of the projections whose weight the
    checkpoint holds wholly in FP8 (`fp8_weights`: parameter names) and whose shape suits the FP8
    product, and hold such experts' weights in FP8, as `with_projections` and `with_experts` say;
    returns their names. Their checkpoint tensors then load as they are, scales and all. block: the
    checkpoint's weight blocks (None: a scale per row), which a projection keeps where
    `whole_blocks(linear)` (its fused parts and this rank's pieces of them are whole blocks)."""
    kept = []
    for name, linear in projections(model).items() if with_projections else ():
        if f"{name}.weight" in fp8_weights and fits(linear, block) and (block is None or whole_blocks(linear)):
            _swap(model, name, Fp8Linear.replacing(linear, block))
            kept.append(name)
    for name, m in experts(model).items() if with_experts else ():
        if {f"{name}.gate_up_proj", f"{name}.down_proj"} <= fp8_weights and experts_fit(m, block):
            scales = [(e, n, 1) if block is None else (e, n // block[0], k // block[1])
                      for e, n, k in (m.gate_up_proj.shape, m.down_proj.shape)]
            m.hold_fp8(torch.empty(m.gate_up_proj.shape, dtype=FP8), torch.empty(scales[0]),
                       torch.empty(m.down_proj.shape, dtype=FP8), torch.empty(scales[1]), block)
            kept.append(name)
    return kept


def keeps_fp8(device: torch.device, dtype: torch.dtype, block: tuple[int, int] | None = None) -> bool:
    """Whether FP8 weights (of `block` scales; None: per row or tensor) stay FP8 here (else they are
    dequantized to `dtype` as they load)."""
    return fp8_gemm_runs(device, dtype) and (block is None or block_gemm_runs(device, dtype))


def keeps_fp8_experts(device: torch.device, dtype: torch.dtype, block: tuple[int, int] | None = None) -> bool:
    """Whether routed experts' FP8 weights stay FP8 here: with `block` scales on a GPU with FP8
    products (flexsgl's kernel); with scales per row where torch._scaled_grouped_mm runs, on SM90
    (its kernels are built for it alone), as a small product checked against the same one
    dequantized shows once per GPU."""
    if block is not None:
        return fp8_gemm_runs(device, dtype)
    return (keeps_fp8(device, dtype) and torch.cuda.get_device_capability(device)[0] == 9
            and hasattr(torch, "_scaled_grouped_mm") and _grouped_product_checks_out(cuda_index(device)))


@functools.cache
def _grouped_product_checks_out(index: int) -> bool:
    """Two experts of [128, 128], rows 5 and 27 (a segment not a multiple of 16), rowwise scales."""
    device = torch.device("cuda", index)
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(32, 128, device=device, generator=g).bfloat16()
    weight, scale = quantize_rows(torch.randn(2, 128, 128, device=device, generator=g))
    xq, x_scale = quantize_rows(x)
    ends = torch.tensor([5, 32], dtype=torch.int32, device=device)
    want = torch.cat([(xq[a:b].float() * x_scale[a:b]) @ (weight[e].float() * scale[e]).T
                      for e, (a, b) in enumerate(((0, 5), (5, 32)))])
    return checks_out(lambda: torch._scaled_grouped_mm(xq, weight.transpose(1, 2), x_scale.view(-1), scale.view(2, -1),
                                                       offs=ends, out_dtype=torch.bfloat16), want)


@torch.no_grad()
def quantize_online(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """`--quantization fp8` on a loaded model: each projection's weight quantized to FP8 per output
    row (absmax / 448). Where FP8 products run (keeps_fp8) it becomes an Fp8Linear, whose activations
    are quantized per token as they come; elsewhere its weight is replaced by its dequantized FP8
    values, so the numbers are those of FP8 weights. Under tensor parallelism a row-parallel
    projection's rows run across the ranks' columns: their absmax is the ranks' maximum, so each
    rank's slice is that of one rank's weights. The routed experts' weights are quantized per row
    too, and held in FP8 where keeps_fp8_experts. Returns how many projections and experts were
    quantized."""
    keep = keeps_fp8(device, dtype)
    count = 0
    for name, linear in projections(model).items():
        absmax = None
        if model.cfg.tp_size > 1 and name.rsplit(".", 1)[-1] in ROW_PARALLEL:
            absmax = linear.weight.float().abs().amax(-1, keepdim=True)
            all_reduce_max_(absmax)
        weight, scale = quantize_rows(linear.weight, absmax)
        if keep and fits(linear):
            new = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None).to(device)
            new.weight.copy_(weight)
            new.weight_scale.copy_(scale)
            if linear.bias is not None:
                new.bias = linear.bias
            _swap(model, name, new)
        else:
            linear.weight.copy_(dequantize(weight, scale, "channel"))
        count += 1
    keep = keeps_fp8_experts(device, dtype)
    for m in experts(model).values():
        quantized = []
        for proj in (m.gate_up_proj, m.down_proj):
            absmax = None
            if model.cfg.tp_size > 1 and proj is m.down_proj:  # its rows run across the ranks' columns
                absmax = proj.float().abs().amax(-1, keepdim=True)
                all_reduce_max_(absmax)
            quantized += quantize_rows(proj, absmax)
        if keep and experts_fit(m):
            m.hold_fp8(*quantized)
        else:
            m.gate_up_proj.copy_(quantized[0].float() * quantized[1])
            m.down_proj.copy_(quantized[2].float() * quantized[3])
        count += 1
    return count
