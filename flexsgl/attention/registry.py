"""Attention backends by name. `auto` picks the best one this machine runs; today that is flex."""

from __future__ import annotations

from typing import Callable

import torch

from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.config import ModelConfig

BACKENDS: dict[str, Callable] = {
    "flex": lambda pool, compiled: FlexAttentionBackend(pool, pad_q_to_block=compiled),
}


def create_backend(override: str, cfg: ModelConfig, device: torch.device) -> Callable:
    """Check `override` before any weights load; return a factory taking (pool, compiled)."""
    name = "flex" if override == "auto" else override
    if name not in BACKENDS:
        raise ValueError(f"Unknown attention override {override!r}; available: auto, {', '.join(BACKENDS)}.")
    return BACKENDS[name]
