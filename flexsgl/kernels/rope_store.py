"""Everything between qkv_proj and attention, in one kernel on CUDA: the per-head q/k RMSNorm
(Qwen3), RoPE, and the write of this step's K and V into the paged pool.

    q = torch.ops.flexsgl.rope_store(qkv, q_norm, k_norm, eps, cos, sin, positions, slots, k_cache, v_cache, hq)

The GQA store path (flexsgl/cache/store.py) is this op where the kernel applies (`applies`: CUDA,
a power-of-two head size), otherwise `norm_rope` and `write_kv`, the PyTorch expressions the
kernel fuses. Attention layers call their store path; backends only attend.

Compiled by Inductor, that stretch is seven small kernels per layer (two norm reductions, two
norm-and-rotate passes, two scatters into the pool and a copy), 1-3 µs each at decode: 252
kernels in a Qwen3-8B batch-1 step (tools/profile_step.py). A program takes one token's head, or from 64 tokens 8 of its heads: a
q head is normalised, rotated and written to the returned q; a K head is normalised, rotated and
written to its pool slot, and its V head copied next to it. The rounding follows the PyTorch expressions step
for step (norm in float32, cast, scale in the model dtype; rotate in float32, cast), so the two
paths differ by a rounding step at most (tests/test_rope_store.py). On SM90+ it launches with PDL
(launch.py).

The kernel runs in a `torch.library` custom op that declares the two cache tensors mutated, so a
compiled model writes them in place (tests/test_rope_store.py checks that on the CPU, where the
op's body is the PyTorch expressions). `launch` runs the kernel itself on any tensors Triton can
take: CUDA ones, or CPU ones under Triton's interpreter (`TRITON_INTERPRET=1`, the CPU tests).
"""

from __future__ import annotations

import functools

import torch

from flexsgl.kernels.launch import pdl
from flexsgl.kernels.norm_rope import rms_norm, rotate
from flexsgl.quant.fp8 import quantize


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_store_kernel(qkv_ptr, stride_t, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                          q_ptr, k_ptr, v_ptr, eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                          HEADS: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # everything here reads the previous kernel's output (launch.py)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # this program's heads of q, then K
        h_ok = h < HQ + HKV
        is_q = h < HQ
        HALF: tl.constexpr = D // 2
        i = tl.arange(0, HALF)
        row = qkv_ptr + t * stride_t
        dt = q_ptr.dtype.element_ty
        x1 = tl.load(row + h[:, None] * D + i[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(row + h[:, None] * D + HALF + i[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
        if HAS_NORM:  # RMSNorm as norm_rope.rms_norm: float32, cast, then times the weight in the model dtype
            r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
            w1 = tl.where(is_q[:, None], tl.load(qn_ptr + i)[None, :], tl.load(kn_ptr + i)[None, :])
            w2 = tl.where(is_q[:, None], tl.load(qn_ptr + HALF + i)[None, :], tl.load(kn_ptr + HALF + i)[None, :])
            x1 = (w1.to(tl.float32) * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2.to(tl.float32) * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        pos = tl.load(pos_ptr + t)
        c = tl.load(cos_ptr + pos * HALF + i)[None, :]
        s = tl.load(sin_ptr + pos * HALF + i)[None, :]
        o1 = (x1 * c - x2 * s).to(dt)
        o2 = (x2 * c + x1 * s).to(dt)
        q_at = q_ptr + (t * HQ + h)[:, None] * D + i[None, :]
        q_ok = (is_q & h_ok)[:, None]
        tl.store(q_at, o1, mask=q_ok)
        tl.store(q_at + HALF, o2, mask=q_ok)
        k_ok = (~is_q & h_ok)[:, None]
        at = (tl.load(slot_ptr + t) * HKV + (h - HQ))[:, None] * D  # K head h - HQ's slot row
        tl.store(k_ptr + at + i[None, :], o1.to(k_ptr.dtype.element_ty), mask=k_ok)
        tl.store(k_ptr + at + HALF + i[None, :], o2.to(k_ptr.dtype.element_ty), mask=k_ok)
        j = tl.arange(0, D)[None, :]
        v = tl.load(row + (h + HKV)[:, None] * D + j, mask=k_ok, other=0.0)  # V head h - HQ follows the K heads
        tl.store(v_ptr + at + j, v.to(v_ptr.dtype.element_ty), mask=k_ok)

    return rope_store_kernel


def norm_rope(qkv, q_norm, k_norm, eps, cos, sin, positions, num_heads, head_dim):
    """The PyTorch expressions the kernel fuses: qkv_proj's output -> (q, k, v), each `[T, heads, D]`."""
    t = qkv.shape[0]
    hkv = (qkv.shape[1] // head_dim - num_heads) // 2
    q, k, v = qkv.split([num_heads * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    q, k, v = q.view(t, num_heads, head_dim), k.view(t, hkv, head_dim), v.view(t, hkv, head_dim)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rotate(positions, cos, sin, q, k)
    return q, k, v


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """One layer's scatter of k, v `[tokens, Hkv, D]` into its flat `[slots, Hkv, D]` tensors, in
    place; into an FP8 cache divided by `scales` ([K's, V's] float32) and saturated to FP8's range."""
    if scales is not None:
        k, v = quantize(k, scales[0]), quantize(v, scales[1])
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)


def launch(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
           cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
           k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The kernel: returns q `[T, num_heads, D]` and writes K, V at `slots` of k_cache, v_cache."""
    t, (hkv, d) = qkv.shape[0], k_cache.shape[1:]
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    use_pdl = pdl(qkv.device)
    # A program per (token, head) at decode's few tokens, where latency is all; per (token, 8 heads)
    # from 64 tokens, where a program per head spent more time starting programs than moving bytes.
    heads, warps = (1, 1) if t < 64 else (8, 2)
    _kernel()[(t, -(-(num_heads + hkv) // heads))](
        qkv, qkv.stride(0), q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv,
        cos, sin, positions, slots, q, k_cache, v_cache, eps,
        HQ=num_heads, HKV=hkv, D=d, HEADS=heads, HAS_NORM=q_norm is not None, PDL=use_pdl, num_warps=warps,
        **({"launch_pdl": True} if use_pdl else {}))
    return q


@torch.library.custom_op("flexsgl::rope_store", mutates_args=("k_cache", "v_cache"))
def rope_store(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
               cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    if qkv.is_cuda:
        return launch(qkv, q_norm, k_norm, eps, cos, sin, positions, slots, k_cache, v_cache, num_heads)
    # The same result through PyTorch: what the CPU tests compile.
    q, k, v = norm_rope(qkv, q_norm, k_norm, eps, cos, sin, positions, num_heads, k_cache.shape[2])
    write_kv(k_cache, v_cache, k, v, slots)
    return q.contiguous()


@rope_store.register_fake
def _(qkv, q_norm, k_norm, eps, cos, sin, positions, slots, k_cache, v_cache, num_heads):
    return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[2])


def applies(device: torch.device, head_dim: int) -> bool:
    """Whether the kernel serves a pool on `device` with heads of `head_dim`: CUDA, a power of two from 16."""
    return device.type == "cuda" and head_dim >= 16 and head_dim & (head_dim - 1) == 0

