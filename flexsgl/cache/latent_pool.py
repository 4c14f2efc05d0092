"""The latent KV pool of multi-head latent attention (MLA) models.

Per layer one tensor `[slots, 1, kv_lora_rank + qk_rope_head_dim]`: each token's normed compressed
KV followed by its rotated shared key, one "head", never expanded into per-head K and V. Slots,
pages, the dummy page, the allocator, the radix cache and the scheduler are the GQA pool's
(flexsgl/cache/pool.py); only what a slot holds differs. The same memory read as
`[pages, page_size, D]` is what FlashInfer's MLA kernels and TRT-LLM's take.

The model's attention layers write their latents through `store`; backends read `kv`, and take the
split point and softmax scale of scores over it from the pool (`kv_lora_rank`, `softmax_scale`).
"""

from __future__ import annotations

import torch

from flexsgl.kernels import latent_query, latent_store  # noqa: F401  (register their torch.ops.flexsgl ops)
from flexsgl.model.mla_config import MLAConfig


class LatentKVPool:
    attention = "mla"

    def __init__(self, num_layers: int, num_pages: int, page_size: int, mla: MLAConfig, dtype: torch.dtype,
                 device: torch.device | str):
        self.page_size, self.num_pages, self.device = page_size, num_pages, torch.device(device)
        self.kv_lora_rank, self.rope_dim = mla.kv_lora_rank, mla.qk_rope_head_dim
        self.qk_nope_head_dim, self.softmax_scale = mla.qk_nope_head_dim, mla.softmax_scale
        # Zeroed: masked slots still enter P @ V as p=0 times v, and 0 * NaN is NaN.
        self.kv = [torch.zeros(num_pages * page_size, 1, mla.latent_dim, dtype=dtype, device=device)
                   for _ in range(num_layers)]

    def layer_cache(self, layer: int) -> tuple[torch.Tensor]:
        """`layer`'s latents, which its attention module holds (`cache`) and hands to the backend."""
        return (self.kv[layer],)

    def store(self, layer: int, latent: torch.Tensor, slots: torch.Tensor) -> None:
        """Write latent `[tokens, kv_lora_rank + rope dims]` into `layer`'s slots, in place."""
        self.store_into(self.layer_cache(layer), latent, slots)

    @staticmethod
    def norm_rope_store(cache: tuple[torch.Tensor], latent: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        rope, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """kv_a_proj's output `latent` `[tokens, kv_lora_rank + rope dims]` into a layer's `cache` at
        `slots`: its compressed KV normed (`norm_weight`, `eps`), its shared key rotated at `positions`
        by `rope` (DeepSeek's interleaved RoPE), in one kernel on CUDA (flexsgl/kernels/latent_store.py)."""
        torch.ops.flexsgl.latent_store(latent, norm_weight, eps, rope.cos, rope.sin, positions, slots, cache[0])

    @staticmethod
    def norm_rope_store_with_query(cache: tuple[torch.Tensor], latent: torch.Tensor, norm_weight: torch.Tensor,
                                   eps: float, rope, positions: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                                   w_uk: torch.Tensor) -> torch.Tensor:
        """`norm_rope_store` of one token, and in the same launch its latent query `[1, H, r + rope]`
        from q `[1, H, nope + rope]` and W_UK `[H, nope, r]` (flexsgl/kernels/latent_query.py)."""
        return torch.ops.flexsgl.latent_query_store(q, w_uk, rope.cos, rope.sin, positions, latent, norm_weight, eps,
                                                    slots, cache[0])

    @staticmethod
    def store_into(cache: tuple[torch.Tensor], latent: torch.Tensor, slots: torch.Tensor) -> None:
        """`store` into a layer's `cache` (what the model's attention layers hold): an index put on
        the pool tensor itself, which compiled graphs keep in place."""
        kv = cache[0]
        kv[slots] = latent.to(kv.dtype)[:, None]
