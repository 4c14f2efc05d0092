"""Ctrl-C held back to a point where the engine is consistent.

A KeyboardInterrupt raised half-way through a step would leave pages, the prefix cache and the
request in flight in no known state. While `deferred_interrupts()` is active (in the main thread),
a first SIGINT is only recorded, and `redeliver()` raises it (through the handler that was there
before) where the caller chooses: between steps. A second SIGINT goes straight to that handler,
so a step that hangs can still be broken off (the engine then counts itself dead).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class Deferred:
    def __init__(self, previous=None):
        self.previous = previous  # the SIGINT handler to restore and to redeliver through
        self.frame = None
        self.caught = False

    def handle(self, signum, frame) -> None:
        if self.caught:  # a second Ctrl-C is not held back
            self._deliver(frame)
        self.caught, self.frame = True, frame

    def redeliver(self) -> None:
        """Raise the held-back interrupt, if one came, through the previous handler."""
        if self.caught:
            self.caught = False
            self._deliver(self.frame)

    def _deliver(self, frame) -> None:
        if callable(self.previous):
            self.previous(SIGINT, frame)
        elif self.previous != signal.SIG_IGN:
            raise KeyboardInterrupt


_active = threading.local()
SIGINT = signal.SIGINT


@contextmanager
def deferred_interrupts():
    """Hold SIGINT back for the duration; yields a Deferred whose redeliver() raises it. Nested
    uses hold nothing themselves (the outermost one redelivers), nor does a thread other than the
    main one (it receives no signals), nor a process whose handler was not set from Python."""
    if getattr(_active, "deferred", None) is not None or threading.current_thread() is not threading.main_thread():
        yield Deferred()
        return
    previous = signal.getsignal(SIGINT)
    if previous is None:
        yield Deferred()
        return
    deferred = _active.deferred = Deferred(previous)
    signal.signal(SIGINT, deferred.handle)
    try:
        yield deferred
    finally:
        _active.deferred = None
        signal.signal(SIGINT, previous)
