"""Bandwidth of a model's projections at decode batch 1: cuBLAS (F.linear) against flexsgl's Triton
matrix-vector kernel (flexsgl/kernels/gemv.py) over a sweep of its tile configurations.

At batch 1 a projection reads its weight once and does two flops per weight, so the figure that
matters is weight bytes over time. Two timings:
- per projection, alone (triton's do_bench, which clears L2 between runs): every config, best kept;
- a whole model's projections replayed from one CUDA graph, as a decode step runs them (one
  weight set per layer, so nothing comes from L2), with cuBLAS and with the chosen configs.

    python tools/gemv_bench.py --model qwen3-8b
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from flexsgl.model.config import ModelConfig
from flexsgl.model.presets import PRESETS
from flexsgl.kernels import gemv

SWEEP = {"block_n": (4, 8, 16, 32), "block_k": (256, 512, 1024), "warps": (4, 8), "stages": (1, 3)}
# tiles tried per projection inside the chained, PDL-launched layer (--chain-sweep)
CHAIN_CANDIDATES = [(8, 512, 4, 1), (8, 512, 4, 2), (8, 512, 4, 3), (16, 512, 4, 2), (16, 512, 4, 3),
                    (8, 512, 8, 1), (8, 1024, 8, 2), (4, 512, 4, 3), (16, 256, 4, 3), (32, 256, 8, 2)]


def shapes(cfg) -> dict[str, tuple[int, int]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv_proj": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o_proj": (h, cfg.num_heads * d),
            "gate_up_proj": (2 * cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, h)}


def rel_err(out, x, w):
    ref = x.double() @ w.double().T
    return ((out.double() - ref).norm() / ref.norm()).item()


def graph_time(fn, reps: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph of fn."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--no-sweep", action="store_true", help="skip the per-projection config sweep")
    ap.add_argument("--chain-sweep", action="store_true",
                    help="try CHAIN_CANDIDATES for each projection in the chained PDL layer")
    args = ap.parse_args()
    from triton.testing import do_bench

    cfg = ModelConfig.from_hf(PRESETS[args.model]["config"])
    dev, dt = torch.device("cuda"), torch.bfloat16
    sweep = [c for c in itertools.product(*SWEEP.values()) if c[0] * c[1] <= 16384]
    best_cfg = {}
    print(f"{'proj':<13} {'N x K':>13} {'M':>2} {'cuBLAS us':>9} {'TB/s':>5} {'triton us':>9} {'TB/s':>5} "
          f"{'best (BN, BK, warps, stages)':>28} {'rel err':>8}", flush=True)
    for name, (n, k) in shapes(cfg).items() if not args.no_sweep else ():
        w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
        nbytes = n * k * 2
        for m in (1,):
            x = torch.randn(m, k, device=dev, dtype=dt)
            out = torch.empty(m, n, device=dev, dtype=dt)
            t_cublas = do_bench(lambda: F.linear(x, w), return_mode="median") * 1e-3
            results = []
            for c in sweep:
                try:
                    t = do_bench(lambda: gemv.launch(x, w, None, out, c), warmup=5, rep=20, return_mode="median")
                except Exception as e:  # a config the compiler refuses (too many registers, ...)
                    print(f"   {c}: {type(e).__name__}", flush=True)
                    continue
                results.append((t * 1e-3, c))
            t_best, c_best = min(results)
            out.fill_(float("nan"))
            gemv.launch(x, w, None, out, c_best)
            best_cfg[(name, m)] = c_best
            print(f"{name:<13} {f'{n}x{k}':>13} {m:>2} {t_cublas * 1e6:>9.1f} {nbytes / t_cublas / 1e12:>5.2f} "
                  f"{t_best * 1e6:>9.1f} {nbytes / t_best / 1e12:>5.2f} {str(c_best):>28} {rel_err(out, x, w):>8.1e}",
                  flush=True)
            top = sorted(results)[:5]
            print("      next best: " + ", ".join(f"{c} {nbytes / t / 1e12:.2f}" for t, c in top[1:]), flush=True)
        del w
    # A whole step's projections from one graph: every layer its own weights.
    layers = [{name: torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for name, (n, k) in shapes(cfg).items()
               if name != "lm_head"} for _ in range(cfg.num_layers)]
    total = sum(w.numel() * 2 for layer in layers for w in layer.values())
    print(f"\n{cfg.num_layers} layers' projections from one CUDA graph ({total / 1e9:.2f} GB of weights):")
    for m in (1,):
        xs = {name: torch.randn(m, k, device=dev, dtype=dt) for name, (n, k) in shapes(cfg).items()}
        outs = {name: torch.empty(m, n, device=dev, dtype=dt) for name, (n, k) in shapes(cfg).items()}

        def cublas():
            for layer in layers:
                for name, w in layer.items():
                    torch.matmul(xs[name], w.T, out=outs[name])

        def triton_kernel(default=False):
            for layer in layers:
                for name, w in layer.items():
                    gemv.launch(xs[name], w, None, outs[name], None if default else best_cfg[(name, m)])

        runs = [("cuBLAS", cublas)]
        if best_cfg:
            runs.append(("triton, best configs", triton_kernel))
        runs.append(("triton, engine's configs", lambda: triton_kernel(True)))
        for label, fn in runs:
            t = graph_time(fn)
            print(f"  M={m} {label:<26} {t * 1e3:7.3f} ms  {total / t / 1e12:5.2f} TB/s", flush=True)
    # As a layer runs them at batch 1: each projection reads the one before's output, with the
    # norms, the SiLU gate and the residual adds folded in; launched plainly and with PDL.
    print("\nthe same projections as a chain (norm -> qkv -> o + residual -> norm -> gate_up -> down + residual):")
    h, q_width = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    g = torch.rand(h, device=dev, dtype=dt) + 0.5
    x0 = torch.randn(1, h, device=dev, dtype=dt)
    bufs = {name: torch.empty(1, n, device=dev, dtype=dt) for name, (n, k) in shapes(cfg).items()}
    hs = [torch.empty(1, h, device=dev, dtype=dt) for _ in range(2)]

    def chain(use_pdl, cfgs=None):
        c = (cfgs or {}).get
        x = x0
        for layer in layers:
            qkv = gemv.launch(x, layer["qkv_proj"], None, bufs["qkv_proj"], c("qkv_proj"), norm_weight=g, eps=1e-6,
                              prologue=gemv.RMS_NORM, use_pdl=use_pdl)
            mid = gemv.launch(qkv[:, :q_width], layer["o_proj"], None, hs[0], c("o_proj"), residual=x,
                              use_pdl=use_pdl)
            gu = gemv.launch(mid, layer["gate_up_proj"], None, bufs["gate_up_proj"], c("gate_up_proj"), norm_weight=g,
                             eps=1e-6, prologue=gemv.RMS_NORM, use_pdl=use_pdl)
            x = gemv.launch(gu, layer["down_proj"], None, hs[1], c("down_proj"), residual=mid,
                            prologue=gemv.SILU_GATE, use_pdl=use_pdl)

    plain = None
    for label, use_pdl in (("plain launches", False), ("PDL", True)):
        t = graph_time(lambda: chain(use_pdl))
        out = hs[1].clone()
        same = "" if plain is None else f"  output equal to plain: {torch.equal(out, plain)}"
        plain = out if plain is None else plain
        print(f"  {label:<26} {t * 1e3:7.3f} ms  {total / t / 1e12:5.2f} TB/s{same}", flush=True)
    if args.chain_sweep:  # one projection's tile at a time in the PDL chain, the others the engine's
        best = {}
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            n, k = shapes(cfg)[name]
            times = []
            for c in dict.fromkeys([gemv.config_for(n, k), *CHAIN_CANDIDATES]):
                try:
                    times.append((graph_time(lambda: chain(True, {name: c})), c))
                except Exception as e:  # a config the compiler refuses
                    print(f"   {name} {c}: {type(e).__name__}", flush=True)
            best[name] = min(times)[1]
            print(f"  {name:<13} " + ", ".join(f"{c} {t * 1e3:.3f}" for t, c in sorted(times)[:4]), flush=True)
        t = graph_time(lambda: chain(True, best))
        print(f"  {'PDL, best of each':<26} {t * 1e3:7.3f} ms  {total / t / 1e12:5.2f} TB/s  {best}", flush=True)


if __name__ == "__main__":
    main()
