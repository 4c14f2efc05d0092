"""The table of `tools/gpu.sh tp-bench`: reads its JSON reports (tp-bench-<part>-tp<N>.json in the
folder given) and prints, per model and tensor-parallel size, batch-1 TPOT against the decode floor
per rank, TTFT of a 4k prompt and default-workload throughput, each with its ratio to TP=1.

    python tools/tp_bench_table.py $OUT
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def load(folder: Path) -> dict:
    """{(part, tp): the report's first result, with the run's device}."""
    found = {}
    for f in sorted(folder.glob("tp-bench-*-tp*.json")):
        m = re.fullmatch(r"tp-bench-(\w+)-tp(\d+)\.json", f.name)
        if m:
            report = json.loads(f.read_text())
            found[m[1], int(m[2])] = report["results"][0]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("folder", help="where tools/gpu.sh tp-bench wrote tp-bench-<part>-tp<N>.json")
    folder = Path(ap.parse_args().folder)
    runs = load(folder) if folder.is_dir() else None
    if not runs:
        ap.error(f"{str(folder)!r} holds no tp-bench-<part>-tp<N>.json report")
    sizes = sorted({tp for _, tp in runs})
    print("TP bench (Qwen3-8B dummy; llama3-70b dummy at batch 1; ratio to TP=1 in brackets)")
    print(f"{'':<26}" + "".join(f"{'TP=' + str(tp):>18}" for tp in sizes))

    def row(label, part, get, better_low):
        base = runs.get((part, 1))
        cells = []
        for tp in sizes:
            r = runs.get((part, tp))
            if r is None:
                cells.append(f"{'-':>18}")
                continue
            v = get(r)
            ratio = ""
            if base is not None and tp != 1:
                b = get(base)
                ratio = f" ({b / v:.2f}x)" if better_low else f" ({v / b:.2f}x)"
            cells.append(f"{v:>10.2f}{ratio:<8}")
        print(f"{label:<26}" + "".join(cells))

    row("8B TPOT ms", "latency", lambda r: r["tpot_s"] * 1e3, True)
    row("8B floor TPOT ms per rank", "latency", lambda r: r["floor_tpot_s"] * 1e3, True)
    row("8B % of floor", "latency", lambda r: r["pct_of_floor"], False)
    row("8B TTFT ms, 512 in", "latency", lambda r: r["ttft_s"] * 1e3, True)
    row("8B TTFT ms, 4k prompt", "prefill", lambda r: r["prefill"][0]["ttft_s"] * 1e3, True)
    row("8B output tok/s", "throughput", lambda r: r["output_tokens_per_s"], False)
    row("70B TPOT ms", "70b", lambda r: r["tpot_s"] * 1e3, True)
    row("70B floor TPOT ms per rank", "70b", lambda r: r["floor_tpot_s"] * 1e3, True)
    row("70B % of floor", "70b", lambda r: r["pct_of_floor"], False)
    row("70B KV cache tokens", "70b", lambda r: float(r["kv_cache_tokens"]), False)


if __name__ == "__main__":
    main()
