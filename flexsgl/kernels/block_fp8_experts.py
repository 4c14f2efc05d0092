"""Routed experts' products over block-scaled FP8 weights (block-wise checkpoints: DeepSeek-V3's and
Qwen3-30B-A3B-FP8's experts, 128 x 128 blocks), in one launch per projection:

    out[r] = a[r] @ (weight[e] * scale[e] expanded over its blocks).T   for each row r of expert e's segment

with the (token, expert) rows sorted by expert and each expert's segment ending at `ends[e]`, as
flexsgl/model/moe.py's grouped path lays them out. torch._scaled_grouped_mm takes rowwise scales
only, so this kernel is flexsgl's own.

Each program computes a BLOCK_M x BLOCK_N tile of one expert's segment: it finds its expert by
walking the segments' tile counts (the grid holds enough tiles for every segment padded to
BLOCK_M, so it is fixed for a given number of rows and replays in a CUDA graph; programs past the
last tile do nothing), then walks K one scale block (BLOCK_K = the block's columns) at a time: the
FP8 weight tile is widened to the activations' dtype in registers (exactly: every FP8 value is a
bfloat16 one), multiplied on tensor cores with the activations as they are (no activation
quantization: weight-only FP8), and the float32 product scaled by the tile's one block scale
(BLOCK_N divides the block's rows) before it is accumulated.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def block_fp8_experts_kernel(a_ptr, w_ptr, s_ptr, out_ptr, ends_ptr, E, N, K, stride_am, stride_we, stride_wn,
                                 stride_se, stride_sn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr):
        t = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        expert, row0, row_end = -1, 0, 0
        start, tiles_before = 0, 0
        for i in range(E):  # the segment whose padded tiles hold tile t
            end = tl.load(ends_ptr + i)
            tiles = (end - start + BLOCK_M - 1) // BLOCK_M
            hit = (t >= tiles_before) & (t < tiles_before + tiles)
            expert = tl.where(hit, i, expert)
            row0 = tl.where(hit, start + (t - tiles_before) * BLOCK_M, row0)
            row_end = tl.where(hit, end, row_end)
            tiles_before += tiles
            start = end
        if expert >= 0:
            rows = row0 + tl.arange(0, BLOCK_M)
            row_ok = rows < row_end
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            ks = tl.arange(0, BLOCK_K)
            e = expert.to(tl.int64)
            a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
            w_ptrs = w_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
            s_ptrs = s_ptr + e * stride_se + (n0 // SCALE_N) * stride_sn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(0, tl.cdiv(K, BLOCK_K)):
                k_ok = kb * BLOCK_K + ks < K
                a = tl.load(a_ptrs + kb * BLOCK_K, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs + kb * BLOCK_K, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                part = tl.dot(a, tl.trans(w.to(a.dtype)))
                acc += part * tl.load(s_ptrs + kb)
            out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return block_fp8_experts_kernel


def tiles(block: tuple[int, int]) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for weights of `block` (rows, columns) scale blocks: BLOCK_K the
    block's columns, BLOCK_N the largest power of two up to 64 that divides its rows."""
    return 64, math.gcd(block[0], 64), block[1]


def runs(block: tuple[int, int]) -> bool:
    """Whether the kernel takes weights of these scale blocks: columns a power of two from 16 (the
    tensor cores' K), rows a multiple of 16."""
    bn, bk = block
    return bk >= 16 and bk & (bk - 1) == 0 and bn % 16 == 0


def launch(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """out `[M, N]` in a's dtype for a `[M, K]` (rows sorted by expert, contiguous), FP8 weight
    `[E, N, K]`, its float32 block scales `[E, N / bn, K / bk]`, and int32 `ends` `[E]`."""
    import triton

    m, k = a.shape
    n_experts, n, _ = weight.shape
    block = (-(-n // scale.shape[1]), -(-k // scale.shape[2]))
    block_m, block_n, block_k = tiles(block)
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, block_m) + n_experts, triton.cdiv(n, block_n))
    _kernel()[grid](a, weight, scale, out, ends, n_experts, n, k, a.stride(0), weight.stride(0), weight.stride(1),
                    scale.stride(0), scale.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                    BLOCK_K=block_k, SCALE_N=block[0], num_warps=4, num_stages=3)
    return out


@torch.library.custom_op("flexsgl::block_fp8_experts", mutates_args=())
def block_fp8_experts(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return launch(a.contiguous(), weight, scale, ends)


@block_fp8_experts.register_fake
def _(a, weight, scale, ends):
    return a.new_empty(a.shape[0], weight.shape[1])
