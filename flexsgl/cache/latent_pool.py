"""The latent KV pool of multi-head latent attention (MLA) models.

Per layer one tensor `[slots, 1, kv_lora_rank + qk_rope_head_dim]`: each token's normed compressed
KV followed by its rotated shared key, one "head", never expanded into per-head K and V. Slots,
pages, the dummy page, the allocator, the radix cache and the scheduler are the GQA pool's
(flexsgl/cache/pool.py); only what a slot holds differs. The same memory read as
`[pages, page_size, D]` is what FlashInfer's MLA kernels and TRT-LLM's take.

The pool is tensors. The model's attention layers write their latents through their store path
(flexsgl/cache/store.py); backends read `kv`, and take the split point and softmax scale of scores
over it from the pool (`kv_lora_rank`, `softmax_scale`).
"""

from __future__ import annotations

import torch

from flexsgl.cache.zeroed import zeroed


def page_slots(pages: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    """The pool slots of `pages` (either pool's layout: page p holds slots p * page_size onwards), on `device`."""
    return (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).view(-1).to(device)


class LatentKVPool:
    attention = "mla"
    quantized = False  # latents stay in the model's dtype (no FP8 cache for MLA)

    def __init__(self, num_layers: int, num_pages: int, page_size: int, mla, dtype: torch.dtype,
                 device: torch.device | str):
        """mla: the model's MLA settings (flexsgl/model/mla_config.py's MLAConfig)."""
        self.page_size, self.num_pages, self.device = page_size, num_pages, torch.device(device)
        self.kv_lora_rank, self.rope_dim = mla.kv_lora_rank, mla.qk_rope_head_dim
        self.qk_nope_head_dim, self.softmax_scale = mla.qk_nope_head_dim, mla.softmax_scale
        # Zeroed: masked slots still enter P @ V as p=0 times v, and 0 * NaN is NaN.
        self.kv = [zeroed((num_pages * page_size, 1, mla.latent_dim), dtype, device) for _ in range(num_layers)]

    def layer_cache(self, layer: int) -> tuple[torch.Tensor]:
        """`layer`'s latents, which its attention module holds (`cache`) and hands to the backend."""
        return (self.kv[layer],)

    def clear_pages(self, pages: list[int]) -> None:
        """Zero every layer's latents in `pages` (masked slots enter P @ V, see __init__)."""
        if pages:
            slots = page_slots(pages, self.page_size, self.device)
            for t in self.kv:
                t.index_fill_(0, slots, 0)

    def store(self, layer: int, latent: torch.Tensor, slots: torch.Tensor) -> None:
        """Write latent `[tokens, kv_lora_rank + rope dims]` into `layer`'s slots, in place."""
        kv = self.kv[layer]
        kv[slots] = latent.to(kv.dtype)[:, None]
