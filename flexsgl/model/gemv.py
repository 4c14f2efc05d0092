"""Projections at decode batch 1-4 on CUDA: a Triton matrix-vector kernel that streams the weight once.

At batch 1 a projection reads its whole weight to do two flops per element, so its time is the
weight's bytes over memory bandwidth. On an H200 (copy bandwidth 4.3 TB/s) cuBLAS reached 1.8 to
3.3 TB/s on a Qwen3-8B's four layer projections (tools/gemv_bench.py): most of a batch-1 decode step.
This kernel gives each program BLOCK_N weight rows and walks K in BLOCK_K slices, multiplying in
float32 into a [BLOCK_N, BLOCK_K] accumulator per batch row and reducing it once at the end; the
weight is loaded once for all (up to 4) batch rows. Many small programs keep enough loads in flight
to cover memory latency without splitting K.

`linear(x, weight, bias)` is what the models call: this kernel where it applies (CUDA, float16 or
bfloat16, at most MAX_M rows), `F.linear` everywhere else. The kernel runs inside a
`torch.library` custom op, so compiled models treat it like the cuBLAS call it replaces.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MAX_M = 4


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                    M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_ok = k + cols < K  # x is a few KB: its loads keep the mask; the weight's only where needed
            if EVEN_K:
                w = tl.load(w_ptrs + k, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                            eviction_policy="evict_first")
            w = w.to(tl.float32)
            acc0 += w * tl.load(x_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            if M > 1:
                acc1 += w * tl.load(x_ptr + stride_xm + k + cols, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            if M > 2:
                acc2 += w * tl.load(x_ptr + 2 * stride_xm + k + cols, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            if M > 3:
                acc3 += w * tl.load(x_ptr + 3 * stride_xm + k + cols, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            bias = tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + rows, (tl.sum(acc0, axis=1) + bias).to(dtype), mask=row_ok)
        if M > 1:
            tl.store(out_ptr + stride_om + rows, (tl.sum(acc1, axis=1) + bias).to(dtype), mask=row_ok)
        if M > 2:
            tl.store(out_ptr + 2 * stride_om + rows, (tl.sum(acc2, axis=1) + bias).to(dtype), mask=row_ok)
        if M > 3:
            tl.store(out_ptr + 3 * stride_om + rows, (tl.sum(acc3, axis=1) + bias).to(dtype), mask=row_ok)

    return gemv_kernel


# (BLOCK_N, BLOCK_K, num_warps, num_stages); tools/gemv_bench.py sweeps the alternatives.
DEFAULT_CONFIG = (8, 512, 4, 1)


def config_for(n: int, k: int, m: int) -> tuple[int, int, int, int]:
    return DEFAULT_CONFIG


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, warps, stages = config or config_for(n, k, m)
    _kernel()[((n + block_n - 1) // block_n,)](
        x, weight, bias if bias is not None else weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        M=m, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=warps, num_stages=stages)
    return out


@torch.library.custom_op("flexsgl::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 4, K] @ weight[N, K].T (+ bias) -> [M, N], in x's dtype."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return launch(x.contiguous(), weight, bias, out)


@gemv.register_fake
def _(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_M and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if applies(x, weight):
        return torch.ops.flexsgl.gemv(x, weight, bias)
    return F.linear(x, weight, bias)
