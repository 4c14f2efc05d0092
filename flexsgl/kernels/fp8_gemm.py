"""An FP8 matrix product sized for decode batches: out = (xq * x_scale) @ (weight * w_scale).T (+ bias)
(+ residual), xq FP8 activations with a float32 scale per token, weight FP8 with one per row.

At a decode step's rows (tens to a few hundred tokens) a projection is too small to fill the GPU on
large tiles. cuBLAS's rowwise-scaled FP8 product (torch._scaled_mm) runs every such shape on 128 x
128 tiles: a weight of 1,024 rows at 224 tokens (Qwen3-0.6B's o_proj and down_proj) becomes 16
programs on an H200's 132 SMs, slower than the bfloat16 product it replaces (docs/BENCHMARKS.md,
H200: FP8). This kernel gives a program up to 64 tokens (BLOCK_M) and the widest slice of weight
rows (BLOCK_N of 128, 64 or 32) that still leaves a program for every two SMs, and walks K in
slices (BLOCK_K) as long as STAGE_BYTES of weight allow, so that a narrow program still keeps as
many weight bytes in flight as a wide one, STAGES of them; the float32 sums take both scales, the
bias and the residual on the way out, so o_proj and down_proj need no kernel of their own for the
residual add (`tiles`).

`fp8_linear` is a `torch.library` custom op that runs it where `applies` says it serves (CUDA SM90,
at most MAX_ROWS tokens, N and K multiples of the tiles), torch._scaled_mm elsewhere: compiled
models see one opaque call whatever the batch, with no guard on the number of rows.
"""

from __future__ import annotations

import functools

import torch

MAX_ROWS = 256  # tokens up to which the kernel serves (decode batches); more run on cuBLAS
ACC_K = 128  # columns summed in the tensor cores' FP8 accumulator before each float32 add
WIDTHS = (128, 64, 32)  # BLOCK_N candidates, widest first
DEPTHS = (512, 256, ACC_K)  # BLOCK_K candidates, deepest first
STAGE_BYTES = 16384  # FP8 weight bytes a program loads per slice of K: BLOCK_N x BLOCK_K
STAGES = 4  # slices in flight per program (num_stages)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, r_ptr, out_ptr, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        ACC_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        m_tiles = tl.cdiv(M, BLOCK_M)  # tokens fastest: the programs reading one weight slice run together
        rows = (tl.program_id(0) % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tl.program_id(0) // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        x_ptrs = x_ptr + rows[:, None] * K + ks[None, :]
        w_ptrs = w_ptr + cols[:, None] * K + ks[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):  # K a multiple of BLOCK_K, N of BLOCK_N (launch)
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            # every ACC_K columns' products summed in the tensor cores' reduced-precision FP8
            # accumulator, then added to the float32 sums (SM90 would carry the former across all of K)
            acc = tl.dot(x, tl.trans(tl.load(w_ptrs)), acc, max_num_imprecise_acc=ACC_K)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc *= tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[:, None] * tl.load(ws_ptr + cols)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        offsets = rows[:, None] * N + cols[None, :]
        if HAS_RESIDUAL:
            acc += tl.load(r_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    return fp8_gemm_kernel


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tiles(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for m tokens and an [n, k] weight on a GPU of `sms` SMs: up to 64
    tokens a program (m's power of two, 16 at least: the tensor cores' M), the widest BLOCK_N in
    WIDTHS dividing n that leaves at least sms / 2 programs (else the narrowest dividing n), and the
    deepest BLOCK_K in DEPTHS dividing k whose weight slice fits STAGE_BYTES."""
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    m_tiles = -(-m // block_m)
    widths = [w for w in WIDTHS if n % w == 0]
    block_n = next((w for w in widths if (n // w) * m_tiles * 2 >= sms), widths[-1])
    return block_m, block_n, next(d for d in DEPTHS if k % d == 0 and (block_n * d <= STAGE_BYTES or d == ACC_K))


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel serves FP8 activations `x` `[M, K]` and an FP8 `weight` `[N, K]`: on an
    SM90 GPU (where it was measured against cuBLAS), at most MAX_ROWS tokens, N a multiple of the
    narrowest tile and K of ACC_K."""
    n, k = weight.shape
    return (x.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(x.device)[0] == 9
            and x.shape[0] <= MAX_ROWS and n % WIDTHS[-1] == 0 and k % ACC_K == 0)


def launch(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor,
           block: tuple[int, int, int] | None = None, sms: int | None = None) -> torch.Tensor:
    """out `[M, N]` = (xq * x_scale) @ (weight * w_scale).T (+ bias) (+ residual): xq FP8 `[M, K]` and
    weight FP8 `[N, K]` contiguous, x_scale float32 `[M]`, w_scale float32 `[N]`, residual `[M, N]`
    contiguous. block: (BLOCK_M, BLOCK_N, BLOCK_K) (default: `tiles` for the device's SMs)."""
    (m, k), n = xq.shape, weight.shape[0]
    block_m, block_n, block_k = block or tiles(m, n, k, sms or _sm_count(xq.device.index or 0))
    if n % block_n or k % block_k or block_k % ACC_K:
        raise ValueError(f"fp8_gemm: a [{n}, {k}] weight in tiles of {block_n} rows and {block_k} columns")
    _kernel()[(-(-m // block_m) * (n // block_n),)](
        xq, x_scale, weight, w_scale, bias if bias is not None else w_scale,
        residual if residual is not None else out, out, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ACC_K=ACC_K, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, num_warps=4, num_stages=STAGES)
    return out


@torch.library.custom_op("flexsgl::fp8_linear", mutates_args=())
def fp8_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, residual: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * x_scale) @ (weight * w_scale).T (+ bias) (+ residual) in out_dtype: x_scale `[M, 1]`,
    w_scale `[N, 1]`; this kernel where `applies`, torch._scaled_mm elsewhere."""
    if applies(xq, weight):
        out = torch.empty(xq.shape[0], weight.shape[0], dtype=out_dtype, device=xq.device)
        return launch(xq.contiguous(), x_scale.reshape(-1).contiguous(), weight, w_scale.reshape(-1).contiguous(),
                      bias, residual.contiguous() if residual is not None else None, out)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), bias=bias,
                           out_dtype=out_dtype)
    return out if residual is None else out + residual


@fp8_linear.register_fake
def _(xq, x_scale, weight, w_scale, bias, residual, out_dtype):
    return xq.new_empty(xq.shape[0], weight.shape[0], dtype=out_dtype)
