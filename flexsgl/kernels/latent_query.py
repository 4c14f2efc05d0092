"""MLA's query in the latent space, in one kernel at decode batch 1 on CUDA: each head's
`W_UK^T q_nope` followed by its rotated `q_pe`, the query the absorbed attention takes.

    q = torch.ops.flexsgl.latent_query(q, w_uk, cos, sin, positions)   # [T, H, r + rope]

`q` is the query projection's output `[T, H, nope + rope]`, `w_uk` each head's key up-projection
`[H, nope, r]` (a view of kv_b_proj's weight). Run as PyTorch (`latent_query_reference`) that is a
cuBLAS batched product, a rotation and a concatenation: at batch 1 two launches of a few µs each
per layer for 2 MB of weight. A program here takes one head of one token and BLOCK_R of its r
outputs, reading its slice of W_UK once; the first of a head's programs also rotates its q_pe
(DeepSeek's interleaved pairs). The rounding follows PyTorch's: products summed in float32 and
rounded once, the rotation in float32 and cast. Each token rereads W_UK, so only a single token
takes the kernel (`applies`); batches keep the batched product.

`latent_query_store` also stores the token's latent (latent_store.py) from one more program of the
same launch: the two read only the query projection's output, so the store needs no launch of its
own (docs/BENCHMARKS.md, "MLA decode").
"""

from __future__ import annotations

import functools

import torch

from flexsgl.kernels import interleaved_rope, latent_store
from flexsgl.kernels.launch import pdl
from flexsgl.kernels.norm_rope import rotate_pairs

BLOCK_R = 64


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def latent_query_kernel(q_ptr, stride_qt, stride_qh, w_ptr, stride_wh, stride_wn, cos_ptr, sin_ptr, pos_ptr,
                            out_ptr, HEADS, x_ptr, g_ptr, eps, slot_ptr, kv_ptr, NOPE: tl.constexpr,
                            ROPE: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_P: tl.constexpr, PDL: tl.constexpr, STORE: tl.constexpr, BLOCK_S: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        jb = tl.program_id(2)
        if STORE and h == HEADS:  # the row after the heads': the token's latent into its slot
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            if jb == 0:
                kv = kv_ptr + tl.load(slot_ptr + t).to(tl.int64) * (R + ROPE)
                latent_store.store_row(x_ptr, kv, g_ptr, cos_ptr, sin_ptr, tl.load(pos_ptr + t), eps, R, ROPE,
                                       BLOCK_S, BLOCK_P)
        else:
            n = tl.arange(0, BLOCK_N)
            cols = jb * BLOCK_R + tl.arange(0, BLOCK_R)
            w = tl.load(w_ptr + h * stride_wh + n[:, None] * stride_wn + cols[None, :],
                        mask=(n < NOPE)[:, None] & (cols < R)[None, :], other=0.0)  # the weight: no wait for it
            if PDL:  # q is the previous kernel's output (launch.py)
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            q = q_ptr + t * stride_qt + h * stride_qh
            qn = tl.load(q + n, mask=n < NOPE, other=0.0).to(tl.float32)
            out = out_ptr + (t * HEADS + h) * (R + ROPE)
            tl.store(out + cols, tl.sum(w.to(tl.float32) * qn[:, None], axis=0).to(out_ptr.dtype.element_ty),
                     mask=cols < R)
            if jb == 0:  # this head's rotated q_pe
                interleaved_rope.rotate_row(q + NOPE, out + R, cos_ptr, sin_ptr, tl.load(pos_ptr + t), ROPE, BLOCK_P)

    return latent_query_kernel


def latent_query_reference(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """The PyTorch expressions: `[T, H, nope + rope]` -> `[T, H, r + rope]`."""
    nope = w_uk.shape[1]
    q_nope, q_pe = q.split([nope, q.shape[-1] - nope], dim=-1)
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
    return torch.cat([q_latent, rotate_pairs(positions, cos, sin, q_pe)], dim=-1)


def launch(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           store: tuple | None = None) -> torch.Tensor:
    """The latent query `[T, H, r + rope]`; with `store` = (latent `[1, r + rope]`, norm weight, eps,
    slots, kv) one token's latent also goes into its slot of kv, normed and rotated (latent_store.py)."""
    t, h, width = q.shape
    _, nope, r = w_uk.shape
    rope = width - nope
    out = torch.empty(t, h, r + rope, dtype=q.dtype, device=q.device)
    latent, norm_weight, eps, slots, kv = store or (q, q, 0.0, positions, out)
    if store is not None and (t != 1 or latent.stride(-1) != 1):
        raise ValueError("the fused store takes one token whose latent is contiguous")
    use_pdl = pdl(q.device)
    _kernel()[(t, h + (store is not None), -(-r // BLOCK_R))](
        q, q.stride(0), q.stride(1), w_uk, w_uk.stride(0), w_uk.stride(1), cos, sin, positions, out, h,
        latent, norm_weight, eps, slots, kv,
        NOPE=nope, ROPE=rope, R=r, BLOCK_N=max(16, 1 << (nope - 1).bit_length()), BLOCK_R=BLOCK_R,
        BLOCK_P=interleaved_rope.block_pairs(rope), PDL=use_pdl, STORE=store is not None,
        BLOCK_S=latent_store.block_latent(r), num_warps=4, **({"launch_pdl": True} if use_pdl else {}))
    return out


@torch.library.custom_op("flexsgl::latent_query", mutates_args=())
def latent_query(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    return launch(q, w_uk, cos, sin, positions)


@latent_query.register_fake
def _(q, w_uk, cos, sin, positions):
    return _query_like(q, w_uk)


@torch.library.custom_op("flexsgl::latent_query_store", mutates_args=("kv",))
def latent_query_store(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       slots: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return launch(q, w_uk, cos, sin, positions, (latent.contiguous(), norm_weight, eps, slots, kv))


@latent_query_store.register_fake
def _(q, w_uk, cos, sin, positions, latent, norm_weight, eps, slots, kv):
    return _query_like(q, w_uk)


def _query_like(q, w_uk):
    return q.new_empty(q.shape[0], q.shape[1], w_uk.shape[2] + q.shape[2] - w_uk.shape[1])


def applies(q: torch.Tensor, w_uk: torch.Tensor) -> bool:
    """Whether the kernel serves this call: one token on CUDA, half precision, rows of W_UK contiguous."""
    return (q.is_cuda and q.shape[0] == 1 and q.dtype in (torch.bfloat16, torch.float16) and w_uk.dtype == q.dtype
            and w_uk.stride(-1) == 1 and q.stride(-1) == 1)
