"""Where compiled code is kept between processes.

torch.compile's caches (Inductor's FX-graph cache, AOTAutograd's cache and the Triton kernels they
build) live under one directory, TORCHINDUCTOR_CACHE_DIR. Unless that variable is set, flexsgl
points it at `$XDG_CACHE_HOME/flexsgl/inductor` (by default `~/.cache/flexsgl/inductor`) instead of
torch's `/tmp/torchinductor_$USER`, so a warm start survives a reboot. flash-attn-4's CuTe DSL
kernels, which FlexAttention's FLASH backend compiles (about 10 s each on an H200), are kept in
its `flash_attn_cute` subdirectory unless FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED or _DIR says
otherwise; without it every process compiles them again. `flexsgl cache` shows the directory and
its size; `flexsgl cache --clear` deletes it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flexsgl" / "inductor"


FLASH_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


def cache_dir() -> Path:
    """The directory in use: TORCHINDUCTOR_CACHE_DIR, set to flexsgl's default where it was unset,
    and flash-attn-4's kernel cache inside it where that was unset (flash-attn-4 reads the variables
    when it is imported, which Inductor does at the first FLASH compile, after this)."""
    if not os.environ.get(ENV):
        os.environ[ENV] = str(default_dir())
    path = Path(os.environ[ENV])
    if not any(os.environ.get(v) for v in FLASH_ENV):
        os.environ.update(zip(FLASH_ENV, ("1", str(path / "flash_attn_cute"))))
    return path


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def clear() -> int:
    """Delete the cache directory; returns the bytes it held."""
    path = cache_dir()
    held = size_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return held
