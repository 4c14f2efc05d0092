"""What `flexsgl bench` prints and writes: one table with a column per backend, and the JSON report."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, fields
from pathlib import Path


def command_line(args) -> str:
    """The `flexsgl bench` command that gives these arguments (options left at their default omitted)."""
    own = {k: v for k, v in asdict(args).items() if k != "engine"}
    return shlex.join(["flexsgl", "bench", *_flags(own, type(args)()), *engine_flags(args.engine)])


def engine_flags(engine, skip: tuple[str, ...] = ("override",)) -> list[str]:
    """The command-line flags that give `engine` (options left at their default omitted)."""
    from flexsgl.config import EngineConfig

    return _flags({f.name: getattr(engine, f.name) for f in fields(engine) if f.name not in skip}, EngineConfig())


def _flags(values: dict, default) -> list[str]:
    words = []
    for name, value in values.items():
        if value == getattr(default, name):
            continue
        flag = "--" + name.replace("_", "-")
        if name == "overrides":
            words += [w for o in value for w in ("--override", o)]
        elif isinstance(value, bool):
            words.append(flag if value or name == "disable_cuda_graph" else flag.replace("--", "--no-", 1))
        else:
            words += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return words


def resolved(p) -> dict:
    """The workload's sizes after defaults were applied."""
    if p.args.workload == "throughput":
        return {"num_prompts": p.num_prompts, "input_len": list(p.input_range), "output_len": list(p.output_range)}
    if p.args.workload == "serve":
        return {"num_prompts": p.num_prompts, "input_len": list(p.input_range), "output_len": list(p.output_range),
                "request_rate": ",".join(map(str, p.request_rates)), "max_concurrency": p.args.max_concurrency,
                "dataset_path": p.args.dataset_path, "structured": p.args.structured}
    if p.args.workload == "latency":
        return {"batch_size": p.batch_size, "input_len": p.input_range[0], "output_len": p.output_range[0],
                "repeats": p.repeats}
    return {"input_len": p.prefill_lens, "repeats": p.repeats}


def table_rows(workload: str, res: dict) -> list[tuple[str, float]]:
    """(label, value) rows of one backend's result, in display units."""
    if workload == "throughput":
        keys = [("output tok/s", "output_tokens_per_s", 1), ("total tok/s", "total_tokens_per_s", 1),
                ("requests/s", "requests_per_s", 1), ("wall s", "wall_s", 1), ("output tokens", "output_tokens", 1),
                ("prefix-cache hit tokens", "cached_tokens", 1)]
    elif workload == "serve":
        keys = [("output tok/s", "output_tokens_per_s", 1), ("total tok/s", "total_tokens_per_s", 1),
                ("requests/s", "requests_per_s", 1), ("wall s", "wall_s", 1)]
        keys += [(f"{name} ms p{q}", f"{key}_p{q}_s", 1e3) for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"),
                                                                             ("ITL", "itl")) for q in (50, 90, 99)]
    elif workload == "latency":
        keys = [("TTFT ms", "ttft_s", 1e3), ("TPOT ms", "tpot_s", 1e3), ("tok/s", "tokens_per_s", 1),
                ("decode tok/s", "decode_tokens_per_s", 1), ("floor TPOT ms", "floor_tpot_s", 1e3),
                ("% of decode floor", "pct_of_floor", 1)]
    else:  # prefill: two rows per prompt length
        keys = []
    rows = [(label, res[key] * scale) for label, key, scale in keys]
    rows += [row for r in res.get("prefill", []) for row in ((f"TTFT ms @ {r['input_len']}", r["ttft_s"] * 1e3),
                                                             (f"prefill tok/s @ {r['input_len']}", r["tokens_per_s"]))]
    if workload == "serve":  # the engine starts in the server's process: start to healthy
        return rows + [("server start-up s", res["startup_s"])]
    return rows + [(label, res[key]) for label, key in STARTUP_ROWS]


# Start-up figures, the same rows under every offline workload: the engine's construction and the
# phases that add up to it (LLM.startup_times: resolving the options, the weights, the tokenizer,
# the KV pool, capturing CUDA graphs, the rest), and all compiling of the run (in capture and
# warm-up passes).
STARTUP_ROWS = [("start-up s", "startup_s"), ("of it resolving s", "resolve_s"), ("of it weights s", "load_s"),
                ("of it tokenizer s", "tokenizer_s"), ("of it KV pool s", "kv_pool_s"),
                ("of it graph capture s", "capture_s"), ("of it other s", "other_s"), ("compile s (all)", "compile_s")]


def column_name(res: dict) -> str:
    """A result's name in the table: its backends, and for the serve workload the request rate."""
    rate = res.get("request_rate")
    return res["backends"] + (f" @ {rate}/s" if rate is not None else "")


def format_table(report: dict) -> str:
    """One column per backend; from the second on, each value also shows its ratio to the first's."""
    w, results = report["workload"], report["results"]
    names, seen = [], {}
    for r in results:
        name = column_name(r)
        seen[name] = seen.get(name, 0) + 1
        names.append(name + (f" #{seen[name]}" if seen[name] > 1 else ""))
    per = [table_rows(w, r) for r in results]
    lines = [[""] + names]
    for i, (label, base) in enumerate(per[0]):
        cells = [label, number(base)]
        for rows in per[1:]:
            v = rows[i][1]
            cells.append(number(v) + (f" ({v / base:.2f}x)" if base else ""))
        lines.append(cells)
    widths = [max(len(line[c]) for line in lines) for c in range(len(lines[0]))]
    tp = report.get("tensor_parallel_size", 1)
    ranks = f" x {tp} tensor-parallel ranks (floor per rank)" if tp > 1 else ""
    out = [f"{w}: {report['model']} ({report['load_format']}) on {report['device']}{ranks}"
           f" ({report['environment']['gpu'] or report['environment']['cpu']}), "
           f"copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e9:,.1f} GB/s"]
    for line in lines:
        out.append("  ".join([line[0].ljust(widths[0])] + [c.rjust(wd) for c, wd in zip(line[1:], widths[1:])]))
    return "\n".join(out)


def number(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 or float(v).is_integer() else f"{v:,.3g}" if abs(v) < 1 else f"{v:,.2f}"


def write_json(report: dict, path: str) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
