"""Start-up time: seconds since the process started, and the phases an engine's construction
spends them in (`LLM.startup_times`), named so that they add up to the whole (`ready_line`).

Imported first by the flexsgl package, before torch, so that where the operating system does not
say when the process started, the time since flexsgl's import stands in for it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

IMPORTED_AT = time.perf_counter()


def _leave_quietly(signum, frame) -> None:
    os._exit(128 + signal.SIGINT)  # as a shell reports a process Ctrl-C ended


def quiet_interrupts_while_importing():
    """Run as the command line (the `flexsgl` script, or `python -m flexsgl`, whose package imports
    while argv[0] is still "-m"), a Ctrl-C during the seconds torch and the command line take to
    import ends the process with status 130 instead of a traceback from inside an import; returns
    the handler it replaced (None: it replaced none). The command line's entry puts it back
    (`restore_interrupts`), from where its commands handle Ctrl-C themselves."""
    cli = os.path.basename(sys.argv[0] if sys.argv else "") in ("flexsgl", "-m")
    if not cli or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None
    try:
        return signal.signal(signal.SIGINT, _leave_quietly)
    except ValueError:  # not the main thread
        return None


_HANDLER_BEFORE_IMPORT = quiet_interrupts_while_importing()


def restore_interrupts() -> None:
    """Put back the SIGINT handler quiet_interrupts_while_importing replaced, if it replaced one."""
    if _HANDLER_BEFORE_IMPORT is not None:
        signal.signal(signal.SIGINT, _HANDLER_BEFORE_IMPORT)

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
