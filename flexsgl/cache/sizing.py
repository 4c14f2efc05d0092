"""How many tokens the KV pool holds: the size asked for, or what the device's free memory allows."""

from __future__ import annotations

import torch

from flexsgl.cache.pool import KVPool
from flexsgl.config import EngineConfig

CPU_DEFAULT_KV_TOKENS = 16384


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


def kv_cache_pages(cfg: EngineConfig, mcfg, dtype: torch.dtype, device: torch.device,
                   prefill_scratch=lambda tokens, itemsize: 0) -> int:
    """Pages of the KV pool (the dummy page included) for this engine, model (`mcfg`, the rank's
    ModelConfig) and device: the size asked for, else what the memory left after the weights and a
    step's activations hold, the prefill backend's scratch among them (`prefill_scratch(tokens,
    itemsize)`, bytes); ValueError if it cannot be had."""
    ps = cfg.page_size
    itemsize = torch.tensor([], dtype=dtype).element_size()
    per_token = mcfg.kv_bytes_per_token(itemsize)
    kv_tokens = cfg.max_total_tokens
    if kv_tokens is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            # Room for one step's activations: the widest layer over the token budget, and logits.
            widest = max(mcfg.intermediate_size, mcfg.num_heads * mcfg.mla.latent_dim if mcfg.mla else 0)
            act = cfg.max_num_batched_tokens * (2 * widest + 4 * mcfg.hidden_size) * itemsize * 2
            act += cfg.max_running_requests * mcfg.vocab_size * 4 * 4 + (1 << 30)
            act += prefill_scratch(cfg.max_num_batched_tokens, itemsize)
            kv_tokens = int((free * cfg.mem_fraction_static - act) // per_token)
        else:
            kv_tokens = CPU_DEFAULT_KV_TOKENS
    if kv_tokens < ps:
        raise ValueError(f"The KV cache must hold at least one page ({ps} tokens); it would hold "
                         f"{max(kv_tokens, 0)}.")
    num_pages = KVPool.num_pages_for(kv_tokens, ps) + 1  # + the dummy page
    need, free = num_pages * ps * per_token, free_memory_bytes(device)
    if free is not None and need > free:
        raise ValueError(f"A KV cache of {kv_tokens} tokens needs {need / 2**30:.1f} GiB, and the "
                         f"{device.type} has {free / 2**30:.1f} GiB free; lower max_total_tokens.")
    return num_pages
