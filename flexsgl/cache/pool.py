"""The paged KV pool and its page allocator: one layout for every attention backend.

Per layer, K and V are `[num_pages, page_size, num_kv_heads, head_dim]` (NHD). A token's slot is
`page * page_size + offset`. The pool holds them flat, `[slots, Hkv, D]` (same memory), the one
tensor per layer that compiled graphs see: a scatter into that tensor is done in place, where a
scatter through a view of it is functionalised into a copy of the whole cache per layer and step
(seen on an H200: 2 ms per layer at 1M slots). Page 0 is reserved as the dummy page: padded batch
rows write there and read only there, so real pages are never touched by padding.
"""

from __future__ import annotations

import random

import torch

DUMMY_PAGE = 0


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """One layer's scatter of k, v `[tokens, Hkv, D]` into its flat `[slots, Hkv, D]` tensors, in place."""
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)


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
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        # Zeroed, not empty: masked slots still enter P @ V as p=0 times v, and 0 * NaN is NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def store(self, layer: int, k: torch.Tensor | None, v: torch.Tensor | None, slots: torch.Tensor) -> None:
        """Write k, v `[tokens, Hkv, D]` into their slots; None: the caller wrote them (the model's
        fused RoPE kernel, flexsgl/kernels/rope_store.py)."""
        if k is not None:
            write_kv(self.k[layer], self.v[layer], k, v, slots)

    @staticmethod
    def num_pages_for(tokens: int, page_size: int) -> int:
        return -(-tokens // page_size)
