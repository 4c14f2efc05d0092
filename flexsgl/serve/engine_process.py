"""The engine thread: the one owner of the LLM's step loop.

HTTP handlers (on the event loop) make their requests (tokenized and checked there, so bad input
is answered at once) and hand them, and aborts, to this thread through a queue. The thread adds
what arrived, runs one step, and hands each token (its text delta, id and log-probabilities) back
to the handlers' asyncio queues with one call into the event loop per step, so it never waits
for a handler. When nothing runs it sleeps on its queue.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from flexsgl.errors import describe
from flexsgl.log import logger
from flexsgl.request import Request, RequestOutput, TokenLogprobs
from flexsgl.serve.metrics import Metrics


@dataclass
class Event:
    """What one request's handler receives: a token, or its end (`output` set)."""

    choice: int  # the request's place among its HTTP request's choices
    text: str  # text released by this event
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    output: RequestOutput | None = None  # the finished request, on its last event
    error: str | None = None  # the engine failed: the server cannot serve any more


@dataclass
class Stream:
    choice: int
    events: asyncio.Queue  # shared by the choices of one HTTP request
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    sent_chars: int = 0


class EngineThread:
    def __init__(self, make_llm: Callable, metrics: Metrics):
        self.make_llm, self.metrics = make_llm, metrics
        self.llm = None
        self.ready = threading.Event()  # set once the LLM is built (or failed to build: see `failure`)
        self.failure: str | None = None  # why the engine cannot serve, once it cannot
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[int, Stream] = {}
        self.outgoing: list[tuple[Stream, Event]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name="flexsgl-engine", daemon=True)

    # ---- the event loop's side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(("stop",))
        self.thread.join(timeout=30)

    @property
    def serving(self) -> bool:
        return self.ready.is_set() and self.failure is None

    def submit(self, reqs: list[Request], events: asyncio.Queue) -> list[Stream]:
        streams = [Stream(i, events) for i in range(len(reqs))]
        self.inbox.put(("add", reqs, streams))
        return streams

    def abort(self, request_ids: list[int]) -> None:
        self.inbox.put(("abort", request_ids))

    # ---- the engine thread's side

    def _run(self) -> None:
        try:
            self.llm = self.make_llm()
        except Exception as e:
            self.failure = f"The engine could not start: {describe(e)}."
            logger.error(self.failure)
            self.ready.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the server stops (uvicorn shuts down on SIGTERM)
            return
        self.ready.set()
        if self.failure is None:
            logger.info("engine ready")
        while self._take_inbox(block=self.failure is not None or not self.llm.has_unfinished):
            if self.failure is not None:
                continue
            try:
                outs = self.llm.step()
            except BaseException as e:  # EngineDeadError (or a bug): nothing more can run
                logger.exception("the engine failed")
                self._fail_all(f"The engine failed: {describe(e)}.")
                continue
            now = time.perf_counter()
            for out in outs:
                self._finish(out, now)
            self._publish()

    def _take_inbox(self, block: bool) -> bool:
        """Act on what handlers sent (waiting for it when idle); False once told to stop."""
        while True:
            try:
                msg = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if msg[0] == "stop":
                return False
            if msg[0] == "add":
                self._add(*msg[1:])
            elif self.failure is None:
                for i in msg[1]:
                    self.llm.abort(i)
            self._publish()

    def _add(self, reqs: list[Request], streams: list[Stream]) -> None:
        if self.failure is not None:
            for s in streams:
                self.outgoing.append((s, Event(s.choice, "", error=self.failure)))
            return
        for r, s in zip(reqs, streams):
            self.streams[r.request_id] = s
        self.llm.submit(reqs, self._on_token)
        self.metrics.requests_received += 1

    def _on_token(self, req: Request) -> None:
        s = self.streams.get(req.request_id)
        if s is None:
            return
        now = time.perf_counter()
        if s.first_token is None:
            s.first_token = now
            self.metrics.ttft.observe(now - s.arrival)
        s.last_token, s.tokens = now, s.tokens + 1
        s.sent_chars += len(req.new_text)
        lp = [req.logprobs[-1]] if req.logprobs else []
        self.outgoing.append((s, Event(s.choice, req.new_text, [req.output_ids[-1]], lp)))

    def _finish(self, out: RequestOutput, now: float) -> None:
        s = self.streams.pop(out.request_id, None)
        if s is None:
            return
        if s.tokens > 1:
            self.metrics.tpot.observe((s.last_token - s.first_token) / (s.tokens - 1))
        self.metrics.finished[out.finish_reason] += 1
        rest = (out.text or "")[s.sent_chars:]
        self.outgoing.append((s, Event(s.choice, rest, output=out)))

    def _fail_all(self, reason: str) -> None:
        self.failure = reason
        for s in self.streams.values():
            self.outgoing.append((s, Event(s.choice, "", error=reason)))
        self.streams.clear()
        self._publish()

    def _publish(self) -> None:
        """Hand this step's events to the event loop in one call, and refresh the metrics' gauges."""
        if self.failure is None:
            self.metrics.engine_stats = self.llm.stats()
        if not self.outgoing:
            return
        batch, self.outgoing = self.outgoing, []
        try:
            self.loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass


def _deliver(batch: list[tuple[Stream, Event]]) -> None:
    for stream, event in batch:
        stream.events.put_nowait(event)
