"""Building blocks shared by the models: RMSNorm, rotary embeddings (default, llama3 and YaRN), gated MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from flexsgl.kernels.norm_rope import rms_norm
from flexsgl.model.mla_config import yarn_mscale
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


def yarn_inv_freq(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor, as HF computes them (float32); `truncate` (default
    true) rounds the ends of the ramp between interpolated and extrapolated frequencies outwards."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                            else yarn_mscale(factor))

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of non-interleaved (rotate-half) RoPE, indexed by absolute position;
    flexsgl/kernels/norm_rope.py's `rotate` applies them (or the fused kernel in
    flexsgl/kernels/rope_store.py). With YaRN scaling its attention factor is folded into them.

    The tables are buffers computed from the config, not weights: a model built on the meta device
    computes them once its parameters are allocated (`build`), and holds only their shapes before
    (computed on the meta device, some of torch's meta operations import torch._dynamo)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        if torch.get_default_device().type == "meta":
            cos, sin = (torch.empty(max_position, head_dim // 2) for _ in range(2))
        else:
            cos, sin = self.tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[max_position, head_dim / 2]`, float32, on the default device."""
        s = self.scaling
        if s is not None and s.get("rope_type", s.get("type")) == "yarn":
            inv_freq, factor = yarn_inv_freq(self.head_dim, self.theta, s)
        else:
            inv_freq, factor = rope_inv_freq(self.head_dim, self.theta, s), 1.0
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        return freqs.cos() * factor, freqs.sin() * factor

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
