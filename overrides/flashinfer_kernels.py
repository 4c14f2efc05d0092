"""Whether FlashInfer holds a compiled kernel for fi and fi-decode, found by file lookups alone
(FlashInfer itself is not imported: that takes seconds, and `auto` asks before anything loads).

FlashInfer runs each attention variant from a JIT module, a shared library named for the variant
(its URI: the kernel family, dtypes, head sizes, options), and loads the first it finds of:

- the flashinfer-jit-cache package's, `flashinfer_jit_cache/jit_cache/<uri>/<uri>.so`: modules
  compiled ahead of time for one CUDA version (`flashinfer-jit-cache==<flashinfer's version>+cu130`),
  published on FlashInfer's own wheel index rather than PyPI;
- an ahead-of-time build of flashinfer itself, `flashinfer/data/aot/<uri>/<uri>.so`;
- its JIT cache, `$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<archs>/cached_ops/<uri>/<uri>.so`
  ($HOME where unset), where the first process that ran the variant left it after compiling it with
  nvcc (about 25 s for the decode kernel on an H100).

The flashinfer-cubin package holds other kernels (TRT-LLM-gen's attention, GEMM and MoE cubins for
SM100, which FlashInfer downloads on first use where it is missing): trtllm-mla's, none that fi and
fi-decode run.

The URIs follow FlashInfer's naming (flashinfer/jit/attention/modules.py: get_batch_prefill_uri,
get_batch_decode_uri) in the version the `flashinfer` extra pins. A name that drifted from it would
find nothing, which only makes `auto` take a path that needs no FlashInfer compile.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

SHORT_DTYPES = {"bfloat16": "bf16", "float16": "f16"}


def prefill_module(dtype: str, head_dim: int, fa3: bool) -> str:
    """FlashInfer's batch prefill module over a paged cache for these shapes (no RoPE, sliding
    window or soft cap, int32 page indices): its FA3 (SM90) or FA2 template."""
    t = SHORT_DTYPES[dtype]
    return (f"batch_prefill_with_kv_cache_dtype_q_{t}_dtype_kv_{t}_dtype_o_{t}_dtype_idx_i32_"
            f"head_dim_qk_{head_dim}_head_dim_vo_{head_dim}_posenc_0_use_swa_False_use_logits_cap_False_"
            f"f16qk_False" + ("_sm90" if fa3 else ""))


def decode_module(dtype: str, head_dim: int, grouped: bool) -> str:
    """The module fi-decode's kernel comes from: with grouped KV heads (it runs on tensor cores there)
    FlashInfer's FA2 batch prefill module, else its batch decode module."""
    if grouped:
        return prefill_module(dtype, head_dim, fa3=False)
    t = SHORT_DTYPES[dtype]
    return (f"batch_decode_with_kv_cache_dtype_q_{t}_dtype_kv_{t}_dtype_o_{t}_dtype_idx_i32_"
            f"head_dim_qk_{head_dim}_head_dim_vo_{head_dim}_posenc_0_use_swa_False_use_logits_cap_False")


def modules(backend: str, dtype: str, head_dim: int, grouped: bool, sm: int) -> list[str]:
    """The modules backend `backend` ("fi" or "fi-decode") runs for a model of these shapes on SM `sm`."""
    needed = [decode_module(dtype, head_dim, grouped)]
    if backend == "fi":  # its prefill takes FA3 on SM90
        needed.append(prefill_module(dtype, head_dim, fa3=sm == 90))
    return list(dict.fromkeys(needed))


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = getattr(spec, "submodule_search_locations", None)
    return Path(list(locations)[0]) if locations else None


def _arch_matches(folder: str, sm: int) -> bool:
    """Whether a JIT cache folder named for its target archs ("90a", "80_90a", "100a") covers SM `sm`."""
    return any(part.rstrip("abf") == str(sm) for part in folder.split("_"))


def prebuilt_dirs() -> list[Path]:
    """The folders of modules compiled ahead of time: flashinfer-jit-cache's, then flashinfer's own."""
    dirs = []
    jit_cache = _package_dir("flashinfer_jit_cache")
    if jit_cache is not None:
        dirs.append(jit_cache / "jit_cache")
    flashinfer = _package_dir("flashinfer")
    if flashinfer is not None:
        dirs.append(flashinfer / "data" / "aot")
    return dirs


def jit_cache_dirs(sm: int) -> list[Path]:
    """FlashInfer's JIT cache folders for its installed version whose target archs cover SM `sm`."""
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return []
    base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home())) / ".cache" / "flashinfer" / version
    try:
        archs = sorted(p.name for p in base.iterdir() if p.is_dir())
    except OSError:
        return []
    return [base / a / "cached_ops" for a in archs if _arch_matches(a, sm)]


def compiled(module: str, sm: int) -> Path | None:
    """Where FlashInfer would load `module` from without compiling it, or None."""
    for folder in prebuilt_dirs() + jit_cache_dirs(sm):
        path = folder / module / f"{module}.so"
        if path.is_file():
            return path
    return None
