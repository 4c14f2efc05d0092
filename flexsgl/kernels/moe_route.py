"""MoE routing of one token (decode at batch 1) in one launch: the router's float32 product of the
RMS-normed input, softmax, greedy top-k and the weights' normalisation, as `MoE.route`
(flexsgl/model/moe.py) computes them.

Unfused, that is seven launches of 1-5 µs each (the norm, a cast, cuBLAS's float32
matrix-vector product and its reduction, softmax, top-k, the weights' scaling) around a 64 x 2048
product: about 0.35 ms of a 2.9 ms DeepSeek-V2-Lite decode step at batch 1 on an H200. Here each
program multiplies ROWS of the router's rows with the input, normed in float32 on the way in as the
matrix-vector kernel (flexsgl/kernels/gemv.py) does, and writes their logits; the last program to
finish (an atomic count, which it sets back to zero) takes softmax and top-k of all of them. A
single program doing everything read the router's 256 KB at 13 GB/s (20 µs); a second launch for
the top-k made DeepSeek-V2-Lite's batch-1 MoE layers 15 µs a step slower (docs/BENCHMARKS.md,
"MLA decode").

The experts read the input and normalise it themselves (expert_gemv's RMS_NORM prologue). The top-k
is TOP_K rounds of taking the largest probability left; a tie goes to the lower expert index. Only
DeepSeek's "greedy" method is fused; group-limited routing takes the unfused path.
"""

from __future__ import annotations

import functools

import torch

from flexsgl.kernels import gemv
from flexsgl.kernels.launch import pdl

ROWS = 1  # router rows a program: 64 programs for DeepSeek-V2's 64 experts (2 and 4 were no faster)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def route_kernel(x_ptr, norm_ptr, w_ptr, logits_ptr, count_ptr, experts_ptr, weights_ptr, E, H, eps, scaling,
                     TOP_K: tl.constexpr, NORM_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        r_ok = r < E
        cols = tl.arange(0, BLOCK_H)
        w_ptrs = w_ptr + r[:, None].to(tl.int64) * H + cols[None, :]
        w_first = tl.load(w_ptrs, mask=r_ok[:, None] & (cols < H)[None, :], other=0.0)
        if PDL:  # the router's first slice loads while the kernel before finishes (launch.py)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
        squares = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in range(0, H, BLOCK_H):
            k_ok = k + cols < H
            if k == 0:
                w = w_first
            else:
                w = tl.load(w_ptrs + k, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            squares += x * x
            x *= tl.load(norm_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        logit = tl.sum(acc, axis=1) * tl.rsqrt(tl.sum(squares, axis=0) / H + eps)
        tl.store(logits_ptr + r, logit, mask=r_ok)
        tl.debug_barrier()  # every thread's logits before the count (the release below covers them)
        done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:  # the last program: every logit is written
            rows = tl.arange(0, BLOCK_E)
            row_ok = rows < E
            logits = tl.load(logits_ptr + rows, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
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
            tl.atomic_xchg(count_ptr, 0)

    return route_kernel


def launch(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor, top_k: int,
           norm_topk_prob: bool, scaling: float, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts int32 [1, top_k], weights float32 [1, top_k]) for one token x `[1, H]` contiguous, the
    RMSNorm's weight and the router's weight `[E, H]`; `count` is an int32 zero the launch counts its
    finished programs in (and leaves at zero)."""
    import triton

    e, hidden = gate_weight.shape
    logits = torch.empty(e, dtype=torch.float32, device=x.device)
    experts = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    use_pdl = pdl(x.device)
    _kernel()[(triton.cdiv(e, ROWS),)](
        x, norm_weight, gate_weight, logits, count, experts, weights, e, hidden, eps, scaling,
        TOP_K=top_k, NORM_TOPK=norm_topk_prob and top_k > 1, BLOCK_E=triton.next_power_of_2(e), ROWS=ROWS,
        BLOCK_H=min(triton.next_power_of_2(hidden), 2048), BLOCK_K=triton.next_power_of_2(top_k), PDL=use_pdl,
        num_warps=4, **({"launch_pdl": True} if use_pdl else {}))
    return experts, weights


@torch.library.custom_op("flexsgl::moe_route", mutates_args=("count",))
def moe_route(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor, top_k: int,
              norm_topk_prob: bool, scaling: float, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return launch(x.contiguous(), norm_weight, eps, gate_weight.contiguous(), top_k, norm_topk_prob, scaling, count)


@moe_route.register_fake
def _(x, norm_weight, eps, gate_weight, top_k, norm_topk_prob, scaling, count):
    return x.new_empty(1, top_k, dtype=torch.int32), x.new_empty(1, top_k, dtype=torch.float32)


def applies(x: torch.Tensor, gate_weight: torch.Tensor, topk_method: str) -> bool:
    """Whether the fused routing serves this call: greedy top-k, one token where the matrix-vector
    kernel runs (CUDA, float16 or bfloat16)."""
    return topk_method == "greedy" and gemv.applies(x, gate_weight)
