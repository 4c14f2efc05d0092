"""flexsgl's log: the `flexsgl` logger, shown on stderr as `[flexsgl] message`, and progress bars.

The level comes from `--log-level` on the command line or the FLEXSGL_LOG_LEVEL environment
variable (debug, info, warning, error; default info). Progress bars (loading, graph capture,
long `generate` calls, benchmarks) show on stderr while the level is info or lower, and only
where stderr is a terminal.
"""

from __future__ import annotations

import logging
import os
import sys

ENV = "FLEXSGL_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
logger = logging.getLogger("flexsgl")


def set_level(level: str | None = None) -> None:
    """Show the log at `level` (default: $FLEXSGL_LOG_LEVEL, else info); ValueError for an unknown level."""
    level = (level or os.environ.get(ENV) or "info").lower()
    if level not in LEVELS:
        raise ValueError(f"Unknown log level {level!r}; choose one of {', '.join(LEVELS)}.")
    logger.setLevel(level.upper())


def _install() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[flexsgl] %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        set_level()
    except ValueError as e:  # a bad environment variable must not stop the import
        logger.setLevel(logging.INFO)
        logger.warning(str(e))


def on_terminal(stream) -> bool:
    """Whether `stream` is a terminal (not a file or a pipe)."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def progress(iterable=None, disable: bool = False, **kw):
    """A tqdm bar on stderr, shown while stderr is a terminal and the log level is info or lower
    (and `disable` is False): a log written to a file or a pipe gets no bars."""
    from tqdm import tqdm

    shown = not disable and on_terminal(sys.stderr) and logger.isEnabledFor(logging.INFO)
    return tqdm(iterable, file=sys.stderr, leave=False, disable=not shown, **kw)


_install()
