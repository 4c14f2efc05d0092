"""Where compiled code is kept between processes.

torch.compile's caches (Inductor's FX-graph cache, AOTAutograd's cache and the Triton kernels they
build) live under one directory, TORCHINDUCTOR_CACHE_DIR. Unless that variable is set, flexsgl
points it at `$XDG_CACHE_HOME/flexsgl/inductor` (by default `~/.cache/flexsgl/inductor`) instead of
torch's `/tmp/torchinductor_$USER`, so a warm start survives a reboot. `flexsgl cache` shows the
directory and its size; `flexsgl cache --clear` deletes it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flexsgl" / "inductor"


def cache_dir() -> Path:
    """The directory in use: TORCHINDUCTOR_CACHE_DIR, set to flexsgl's default where it was unset."""
    if not os.environ.get(ENV):
        os.environ[ENV] = str(default_dir())
    return Path(os.environ[ENV])


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def clear() -> int:
    """Delete the cache directory; returns the bytes it held."""
    path = cache_dir()
    held = size_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return held
