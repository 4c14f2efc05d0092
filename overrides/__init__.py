"""Kernel overrides for the attention hot spots (imported as flexsgl.overrides)."""
