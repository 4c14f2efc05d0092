"""Continuous batching: each step is a prefill batch (chunked to the token budget) or a decode batch.

Admission is first come, first served, while the per-step token budget, the running-batch limit
and free KV pages allow. A request reserves the pages for its whole life (prompt plus every token
it may produce) when admitted, so a running request never waits for memory.

The host runs one step ahead of what it has read back: `schedule()` may decode a request whose
last token the host has not seen yet (the device has it), and `process()` of a step happens after
the next step is launched. A request that finished in the step being processed may therefore sit
in the step already launched; its result there is ignored.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from flexsgl.cache.pool import KVPool, PageAllocator
from flexsgl.request import Request, State


@dataclass
class ScheduledBatch:
    mode: str  # "prefill" or "decode"
    requests: list[Request]
    starts: list[int]  # position of each request's first token this step
    num_new: list[int]  # tokens each request computes this step
    samples: list[bool]  # whether each request samples a token this step


class Scheduler:
    def __init__(self, pool: KVPool, allocator: PageAllocator, max_batch_tokens: int, max_running: int):
        self.pool = pool
        self.allocator = allocator
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_running - 1, -1, -1))

    def pages_needed(self, req: Request) -> int:
        return KVPool.num_pages_for(req.target_len, self.pool.page_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_batch_tokens
        reqs, num_new = [], []
        for r in self.running:  # prompts already admitted and partly prefilled go first
            if not r.prefilled and budget > 0:
                n = min(r.prompt_len - r.num_computed, budget)
                reqs.append(r), num_new.append(n)
                budget -= n
        while self.waiting and budget > 0 and self._free_slots:
            r = self.waiting[0]
            need = self.pages_needed(r)
            if need > self.allocator.num_free:
                break
            self.waiting.popleft()
            r.pages = self.allocator.alloc(need)
            self.pool.set_page_positions(r.pages, 0)
            r.slot = self._free_slots.pop()
            r.state = State.RUNNING
            self.running.append(r)
            n = min(r.prompt_len, budget)
            reqs.append(r), num_new.append(n)
            budget -= n
        if not reqs:
            return None
        starts = [r.num_computed for r in reqs]
        samples = [r.num_computed + n == r.prompt_len for r, n in zip(reqs, num_new)]
        for r, n, s in zip(reqs, num_new, samples):
            r.num_computed += n
            r.num_scheduled_outputs += s
        return ScheduledBatch("prefill", reqs, starts, num_new, samples)

    def _schedule_decode(self) -> ScheduledBatch | None:
        reqs = [r for r in self.running if r.prefilled and r.finish_reason is None
                and r.prompt_len + r.num_scheduled_outputs < r.target_len]
        if not reqs:
            return None
        starts = [r.num_computed for r in reqs]
        for r in reqs:
            r.num_computed += 1  # the last sampled token's K/V
            r.num_scheduled_outputs += 1
        n = len(reqs)
        return ScheduledBatch("decode", reqs, starts, [1] * n, [True] * n)

    def process(self, batch: ScheduledBatch, tokens: list[int]) -> list[Request]:
        """Hand a step's sampled tokens to their requests; returns the requests that finished."""
        done = []
        sampled = (r for r, s in zip(batch.requests, batch.samples) if s)
        for r, tok in zip(sampled, tokens):
            if r.finished:
                continue  # it finished in an earlier step; this token was computed one step ahead
            r.append(tok)
            if r.finish_reason is not None:
                self._finish(r)
                done.append(r)
        return done

    def _finish(self, r: Request) -> None:
        r.state = State.FINISHED
        self.running.remove(r)
        self.allocator.free(r.pages)
        r.pages = []
        self._free_slots.append(r.slot)
        r.slot = -1
