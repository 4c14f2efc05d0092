"""Flex decode on CUDA, compiled: one opaque op, a flex-decoding kernel per batch size.

Inductor lowers short queries to its flex-decoding kernel (KV split across programs, a KV head's
query heads in one tile) only for a static batch; with a symbolic one it falls back to the main
kernel, which gives each query head a 128-row tile. Compiling the model's decode per batch size
would cost a whole model compile per size. Here decode attention is a custom op that the compiled
decoder layer cannot see into: it compiles once with a symbolic batch, as it does around a kernel
override, and the op runs flex_attention compiled for the batch size it receives (one small
kernel; Inductor's cache keeps it across processes).

Kernel options, chosen by timing the op (for GQA on the kernel matrix's batches, 32 query / 8 KV
heads, d=128; figures in docs/BENCHMARKS.md). Decode: 4 warps and 3 stages rather than Inductor's
default config, and at least MIN_SPLITS KV splits while batch x KV heads is at most FEW_PROGRAMS,
where Inductor's own rule gives fewer splits than run fastest; with pages of 16 or 32 tokens, 2
warps and the splits small_tile_splits picks. Prefill (run inside the compiled decoder layer), up to
head_dim 128: 64x64 tiles, 4 warps, 3 stages, with TMA loads at head_dim 128, pages of 64, bf16/fp16
on SM90. With flash-attn-4 installed, prefill over KV blocks of 128 (the step's K/V packed into
rows, flex_meta.py, or pages of 128) runs on FlexAttention's FLASH backend instead, which takes
less time than the Triton kernel there. MLA's latent decode (one KV head of 576 dims):
latent_decode_options; its split-combining reduction kernels take the config Inductor's heuristic
picks, not the fastest of their candidates timed one by one on first use: those timings pick
differently from compile to compile, and one of their picks makes DeepSeek-V2-Lite's batch-1 step
markedly slower. The KV tile must divide a page.

The flex-decoding kernel indexes its KV tensor with 32-bit offsets (torch 2.11: with 64-bit ones its
template does not compile), so a pool of more than MAX_KERNEL_ELEMENTS elements per layer is read in
shards of whole pages: the op runs the kernel once per shard, over the pages each request's block
lists hold there, and merges the partial outputs by their log-sum-exp.

Prefill stays inside the model's step: the same op pattern for it, compiled with dynamic shapes,
does not compile in torch 2.11 ("XBLOCK is not defined" in the flex template once the page size is
symbolic, and engine steps fail under dynamo's automatic dynamic too).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import types

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from flexsgl.attention.bound_variant import BOUND
from flexsgl.attention.flex_masks import Q_BLOCK, listed_decode_causal, listed_decode_variant
from flexsgl.compile import settings
from flexsgl.compile_cache import prepare as prepare_cache

MIN_SPLITS, FEW_PROGRAMS = 16, 32
SMALL_TILE, SMALL_TILE_MAX_SPLITS = 32, 64
SMALL_TILE_FEW_PROGRAMS, SMALL_TILE_MANY_PROGRAMS = 512, 4096
LARGE_HEAD_DIM, LATENT_SPLITS = 256, 32
MAX_KERNEL_ELEMENTS = 2**31 - 1  # the largest KV tensor the flex-decoding kernel's 32-bit offsets reach
# Inductor's setting (torch 2.11-2.13) under which a reduction kernel takes the config its heuristic
# picks rather than the fastest of its candidates timed on first use (module docstring)
HEURISTIC_REDUCTIONS = "force_filter_reduction_configs"


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
        return {"BACKEND": "FLASH"}
    return triton_prefill_options(head_dim, page_size, dtype)


def triton_prefill_options(head_dim: int, page_size: int, dtype: torch.dtype) -> dict:
    """Options of flex's Triton main kernel for prefill on CUDA. Attention variants (their mods close
    over Python integers, which the dynamic-shape prefill compile makes symbolic, and the FLASH
    lowering refuses symbolic integers in a mod) always run on it."""
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
        return {"BACKEND": "FLASH"}
    return prefill_options(head_dim, 64, dtype)


FLASH_KV_TILE = 128


def flash_prefill_runs(head_dim: int, page_size: int, dtype: torch.dtype) -> bool:
    """Whether prefill runs on the FLASH backend (flash-attn-4's CuTe DSL kernel): where flash-attn-4 is
    installed, on SM90 and SM100, in bf16 and fp16, at head_dim 128 (the dim measured), and with
    pages of FLASH_KV_TILE tokens, as its block sparsity needs a BlockMask KV block (a page) equal
    to its KV tile."""
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


def _decode(q, k, v, kv_num_blocks, kv_indices, full_num_blocks, full_indices, page_table, last_pos,
            page_size: int, scale: float | None, options: dict, first_page: torch.Tensor | None,
            variant: int = -1, page_pos=None, req_slots=None, with_lse: bool = False):
    """Decode over k and v. first_page None: they are the whole pool. Else they are a shard of it,
    its pages from first_page (a 0-dim tensor) on: the block lists are cut to those pages. variant:
    a bound attention variant's id (bound_variant.py; -1: plain causal), whose mods read page_pos
    and each row's request slot. with_lse: the output comes with each query head's log-sum-exp,
    `[B, Hq]`."""
    b, hq, d = q.shape
    first_slot = 0
    if first_page is not None:
        end_page = first_page + k.shape[0] // page_size
        kv_num_blocks, kv_indices = shard_block_list(kv_num_blocks, kv_indices, first_page, end_page)
        if full_num_blocks is not None:
            full_num_blocks, full_indices = shard_block_list(full_num_blocks, full_indices, first_page, end_page)
        first_slot = first_page * page_size
    if variant < 0:
        mask_mod, score_mod = listed_decode_causal(page_table, last_pos, page_size, first_slot), None
    else:
        mask_mod, score_mod = listed_decode_variant(BOUND[variant], last_pos, page_pos, req_slots, page_size,
                                                    first_slot)
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_num_blocks, full_indices, BLOCK_SIZE=(Q_BLOCK, page_size),
        mask_mod=mask_mod, seq_lengths=(1, k.shape[0]), compute_q_blocks=False)
    out = flex_attention(q.view(b, 1, hq, d).transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
                         score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=hq != k.shape[1],
                         kernel_options=options, return_aux=AuxRequest(lse=True) if with_lse else None)
    if not with_lse:
        return out.transpose(1, 2).reshape(b, hq, v.shape[-1])
    out, aux = out
    return out.transpose(1, 2).reshape(b, hq, v.shape[-1]), aux.lse.view(b, hq)


def with_sink(out: torch.Tensor, aux, sink: torch.Tensor) -> torch.Tensor:
    """Attention `out` `[B, Hq, L, Dv]` with its log-sum-exp (flex's aux) as if each head's softmax had
    one more key, of logit sink[h] and value zero (GPT-OSS's attention sinks): out * sigmoid(lse - sink)."""
    lse = aux.lse if hasattr(aux, "lse") else aux
    keep = torch.sigmoid(lse.float() - sink.float().view(1, -1, 1))
    return (out.float() * keep[..., None]).to(out.dtype)


def shard_pages(k: torch.Tensor, v: torch.Tensor, page_size: int) -> int:
    """The most whole pages of the pool one decode kernel reads (all of them where the pool is small
    enough): k and v (which may be a view into k) of that many pages stay within MAX_KERNEL_ELEMENTS."""
    slots = MAX_KERNEL_ELEMENTS // max(k.stride(0), v.stride(0))
    return min(k.shape[0], slots) // page_size


def shard_block_list(num_blocks: torch.Tensor, indices: torch.Tensor, first, end):
    """The part of a BlockMask's block list `(num_blocks [B, 1, 1], indices [B, 1, 1, W])` that lies in
    pages first..end-1, renumbered from first: each row's pages there, in their order, then zeros."""
    w = indices.shape[-1]
    cols = torch.arange(w, device=indices.device)
    inside = (indices >= first) & (indices < end) & (cols < num_blocks[..., None])
    dest = torch.where(inside, torch.cumsum(inside, -1) - 1, w)  # column w: a spare for the pages outside
    local = torch.zeros(*indices.shape[:-1], w + 1, dtype=torch.int32, device=indices.device)
    local.scatter_(-1, dest, (indices - first).to(torch.int32))
    return inside.sum(-1, dtype=torch.int32), local[..., :w]


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Attention over the union of disjoint KV parts from each part's output `[B, H, Dv]` and
    log-sum-exp `[B, H]` (-inf where a row saw nothing there)."""
    lse = torch.stack(lses)
    weight = torch.exp(lse - lse.amax(0).clamp(min=torch.finfo(lse.dtype).min))
    out = (weight[..., None] * torch.stack(outs).float()).sum(0) / weight.sum(0).clamp(min=1e-30)[..., None]
    return out.to(outs[0].dtype)


@functools.cache
def _compiled(fn, key: tuple, heuristic_reductions: bool = False):
    """fn compiled for the static shapes of `key`, as a code object of its own: dynamo counts
    recompiles per code object, and past its limit it would run flex eagerly. heuristic_reductions:
    this compile's reduction kernels take Inductor's heuristic config (HEURISTIC_REDUCTIONS), where
    torch has the setting."""
    prepare_cache()  # flexsgl's compile cache, also when the op runs outside the engine (benchmarks)
    import torch._inductor.config  # after prepare_cache (compile.settings says why)

    options = None
    if heuristic_reductions and hasattr(torch._inductor.config.test_configs, HEURISTIC_REDUCTIONS):
        options = {f"test_configs.{HEURISTIC_REDUCTIONS}": True}
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{abs(hash(key))}")
    return torch.compile(types.FunctionType(code, fn.__globals__), fullgraph=True, dynamic=False, options=options)


_warm: set[tuple] = set()


def _run(fn, key: tuple, *args, heuristic_reductions: bool = False):
    """fn compiled for `key`; its first call compiles, under flexsgl's compile settings."""
    compiled = _compiled(fn, key, heuristic_reductions)
    if key in _warm:
        return compiled(*args)
    with settings():
        out = compiled(*args)
    _warm.add(key)
    return out


@torch.library.custom_op("flexsgl::flex_decode", mutates_args=())
def flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_num_blocks: torch.Tensor,
                kv_indices: torch.Tensor, full_num_blocks: torch.Tensor | None, full_indices: torch.Tensor | None,
                page_table: torch.Tensor, last_pos: torch.Tensor, page_size: int,
                scale: float | None = None, variant: int = -1, page_pos: torch.Tensor | None = None,
                req_slots: torch.Tensor | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q `[B, Hq, D]` over one layer's pool `k` (`[slots, Hkv, D]`) and `v`
    (`[slots, Hkv, Dv]`, which may be a view of k: MLA's latent) through the BlockMask given by its
    four tensors (`[B, 1, 1, ...]`; the full ones may be None), which list request b's pages
    `page_table[b]` and no other; request b's query is at position last_pos[b]; scale None is
    1/sqrt(D). variant >= 0: a bound attention variant's id, whose mods read `page_pos` (each page's
    logical index) and `req_slots` (each row's request slot); sink: per-head sink logits `[Hq]`.
    Returns `[B, Hq, Dv]`."""
    options = decode_options(q.shape[0], k.shape[1], page_size, k.shape[2])
    latent = k.shape[2] > LARGE_HEAD_DIM
    per_shard = shard_pages(k, v, page_size)
    extra = (variant, page_pos, req_slots)
    if per_shard * page_size == k.shape[0]:
        out = _run(_decode, _decode_key(q, k, v, page_table, page_size, scale, full_num_blocks, options, variant,
                                        sink is not None), q, k, v, kv_num_blocks, kv_indices, full_num_blocks,
                   full_indices, page_table, last_pos, page_size, scale, options, None, *extra, sink is not None,
                   heuristic_reductions=latent)
        return out if sink is None else _decode_sink(*out, sink)
    # The shards are views made outside the compiled function: each is an input of its own, which 32-bit offsets index.
    outs, lses = [], []
    for first in range(0, k.shape[0] // page_size, per_shard):
        ks, vs = (x[first * page_size:(first + per_shard) * page_size] for x in (k, v))
        first_page = torch.full((), first, dtype=torch.long, device=q.device)  # a tensor: one compile for all shards
        out, lse = _run(_decode, _decode_key(q, ks, vs, page_table, page_size, scale, full_num_blocks, options,
                                             variant, True, True),
                        q, ks, vs, kv_num_blocks, kv_indices, full_num_blocks, full_indices, page_table, last_pos,
                        page_size, scale, options, first_page, *extra, True, heuristic_reductions=latent)
        outs.append(out), lses.append(lse)
    out = _run(merge_partials, ("merge", len(outs), *outs[0].shape, q.dtype, q.device), outs, lses)
    return out if sink is None else _decode_sink(out, torch.logsumexp(torch.stack(lses), 0), sink)


def _decode_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """with_sink for decode's `[B, Hq, Dv]` output and `[B, Hq]` log-sum-exp."""
    return with_sink(out[:, :, None], lse[:, :, None], sink)[:, :, 0]


def _decode_key(q, k, v, page_table, page_size, scale, full_num_blocks, options: dict, variant: int = -1,
                with_lse: bool = False, sharded: bool = False) -> tuple:
    """What one compiled decode function serves: the shapes, dtype and device, the variant, and the
    kernel options it was compiled with (other options get a function of their own, not a recompile
    of this one)."""
    return ("decode", *q.shape, *k.shape, v.shape[-1], page_table.shape[1], q.dtype, page_size, scale, q.device,
            full_num_blocks is None, sharded, variant, with_lse, *options.items())


@flex_decode.register_fake
def _(q, k, v, kv_num_blocks, kv_indices, full_num_blocks, full_indices, page_table, last_pos, page_size,
      scale=None, variant=-1, page_pos=None, req_slots=None, sink=None):
    return q.new_empty(*q.shape[:2], v.shape[-1])
