"""How fast this device moves bytes, and the fastest a decode step can therefore be.

The decode floor: a decode step is memory-bound, so it cannot take less than the bytes it must
read over the device's memory bandwidth. Bytes per step = the weights read (every parameter once;
a tied embedding/lm_head matrix once; an *untied* input embedding table is left out, since a step
gathers only one row of it per request, and reported apart as `embedding_bytes`; of a MoE model's
routed experts, only those the batch is expected to pick, see `decode_floor`) + the KV cache read
by the batch at its mean context (an MLA model's latent cache), of which a layer with a sliding
window of W keys reads at most W per request. Under tensor parallelism the floor
is one rank's: its part of the weights (a 1/tp share of each split matrix, the norms whole) and
its KV heads, read by every rank at once; the all-reduces between ranks are not in it. The bandwidth is measured here
with a large device-to-device copy, which reads and writes every byte: bandwidth = 2 * bytes / time.
"""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int | None = None) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of three timings."""
    cuda = device.type == "cuda"
    if nbytes is None:
        nbytes = 1 << 30 if cuda else 1 << 26  # 1 GiB: far past any cache
        if cuda:
            nbytes = min(nbytes, torch.cuda.mem_get_info(device)[0] // 4)
    iters = iters or (20 if cuda else 5)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of the pages, kernel load
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()  # hand the buffers back before an LLM sizes its KV cache from free memory
    return 2 * nbytes * iters / best


def weight_bytes(model) -> dict:
    """Parameter bytes: all of them (shared tensors once), and those a decode step reads (of this
    rank's part of the model, under tensor parallelism)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields shared ones once
    embed = model.model.embed_tokens.weight
    tied = embed.data_ptr() == model.lm_head.weight.data_ptr()
    embed_bytes = 0 if tied else embed.numel() * embed.element_size()
    return {"weight_bytes": total, "embedding_bytes": embed_bytes, "weight_bytes_read": total - embed_bytes,
            "tied_embeddings": tied}


def decode_floor(llm, batch_size: int, mean_context: float, bandwidth: float) -> dict:
    """The fastest a decode step can be on this device: bytes it reads over the copy bandwidth.
    A MoE model's step reads only the routed experts its tokens pick: with k of E experts per
    token, routed uniformly, a batch of B reads a fraction 1 - (1 - k/E)^B of them per layer."""
    w = weight_bytes(llm.model)
    moe = llm.config.moe
    if moe is not None:
        routed = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters() if ".experts." in n)
        read = 1 - (1 - moe.top_k / moe.n_routed_experts) ** batch_size
        w = {**w, "routed_expert_bytes": routed, "routed_fraction_read": read,
             "weight_bytes_read": w["weight_bytes_read"] - routed * (1 - read)}
    itemsize = llm.resolved.cache_dtype.itemsize
    cfg = llm.model.cfg
    per_layer = cfg.kv_bytes_per_token(itemsize) / cfg.num_layers  # this rank's KV heads
    windows = [None if v is None else v.window for v in llm.resolved.variants] or [None] * cfg.num_layers
    kv = batch_size * per_layer * sum(mean_context if w is None else min(mean_context, w) for w in windows)
    step = w["weight_bytes_read"] + kv
    return {**w, "kv_bytes_read": kv, "mean_context": mean_context, "bytes_per_step": step,
            "floor_tpot_s": step / bandwidth}
