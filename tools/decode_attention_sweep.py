"""Decode attention kernels and their options at the throughput workload's shapes: which reads the
paged KV fastest. Decode attention is ~74% of a Qwen3-0.6B decode step at batch 256
(docs/BENCHMARKS.md), so this is where the throughput workload's time is.

Each case is one layer's decode over a pool laid out as the engine lays it out (`[pages, page_size,
Hkv, D]`, pages shuffled, ragged lengths around the given context). Variants:
  fi-tc           FlashInfer decode on tensor cores (what fi-decode runs for GQA)
  fi-tc-nosplit   the same, split-KV disabled
  fi-tc-fa3       the same on FlashInfer's Hopper (fa3) prefill backend
  fi-cuda         FlashInfer's CUDA-core decode kernel
  fa3             sgl_kernel FA3 flash_attn_with_kvcache, splits chosen by FA3
  fa3-1split      the same, one split
  triton          flexsgl's split-KV kernel (overrides/triton_decode.py), merge in the same launch;
                  triton-1x/-4x: one or four programs per SM; -w2/-w8: warps; -s3: pipeline stages
Each output is checked against fi-tc's (they compute the same attention). Rate = KV bytes / time.

    python tools/decode_attention_sweep.py
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from flexsgl.cache.pool import DUMMY_PAGE
from flexsgl.overrides.flashinfer import csr_pages
from flexsgl.overrides.triton_decode import split_kv_decode

CASES = [(256, 760), (128, 1100), (64, 1500), (16, 1800), (1, 1152)]  # batch x mean context
HEADS = [(16, 8), (32, 8)]  # Qwen3-0.6B, Qwen3-8B
D, PAGE, DTYPE = 128, 64, torch.bfloat16


def layout(bs: int, ctx: int, hkv: int, rng: random.Random):
    lens = [max(1, int(ctx * rng.uniform(0.5, 1.5))) for _ in range(bs)]
    counts = [math.ceil(n / PAGE) for n in lens]
    pages = list(range(1, sum(counts) + 1))
    rng.shuffle(pages)
    tables, at = [], 0
    for c in counts:
        tables.append(pages[at:at + c])
        at += c
    k = torch.randn(sum(counts) + 1, PAGE, hkv, D, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    return lens, tables, k, v


def flashinfer_variant(lens, tables, k, v, q, hq, hkv, tensor_cores=True, backend="auto", **plan_opts):
    import flashinfer

    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores, backend=backend)
    indptr, last, indices = csr_pages(lens, tables, PAGE)  # the engine's page list
    indptr, last = (torch.tensor(x, dtype=torch.int32) for x in (indptr, last))  # host, as the engine plans
    indices = torch.tensor(indices, dtype=torch.int32, device="cuda")
    w.plan(indptr, indices, last, hq, hkv, D, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE, **plan_opts)
    return lambda: w.run(q, (k, v))


def device_table(lens, tables):
    """The page table `[B, W]` (padded with the dummy page) and KV lengths as the engine hands them to
    kernels that read the table directly (FA3, triton-decode)."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [DUMMY_PAGE] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    return table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def fa3_variant(lens, tables, k, v, q, hq, hkv, num_splits=0):
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    table, seqlens = device_table(lens, tables)
    q4 = q.unsqueeze(1)
    return lambda: flash_attn_with_kvcache(q4, k, v, cache_seqlens=seqlens, page_table=table, causal=True,
                                           num_splits=num_splits).squeeze(1)


def triton_variant(lens, tables, k, v, q, hq, hkv, **options):
    """options: PROGRAMS_PER_SM, MAX_SPLITS (module settings) or num_warps, num_stages (its LAUNCH)."""
    from flexsgl.overrides import triton_decode as td

    table, seqlens = device_table(lens, tables)
    counter = torch.zeros(len(lens) * hkv, dtype=torch.int32, device="cuda")
    kf, vf = k.view(-1, hkv, D), v.view(-1, hkv, D)
    defaults = {"PROGRAMS_PER_SM": td.PROGRAMS_PER_SM, "MAX_SPLITS": td.MAX_SPLITS, "LAUNCH": td.LAUNCH}

    def run():
        launch = {**defaults["LAUNCH"], **{o: options[o] for o in ("num_warps", "num_stages") if o in options}}
        for name in ("PROGRAMS_PER_SM", "MAX_SPLITS"):
            setattr(td, name, options.get(name, defaults[name]))
        td.LAUNCH = launch
        try:
            return split_kv_decode(q, kf, vf, table, seqlens, counter, PAGE)
        finally:
            for name, value in defaults.items():
                setattr(td, name, value)

    return run


VARIANTS = {
    "fi-tc": lambda *a: flashinfer_variant(*a),
    "fi-tc-nosplit": lambda *a: flashinfer_variant(*a, disable_split_kv=True),
    "fi-tc-fa3": lambda *a: flashinfer_variant(*a, backend="fa3"),
    "fi-cuda": lambda *a: flashinfer_variant(*a, tensor_cores=False),
    "fa3": lambda *a: fa3_variant(*a),
    "fa3-1split": lambda *a: fa3_variant(*a, num_splits=1),
    "triton": triton_variant,
    "triton-1x": lambda *a: triton_variant(*a, PROGRAMS_PER_SM=1),
    "triton-4x": lambda *a: triton_variant(*a, PROGRAMS_PER_SM=4),
    "triton-w2": lambda *a: triton_variant(*a, num_warps=2),
    "triton-w8": lambda *a: triton_variant(*a, num_warps=8),
    "triton-s3": lambda *a: triton_variant(*a, num_stages=3),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--cases", nargs="+", default=[f"{b}x{c}" for b, c in CASES], help="BATCHxCONTEXT ...")
    ap.add_argument("--graph", action="store_true",
                    help="time each call replayed from a CUDA graph (no launch overhead: what a graphed decode step sees)")
    args = ap.parse_args()
    from triton.testing import do_bench, do_bench_cudagraph

    def timed(fn):
        if args.graph:
            return do_bench_cudagraph(fn, rep=50, return_mode="median")
        return do_bench(fn, warmup=10, rep=50, return_mode="median")

    rng = random.Random(0)
    print(f"{'heads':>6} {'batch':>5} {'ctx':>5} " + " ".join(f"{v:>14}" for v in args.variants) + "   (µs, TB/s)")
    for hq, hkv in HEADS:
        for bs, ctx in (map(int, c.split("x")) for c in args.cases):
            lens, tables, k, v = layout(bs, ctx, hkv, rng)
            q = torch.randn(bs, hq, D, dtype=DTYPE, device="cuda")
            nbytes = sum(lens) * hkv * D * 2 * 2
            ref, cells = None, []
            for name in args.variants:
                try:
                    fn = VARIANTS[name](lens, tables, k, v, q, hq, hkv)
                    out = fn()
                    ref = out if ref is None else ref
                    if (out.float() - ref.float()).abs().max().item() > 2e-2:
                        cells.append("WRONG")
                        continue
                    t = timed(fn) * 1e-3
                    cells.append(f"{t * 1e6:6.1f} {nbytes / t / 1e12:4.2f}")
                except Exception as e:  # an option this version or GPU lacks
                    cells.append(type(e).__name__[:14])
            print(f"{hq}/{hkv:<3} {bs:>5} {ctx:>5} " + " ".join(f"{c:>14}" for c in cells), flush=True)
            del k, v


if __name__ == "__main__":
    main()
