"""Flex decode on CUDA, compiled: one opaque op, a flex-decoding kernel per batch size.

Inductor lowers short queries to its flex-decoding kernel (KV split across programs, a KV head's
query heads in one tile) only for a static batch; with a symbolic one it falls back to the main
kernel, which gives each query head a 128-row tile. Compiling the model's decode per batch size
would cost a whole model compile per size. Here decode attention is a custom op that the compiled
decoder layer cannot see into: it compiles once with a symbolic batch, as it does around a kernel
override, and the op runs flex_attention compiled for the batch size it receives (one small
kernel; Inductor's cache keeps it across processes), with the options flex_options.py picks.
MLA's latent decode compiles with its split-combining reduction kernels on the config Inductor's
heuristic picks, not the fastest of their candidates timed one by one on first use: those timings
pick differently from compile to compile, and one of their picks makes DeepSeek-V2-Lite's batch-1
step markedly slower.

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
import types

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from flexsgl.attention.bound_variant import BOUND
from flexsgl.attention.flex_masks import Q_BLOCK, listed_decode_causal, listed_decode_variant
from flexsgl.attention.flex_options import LARGE_HEAD_DIM, decode_options
from flexsgl.compile import settings
from flexsgl.compile_cache import prepare as prepare_cache

MAX_KERNEL_ELEMENTS = 2**31 - 1  # the largest KV tensor the flex-decoding kernel's 32-bit offsets reach
# Inductor's setting (torch 2.11-2.13) under which a reduction kernel takes the config its heuristic
# picks rather than the fastest of its candidates timed on first use (module docstring)
HEURISTIC_REDUCTIONS = "force_filter_reduction_configs"


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
