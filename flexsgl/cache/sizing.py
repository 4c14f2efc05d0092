"""How many tokens the KV pool holds: the size the config resolved to, or, on a GPU without one,
what the memory free once the weights are loaded allows."""

from __future__ import annotations

import torch

from flexsgl.cache.pool import KVPool
from flexsgl.config import ResolvedConfig, check_kv_tokens


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
    return int((free * o.mem_fraction_static - act) // mcfg.kv_bytes_per_token(itemsize))


def kv_cache_pages(rc: ResolvedConfig, mcfg, prefill_scratch=lambda tokens, itemsize: 0) -> int:
    """Pages of the KV pool (the dummy page included) for this engine and model (`mcfg`, the rank's
    ModelConfig):
    rc.max_total_tokens, else what the GPU memory left after the weights holds
    (kv_tokens_from_memory; `prefill_scratch(tokens, itemsize)`: the prefill backend's bytes);
    ValueError if it cannot be had."""
    ps, device = rc.options.page_size, rc.device
    itemsize = torch.tensor([], dtype=rc.dtype).element_size()
    kv_tokens = rc.max_total_tokens
    if kv_tokens is None:
        free, _ = torch.cuda.mem_get_info(device)
        scratch = prefill_scratch(rc.options.max_num_batched_tokens, itemsize)
        kv_tokens = kv_tokens_from_memory(rc, mcfg, free, itemsize, scratch)
    check_kv_tokens(kv_tokens, ps)
    num_pages = KVPool.num_pages_for(kv_tokens, ps) + 1  # + the dummy page
    need, free = num_pages * ps * mcfg.kv_bytes_per_token(itemsize), free_memory_bytes(device)
    if free is not None and need > free:
        raise ValueError(f"A KV cache of {kv_tokens} tokens needs {need / 2**30:.1f} GiB, and the "
                         f"{device.type} has {free / 2**30:.1f} GiB free; lower max_total_tokens.")
    return num_pages
