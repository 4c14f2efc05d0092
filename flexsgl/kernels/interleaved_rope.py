"""DeepSeek's RoPE inside flexsgl's MLA kernels (latent_query.py, latent_store.py): a Triton
helper that rotates one row's interleaved pairs (x[2i], x[2i+1]) by the tables' angle i, in
float32, and stores them in the destination's dtype, as `norm_rope.rotate_pairs` computes them.

Kernels call it as `interleaved_rope.rotate_row(...)`, through this module as one of their
globals: Triton's compiler and its CPU interpreter both resolve a kernel's names from its module's
globals (the interpreter sees no closure). It is built on first use, like the kernels that call it,
so that importing flexsgl needs no Triton.
"""

from __future__ import annotations

import functools


def __getattr__(name: str):
    if name == "rotate_row":
        return _helper()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _helper():
    global tl  # a module global, where the interpreter looks for it
    import triton
    import triton.language as tl

    @triton.jit
    def rotate_row(src, dst, cos_ptr, sin_ptr, pos, ROPE: tl.constexpr, BLOCK_P: tl.constexpr):
        """dst[0:ROPE] = src[0:ROPE] turned by position `pos` (cos/sin `[positions, ROPE / 2]`)."""
        i = tl.arange(0, BLOCK_P)
        ok = i < ROPE // 2
        x1 = tl.load(src + 2 * i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + 2 * i + 1, mask=ok, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + pos * (ROPE // 2) + i, mask=ok, other=0.0)
        sin = tl.load(sin_ptr + pos * (ROPE // 2) + i, mask=ok, other=0.0)
        tl.store(dst + 2 * i, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=ok)
        tl.store(dst + 2 * i + 1, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=ok)

    return rotate_row


def block_pairs(rope: int) -> int:
    """The helper's BLOCK_P for `rope` rotated dims: their pairs rounded up to a power of two, at least 16."""
    return max(16, 1 << (rope // 2 - 1).bit_length())
