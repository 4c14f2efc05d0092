"""Kernel options of flex's compiled kernels on CUDA, per regime: decode (the flex-decoding kernel
of flex_ops.py's op), MLA's latent decode, and prefill over pages or over packed rows, on the
Triton main kernel or FlexAttention's FLASH backend where it runs (flash_prefill_runs).

Each chosen by timing the op (for GQA on the kernel matrix's batches, 32 query / 8 KV heads,
d=128; figures in docs/BENCHMARKS.md). Decode: 4 warps and 3 stages rather than Inductor's default
config, and at least MIN_SPLITS KV splits while batch x KV heads is at most FEW_PROGRAMS, where
Inductor's own rule gives fewer splits than run fastest; with pages of 16 or 32 tokens, 2 warps and
the splits small_tile_splits picks. Prefill (run inside the compiled decoder layer), up to head_dim
128: 64x64 tiles, 4 warps, 3 stages, with TMA loads at head_dim 128, pages of 64, bf16/fp16 on
SM90. With flash-attn-4 installed, prefill over KV blocks of 128 (the step's K/V packed into rows,
flex_meta.py, or pages of 128) runs on FlexAttention's FLASH backend instead, which takes less time
than the Triton kernel there (an attention variant's too, unless FLEXSGL_FLASH_VARIANTS=0:
variant_prefill_options). MLA's latent decode (one KV head of 576 dims): latent_decode_options. The
KV tile must divide a page.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

MIN_SPLITS, FEW_PROGRAMS = 16, 32
FLASH = {"BACKEND": "FLASH"}  # FlexAttention's FLASH backend (flash-attn-4's CuTe DSL kernel)
FLASH_VARIANTS_ENV = "FLEXSGL_FLASH_VARIANTS"  # "0": variants' prefill stays on Triton (variant_prefill_options)
SMALL_TILE, SMALL_TILE_MAX_SPLITS = 32, 64
SMALL_TILE_FEW_PROGRAMS, SMALL_TILE_MANY_PROGRAMS = 512, 4096
LARGE_HEAD_DIM, LATENT_SPLITS = 256, 32


@functools.cache
def decode_options(batch: int, kv_heads: int, page_size: int, head_dim: int) -> dict:
    """flex-decoding kernel options for a static batch size."""
    if head_dim > LARGE_HEAD_DIM:
        return latent_decode_options(batch, page_size)
    options = {"num_warps": 4, "num_stages": 3}
    if page_size % 128:
        options["BLOCK_N"] = math.gcd(page_size, 64)
    if options.get("BLOCK_N", 128) <= SMALL_TILE:
        options.update(num_warps=2, SPLIT_KV=small_tile_splits(batch, kv_heads))
    elif batch * kv_heads <= FEW_PROGRAMS:
        options["SPLIT_KV"] = max(MIN_SPLITS, _inductor_splits(batch, kv_heads))
    return options


def small_tile_splits(batch: int, kv_heads: int) -> int:
    """KV splits where a page caps the KV tile at 16 or 32 tokens: each turn of a program's loop reads
    one small tile and waits on it, so the kernel needs many programs in flight (of 2 warps each). The
    time depends mostly on the number of programs, batch x KV heads x splits, and not smoothly: about
    SMALL_TILE_FEW_PROGRAMS of them (one wave, at least two splits a request) while batch x KV heads is
    at most that, else about SMALL_TILE_MANY_PROGRAMS: the counts in between took longer at 4k-16k
    tokens wherever tried (docs/BENCHMARKS.md)."""
    pairs = batch * kv_heads
    if pairs <= SMALL_TILE_FEW_PROGRAMS:
        return min(SMALL_TILE_MAX_SPLITS, max(2, -(-SMALL_TILE_FEW_PROGRAMS // pairs)))
    return max(2, round(SMALL_TILE_MANY_PROGRAMS / pairs))


def latent_decode_options(batch: int, page_size: int) -> dict:
    """MLA's latent KV (576 dims, which the kernel rounds up to 1024; one KV head, a request's heads
    as the rows of one tile): KV tiles of 32 tokens and no pipelining keep a K and a V tile within
    shared memory, and at most LATENT_SPLITS programs share a request, as each writes a partial
    output of kv_lora_rank floats per head."""
    return {"num_warps": 4, "num_stages": 1, "BLOCK_N": math.gcd(page_size, 32),
            "SPLIT_KV": min(LATENT_SPLITS, _inductor_splits(batch, 1))}


@functools.cache
def kv_splits(batch: int, kv_heads: int, page_size: int, head_dim: int) -> int:
    """How many programs share a request's KV in the decode kernel: ours where set, else Inductor's rule."""
    return decode_options(batch, kv_heads, page_size, head_dim).get("SPLIT_KV") or _inductor_splits(batch, kv_heads)


def _inductor_splits(batch: int, kv_heads: int) -> int:
    """The KV splits Inductor's flex-decoding lowering picks by default (two programs per SM)."""
    sms = torch.cuda.get_device_properties().multi_processor_count
    return max(1, sms // (batch * kv_heads) * 2)


def prefill_options(head_dim: int, page_size: int, dtype: torch.dtype) -> dict:
    """Kernel options for prefill on CUDA: FlexAttention's FLASH backend where it runs
    (flash_prefill_runs), else its Triton main kernel."""
    if flash_prefill_runs(head_dim, page_size, dtype):
        return dict(FLASH)
    return triton_prefill_options(head_dim, page_size, dtype)


def variant_prefill_options(head_dim: int, page_size: int, dtype: torch.dtype, packed: bool = False,
                            flash_refused: str | None = None) -> dict:
    """Kernel options for an attention variant's prefill on CUDA, over pages or (`packed`) over the
    step's K/V packed into rows: the FLASH backend where prefill runs there and the variant's mods are
    ones FLASH compiles correctly (`flash_refused` None: flash_mods.py), unless FLEXSGL_FLASH_VARIANTS=0;
    else the Triton kernel (as plain prefill's). On FLASH a variant's masks read int32 integers only, a
    mask_mod that decides every block comes with empty full-block lists (flex_meta.py), and a sink
    reads the log-sum-exp in base e (flex.py), as that backend needs."""
    flash = flash_variants_wanted() and flash_refused is None
    if flash and flash_prefill_runs(head_dim, FLASH_KV_TILE if packed else page_size, dtype):
        return dict(FLASH)
    return triton_prefill_options(head_dim, 64 if packed else page_size, dtype)


def flash_variants_wanted() -> bool:
    """Whether variants' prefill may take the FLASH backend: unless FLEXSGL_FLASH_VARIANTS=0."""
    return os.environ.get(FLASH_VARIANTS_ENV, "1") != "0"


def triton_prefill_options(head_dim: int, page_size: int, dtype: torch.dtype) -> dict:
    """Options of flex's Triton main kernel for prefill on CUDA."""
    options = {"BLOCK_N": math.gcd(page_size, 64)}
    if head_dim <= 128:
        options.update(BLOCK_M=64, num_warps=4, num_stages=3)
    if (head_dim, page_size) == (128, 64) and dtype in (torch.bfloat16, torch.float16) \
            and torch.cuda.get_device_capability()[0] >= 9:
        options["USE_TMA"] = True  # TMA loads: 12-13% faster on an H200, the one shape measured and checked
    return options


def packed_prefill_options(head_dim: int, dtype: torch.dtype) -> dict:
    """Kernel options for prefill over the step's K/V packed into rows (flex_meta.py), where a KV
    block is 128 rows rather than a page: the FLASH backend where flash_prefill_runs
    at that block, else the Triton kernel as over pages of 64 (64x64 tiles, 4 warps, 3 stages, TMA
    loads at head_dim 128 in half precision on SM90: the fastest of the option sets timed on packed
    rows, docs/BENCHMARKS.md)."""
    if flash_prefill_runs(head_dim, FLASH_KV_TILE, dtype):
        return dict(FLASH)
    return prefill_options(head_dim, 64, dtype)


FLASH_KV_TILE = 128


def flash_prefill_runs(head_dim: int, page_size: int, dtype: torch.dtype) -> bool:
    """Whether prefill runs on the FLASH backend (flash-attn-4's CuTe DSL kernel): where flash-attn-4 is
    installed, on SM90 and SM100, in bf16 and fp16, at head_dim 128 (the dim measured), and with
    pages of FLASH_KV_TILE tokens, as its block sparsity needs a BlockMask KV block (a page) equal
    to its KV tile. Attention variants: variant_prefill_options."""
    return (page_size == FLASH_KV_TILE and head_dim == 128 and dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability()[0] in (9, 10) and _flash_installed())


def flash_note(sm: int | None) -> str:
    """What `flexsgl backends` says of flex's FLASH prefill on a GPU of this SM version (90 for
    SM90; None: no GPU), empty where it cannot run."""
    if sm is None or sm // 10 not in (9, 10):
        return ""
    if _flash_installed():
        return "; prefill at head_dim 128 in bf16/fp16 on FlexAttention's FLASH backend (flash-attn-4)"
    return ("; flash-attn-4 is not installed, so prefill runs on the Triton kernel (1.3-1.9x FLASH's time at "
            "head_dim 128 on an H200): pip install 'flexsgl[flash]' for FlexAttention's FLASH backend")


@functools.cache
def _flash_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn at all
        return False

