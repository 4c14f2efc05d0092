"""Sweeps flex decode's kernel options (KV splits, warps, stages) on the kernel matrix's paged decode
batches, FlashInfer's decode beside each (CUDA GPU; FlashInfer installed or staged).

    python tools/decode_sweep.py --page 16 --batches 8,96,128 --splits 2,4,8 --warps 2 --stages 3

Every (batch, context, GQA) cell is built as benchmarks/attention_matrix.py builds it (random K/V,
shuffled pages) and timed the same way (calls captured in one CUDA graph, the median of the
replays). For each option set the flex_decode op's options are replaced, and the op compiles a
function of its own for them; `default` is what flexsgl chooses (flexsgl/attention/flex_options.py,
decode_options). Each line gives µs, the ratio to fi-decode and the largest error against float64 on
sampled rows; --json appends a line per cell. Times of a few µs vary from compile to compile by
Inductor's autotuned split-combining kernels (docs/BENCHMARKS.md, "H200: attention kernels"):
compare small cells over several runs.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_matrix import (  # noqa: E402
    CHECK_ROWS, INNER, KV_HEADS, ROUNDS, attend_fn, gathered, paged_batch, reference_rows)
from flexsgl.attention import flex_ops  # noqa: E402
from flexsgl.bench.cuda_timing import graph_median_s  # noqa: E402
from flexsgl.tool_args import need_gpus, parser, positive_int, positive_ints  # noqa: E402

D = 128


def option_sets(page: int, splits, warps, stages) -> list[tuple[str, dict]]:
    tile = min(page, 64)
    return [(f"splits {s}, {w} warps, {st} stages", {"num_warps": w, "num_stages": st, "BLOCK_N": tile, "SPLIT_KV": s})
            for s, w, st in itertools.product(splits, warps, stages)]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--page", type=positive_int, default=16)
    ap.add_argument("--batches", type=positive_ints, default="8,32,128")
    ap.add_argument("--contexts", type=positive_ints, default="1024,4096,16384")
    ap.add_argument("--gqa", type=positive_ints, default="4")
    ap.add_argument("--splits", type=positive_ints, default="2,4,8")
    ap.add_argument("--warps", type=positive_ints, default="2")
    ap.add_argument("--stages", type=positive_ints, default="3")
    ap.add_argument("--json", default=None, help="append one JSON line per cell to this file")
    a = ap.parse_args()
    need_gpus("decode_sweep")
    chosen = flex_ops.decode_options
    sets = option_sets(a.page, a.splits, a.warps, a.stages)
    for bs, ctx, gqa in itertools.product(a.batches, a.contexts, a.gqa):
        hq = KV_HEADS * gqa
        with torch.inference_mode():
            specs = [(ctx - 1, 1)] * bs
            pool, fb, q, tables = paged_batch(specs, a.page, hq)
            rows = torch.randperm(bs, generator=torch.Generator().manual_seed(0))[:CHECK_ROWS].sort().values
            ref = reference_rows(q, gathered(pool, tables, fb.host_seq_lens), specs, rows.tolist())
            fi = graph_median_s(attend_fn("fi-decode", pool, fb, q, hq, None), INNER["decode"], ROUNDS) * 1e6
            cell = {"page": a.page, "batch": bs, "context": ctx, "gqa": gqa, "fi_us": fi, "flex_us": {}}
            for name, options in [("default", chosen(bs, KV_HEADS, a.page, D)), *sets]:
                flex_ops.decode_options = lambda *_, o=options: o  # the op compiles a function per option set
                try:
                    fn = attend_fn("flex", pool, fb, q, hq, None)
                    err = (fn()[rows.cuda()].double() - ref).abs().max().item()
                    us = graph_median_s(fn, INNER["decode"], ROUNDS) * 1e6
                except Exception as e:  # noqa: BLE001 - an option set the kernel refuses must not end the sweep
                    print(f"{bs}x{ctx} gqa {gqa} {name}: failed, {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                finally:
                    flex_ops.decode_options = chosen
                cell["flex_us"][name] = us
                print(f"{bs}x{ctx} gqa {gqa} page {a.page}  {name:28} {us:9.1f} µs  {us / fi:.3f}x fi-decode "
                      f"({fi:.1f})  err {err:.4f}", flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(cell) + "\n")
            del pool, fb, q
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
