"""RMSNorm and the two RoPE rotations as plain PyTorch expressions, on tensors: what the models
compute (flexsgl/model/) and the rounding flexsgl's fused kernels follow step for step
(rope_store.py, latent_store.py, latent_query.py; interleaved_rope.py inside Triton)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF does it: normalise in float32, cast back, then scale.
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RoPE (rotate-half) on each `[T, heads, D]` x, from cos/sin tables `[positions, D/2]` (float32)."""
    cos, sin = cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)  # [T, 1, D/2]
    out = []
    for x in xs:
        x1, x2 = x.float().chunk(2, dim=-1)
        out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))
    return tuple(out)


def rotate_pairs(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE on x `[T, ..., D]`: pair i is (x[2i], x[2i+1]), turned by the tables' angle i
    (cos/sin `[positions, D/2]`, float32); in float32, then back to x's dtype."""
    cos, sin = cos[positions], sin[positions]
    cos, sin = cos.view(cos.shape[0], *[1] * (x.dim() - 2), -1), sin.view(sin.shape[0], *[1] * (x.dim() - 2), -1)
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
