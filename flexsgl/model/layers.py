"""Building blocks shared by the models: RMSNorm, rotary embeddings (default and llama3), gated MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from flexsgl.kernels.norm_rope import rms_norm
from flexsgl.model.weight_loaders import fused_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # float32 throughout, as HF computes it, so positions far into the context agree with it.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept, smooth between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of non-interleaved (rotate-half) RoPE, indexed by absolute position;
    flexsgl/kernels/norm_rope.py's `rotate` applies them (or the fused kernel in
    flexsgl/kernels/rope_store.py).

    The tables are buffers computed from the config, not weights: a model built on the meta device
    computes them once its parameters are allocated (`build`)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        cos, sin = self.tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[max_position, head_dim / 2]`, float32, on the default device."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        return freqs.cos(), freqs.sin()

    def build(self, device: torch.device) -> None:
        """Compute the tables (in float32 on the CPU, as HF does) and place them on `device`."""
        with torch.device("cpu"):
            cos, sin = self.tables()
        self.cos, self.sin = cos.to(device), sin.to(device)


class GatedMLP(nn.Module):
    """The SwiGLU MLP's projections: gate and up fused into one, then down. A decoder layer runs
    them through flexsgl.kernels.gemv, with the norm before and the residual add after folded in."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.gate_up_proj.weight.weight_loader = fused_rows([inter, inter])  # gate_proj, up_proj
        self.down_proj = nn.Linear(inter, hidden, bias=False)
