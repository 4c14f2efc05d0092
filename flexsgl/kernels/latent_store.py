"""MLA's latent store in one kernel on CUDA: the RMSNorm of the compressed KV, DeepSeek's RoPE of
the shared key, and their write into the latent pool.

    torch.ops.flexsgl.latent_store(latent, norm_weight, eps, cos, sin, positions, slots, kv)

`latent` is kv_a_proj's output `[T, kv_lora_rank + rope dims]` (a view into the fused projection's
output may be strided by rows); each token's slot in `kv` (`[slots, 1, kv_lora_rank + rope dims]`)
gets its normed `c` followed by its rotated `k_pe`. DeepSeek's RoPE rotates interleaved pairs
(x[2i], x[2i+1]) by the tables' angle i. Compiled by Inductor that stretch is three small kernels a
layer (the norm, the rotation with the concatenation, the scatter into the pool), each a launch on
decode's critical path at batch 1. A program takes one token. The rounding follows the PyTorch
expressions (`norm_rope_latent`): norm in float32, cast, scale in the model dtype; rotate in
float32, cast.

The op declares `kv` mutated, so a compiled model writes the pool in place; on the CPU its body is
the PyTorch expressions. `launch` runs the kernel on any tensors Triton can take (CUDA ones, or CPU
ones under Triton's interpreter in the CPU tests).
"""

from __future__ import annotations

import functools

import torch

from flexsgl.kernels import interleaved_rope
from flexsgl.kernels.launch import pdl
from flexsgl.kernels.norm_rope import rms_norm, rotate_pairs


def __getattr__(name: str):
    if name == "store_row":
        return _helper()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _helper():
    """`store_row`, the store of one token, which latent_query.py's kernel runs too (as
    interleaved_rope.py's helper is built and called)."""
    global tl  # a module global, where the interpreter looks for it
    import triton
    import triton.language as tl

    @triton.jit
    def store_row(row, out, w_ptr, cos_ptr, sin_ptr, pos, eps, R: tl.constexpr, ROPE: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
        """out[0:R] = RMSNorm(row[0:R]) (weight w_ptr), out[R:R + ROPE] = row[R:] turned by `pos`."""
        dt = out.dtype.element_ty
        j = tl.arange(0, BLOCK_R)
        c = tl.load(row + j, mask=j < R, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(c * c, axis=0) / R + eps)
        w = tl.load(w_ptr + j, mask=j < R, other=0.0).to(tl.float32)
        tl.store(out + j, (w * (c * r).to(dt).to(tl.float32)).to(dt), mask=j < R)
        interleaved_rope.rotate_row(row + R, out + R, cos_ptr, sin_ptr, pos, ROPE, BLOCK_P)

    return store_row


def block_latent(r: int) -> int:
    """store_row's BLOCK_R for a latent of `r` normed dims: r rounded up to a power of two, at least 16."""
    return max(16, 1 << (r - 1).bit_length())


@functools.cache
def _kernel():
    global latent_store  # this module, as the kernel's global: its helper is built on first use
    import triton
    import triton.language as tl

    from flexsgl.kernels import latent_store

    @triton.jit
    def latent_store_kernel(x_ptr, stride_t, w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kv_ptr, eps,
                            R: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                            PDL: tl.constexpr):
        if PDL:  # everything here reads the previous kernel's output (launch.py)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        out = kv_ptr + tl.load(slot_ptr + t).to(tl.int64) * (R + ROPE)
        latent_store.store_row(x_ptr + t * stride_t, out, w_ptr, cos_ptr, sin_ptr, tl.load(pos_ptr + t), eps,
                               R, ROPE, BLOCK_R, BLOCK_P)

    return latent_store_kernel


def norm_rope_latent(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The PyTorch expressions the kernel fuses: `[T, R + rope]` -> [normed c, rotated k_pe]."""
    rope = 2 * cos.shape[-1]
    c, k_pe = latent.split([latent.shape[-1] - rope, rope], dim=-1)
    return torch.cat([rms_norm(c, norm_weight, eps), rotate_pairs(positions, cos, sin, k_pe)], dim=-1)


def launch(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """The kernel: writes each token's normed c and rotated k_pe at its slot of kv."""
    t, width = latent.shape
    rope = 2 * cos.shape[-1]
    latent = latent if latent.stride(1) == 1 else latent.contiguous()
    use_pdl = pdl(latent.device)
    _kernel()[(t,)](
        latent, latent.stride(0), norm_weight, cos, sin, positions, slots, kv, eps, R=width - rope, ROPE=rope,
        BLOCK_R=block_latent(width - rope), BLOCK_P=interleaved_rope.block_pairs(rope),
        PDL=use_pdl, num_warps=4, **({"launch_pdl": True} if use_pdl else {}))


@torch.library.custom_op("flexsgl::latent_store", mutates_args=("kv",))
def latent_store(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    if latent.is_cuda:
        return launch(latent, norm_weight, eps, cos, sin, positions, slots, kv)
    kv[slots] = norm_rope_latent(latent, norm_weight, eps, cos, sin, positions).to(kv.dtype)[:, None]


@latent_store.register_fake
def _(latent, norm_weight, eps, cos, sin, positions, slots, kv):
    return None
