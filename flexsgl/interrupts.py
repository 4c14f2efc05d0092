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
        self.caught, self.frame = True, frame
        signal.signal(signal.SIGINT, self.previous)  # a second Ctrl-C is not held back

    def redeliver(self) -> None:
        """Raise the held-back interrupt, if one came, through the previous handler."""
        if not self.caught:
            return
        self.caught = False
        if callable(self.previous):
            self.previous(signal.SIGINT, self.frame)
        elif self.previous != signal.SIG_IGN:
            raise KeyboardInterrupt


_active = threading.local()


@contextmanager
def deferred_interrupts():
    """Hold SIGINT back for the duration; yields a Deferred whose redeliver() raises it. Nested
    uses hold nothing themselves (the outermost one redelivers), nor does a thread other than the
    main one (it receives no signals), nor a process whose handler was not set from Python."""
    previous = signal.getsignal(signal.SIGINT)
    if getattr(_active, "deferred", None) is not None or previous is None \
            or threading.current_thread() is not threading.main_thread():
        yield Deferred()
        return
    deferred = Deferred(previous)
    _active.deferred = deferred
    signal.signal(signal.SIGINT, deferred.handle)
    try:
        yield deferred
    finally:
        _active.deferred = None
        if signal.getsignal(signal.SIGINT) == deferred.handle:
            signal.signal(signal.SIGINT, deferred.previous)
