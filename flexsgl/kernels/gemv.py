"""The decoder's projections, each with what precedes or follows it folded in, and a Triton
matrix-vector kernel that runs them at decode batch 1 on CUDA.

    norm_linear(x, norm, proj)            proj(norm(x))        (RMSNorm, then the projection)
    linear(x, proj, residual)             residual + proj(x)
    silu_linear(gate_up, proj, residual)  residual + proj(silu(gate) * up)

and `stacked_gemv`: the same kernel with a grid row per slot s, out[s] = weight[index[s]] @ x[s] for
a stacked `[E, N, K]` weight (MLA's W_UV at batch 1, a slot per head).

A projection with FP8 weights (flexsgl/quant/fp8_linear.py Fp8Linear: float8_e4m3fn, one float32
scale per row or per 128 x 128 block) runs the same kernel at batch 1: it reads the FP8 bytes,
widens them to float32 in registers, and multiplies each row's sum by its scale, or with block
scales x by its row block's scale of each column block (a program's rows lie in one row block),
with x as it is (bfloat16; at larger batches Fp8Linear quantizes activations for its FP8
products). Its tiles are its own (FP8_TILES, the fastest over an 8B's projections in
`tools/gemv_bench.py --fp8`): 8 rows of 2,048 bytes with 8 warps, where bfloat16's read 4-16 rows
of 1,024 bytes with 4; the RMSNorm form with a scale per row (qkv_proj, gate_up_proj) reads 8 rows
of 1,024 bytes with 4 warps (FP8_NORM_TILES, faster in the batch-1 step under the register cap
below; with block scales, whose loads take more registers, it keeps FP8_TILES). With FP8 weights
each thread sums its 16 consecutive products (a 16-byte load's worth) into one float32 accumulator
as they come (FP8_INNER) rather than keeping an accumulator register per element.

Everywhere but batch 1 on CUDA they are those PyTorch expressions. At batch 1 each is one kernel:
the projection reads its whole weight to do two flops per element, so its time is the weight's
bytes over memory bandwidth, and the norms, the SiLU gate and the residual adds would otherwise be
a kernel each, a few microseconds of launch and latency apiece, 108 of them in a Qwen3-8B step.
The kernel reads the weights closer to the copy bandwidth than cuBLAS does at batch 1
(tools/gemv_bench.py; figures in docs/BENCHMARKS.md).

The kernel gives each program BLOCK_N weight rows and walks K in BLOCK_K slices, multiplying in
float32 into a [BLOCK_N, BLOCK_K] accumulator that it reduces once at the end; many small
programs keep enough loads in flight without splitting K. Every program reads all of x anyway, so
the RMSNorm folds in: it scales x by the norm weight on the way in, sums x squared on
the side, and divides by the root mean square at the end. The SiLU gate is computed from
gate_up as x is read; bias and residual are added on the way out. At batch 2 the plain kernel
only matched cuBLAS and at 4 it lost, so batch 1 alone takes it. It runs inside a
`torch.library` custom op, so compiled models treat it like the cuBLAS call it replaces. On SM90+
it launches with PDL and loads its first weight slice before waiting on the kernel before it
(launch.py), and multiplies that slice ahead of the loop over the rest (`add_slice` serves both).
With the slice chosen inside the loop (the prefetched one at k = 0, else a load) Triton keeps each
FP8 byte in a register of its own and merges them every iteration: compiled for SM90, a 16 x 512
FP8 tile's loop is 244 instructions a thread in 64 registers this way, 457 in 161 that way
(tools/gemv_sass.py prints a tile's loop).
`config_for` gives the tiles that were fastest inside that chain.

FP8 launches cap the kernel at FP8_MAX_REGISTERS (64) registers a thread wherever Triton specialises
every size, stride and pointer as a multiple of 16 (the engine's projections): the RMSNorm and
block-scaled forms otherwise take 72-80, which fits three programs of 8 warps an SM instead of four,
and capped they compile without spilling on the GPU image's Triton (`tools/gemv_sass.py --fp8
--prologue rms_norm` prints registers and spills; the step's gain is in docs/BENCHMARKS.md). A launch
without those facts compiles to over 200 registers and would spill under the cap, so it runs uncapped.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from flexsgl.kernels.launch import pdl

FP8 = torch.float8_e4m3fn

PLAIN, RMS_NORM, SILU_GATE = 0, 1, 2  # what the kernel does to x on the way in
PROLOGUES = {"plain": PLAIN, "rms_norm": RMS_NORM, "silu_gate": SILU_GATE}  # by name (tests, tools/gemv_sass.py)
NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2  # an FP8 weight's scales: none (x's dtype), per row, per block
FP8_INNER = 16  # FP8 products summed 16 at a time, a 16-byte load's worth (module docstring)


@functools.cache
def _kernel():
    global add_slice  # Triton, its interpreter too, finds a kernel's helpers among the module's globals
    import triton
    import triton.language as tl

    @triton.jit
    def add_slice(acc, squares, w, x_ptr, g_ptr, s_ptr, stride_sn, k, cols, K,
                  PROLOGUE: tl.constexpr, SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INNER: tl.constexpr):
        """The products of weight slice `w` (columns k + cols) with x's slice, added to acc (and x's
        squares to squares, for RMSNorm)."""
        k_ok = k + cols < K
        x = tl.load(x_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
        if PROLOGUE == 1:  # RMSNorm: weight now, 1 / rms at the end
            squares += x * x
            x *= tl.load(g_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
        if PROLOGUE == 2:  # x holds gate; up follows it in the same row
            up = tl.load(x_ptr + K + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            x = x / (1.0 + tl.exp(-x)) * up
        if SCALE == 2:  # FP8 weights by SCALE_N x SCALE_K blocks: this row block's scale of each column
            block_row = tl.program_id(0) * BLOCK_N // SCALE_N
            x *= tl.load(s_ptr + block_row * stride_sn + (k + cols) // SCALE_K, mask=k_ok, other=0.0)
        if INNER > 1:  # each INNER consecutive products summed as they come (module docstring)
            acc += tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (BLOCK_N, BLOCK_K // INNER, INNER)), axis=2)
        else:
            acc += w.to(tl.float32) * x[None, :]
        return acc, squares

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, r_ptr, g_ptr, out_ptr, N, K, stride_wn, eps,
                    e_ptr, stride_we, stride_xs, stride_os, s_ptr, stride_sn,
                    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SCALE: tl.constexpr,
                    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                    STACKED: tl.constexpr, INNER: tl.constexpr):
        if STACKED:  # program_id(1) is a slot: its weight of the stack, its x row, its output row
            slot = tl.program_id(1)
            w_ptr += tl.load(e_ptr + slot).to(tl.int64) * stride_we
            x_ptr += slot * stride_xs
            out_ptr += slot * stride_os
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K // INNER), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        start = 0
        if PDL:  # the first weight slice loads while the previous kernel finishes (launch.py), outside the loop
            w = tl.load(w_ptrs, mask=row_ok[:, None] & (cols < K)[None, :], other=0.0, eviction_policy="evict_first")
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
            acc, squares = add_slice(acc, squares, w, x_ptr, g_ptr, s_ptr, stride_sn, 0, cols, K, PROLOGUE, SCALE,
                                     SCALE_N, SCALE_K, BLOCK_N, BLOCK_K, INNER)
            start = BLOCK_K
        for k in range(start, K, BLOCK_K):
            w_mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & (k + cols < K)[None, :]
            w = tl.load(w_ptrs + k, mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc, squares = add_slice(acc, squares, w, x_ptr, g_ptr, s_ptr, stride_sn, k, cols, K, PROLOGUE, SCALE,
                                     SCALE_N, SCALE_K, BLOCK_N, BLOCK_K, INNER)
        out = tl.sum(acc, axis=1)
        if PROLOGUE == 1:
            out *= tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if SCALE == 1:  # FP8 weights: each row's scale
            out *= tl.load(s_ptr + rows, mask=row_ok, other=0.0)
        if HAS_BIAS:
            out += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            out += tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)

    return gemv_kernel


FP8_TILES = (8, 2048, 8, 2)  # FP8 weights' tiles (module docstring)
FP8_NORM_TILES = (8, 1024, 4, 3)  # FP8 weights' tiles for the RMSNorm form, per-row scales (module docstring)
FP8_MAX_REGISTERS = 64  # registers a thread for FP8 launches: four programs of 8 warps an SM (module docstring)


def register_cap(weight: torch.Tensor, *tensors: torch.Tensor | None) -> dict:
    """The launch option capping an FP8 weight's kernel at FP8_MAX_REGISTERS: where the weight's sizes
    and row stride and every tensor's address are multiples of 16 (as Triton then specialises the
    kernel); none otherwise, nor on ROCm, whose Triton has no such option."""
    if weight.dtype != FP8 or torch.version.hip is not None:
        return {}
    sizes = (weight.shape[0], weight.shape[1], weight.stride(0))
    addresses = (t.data_ptr() for t in (weight, *tensors) if t is not None)
    return {"maxnreg": FP8_MAX_REGISTERS} if all(v % 16 == 0 for v in (*sizes, *addresses)) else {}


def config_for(n: int, k: int, fp8: bool = False, prologue: int = PLAIN,
               block_scales: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight: the best tiles for an 8B's
    projections timed where the engine runs them, chained as a layer with PDL
    (`tools/gemv_bench.py --chain-sweep`; tiles picked with each projection timed alone lose there),
    and lm_head's from the sweep alone. fp8: FP8 weights, FP8_NORM_TILES for the RMSNorm `prologue`
    with per-row scales (timed in the batch-1 step), FP8_TILES for the other forms."""
    if n >= 65536:
        return 8, 512, 4, 1  # lm_head
    if fp8:
        return FP8_NORM_TILES if prologue == RMS_NORM and not block_scales else FP8_TILES
    if k >= 8192:
        return 4, 512, 4, 3  # long rows (down_proj)
    if n >= 16384:
        return 16, 512, 4, 2  # wide, short rows (gate_up_proj)
    if n > k and k <= 2048:
        return 4, 512, 4, 3  # DeepSeek-V2-Lite's qkv_a_proj [3648, 2048]: more programs in flight
    if n > k:
        return 16, 512, 4, 3  # qkv_proj
    return 4, 512, 4, 3  # o_proj


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           config: tuple[int, int, int, int] | None = None, residual: torch.Tensor | None = None,
           norm_weight: torch.Tensor | None = None, eps: float = 0.0, prologue: int = PLAIN,
           use_pdl: bool | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[0] = (weight * scale) @ f(x[0]) (+ bias) (+ residual[0]); x contiguous, [1, K] ([1, 2K] for
    SILU_GATE); scale: FP8 weights' float32 scales, per row `[N]` or per block `[N / bn, K / bk]`
    contiguous (blocks that divide the weight, bn a multiple of the tile's rows; None: weights in x's
    dtype). use_pdl: launch with programmatic dependent launch (default: launch.pdl's answer for the device)."""
    n, k = weight.shape
    block_scales = scale is not None and scale.dim() == 2
    block_n, block_k, warps, stages = config or config_for(n, k, weight.dtype == FP8, prologue, block_scales)
    use_pdl = pdl(x.device) if use_pdl is None else use_pdl
    mode, scale_n, scale_k = NO_SCALE, 1, 1
    if block_scales:
        mode, scale_n, scale_k = BLOCK_SCALE, n // scale.shape[0], k // scale.shape[1]
        if scale_n * scale.shape[0] != n or scale_k * scale.shape[1] != k or scale_n % block_n:
            raise ValueError(f"gemv: block scales {tuple(scale.shape)} of a [{n}, {k}] weight in tiles of "
                             f"{block_n} rows")
    elif scale is not None:
        mode = ROW_SCALE
    _kernel()[((n + block_n - 1) // block_n,)](
        x, weight, bias if bias is not None else weight, residual if residual is not None else weight,
        norm_weight if norm_weight is not None else weight, out, n, k, weight.stride(0), eps,
        weight, 0, 0, 0, scale if scale is not None else weight, scale.stride(0) if mode == BLOCK_SCALE else 0,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, SCALE=mode,
        SCALE_N=scale_n, SCALE_K=scale_k,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, PDL=use_pdl, STACKED=False,
        INNER=FP8_INNER if weight.dtype == FP8 else 1, num_warps=warps,
        num_stages=stages, **({"launch_pdl": True} if use_pdl else {}),
        **register_cap(weight, x, out, bias, residual, norm_weight, scale))
    return out


def launch_stacked(x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[s] = weight[index[s]] @ x[s] for each slot s, in one launch: weight `[E, N, K]`, x `[S, K]`
    contiguous, index int `[S]`, out `[S, N]`. Its weight slices load before the wait on the kernel before
    (launch.py), so `index` must not be that kernel's output (W_UV's is a constant buffer)."""
    _, n, k = weight.shape
    block_n, block_k, warps, stages = config_for(n, k)
    use_pdl = pdl(x.device)
    _kernel()[((n + block_n - 1) // block_n, index.numel())](
        x, weight, weight, weight, weight, out, n, k, weight.stride(1), 0.0, index, weight.stride(0), x.stride(0),
        out.stride(0), weight, 0, PROLOGUE=PLAIN, HAS_BIAS=False, HAS_RESIDUAL=False, SCALE=NO_SCALE, SCALE_N=1,
        SCALE_K=1,
        BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, PDL=use_pdl, STACKED=True, INNER=1, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if use_pdl else {}))
    return out


@torch.library.custom_op("flexsgl::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
         norm_weight: torch.Tensor | None, eps: float, prologue: int, scale: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    residual = residual.contiguous() if residual is not None else None
    return launch(x.contiguous(), weight, bias, out, residual=residual, norm_weight=norm_weight, eps=eps,
                  prologue=prologue, scale=scale)


@gemv.register_fake
def _(x, weight, bias, residual, norm_weight, eps, prologue, scale):
    return x.new_empty(1, weight.shape[0])


@torch.library.custom_op("flexsgl::stacked_gemv", mutates_args=())
def stacked_gemv(x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = torch.empty(index.numel(), weight.shape[1], dtype=x.dtype, device=x.device)
    return launch_stacked(x.contiguous(), weight, index, out)


@stacked_gemv.register_fake
def _(x, weight, index):
    return x.new_empty(index.numel(), weight.shape[1])


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel serves this call: CUDA, float16 or bfloat16, one row, weights in x's dtype
    or FP8."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype in (x.dtype, FP8) and weight.stride(-1) == 1)


def row_scale(proj: nn.Module) -> torch.Tensor | None:
    """An FP8 projection's scales (Fp8Linear's weight_scale): per row `[N]`, or per block `[N / bn,
    K / bk]`; None for any other projection."""
    scale = getattr(proj, "weight_scale", None)
    if scale is None:
        return None
    return scale if getattr(proj, "block", None) is not None else scale.view(-1)


def norm_linear(x: torch.Tensor, norm, proj: nn.Linear) -> torch.Tensor:
    """proj(norm(x)) for an RMSNorm `norm` (weight, eps)."""
    if applies(x, proj.weight):
        return torch.ops.flexsgl.gemv(x, proj.weight, proj.bias, None, norm.weight, norm.eps, RMS_NORM, row_scale(proj))
    return proj(norm(x))


def linear(x: torch.Tensor, proj: nn.Linear, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + proj(x) (proj(x) alone for residual None)."""
    if applies(x, proj.weight):
        return torch.ops.flexsgl.gemv(x, proj.weight, proj.bias, residual, None, 0.0, PLAIN, row_scale(proj))
    return with_residual(proj, x, residual)


def silu_linear(gate_up: torch.Tensor, proj: nn.Linear, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + proj(silu(gate) * up), gate and up the two halves of gate_up's last dimension
    (without the residual for None)."""
    if applies(gate_up, proj.weight):
        return torch.ops.flexsgl.gemv(gate_up, proj.weight, proj.bias, residual, None, 0.0, SILU_GATE,
                                      row_scale(proj))
    gate, up = gate_up.chunk(2, dim=-1)
    return with_residual(proj, F.silu(gate) * up, residual)


def with_residual(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + proj(x) (proj(x) for None), the add inside proj's product where it takes one
    (`adds_residual`: Fp8Linear)."""
    if residual is None:
        return proj(x)
    return proj(x, residual) if getattr(proj, "adds_residual", False) else residual + proj(x)
