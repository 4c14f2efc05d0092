"""Tune and check flexsgl's batch-1 matrix-vector kernel (flexsgl/kernels/gemv.py) on a model's shapes.

At batch 1 a projection reads its weight once and does two flops per weight, so the figure that
matters is weight bytes over time. Every timing replays a whole decode step's projections from
one CUDA graph, each layer with its own weights (so nothing comes from L2):
- the projections one after another: cuBLAS against the kernel with the engine's tiles;
- chained as a layer runs them (norm, qkv, o + residual, norm, gate_up, SiLU gate, down +
  residual), launched plainly and with PDL (the outputs must be equal);
- with --chain-sweep, each projection's tile varied in the PDL chain, the others the engine's:
  `gemv.config_for` returns these winners (tiles chosen with a projection timed alone, L2 cleared,
  were not the ones that win in the chain);
- with --fp8, the same projections with FP8 weights (a float32 scale per row): the kernel reading
  them with the engine's tiles and with each of FP8_CANDIDATES, against torch._scaled_mm at one row
  (what Fp8Linear runs beyond batch 1: x quantized per token), in TB/s of FP8 bytes.

    python tools/gemv_bench.py --model qwen3-8b --chain-sweep
    python tools/gemv_bench.py --model qwen3-8b --fp8
"""

from __future__ import annotations


import torch

from flexsgl.bench.cuda_timing import graph_median_s
from flexsgl.kernels import gemv
from flexsgl.model.config import ModelConfig
from flexsgl.model.presets import PRESETS
from flexsgl.tool_args import need_gpus, parser, preset

# tiles (BLOCK_N, BLOCK_K, warps, stages) tried per projection inside the chained, PDL-launched layer
CHAIN_CANDIDATES = [(8, 512, 4, 1), (8, 512, 4, 2), (8, 512, 4, 3), (16, 512, 4, 2), (16, 512, 4, 3),
                    (8, 512, 8, 1), (8, 1024, 8, 2), (4, 512, 4, 3), (16, 256, 4, 3), (32, 256, 8, 2)]
# tiles tried for FP8 weights, all projections at once (BLOCK_K in FP8 elements, a byte each)
FP8_CANDIDATES = [(4, 1024, 4, 3), (8, 1024, 4, 3), (16, 1024, 8, 3), (8, 2048, 8, 2), (8, 2048, 8, 3),
                  (4, 2048, 8, 2), (4, 2048, 4, 2), (16, 2048, 8, 2), (8, 4096, 8, 2), (4, 4096, 8, 2),
                  (16, 1024, 4, 2), (16, 2048, 8, 3), (32, 1024, 8, 2), (32, 2048, 8, 2), (16, 4096, 16, 2)]


def shapes(cfg) -> dict[str, tuple[int, int]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv_proj": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o_proj": (h, cfg.num_heads * d),
            "gate_up_proj": (2 * cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, h)}


def main():
    ap = parser(__doc__)
    ap.add_argument("--model", type=preset, default="qwen3-8b")
    ap.add_argument("--chain-sweep", action="store_true",
                    help="try CHAIN_CANDIDATES for each projection in the chained PDL layer")
    ap.add_argument("--fp8", action="store_true", help="also time FP8 weights (module docstring)")
    args = ap.parse_args()
    need_gpus("gemv_bench")
    cfg = ModelConfig.from_hf(PRESETS[args.model]["config"])
    dev, dt = torch.device("cuda"), torch.bfloat16
    # A whole step's projections from one graph: every layer its own weights.
    layers = [{name: torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for name, (n, k) in shapes(cfg).items()
               if name != "lm_head"} for _ in range(cfg.num_layers)]
    total = sum(w.numel() * 2 for layer in layers for w in layer.values())
    print(f"{cfg.num_layers} layers' projections from one CUDA graph ({total / 1e9:.2f} GB of weights):")
    xs = {name: torch.randn(1, k, device=dev, dtype=dt) for name, (n, k) in shapes(cfg).items()}
    outs = {name: torch.empty(1, n, device=dev, dtype=dt) for name, (n, k) in shapes(cfg).items()}

    def each(project):
        for layer in layers:
            for name, w in layer.items():
                project(xs[name], w, outs[name])

    for label, project in (("cuBLAS", lambda x, w, out: torch.matmul(x, w.T, out=out)),
                           ("kernel, engine's tiles", lambda x, w, out: gemv.launch(x, w, None, out, None))):
        t = graph_median_s(lambda: each(project))
        print(f"  {label:<26} {t * 1e3:7.3f} ms  {total / t / 1e12:5.2f} TB/s", flush=True)
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
        t = graph_median_s(lambda: chain(use_pdl))
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
                    times.append((graph_median_s(lambda: chain(True, {name: c})), c))
                except Exception as e:  # a config the compiler refuses
                    print(f"   {name} {c}: {type(e).__name__}", flush=True)
            best[name] = min(times)[1]
            print(f"  {name:<13} " + ", ".join(f"{c} {t * 1e3:.3f}" for t, c in sorted(times)[:4]), flush=True)
        t = graph_median_s(lambda: chain(True, best))
        print(f"  {'PDL, best of each':<26} {t * 1e3:7.3f} ms  {total / t / 1e12:5.2f} TB/s  {best}", flush=True)
    if args.fp8:
        fp8_section(layers, xs, outs)


def fp8_section(layers, xs, outs):
    """The projections with FP8 weights: the kernel against torch._scaled_mm at one row."""
    from flexsgl.quant.fp8 import quantize_rows, quantize_tokens

    quantized = [{name: quantize_rows(w) for name, w in layer.items()} for layer in layers]
    for layer in layers:  # only the FP8 copies stay on the device
        layer.clear()
    total = sum(w.numel() for layer in quantized for w, _ in layer.values())
    scales = [{name: s.view(-1) for name, (_, s) in layer.items()} for layer in quantized]
    print(f"\nFP8 weights ({total / 1e9:.2f} GB), the projections one after another:")

    def kernel(config=None):
        for layer, row_scales in zip(quantized, scales):
            for name, (w, _) in layer.items():
                gemv.launch(xs[name], w, None, outs[name], config, scale=row_scales[name])

    def scaled_mm():
        for layer in quantized:
            for name, (w, s) in layer.items():
                xq, x_scale = quantize_tokens(xs[name])
                torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)

    rows = [("torch._scaled_mm", scaled_mm), ("kernel, engine's tiles", kernel)]
    rows += [(f"kernel {c}", lambda c=c: kernel(c)) for c in FP8_CANDIDATES]
    for label, run in rows:
        try:
            t = graph_median_s(run)
        except Exception as e:  # a config the compiler refuses
            print(f"  {label:<26} {type(e).__name__}", flush=True)
            continue
        print(f"  {label:<26} {t * 1e3:7.3f} ms  {total / t / 1e12:5.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
