"""The HTTP process's side of the engine process (engine_process.py).

Handlers make their requests (tokenized and checked here, with the engine's RequestFactory, so
bad input is answered at once) and submit them; submit and abort hand messages to a sender thread,
so the event loop never blocks on the pipe. A reader thread blocks on the engine's pipe and hands
each Step message to the event loop in one call, which puts each event on its handler's asyncio
queue and observes TTFT and TPOT from the messages' arrival times.

If the engine fails or its process ends, every request in flight ends with an error, /health
answers 503 with the reason, and later requests are answered 503 with it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field

from flexsgl.log import logger
from flexsgl.request import Request
from flexsgl.serve import engine_process
from flexsgl.serve.messages import Abort, Add, EngineInfo, Event, Failed, Ready, StartFailed, Step, Stop
from flexsgl.serve.metrics import Metrics

STOP_TIMEOUT_S = 30  # how long shutdown waits for the engine process before terminating it


@dataclass
class Stream:
    choice: int
    events: asyncio.Queue  # shared by the choices of one HTTP request
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0


class EngineClient:
    def __init__(self, engine_config, metrics: Metrics):
        self.engine_config, self.metrics = engine_config, metrics
        self.info: EngineInfo | None = None  # set once the engine is ready
        self.ready = threading.Event()  # set once the engine is built (or failed to build: see `failure`)
        self.failure: str | None = None  # why the engine cannot serve, once it cannot
        self.streams: dict[int, Stream] = {}  # by request id; touched on the event loop only
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # to the sender thread
        self.loop: asyncio.AbstractEventLoop | None = None
        self.process = None
        self.stopping = False

    # ---- lifetime

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        to_engine, self._to_engine = ctx.Pipe(duplex=False)
        self._from_engine, from_engine = ctx.Pipe(duplex=False)
        # Not a daemon: the engine process starts the other tensor-parallel ranks itself.
        self.process = ctx.Process(target=engine_process.main, name="flexsgl-engine",
                                   args=(self.engine_config, logger.getEffectiveLevel(), to_engine, from_engine))
        self.process.start()
        to_engine.close()
        from_engine.close()
        threading.Thread(target=self._read, name="flexsgl-engine-reader", daemon=True).start()
        threading.Thread(target=self._send, name="flexsgl-engine-sender", daemon=True).start()

    def stop(self) -> None:
        """Stop the engine process: Stop, then SIGTERM, then SIGKILL if it does not end."""
        self.stopping = True
        if self.process is None:
            return
        if self.ready.is_set():
            self.outbox.put(Stop())
            self.process.join(STOP_TIMEOUT_S)
        for end in (self.process.terminate, self.process.kill):
            if self.process.exitcode is not None:
                break
            end()
            self.process.join(STOP_TIMEOUT_S)
        self.outbox.put(None)

    @property
    def serving(self) -> bool:
        return self.ready.is_set() and self.failure is None

    # ---- the event loop's side

    def submit(self, reqs: list[Request], events: asyncio.Queue) -> list[Stream]:
        streams = [Stream(i, events) for i in range(len(reqs))]
        if self.failure is not None:
            for s in streams:
                events.put_nowait(Event(s.choice, "", error=self.failure))
            return streams
        for r, s in zip(reqs, streams):
            self.streams[r.request_id] = s
        self.outbox.put(Add(reqs))
        self.metrics.requests_received += 1
        return streams

    def abort(self, request_ids: list[int]) -> None:
        self.outbox.put(Abort(request_ids))

    def _dispatch(self, msg: Step) -> None:
        now = time.perf_counter()
        self.metrics.engine_stats = msg.stats
        streams = self.streams
        for rid, text, token, lp in msg.tokens:
            s = streams.get(rid)
            if s is None:
                continue
            if s.first_token is None:
                s.first_token = now
                self.metrics.ttft.observe(now - s.arrival)
            s.last_token, s.tokens = now, s.tokens + 1
            s.events.put_nowait(Event(s.choice, text, [token], [lp] if lp is not None else []))
        for rid, rest, out in msg.finished:
            s = streams.pop(rid, None)
            if s is None:
                continue
            if s.tokens > 1:
                self.metrics.tpot.observe((s.last_token - s.first_token) / (s.tokens - 1))
            self.metrics.finished[out.finish_reason] += 1
            s.events.put_nowait(Event(s.choice, rest, output=out))

    def _fail_all(self) -> None:
        for s in self.streams.values():
            s.events.put_nowait(Event(s.choice, "", error=self.failure))
        self.streams.clear()

    # ---- the threads

    def _send(self) -> None:
        while (msg := self.outbox.get()) is not None:
            try:
                self._to_engine.send(msg)
            except OSError:  # the engine process has gone: the reader says why
                if isinstance(msg, Stop):
                    return

    def _read(self) -> None:
        try:
            while True:
                msg = self._from_engine.recv()
                if isinstance(msg, Step):
                    self._call(self._dispatch, msg)
                elif isinstance(msg, Ready):
                    self.info = msg.info
                    self.metrics.total_pages = msg.info.total_pages
                    self.ready.set()
                elif isinstance(msg, StartFailed):
                    self._failed(msg.reason)
                    os.kill(os.getpid(), signal.SIGTERM)  # the server stops (uvicorn shuts down on SIGTERM)
                    return
                elif isinstance(msg, Failed):
                    self._failed(msg.reason)
        except (EOFError, OSError):
            if not self.stopping:
                self.process.join(1)
                self._failed(f"The engine process ended unexpectedly (exit code {self.process.exitcode}).")

    def _failed(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            logger.error(reason)
        self.ready.set()
        self._call(self._fail_all)

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass
