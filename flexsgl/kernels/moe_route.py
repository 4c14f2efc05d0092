"""MoE routing of decode-batch-1 tokens in one Triton kernel: the RMSNorm before the MoE layer,
the router's float32 product, softmax, greedy top-k and the weights' normalisation, as
`MoE.route` (flexsgl/model/moe.py) computes them on the normed input.

Unfused, one token's routing is seven launches of 1-5 µs each (the norm, a cast, cuBLAS's float32
matrix-vector product and its reduction, softmax, top-k, the weights' scaling) around a 64 x 2048
product; in a DeepSeek-V2-Lite decode step at batch 1 that was about 0.35 ms of 2.9. Here one
program per token does all of it and also writes the normed input, which the experts and the shared
experts read next.

The norm rounds as `rms_norm` does (normalised in float32, rounded to the input's dtype, then scaled
by the weight and rounded again), so the router sees the very input the unfused path gives it. The
top-k is TOP_K rounds of taking the largest probability left; a tie goes to the lower expert index.
Only DeepSeek's "greedy" method is fused; group-limited routing takes the unfused path.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def route_kernel(x_ptr, norm_ptr, gate_ptr, h_ptr, experts_ptr, weights_ptr, E, H, eps, scaling,
                     TOP_K: tl.constexpr, NORM_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        x_ptr += t * H
        h_ptr += t * H
        cols = tl.arange(0, BLOCK_H)
        squares = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in range(0, H, BLOCK_H):
            x = tl.load(x_ptr + k + cols, mask=k + cols < H, other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / H + eps)

        rows = tl.arange(0, BLOCK_E)
        row_ok = rows < E
        acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
        for k in range(0, H, BLOCK_H):
            k_ok = k + cols < H
            x = tl.load(x_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            g = tl.load(norm_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            h = (g * (x * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + k + cols, h, mask=k_ok)
            w = tl.load(gate_ptr + rows[:, None] * H + k + cols[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc += w.to(tl.float32) * h.to(tl.float32)[None, :]
        logits = tl.where(row_ok, tl.sum(acc, axis=1), float("-inf"))
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
        tl.store(experts_ptr + t * TOP_K + slots, chosen, mask=slots < TOP_K)
        tl.store(weights_ptr + t * TOP_K + slots, chosen_p, mask=slots < TOP_K)

    return route_kernel


def launch(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor, top_k: int,
           norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed x, experts int32 [T, top_k], weights float32 [T, top_k]) for x `[T, H]` contiguous and
    the router's weight `[E, H]`."""
    import triton

    t, hidden = x.shape
    e = gate_weight.shape[0]
    h = torch.empty_like(x)
    experts = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    block_e = triton.next_power_of_2(e)
    block_h = max(16, min(triton.next_power_of_2(hidden), 8192 // block_e))
    _kernel()[(t,)](x, norm_weight, gate_weight, h, experts, weights, e, hidden, eps, scaling,
                    TOP_K=top_k, NORM_TOPK=norm_topk_prob and top_k > 1, BLOCK_E=block_e, BLOCK_H=block_h,
                    BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return h, experts, weights


@torch.library.custom_op("flexsgl::moe_route", mutates_args=())
def moe_route(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor, top_k: int,
              norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch(x.contiguous(), norm_weight, eps, gate_weight.contiguous(), top_k, norm_topk_prob, scaling)


@moe_route.register_fake
def _(x, norm_weight, eps, gate_weight, top_k, norm_topk_prob, scaling):
    t = x.shape[0]
    return (torch.empty_like(x), x.new_empty(t, top_k, dtype=torch.int32), x.new_empty(t, top_k, dtype=torch.float32))


def applies(x: torch.Tensor, topk_method: str) -> bool:
    """Whether the fused routing serves this call: one token on CUDA in float16 or bfloat16, greedy top-k."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and topk_method == "greedy")
