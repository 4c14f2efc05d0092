"""The paged KV pool and its page allocator: one layout for every attention backend.

Per layer, K and V are `[num_pages, page_size, num_kv_heads, head_dim]` (NHD). A token's slot is
`page * page_size + offset`. The pool holds them flat, `[slots, Hkv, D]` (same memory), the one
tensor per layer that compiled graphs see: a scatter into that tensor is done in place, where a
scatter through a view of it is functionalised into a copy of the whole cache per layer and step
(seen on an H200: 2 ms per layer at 1M slots). Page 0 is reserved as the dummy page: padded batch
rows write there and read only there, so real pages are never touched by padding.

An FP8 pool (kv_cache_dtype fp8_e4m3) holds K and V in float8_e4m3fn, each layer's scaled by one
factor for K and one for V, which the attention layer keeps (`kv_scales`): it divides by them as
it stores and multiplies the query and its output by them as it attends (flexsgl/model/decoder.py),
so a backend reads FP8 values as they are, casting them in its kernel. The queries that attend
over the pool come in `query_dtype`, the engine's.

The pool is tensors, and the allocator hands out its pages. Each attention layer holds its own
layer's tensors (`layer_cache`) and writes its step's K/V into them through its store path
(flexsgl/cache/store.py), then asks the backend to attend; backends only read the pool. `store`
writes given K/V (tests and benchmarks fill a pool with it).
"""

from __future__ import annotations

import random

import torch

from flexsgl.cache.latent_pool import LatentKVPool, page_slots
from flexsgl.cache.zeroed import zeroed
from flexsgl.kernels.rope_store import write_kv

DUMMY_PAGE = 0


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than asked for."""


class PageAllocator:
    """Free-page bookkeeping on the host. Hands out the lowest free pages first (or shuffled, for tests)."""

    def __init__(self, num_pages: int, shuffle_seed: int | None = None):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, DUMMY_PAGE, -1))  # a stack: pop() gives the lowest page
        if shuffle_seed is not None:
            self.shuffle(shuffle_seed)

    def shuffle(self, seed: int) -> None:
        """Hand out the free pages in an order shuffled with `seed` (tests: pages in any order)."""
        random.Random(seed).shuffle(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages a request may ever use (all but the dummy page)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free")
        out = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class KVPool:
    """K and V per layer, `[slots, Hkv, D]` (module docstring)."""

    attention = "gqa"  # the attention kind whose cache this is (the latent pool's is "mla")

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, query_dtype: torch.dtype | None = None):
        """dtype: K's and V's; query_dtype: the queries' (the engine's dtype; default `dtype`)."""
        self.page_size = page_size
        self.query_dtype = query_dtype or dtype
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        # Zeroed, not empty: masked slots still enter P @ V as p=0 times v, and 0 * NaN is NaN.
        self.k = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.v = [zeroed(shape, dtype, device) for _ in range(num_layers)]

    @property
    def quantized(self) -> bool:
        """Whether K and V are FP8, stored with per-layer scales."""
        return self.k[0].dtype.itemsize == 1 if self.k else False

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s K and V, which its attention module holds (`cache`) and hands to the backend."""
        return self.k[layer], self.v[layer]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              scales: torch.Tensor | None = None) -> None:
        """Write k, v `[tokens, Hkv, D]` into `layer`'s slots, in place (into an FP8 pool divided by
        `scales`, [K's, V's])."""
        write_kv(self.k[layer], self.v[layer], k, v, slots, scales)

    def clear_pages(self, pages: list[int]) -> None:
        """Zero every layer's K and V in `pages` (masked slots enter P @ V, see __init__)."""
        if pages:
            slots = page_slots(pages, self.page_size, self.device)
            for t in (*self.k, *self.v):
                (t.view(torch.uint8) if t.dtype.itemsize == 1 else t).index_fill_(0, slots, 0)  # FP8's zero is 0x00

    @staticmethod
    def num_pages_for(tokens: int, page_size: int) -> int:
        return -(-tokens // page_size)


def build_kv_pool(mcfg, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device,
                  query_dtype: torch.dtype | None = None):
    """The pool for model config `mcfg` in `dtype` (FP8 for a quantized cache, attended by queries
    of `query_dtype`): K/V per KV head, or the latent pool of an MLA model."""
    if mcfg.mla is not None:
        return LatentKVPool(mcfg.num_layers, num_pages, page_size, mcfg.mla, dtype, device)
    return KVPool(mcfg.num_layers, num_pages, page_size, mcfg.num_kv_heads, mcfg.head_dim, dtype, device,
                  query_dtype)
