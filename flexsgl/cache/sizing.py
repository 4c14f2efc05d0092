"""How many tokens the KV pool holds, and why: the one rule (pool_tokens).

- `max_total_tokens`, when given, is the size.
- Otherwise the pool holds no more than the engine can use: `max_running_requests` requests at the
  model's context length, each in whole pages, and as much again for the prefix cache
  (PREFIX_CACHE_SHARE), so that the pages finished requests leave behind (a shared system prompt,
  a conversation's earlier turns) outlive a whole batch of running requests at full length;
- and no more than the device allows: on a GPU, `mem_fraction_static` of the memory free once the
  weights are loaded, less one step's activations (kv_tokens_from_memory), and no more than the
  decode kernel reads in one pass (the backends' max_pool_slots); on the CPU, CPU_KV_TOKENS.

EngineConfig.resolve applies the rule where the device's limit is known before anything loads (on
the CPU, or with max_total_tokens given); on a GPU, kv_pool_size applies it once the weights are in
memory. A small model on a large GPU thus gets a pool its requests can fill (the embedded model:
256 requests x 1,024 tokens x 2 = 524,288 tokens, 1 GiB) instead of tens of GiB it never touches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flexsgl.cache.pool import KVPool

if TYPE_CHECKING:
    from flexsgl.resolved_config import ResolvedConfig

CPU_KV_TOKENS = 16384  # the most the CPU's KV pool holds unless max_total_tokens is given
# Pages the prefix cache may keep, as a share of those the running requests can fill: as much again.
PREFIX_CACHE_SHARE = 1


@dataclass(frozen=True)
class PoolTokens:
    """The KV pool's size in tokens, and why (a phrase for the log)."""

    tokens: int
    reason: str


@dataclass(frozen=True)
class KVPoolSize:
    """The KV pool as built: its pages (the dummy page included), its tokens, and why."""

    pages: int
    tokens: int
    reason: str


def check_kv_tokens(tokens: int, page_size: int) -> None:
    """ValueError unless a KV cache of `tokens` tokens holds at least one page."""
    if tokens < page_size:
        raise ValueError(f"The KV cache must hold at least one page ({page_size} tokens); it would hold "
                         f"{max(tokens, 0)}.")


def usable_kv_tokens(max_running: int, context: int, page_size: int) -> int:
    """The most KV tokens the engine can fill: `max_running` requests of `context` tokens, each in
    whole pages, and PREFIX_CACHE_SHARE as much again for the prefix cache."""
    running = max_running * -(-context // page_size) * page_size
    return running * (1 + PREFIX_CACHE_SHARE)


def pool_tokens(options, context: int, device_tokens: int | None, device_limit: str) -> PoolTokens | None:
    """The KV pool's size for engine `options` (an EngineConfig) and a model of `context` tokens:
    max_total_tokens if given, else the smaller of what the engine can use and `device_tokens`, the
    most the device allows (`device_limit` says what that is). None where the device's limit is not
    known yet (a GPU before the weights load) and max_total_tokens was not given."""
    if options.max_total_tokens is not None:
        return PoolTokens(options.max_total_tokens, "max_total_tokens, as given")
    if device_tokens is None:
        return None
    r = options.max_running_requests
    usable = usable_kv_tokens(r, context, options.page_size)
    running = f"{r} running request{'s' if r > 1 else ''} at the model's {context:,}-token context"
    if usable <= device_tokens:
        return PoolTokens(usable, f"what {running} fill{'s' if r == 1 else ''}, and as much again for the "
                                  "prefix cache")
    return PoolTokens(device_tokens, f"{device_limit}; {running} could fill {usable:,}")


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory the device can still give: free GPU memory, or the host's available memory (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_tokens_from_memory(rc: ResolvedConfig, mcfg, free: int, itemsize: int,
                          prefill_scratch: int) -> int:
    """The KV tokens that fit in mem_fraction_static of `free` bytes (the GPU memory free once the
    weights are loaded) less room for one step's activations: the widest layer over the prefill
    token budget, the logits of every running request, the prefill backend's scratch and 1 GiB."""
    o = rc.options
    widest = max(mcfg.intermediate_size, mcfg.num_heads * mcfg.mla.latent_dim if mcfg.mla else 0)
    act = o.max_num_batched_tokens * (2 * widest + 4 * mcfg.hidden_size) * itemsize * 2
    act += o.max_running_requests * mcfg.vocab_size * 4 * 4 + (1 << 30)
    act += prefill_scratch
    return int((free * o.mem_fraction_static - act) // mcfg.kv_bytes_per_token(rc.cache_dtype.itemsize))


def kv_pool_size(rc: ResolvedConfig, mcfg, prefill_scratch=lambda tokens, itemsize: 0,
                 kernel_slots: int | None = None) -> KVPoolSize:
    """The KV pool for this engine and model (`mcfg`, the rank's ModelConfig): rc.max_total_tokens
    where the config resolved it, else the rule (pool_tokens) with what the GPU memory left after
    the weights holds (kv_tokens_from_memory; `prefill_scratch(tokens, itemsize)`: the prefill
    backend's bytes) as the device's limit, and within `kernel_slots`, the most slots the decode
    kernel reads in one pass (the backends' max_pool_slots), whole pages and the dummy page
    included; ValueError if it cannot be had."""
    ps, device = rc.options.page_size, rc.device
    itemsize = torch.tensor([], dtype=rc.dtype).element_size()
    if rc.max_total_tokens is not None:
        size = PoolTokens(rc.max_total_tokens, rc.max_total_tokens_reason)
    else:
        free, _ = torch.cuda.mem_get_info(device)
        scratch = prefill_scratch(rc.options.max_num_batched_tokens, itemsize)
        memory = kv_tokens_from_memory(rc, mcfg, free, itemsize, scratch)
        limit = (f"what mem_fraction_static {rc.options.mem_fraction_static:g} of the {free / 2**30:.1f} GiB "
                 f"free once the weights loaded holds, less one step's activations")
        kernel_tokens = None if kernel_slots is None else (kernel_slots // ps - 1) * ps  # less the dummy page
        if kernel_tokens is not None and kernel_tokens < memory:
            limit = f"the most the decode kernel reads in one pass, where the memory holds {memory:,} tokens"
            memory = kernel_tokens
        size = pool_tokens(rc.options, mcfg.max_position, memory, limit)
    check_kv_tokens(size.tokens, ps)
    num_pages = KVPool.num_pages_for(size.tokens, ps) + 1  # + the dummy page
    need, free = num_pages * ps * mcfg.kv_bytes_per_token(rc.cache_dtype.itemsize), free_memory_bytes(device)
    if free is not None and need > free:
        raise ValueError(f"A KV cache of {size.tokens} tokens needs {need / 2**30:.1f} GiB, and the "
                         f"{device.type} has {free / 2**30:.1f} GiB free; lower max_total_tokens.")
    return KVPoolSize(num_pages, size.tokens, size.reason)


def kv_cache_pages(rc: ResolvedConfig, mcfg, prefill_scratch=lambda tokens, itemsize: 0) -> int:
    """Pages of the KV pool (the dummy page included): kv_pool_size's."""
    return kv_pool_size(rc, mcfg, prefill_scratch).pages
