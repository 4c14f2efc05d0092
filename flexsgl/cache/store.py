"""How an attention layer writes a step into its cache: one store path per cache layout, chosen once
when the model is bound to its pool (`store_path`), which the layer calls with tensors.

    q = store.norm_rope_store(cache, x, norm_weights, eps, rope, positions, slots, scales)

`cache` is the layer's cache tensors (the pool's `layer_cache`), `x` the projection output this
step's cache entries come from, `norm_weights` the RMSNorm weights of its normed parts (epsilon
`eps`), `rope` the model's rotary tables (`cos`, `sin`), `slots` where each token goes, `scales` an FP8
cache's [K, V] scales (None for a cache in the model's dtype). The path
normalises and rotates what the layout keeps, writes it at `slots` in place, and returns the
query heads `x` carries, normed and rotated (None where it carries none):

- K and V per KV head (`KVStore`): `x` is qkv_proj's output `[T, (Hq + 2 Hkv) * D]`,
  `norm_weights` the q and k norms' (Qwen3) or none (Llama 3); returns q `[T, Hq, D]`. Where the
  fused kernel applies (kernels/rope_store.py: CUDA, a power-of-two head size) it does all of it in
  one launch; elsewhere, and into an FP8 cache, the same PyTorch expressions run, then the
  scatter into the pool (quantizing into an FP8 one).
- MLA's latents (`LatentStore`): `x` is kv_a_proj's output `[T, kv_lora_rank + rope dims]`,
  `norm_weights` kv_a_layernorm's; it writes the normed compressed KV and the rotated shared key
  and returns None. One kernel on CUDA (kernels/latent_store.py), its PyTorch expressions inside
  the same op elsewhere; a single token's store can ride in its latent query's launch
  (`norm_rope_store_with_query`, kernels/latent_query.py).

The pools are only tensors; backends only read them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from flexsgl.kernels import latent_query, latent_store, rope_store  # noqa: F401  (register torch.ops.flexsgl ops)


class StorePath(ABC):
    """The one signature both cache layouts' store paths share (module docstring)."""

    @abstractmethod
    def norm_rope_store(self, cache: tuple[torch.Tensor, ...], x: torch.Tensor, norm_weights: tuple[torch.Tensor, ...],
                        eps: float, rope, positions: torch.Tensor, slots: torch.Tensor,
                        scales: torch.Tensor | None = None) -> torch.Tensor | None:
        """Norm, RoPE and the write of this step's cache entries from `x` (module docstring)."""


class KVStore(StorePath):
    """K and V per KV head, for a model of `num_heads` query heads of `head_dim` (on this rank)."""

    def __init__(self, num_heads: int, head_dim: int, fused: bool):
        self.num_heads, self.head_dim, self.fused = num_heads, head_dim, fused

    def norm_rope_store(self, cache, x, norm_weights, eps, rope, positions, slots, scales=None) -> torch.Tensor:
        k_cache, v_cache = cache
        q_norm, k_norm = norm_weights or (None, None)
        if self.fused and scales is None:
            return torch.ops.flexsgl.rope_store(x, q_norm, k_norm, eps, rope.cos, rope.sin, positions, slots,
                                                k_cache, v_cache, self.num_heads)
        q, k, v = rope_store.norm_rope(x, q_norm, k_norm, eps, rope.cos, rope.sin, positions, self.num_heads,
                                       self.head_dim)
        rope_store.write_kv(k_cache, v_cache, k, v, slots, scales)
        return q


class LatentStore(StorePath):
    """MLA's latent vector per token."""

    def norm_rope_store(self, cache, x, norm_weights, eps, rope, positions, slots, scales=None) -> None:
        assert scales is None, "MLA latents are cached in the model's dtype"
        (weight,) = norm_weights
        torch.ops.flexsgl.latent_store(x, weight, eps, rope.cos, rope.sin, positions, slots, cache[0])

    def norm_rope_store_with_query(self, cache, x, norm_weights, eps, rope, positions, slots, q: torch.Tensor,
                                   w_uk: torch.Tensor) -> torch.Tensor:
        """`norm_rope_store` of one token, and in the same launch its latent query `[1, H, r + rope]`
        from q `[1, H, nope + rope]` and W_UK `[H, nope, r]` (where kernels/latent_query.py applies)."""
        (weight,) = norm_weights
        return torch.ops.flexsgl.latent_query_store(q, w_uk, rope.cos, rope.sin, positions, x, weight, eps, slots,
                                                    cache[0])


def store_path(pool, num_heads: int) -> StorePath:
    """The store path for `pool`'s layout, for a model of `num_heads` query heads on this rank."""
    if pool.attention == "mla":
        return LatentStore()
    head_dim = pool.k[0].shape[2]
    return KVStore(num_heads, head_dim, fused=rope_store.applies(pool.device, head_dim))
