"""Bandwidth of the projections of a decode step at small batch: cuBLAS (F.linear) against an
Inductor-generated reduction, for a model's weight shapes.

At batch 1 a projection reads its weight once and does two flops per weight: it is a matrix-vector
product bound by memory, so the figure that matters is weight bytes over time. Weights rotate
through several copies so that no timing reads a weight from L2.

    python tools/gemv_bench.py --model qwen3-8b --batch 1 8
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from flexsgl.config import PRESETS, ModelConfig


def shapes(cfg) -> dict[str, tuple[int, int]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv_proj": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o_proj": (h, cfg.num_heads * d),
            "gate_up_proj": (2 * cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, h)}


def reduction_linear(x, w):
    return (x[:, None, :].float() * w[None].float()).sum(-1).to(x.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--copies", type=int, default=4)
    args = ap.parse_args()
    from triton.testing import do_bench

    cfg = ModelConfig.from_hf(PRESETS[args.model]["config"])
    dev, dt = torch.device("cuda"), torch.bfloat16
    import torch._inductor.config as ic
    ic.coordinate_descent_tuning = True
    red = torch.compile(reduction_linear, dynamic=False)
    print(f"{'proj':<14} {'N x K':>14} {'batch':>5} {'cuBLAS us':>10} {'TB/s':>6} {'inductor us':>11} {'TB/s':>6} {'max err':>8}")
    for name, (n, k) in shapes(cfg).items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(args.copies)]
        nbytes = n * k * 2
        for b in args.batch:
            x = torch.randn(b, k, device=dev, dtype=dt)
            it = iter(range(10**9))
            t_cublas = do_bench(lambda: F.linear(x, ws[next(it) % len(ws)]), return_mode="median") * 1e3
            err = (red(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max().item()
            t_red = do_bench(lambda: red(x, ws[next(it) % len(ws)]), return_mode="median") * 1e3
            print(f"{name:<14} {f'{n}x{k}':>14} {b:>5} {t_cublas:>10.1f} {nbytes / t_cublas / 1e6:>6.2f} "
                  f"{t_red:>11.1f} {nbytes / t_red / 1e6:>6.2f} {err:>8.4f}", flush=True)
        del ws


if __name__ == "__main__":
    main()
