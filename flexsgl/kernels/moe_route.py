"""MoE routing of one token (decode at batch 1) in two launches: the RMSNorm before the MoE
layer, the router's float32 product, softmax, greedy top-k and the weights' normalisation, as
`MoE.route` (flexsgl/model/moe.py) computes them on the normed input.

Unfused, that is seven launches of 1-5 µs each (the norm, a cast, cuBLAS's float32
matrix-vector product and its reduction, softmax, top-k, the weights' scaling) around a 64 x 2048
product: about 0.35 ms of a 2.9 ms DeepSeek-V2-Lite decode step at batch 1 on an H200. Here the router's
product is the matrix-vector kernel (flexsgl/kernels/gemv.py) with the norm folded in, a program
per two experts, writing float32 logits; then one program normalises the input again, writes it for the
experts and the shared experts, and takes softmax and top-k of the logits. (A single program doing
both read the router's 256 KB at 13 GB/s: 20 µs.)

The normed input written rounds as `rms_norm` does (normalised in float32, rounded to the input's
dtype, then scaled by the weight and rounded again); the router's product reads the input normed in
float32 without those roundings, as every projection the matrix-vector kernel runs does. The top-k
is TOP_K rounds of taking the largest probability left; a tie goes to the lower expert index. Only
DeepSeek's "greedy" method is fused; group-limited routing takes the unfused path.
"""

from __future__ import annotations

import functools

import torch

from flexsgl.kernels import gemv


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def route_kernel(x_ptr, norm_ptr, logits_ptr, h_ptr, experts_ptr, weights_ptr, E, H, eps, scaling,
                     TOP_K: tl.constexpr, NORM_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        cols = tl.arange(0, BLOCK_H)
        squares = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in range(0, H, BLOCK_H):
            x = tl.load(x_ptr + k + cols, mask=k + cols < H, other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / H + eps)
        for k in range(0, H, BLOCK_H):
            k_ok = k + cols < H
            x = tl.load(x_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            g = tl.load(norm_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            h = (g * (x * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + k + cols, h, mask=k_ok)

        rows = tl.arange(0, BLOCK_E)
        row_ok = rows < E
        logits = tl.load(logits_ptr + rows, mask=row_ok, other=float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = p / tl.sum(p, axis=0)
        slots = tl.arange(0, BLOCK_K)
        chosen = tl.zeros((BLOCK_K,), dtype=tl.int32)
        chosen_p = tl.zeros((BLOCK_K,), dtype=tl.float32)
        left = tl.where(row_ok, p, -1.0)
        for i in tl.static_range(TOP_K):
            best_p = tl.max(left, axis=0)
            best = tl.min(tl.where(left == best_p, rows, BLOCK_E), axis=0)
            chosen = tl.where(slots == i, best, chosen)
            chosen_p = tl.where(slots == i, best_p, chosen_p)
            left = tl.where(rows == best, -1.0, left)
        if NORM_TOPK:
            chosen_p = chosen_p / (tl.sum(chosen_p, axis=0) + 1e-20)
        else:
            chosen_p = chosen_p * scaling
        tl.store(experts_ptr + slots, chosen, mask=slots < TOP_K)
        tl.store(weights_ptr + slots, chosen_p, mask=slots < TOP_K)

    return route_kernel


def launch(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor, top_k: int,
           norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed x, experts int32 [1, top_k], weights float32 [1, top_k]) for one token x `[1, H]`
    contiguous and the router's weight `[E, H]`."""
    import triton

    hidden = x.shape[1]
    e = gate_weight.shape[0]
    logits = torch.empty(1, e, dtype=torch.float32, device=x.device)
    gemv.launch(x, gate_weight, None, logits, config=(2, min(triton.next_power_of_2(hidden), 4096), 4, 1),
                norm_weight=norm_weight, eps=eps, prologue=gemv.RMS_NORM)
    h = torch.empty_like(x)
    experts = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    _kernel()[(1,)](x, norm_weight, logits, h, experts, weights, e, hidden, eps, scaling,
                    TOP_K=top_k, NORM_TOPK=norm_topk_prob and top_k > 1, BLOCK_E=triton.next_power_of_2(e),
                    BLOCK_H=min(triton.next_power_of_2(hidden), 1024), BLOCK_K=triton.next_power_of_2(top_k),
                    num_warps=4)
    return h, experts, weights


@torch.library.custom_op("flexsgl::moe_route", mutates_args=())
def moe_route(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor, top_k: int,
              norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch(x.contiguous(), norm_weight, eps, gate_weight.contiguous(), top_k, norm_topk_prob, scaling)


@moe_route.register_fake
def _(x, norm_weight, eps, gate_weight, top_k, norm_topk_prob, scaling):
    return (torch.empty_like(x), x.new_empty(1, top_k, dtype=torch.int32), x.new_empty(1, top_k, dtype=torch.float32))


def applies(x: torch.Tensor, gate_weight: torch.Tensor, topk_method: str) -> bool:
    """Whether the fused routing serves this call: greedy top-k, where the matrix-vector kernel runs
    the router's product (one token on CUDA in float16 or bfloat16)."""
    return topk_method == "greedy" and gemv.applies(x, gate_weight)
