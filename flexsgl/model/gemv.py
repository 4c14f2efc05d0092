"""Projections at decode batch 1 on CUDA: a Triton matrix-vector kernel that streams the weight once.

At batch 1 a projection reads its whole weight to do two flops per element, so its time is the
weight's bytes over memory bandwidth. On an H200 (copy bandwidth 4.3 TB/s), replaying a Qwen3-8B's
36 layers of projections from one CUDA graph, cuBLAS moved 3.63 TB/s and this kernel 3.93
(tools/gemv_bench.py, docs/BENCHMARKS.md). It gives each program BLOCK_N weight rows and walks K
in BLOCK_K slices, multiplying in float32 into a [BLOCK_N, BLOCK_K] accumulator that it reduces
once at the end. Many small programs keep enough loads in flight to cover memory latency without
splitting K. At batch 2 it only matched cuBLAS and at 4 it lost, so it serves batch 1 alone.

`linear(x, weight, bias)` is what the models call: this kernel where it applies (CUDA, float16 or
bfloat16, one row), `F.linear` everywhere else. The kernel runs inside a `torch.library` custom op,
so compiled models treat it like the cuBLAS call it replaces.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_ok = k + cols < K
            if EVEN_K:
                w = tl.load(w_ptrs + k, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                            eviction_policy="evict_first")
            x = tl.load(x_ptr + k + cols, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)

    return gemv_kernel


def config_for(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight: the sweep's best on an H200's
    8B shapes (tools/gemv_bench.py); the runners-up were within 1-2%."""
    if k >= 8192:
        return 8, 512, 8, 1  # long rows (down_proj): more warps per row block
    if 16384 <= n < 65536:
        return 16, 512, 4, 3  # wide, short rows (gate_up_proj)
    return 8, 512, 4, 1


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """out[0] = weight @ x[0] (+ bias); x [1, K] contiguous, weight [N, K] with unit column stride."""
    n, k = weight.shape
    block_n, block_k, warps, stages = config or config_for(n, k)
    _kernel()[((n + block_n - 1) // block_n,)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages)
    return out


@torch.library.custom_op("flexsgl::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N], in x's dtype."""
    out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    return launch(x.contiguous(), weight, bias, out)


@gemv.register_fake
def _(x, weight, bias=None):
    return x.new_empty(1, weight.shape[0])


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if applies(x, weight):
        return torch.ops.flexsgl.gemv(x, weight, bias)
    return F.linear(x, weight, bias)
