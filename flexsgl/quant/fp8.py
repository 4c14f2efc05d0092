"""FP8 (float8_e4m3fn) arithmetic: a checkpoint weight's scales expanded and applied (dequantize),
weights quantized by output row or by block, and activations quantized by token or by group of a
token's values, each as vLLM's FP8 methods do (scale = absmax / 448, the largest e4m3 number)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # an all-zero row or token: any scale reproduces it; this one avoids 0 / 0


def expand_scale(scale: torch.Tensor, strategy: str, block: tuple[int, int] | None,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """`scale` (a weight's scale as its checkpoint stores it: per block `[ceil(N / bn), ceil(K / bk)]`,
    per channel `[N, 1]`, per tensor `[1]`) as float32 broadcastable to the weight `[N, K]`: each
    block's scale repeated over its block (the last blocks cut to the weight's edge). Scales may
    lead with more dimensions (stacked experts': `[E, ...]` for `[E, N, K]`)."""
    *lead, n, k = shape
    scale = scale.float()
    if strategy == "block":
        bn, bk = block
        return scale.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return scale.reshape(*lead, n, 1) if strategy == "channel" else scale.reshape(*lead, 1, 1)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, strategy: str,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """The float32 weight an FP8 `weight` `[..., N, K]` and its checkpoint `scale` stand for."""
    return weight.float() * expand_scale(scale, strategy, block, tuple(weight.shape))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in FP8 (computed in float32), values past 448 saturated to it (a cast alone would
    make them NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[N, K]` as FP8 with one float32 scale per row `[N, 1]`: row absmax / 448, the
    absmax `[N, 1]` given where the rows run on beyond `weight` (a rank's columns of them)."""
    w = weight.float()
    absmax = w.abs().amax(-1, keepdim=True) if absmax is None else absmax
    scale = (absmax / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize(w, scale), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `x` `[M, K]` as FP8 with one float32 scale per token `[M, 1]` (dynamic: from x itself)."""
    return quantize_rows(x)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `x` `[M, K]` (K a multiple of `group`) as FP8 with one float32 scale per token and
    group of `group` consecutive values, `[M, K / group]` (DeepSeek-V3's 1 x 128 activation blocks)."""
    m, k = x.shape
    q, scale = quantize_rows(x.reshape(m, k // group, group))
    return q.view(m, k), scale.view(m, k // group)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[N, K]` (multiples of the block) as FP8 with one float32 scale per block `[N / bn,
    K / bk]`, as block-wise checkpoints store it (their `weight_scale_inv`)."""
    (n, k), (bn, bk) = weight.shape, block
    blocks = weight.float().reshape(n // bn, bn, k // bk, bk).transpose(1, 2)  # [N / bn, K / bk, bn, bk]
    scale = (blocks.abs().amax((-2, -1)) / FP8_MAX).clamp(min=MIN_SCALE)
    q = quantize(blocks, scale[..., None, None])
    return q.transpose(1, 2).reshape(n, k), scale
