"""The HTTP process's side of the engine process (engine_process.py).

Handlers make their requests (tokenized and checked here, with the engine's RequestFactory, so
bad input is answered at once) and submit them; submit and abort hand messages to a sender thread,
so the event loop never blocks on the pipe. A reader thread blocks on the engine's pipe and hands
each Step message to the event loop in one call, which puts each event on its handler's asyncio
queue and records the metrics (metrics.py) from the messages' arrival times: per HTTP request
(a Call, whatever its number of choices), its TTFT, TPOT, latency and queue time.

If the engine fails or its process ends, every request in flight ends with an error, /health
answers 503 with the reason, and later requests are answered 503 with it. When the server stops,
`drain` ends the requests in flight (finish reason "abort") before the engine process is stopped.
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

from flexsgl.errors import describe
from flexsgl.log import logger
from flexsgl.request import Request
from flexsgl.serve import engine_process
from flexsgl.serve.messages import Abort, Add, EngineInfo, Event, Failed, Ready, StartFailed, Step, Stop
from flexsgl.serve.metrics import Metrics

STOP_TIMEOUT_S = 30  # how long shutdown waits for the engine process before killing it
SHUTTING_DOWN = "The server is shutting down."


@dataclass
class Call:
    """One HTTP request's timing and tally, over its choices."""

    choices: int
    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    most_tokens: int = 0  # of one choice
    tokens: int = 0  # of all choices
    reasons: list = field(default_factory=list)
    queue_s: float | None = None  # its choices' longest wait for admission
    first_admitted_s: float | None = None  # their shortest: when its first choice was admitted


@dataclass
class Stream:
    choice: int
    events: asyncio.Queue  # shared by the choices of one HTTP request
    call: Call
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
        self.start_failed = threading.Event()  # the engine could not start (`failure` says why)
        self.on_start_failed = lambda: os.kill(os.getpid(), signal.SIGTERM)  # what stops the server then
        self.on_ready = lambda: None  # once the engine is ready (the server says where it serves)
        self.on_engine_died = lambda: None  # the engine failed or its process ended: what stops the server
        self.draining = False  # the server is stopping: requests in flight are being ended (drain)

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
        """Stop the engine process: Stop, then SIGKILL if it does not end (it ignores SIGTERM, which
        reaches it with the whole process group; its other ranks end with it)."""
        self.stopping = True
        if self.process is None:
            return
        if self.ready.is_set():
            self.outbox.put(Stop())
            self.process.join(STOP_TIMEOUT_S)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)
        self.outbox.put(None)

    def drain(self) -> None:
        """The server is stopping: end every request in flight now, each with finish reason "abort"
        and the tokens it has (a stream with its last chunk and [DONE]), so that their responses
        complete before the connections close; later requests are answered 503. Callable from a
        signal handler."""
        self.draining = True
        if self.loop is not None:  # else nothing has started
            self._call(lambda: self.abort(list(self.streams)))

    @property
    def serving(self) -> bool:
        return self.ready.is_set() and self.failure is None and not self.draining

    @property
    def unavailable(self) -> str:
        """Why the engine does not take requests (when not `serving`)."""
        if self.failure is not None:
            return self.failure
        return SHUTTING_DOWN if self.draining else "The model is still loading; try again when /health says ok."

    # ---- the event loop's side

    def submit(self, reqs: list[Request], events: asyncio.Queue) -> list[Stream]:
        call = Call(len(reqs), sum(r.prompt_len for r in reqs if r.index == 0))
        streams = [Stream(i, events, call) for i in range(len(reqs))]
        if not self.serving:  # failed, or stopping since the handler checked
            for s in streams:
                events.put_nowait(Event(s.choice, "", error=self.unavailable))
            return streams
        for r, s in zip(reqs, streams):
            self.streams[r.request_id] = s
        self.outbox.put(Add(reqs))
        return streams

    def abort(self, request_ids: list[int]) -> None:
        self.outbox.put(Abort(request_ids))

    def _dispatch(self, msg: Step) -> None:
        now = time.perf_counter()
        m = self.metrics
        m.engine(msg.stats, self.info.total_pages)
        streams, prompts = self.streams, msg.prompts
        for rid, text, token, lp in msg.tokens:
            s = streams.get(rid)
            if s is None:
                continue
            c = s.call
            if c.first_token is None:
                c.first_token = now
                m.ttft.observe(now - c.arrival)
            if s.last_token is not None:
                m.token_gap(now - s.last_token)
            s.last_token, s.tokens = now, s.tokens + 1
            c.last_token, c.tokens, c.most_tokens = now, c.tokens + 1, max(c.most_tokens, s.tokens)
            s.events.put_nowait(Event(s.choice, text, [token], [lp] if lp is not None else [],
                                      prompt=prompts.get(rid) if prompts else None))
        for rid, rest, out in msg.finished:
            s = streams.pop(rid, None)
            if s is None:
                continue
            self._end(s.call, out.finish_reason, out.time_in_queue, now)
            s.events.put_nowait(Event(s.choice, rest, output=out))

    def _end(self, c: Call, reason: str, queue_s: float | None, now: float) -> None:
        """A choice of `c` ended; the last one ends the call in the metrics."""
        c.reasons.append(reason)
        if queue_s is not None:
            c.queue_s = max(c.queue_s or 0.0, queue_s)
            c.first_admitted_s = queue_s if c.first_admitted_s is None else min(c.first_admitted_s, queue_s)
        if len(c.reasons) < c.choices:
            return
        if c.first_token is not None:
            self.metrics.generated(c.most_tokens, c.arrival + (c.first_admitted_s or 0.0), c.first_token, c.last_token)
        self.metrics.finished(c.reasons, c.prompt_tokens, c.tokens, now - c.arrival, c.queue_s)

    def _fail_all(self) -> None:
        now = time.perf_counter()
        for s in self.streams.values():
            self._end(s.call, "error", None, now)
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
                    self.metrics.engine(msg.stats, msg.info.total_pages)  # the gauges before any step
                    self.ready.set()
                    self.on_ready()
                elif isinstance(msg, StartFailed):
                    self._failed(msg.reason)
                    self.start_failed.set()
                    self.on_start_failed()  # the server stops
                    return
                elif isinstance(msg, Failed):
                    self._died(msg.reason)
                    return
        except (EOFError, OSError):
            if not self.stopping:
                self.process.join(1)
                self._died(f"The engine process ended unexpectedly (exit code {self.process.exitcode}).")
        except Exception as e:  # a fault of this thread: the server must say so, not wait on it forever
            logger.exception("the engine's reader failed")
            self._died(f"The server stopped reading the engine ({describe(e)}).")

    def _died(self, reason: str) -> None:
        """The engine cannot serve any more: the requests in flight end with `reason`, then the server stops."""
        self._failed(reason)
        self.on_engine_died()

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
