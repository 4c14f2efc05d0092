"""Where compiled code is kept between processes.

torch.compile's caches (Inductor's FX-graph cache, AOTAutograd's cache and the Triton kernels they
build) live under one directory, TORCHINDUCTOR_CACHE_DIR. Unless that variable is set, flexsgl
points it at `$XDG_CACHE_HOME/flexsgl/inductor` (by default `~/.cache/flexsgl/inductor`) instead of
torch's `/tmp/torchinductor_$USER`, so a warm start survives a reboot. flash-attn-4's CuTe DSL
kernels, which FlexAttention's FLASH backend compiles (about 10 s each on an H200), are kept in
its `flash_attn_cute` subdirectory unless FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED or _DIR says
otherwise; without it every process compiles them again. `flexsgl cache` shows the directory and
its size; `flexsgl cache --clear` deletes it (of a directory the user named, only what torch.compile
keeps there).

torch.compile keys its cached graphs on the graph it traced, not on the code of the custom ops the
graph calls: a graph traced by one version of flexsgl can be served to another whose op takes other
arguments (seen when an op gained an optional argument: the older code loaded the newer graph and
failed with "expected at most 5 argument(s) but received 6"). So flexsgl tags torch.compile's cache
keys with a hash of its own source (`torch.compiler.config.cache_key_tag`), unless
TORCH_COMPILE_CACHE_KEY_TAG is set: a changed flexsgl compiles afresh.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
from pathlib import Path

ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flexsgl" / "inductor"


FLASH_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


TAG_ENV = "TORCH_COMPILE_CACHE_KEY_TAG"
# what torch.compile (and flash-attn-4, here) keep under the cache directory
TORCH_ENTRIES = frozenset({"fxgraph", "aotautograd", "triton", "flash_attn_cute", "pgo", "autotune", "precompile",
                           "cache", "kernel"})


def cache_dir() -> Path:
    """The directory in use: TORCHINDUCTOR_CACHE_DIR, set to flexsgl's default where it was unset."""
    if not os.environ.get(ENV):
        os.environ[ENV] = str(default_dir())
    return Path(os.environ[ENV])


def prepare() -> Path:
    """Before the first compile: the cache directory (cache_dir), flash-attn-4's kernel cache inside
    it where its variables are unset (flash-attn-4 reads them when it is imported, which Inductor
    does at the first FLASH compile, after this), and torch.compile's cache keys tagged with
    flexsgl's source where TORCH_COMPILE_CACHE_KEY_TAG is unset. Returns the directory."""
    import torch

    path = cache_dir()
    if not any(os.environ.get(v) for v in FLASH_ENV):
        os.environ.update(zip(FLASH_ENV, ("1", str(path / "flash_attn_cute"))))
    if not os.environ.get(TAG_ENV) and hasattr(torch.compiler.config, "cache_key_tag"):
        torch.compiler.config.cache_key_tag = f"flexsgl-{source_hash()}"
    return path


@functools.cache
def source_hash() -> str:
    """A hash of flexsgl's Python source: the flexsgl package and its overrides."""
    digest = hashlib.sha256()
    for package in ("flexsgl", "flexsgl.overrides"):
        for root in importlib.util.find_spec(package).submodule_search_locations:
            for f in sorted(Path(root).rglob("*.py")):
                digest.update(f"{package}/{f.relative_to(root)}".encode())
                digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def clear() -> int:
    """Delete the cached compiled code; returns the bytes it held. flexsgl's own directory goes
    whole; a TORCHINDUCTOR_CACHE_DIR the user set keeps everything but what torch.compile writes
    there (TORCH_ENTRIES, and Inductor's code in directories named by two characters of a hash)."""
    path = cache_dir()
    if path == default_dir():
        held = size_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        return held
    held = 0
    for entry in path.iterdir() if path.is_dir() else ():
        if entry.is_dir() and (entry.name in TORCH_ENTRIES or re.fullmatch(r"[0-9a-z]{2}", entry.name)):
            held += size_bytes(entry)
            shutil.rmtree(entry, ignore_errors=True)
    return held
