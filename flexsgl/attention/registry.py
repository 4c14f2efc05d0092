"""Attention backends by name. `auto` picks the best one this machine runs; today that is flex."""

from __future__ import annotations

from typing import Callable

import torch

from flexsgl.attention.flex import FlexAttentionBackend

BACKENDS = {"flex": FlexAttentionBackend}


def create_backend(override: str, device: torch.device, page_size: int) -> Callable:
    """Check `override` before any weights load; return a factory taking (pool, compiled)."""
    name = "flex" if override == "auto" else override
    if name not in BACKENDS:
        raise ValueError(f"Unknown attention override {override!r}; available: auto, {', '.join(BACKENDS)}.")
    cls = BACKENDS[name]
    reason = cls.unsupported(page_size, device)
    if reason:
        raise ValueError(f"Override {override!r} cannot run here: {reason}.")
    return lambda pool, compiled: cls(pool, compiled=compiled)
