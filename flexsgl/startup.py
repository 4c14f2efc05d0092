"""Start-up time: seconds since the process started, and the phases an engine's construction
spends them in (`LLM.startup_times`), named so that they add up to the whole (`ready_line`).

Imported first by the flexsgl package, before torch, so that where the operating system does not
say when the process started, the time since flexsgl's import stands in for it.
"""

from __future__ import annotations

import os
import time

IMPORTED_AT = time.perf_counter()

# LLM.startup_times' phases, in the order they run, with their names in the log
PHASES = (("resolve_s", "resolving"), ("load_s", "weights"), ("tokenizer_s", "tokenizer"), ("kv_pool_s", "KV pool"),
          ("capture_s", "CUDA graphs"))


def process_seconds() -> float:
    """Seconds since this process started (Linux: its start time in /proc, to the clock tick);
    elsewhere, since flexsgl was imported."""
    since_import = time.perf_counter() - IMPORTED_AT
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22, after boot
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, since_import)
    except (OSError, ValueError, IndexError, AttributeError):
        return since_import


def ready_line(total_s: float, before_s: float, times: dict[str, float]) -> str:
    """`generate`'s start-up line: `total_s` seconds from the process's start to a ready engine,
    of them `before_s` before the engine's construction began (imports, mostly torch's), then
    each phase of `times` (LLM.startup_times), and what no phase holds as "other"."""
    other = total_s - before_s - sum(times[key] for key, _ in PHASES)
    parts = [f"imports {before_s:.1f}s"]
    for key, name in PHASES:
        if key == "capture_s":
            if times[key]:
                parts.append(f"{name} {times[key]:.1f}s with {times['compile_s']:.1f}s of compiling")
        else:
            parts.append(f"{name} {times[key]:.1f}s")
    return f"ready in {total_s:.1f}s after start ({', '.join(parts)}, other {other:.1f}s)"
