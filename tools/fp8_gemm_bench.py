"""Which FP8 matrix product is fastest for a model's projections, batch size by batch size.

For each projection of the model (qkv, o, gate_up, down) and each number of rows M, times from one
CUDA graph, as the engine runs them (compiled, activations quantized as they come):

- bf16: cuBLAS's bfloat16 product (the unquantized model);
- fp8-row: Fp8Linear with a scale per row (`--quantization fp8`, per-channel checkpoints):
  activations per token, flexsgl's FP8 kernel up to fp8_gemm.MAX_ROWS rows on SM90
  (flexsgl/kernels/fp8_gemm.py), torch._scaled_mm rowwise past them;
- scaled-mm: the same activations and weight, torch._scaled_mm rowwise (cuBLAS) at every M;
- fp8-wonly: the same weight, activations as they are: a Triton weight-only product defined here
  (weight_only_kernel: each FP8 weight tile widened to bfloat16 in registers for tl.dot, float32
  sums, the row scales on the way out), the mixed-input product Fp8Linear lacks;
- fp8-block: Fp8Linear with 128 x 128 block scales (block-wise checkpoints): activations per token
  and group of 128, torch._scaled_mm's block recipe (where `block_gemm_runs` says it runs);
- sgl-row, sgl-block: sgl_kernel's fp8_scaled_mm and fp8_blockwise_scaled_mm on the same operands,
  where sgl_kernel is installed;
- gemv (M = 1): flexsgl's matrix-vector kernel on the FP8 bytes with row scales.

Every output is checked against float32 products of the same FP8 values (within 2% of its largest
magnitude); a product that fails the check or raises is reported instead of timed. The last column
names the fastest FP8 product. The columns replay one weight, which stays in L2 where it fits (a
Qwen3-0.6B's projections on an H200), unlike a model's layers. With --tiles, each projection and M
also times the weight-only kernel over a grid of tiles (TILE_GRID) and prints the three fastest
(fp8-wonly's column: its default tiles), and, where the engine runs it (`fp8_gemm.applies`),
flexsgl's FP8 kernel (kernels/fp8_gemm.py) on every (BLOCK_M, BLOCK_N, BLOCK_K) it can take with
the weight cold, as in a model (copies of it past L2): the tiles `fp8_gemm.tiles` picks and the
three fastest, beside bf16's and torch._scaled_mm's products timed the same way. CUDA only.

    python tools/fp8_gemm_bench.py --model qwen3-8b --rows 1,16,64,256,1024,4096 [--tiles]
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from flexsgl.bench.cuda_timing import graph_median_s  # noqa: E402
from flexsgl.kernels import fp8_gemm, gemv  # noqa: E402
from flexsgl.model.config import ModelConfig  # noqa: E402
from flexsgl.model.presets import PRESETS  # noqa: E402
from flexsgl.quant.fp8 import dequantize, quantize_blocks, quantize_groups, quantize_rows, quantize_tokens  # noqa: E402
from flexsgl.quant.fp8_linear import BLOCK, Fp8Linear, block_gemm_runs  # noqa: E402
from flexsgl.tool_args import need_gpus, parser, positive_ints, preset  # noqa: E402


L2_BYTES = 200_000_000  # weight copies the cold timings rotate through: past any GPU's L2 (an H200's: 50 MB)


def projections(cfg) -> dict[str, tuple[int, int]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv_proj": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o_proj": (h, cfg.num_heads * d),
            "gate_up_proj": (2 * cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size)}


@functools.cache
def weight_only_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
        m_tiles = tl.cdiv(M, BLOCK_M)  # M fastest: the programs that read a weight tile run together
        rows = (tl.program_id(0) % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tl.program_id(0) // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_ok = k + ks < K
            x = tl.load(x_ptr + rows[:, None] * K + k + ks[None, :], mask=(rows < M)[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + cols[:, None] * K + k + ks[None, :], mask=(cols < N)[:, None] & k_ok[None, :],
                        other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        acc *= tl.load(s_ptr + cols, mask=cols < N, other=0.0)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])

    return kernel


def row_tile(m: int) -> int:
    """The weight-only kernel's largest row tile for m rows: m's power of two, 16 at least (the tensor
    cores' M)."""
    return max(16, 1 << (m - 1).bit_length())


def weight_only(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """out = x @ (w8 * scale[:, None]).T for contiguous x `[M, K]` and FP8 w8 `[N, K]`; tiles (BLOCK_M,
    BLOCK_N, BLOCK_K, num_warps, num_stages), by default a row tile of up to 64 rows, 64 x 128 weight tiles."""
    (m, k), n = x.shape, w8.shape[0]
    bm, bn, bk, warps, stages = tiles or (min(row_tile(m), 64), 64, 128, 4, 4)
    weight_only_kernel()[(-(-m // bm) * -(-n // bn),)](x, w8, scale, out, m, n, k, BLOCK_M=bm, BLOCK_N=bn,
                                                         BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def candidates(w: torch.Tensor, block_runs: bool) -> dict[str, tuple]:
    """name -> (product of x, the float32 weight it multiplies by, the activations' rounding)."""
    n, k = w.shape
    row = Fp8Linear(k, n, bias=False).cuda()
    row.weight.data, row.weight_scale.data = quantize_rows(w)
    row_w = dequantize(row.weight, row.weight_scale, "channel")
    tokens = lambda x: (lambda q, s: q.float() * s)(*quantize_tokens(x))  # noqa: E731
    scaled_mm = torch.compile(lambda x: (lambda q, s: torch._scaled_mm(  # noqa: E731
        q, row.weight.t(), scale_a=s, scale_b=row.weight_scale.view(1, -1), out_dtype=x.dtype))(*quantize_tokens(x)),
        dynamic=False)
    out = {"bf16": (lambda x: F.linear(x, w), w.float(), lambda x: x.float()),
           "fp8-row": (torch.compile(row, dynamic=False), row_w, tokens),
           "scaled-mm": (scaled_mm, row_w, tokens),
           "fp8-wonly": (lambda x: weight_only(x, row.weight, row.weight_scale.view(-1), x.new_empty(x.shape[0], n)),
                         row_w, lambda x: x.float())}
    blk = Fp8Linear(k, n, bias=False, block=BLOCK).cuda()
    blk.weight.data, blk.weight_scale.data = quantize_blocks(w, BLOCK)
    blk_w = dequantize(blk.weight, blk.weight_scale, "block", BLOCK)
    groups = lambda x: (lambda q, s: (q.float().view(x.shape[0], -1, 128) * s[..., None]).view(x.shape))(  # noqa: E731
        *quantize_groups(x, 128))
    if block_runs:
        out["fp8-block"] = (torch.compile(blk, dynamic=False), blk_w, groups)
    try:
        import sgl_kernel

        quant_tokens = torch.compile(quantize_tokens, dynamic=False)
        quant_groups = torch.compile(lambda x: quantize_groups(x, 128), dynamic=False)
        out["sgl-row"] = (lambda x: sgl_kernel.fp8_scaled_mm(*(lambda q, s: (q, row.weight.t(), s, row.weight_scale))(
            *quant_tokens(x)), torch.bfloat16), row_w, tokens)
        out["sgl-block"] = (lambda x: sgl_kernel.fp8_blockwise_scaled_mm(*(lambda q, s: (
            q, blk.weight.t(), s.t().contiguous().t(), blk.weight_scale.t()))(*quant_groups(x)), torch.bfloat16),
            blk_w, groups)
    except ImportError:
        pass
    out["gemv"] = (lambda x: gemv.linear(x, row, None), row_w, lambda x: x.float())
    return out


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) the --tiles sweep tries, BLOCK_M up to row_tile(M)
TILE_GRID = [(bm, bn, bk, 4 if bm * bn <= 4096 else 8, 3) for bm in (16, 32, 64, 128) for bn in (32, 64, 128)
             for bk in (128, 256)]


def sweep_tiles(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> str:
    """The weight-only kernel's three fastest tiles for x, "tiles: µs" each."""
    m = x.shape[0]
    out = torch.empty(m, w8.shape[0], device=x.device, dtype=x.dtype)
    times = []
    for config in TILE_GRID:
        if config[0] > row_tile(m):
            continue
        try:
            us = graph_median_s(lambda: weight_only(x, w8, scale, out, config), inner=10) * 1e6
        except Exception as e:  # out of shared memory or registers: not a candidate
            print(f"    {config}: {type(e).__name__}")
            continue
        times.append((us, config))
    return ", ".join(f"{c}: {us:.1f}" for us, c in sorted(times)[:3])


def cold_us(product: Callable[[int], object], copies: int) -> float:
    """Median µs per call of product(i) over i < copies, all in one CUDA graph: each call reads its own
    copy of the weight, as a model's layers do, so none finds its weight in L2."""
    return graph_median_s(lambda: [product(i) for i in range(copies)], rounds=15) * 1e6 / copies


def sweep_fp8_kernel(x: torch.Tensor, w: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> str:
    """flexsgl's FP8 kernel on every (BLOCK_M, BLOCK_N, BLOCK_K) it can take, weights cold (copies
    past L2_BYTES, `cold_us`): its pick's time and the three fastest, beside bf16's and
    torch._scaled_mm's products timed the same way."""
    (m, k), n = x.shape, w8.shape[0]
    copies = max(2, min(48, L2_BYTES // w8.numel()))
    w8s = [(w8.clone(), scale.clone()) for _ in range(copies)]
    ws = [w.clone() for _ in range(max(2, copies // 2))]
    xq, x_scale = quantize_tokens(x)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    times = {}
    for block in [(bm, bn, bk) for bm in (16, 32, 64, 128) if bm <= row_tile(m) for bn in fp8_gemm.WIDTHS
                  if n % bn == 0 for bk in fp8_gemm.DEPTHS if k % bk == 0]:
        try:
            times[block] = cold_us(lambda i: fp8_gemm.launch(xq, x_scale.view(-1), *w8s[i], None, None, out, block),
                                   copies)
        except Exception as e:  # out of shared memory at STAGES deep: not a candidate
            print(f"    {block}: {type(e).__name__}")
    pick = fp8_gemm.tiles(m, n, k, torch.cuda.get_device_properties(x.device).multi_processor_count)
    bf16 = cold_us(lambda i: F.linear(x, ws[i]), len(ws))
    scaled_mm = cold_us(lambda i: torch._scaled_mm(xq, w8s[i][0].t(), scale_a=x_scale, scale_b=w8s[i][1].view(1, -1),
                                                   out_dtype=x.dtype), copies)
    best = ", ".join(f"{b}: {us:.1f}" for b, us in sorted(times.items(), key=lambda t: t[1])[:3])
    picked = times.get(pick, float("nan"))  # nan: the engine's own tiles failed to launch here
    return f"picked {pick}: {picked:.1f}; fastest {best}; bf16 {bf16:.1f}, scaled-mm {scaled_mm:.1f}"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", type=preset, default="qwen3-8b")
    ap.add_argument("--rows", type=positive_ints, default="1,16,64,256,1024,4096", help="numbers of rows (tokens) M")
    ap.add_argument("--tiles", action="store_true",
                    help="sweep the weight-only kernel's tiles (TILE_GRID) and, weights cold, the FP8 kernel's")
    args = ap.parse_args()
    need_gpus("fp8_gemm_bench")
    cfg = ModelConfig.from_hf(PRESETS[args.model]["config"])
    rows = args.rows
    # one compiled Fp8Linear.forward per projection and M: at dynamo's default limit (8) the rest would run eager
    torch._dynamo.config.recompile_limit = 8 * len(rows) * len(projections(cfg))
    block_runs = block_gemm_runs(torch.device("cuda"), torch.bfloat16)
    print(f"{args.model}: microseconds per product (CUDA graph), fp8 against bf16; 128 x 128 blocks "
          f"{'run' if block_runs else 'do not run'} in torch._scaled_mm here")
    for name, (n, k) in projections(cfg).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        products = candidates(w, block_runs)
        w8, w8_scale = quantize_rows(w)
        w8_scale = w8_scale.view(-1)
        print(f"\n{name} [{n}, {k}]")
        print(f"{'M':>6} " + " ".join(f"{p:>12}" for p in products) + "   fastest FP8")
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cells, best = [], None
            for p, (fn, weight, rounded) in products.items():
                if p == "gemv" and m != 1:
                    cells.append(f"{'-':>12}")
                    continue
                try:
                    got = fn(x).float()
                    want = rounded(x) @ weight.T
                    if (got - want).abs().max() > 0.02 * want.abs().max():
                        cells.append(f"{'wrong':>12}")
                        continue
                    us = graph_median_s(lambda: fn(x), inner=10) * 1e6
                except Exception as e:  # a kernel this machine or build lacks: say so, time the rest
                    cells.append(f"{type(e).__name__[:12]:>12}")
                    continue
                cells.append(f"{us:12.1f}")
                if p != "bf16" and (best is None or us < best[1]):
                    best = (p, us)
            print(f"{m:>6} " + " ".join(cells) + f"   {best[0] if best else '-'}", flush=True)
            if args.tiles:
                print(f"       weight-only tiles, fastest: {sweep_tiles(x, w8, w8_scale)}", flush=True)
                if fp8_gemm.applies(x, w8):  # where the engine would run it
                    print(f"       FP8 kernel, weights cold: {sweep_fp8_kernel(x, w, w8, w8_scale)}", flush=True)


if __name__ == "__main__":
    main()
