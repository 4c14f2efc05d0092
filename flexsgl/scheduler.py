"""Continuous batching over a paged KV pool with a radix prefix cache.

Each step is a prefill batch or a decode batch. While requests are decoding and prompts wait,
the two alternate, so a long prompt (prefilled in chunks of at most `max_batch_tokens`) never
stalls the running requests for more than one step at a time. With `prefill_first` a decode step
runs only when no prompt can be prefilled: a batch submitted at once decodes together once every
prompt is in (flexsgl bench's latency workload runs so).

Admission is first come, first served: a request reuses the whole pages of its longest cached
prefix and is admitted while the per-step budget, the running-batch limit and pages allow (free
pages plus unreferenced cached ones, less one page of headroom per running request). Pages are
taken as tokens need them. When a decode step needs a page and none is free even after evicting
the cache, the most recently admitted running request is preempted: its computed pages go to the
cache, and it is recomputed later from its prompt plus the tokens it already produced.

The host runs one step ahead of what it has read back: `schedule()` may decode a request whose
last token the host has not seen yet (the device has it), and a step is `process()`ed after the
next one is launched. So a request that finished in the step being processed may sit in the step
already launched (its result there is ignored), and a preempted request still receives the token
of the step it was in before it is readmitted (readmission happens one schedule() later).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from flexsgl.cache.pool import DUMMY_PAGE, KVPool, PageAllocator
from flexsgl.cache.radix import RadixCache
from flexsgl.request import FinishReason, Request, State, TokenEvent
from flexsgl.request_factory import refusal


@dataclass
class ScheduledBatch:
    mode: str  # "prefill" or "decode"
    requests: list[Request]
    starts: list[int]  # position of each request's first token this step
    num_new: list[int]  # tokens each request computes this step
    samples: list[bool]  # whether each request samples a token this step


class Scheduler:
    def __init__(self, page_size: int, allocator: PageAllocator, max_batch_tokens: int, max_running: int,
                 kv_window: int | None = None, prefill_first: bool = False, whole_prompts: bool = False):
        """kv_window: where every layer attends only to its last kv_window keys, pages wholly behind
        the window of a request's next query go back to the pool as it proceeds. prefill_first: a
        decode step runs only when no prompt can be prefilled (else a decode step follows each
        prefill step while requests decode). whole_prompts: a prompt is prefilled in one step, never
        in chunks (the attention sees each prompt whole: flexsgl/attention/request_variants.py).
        A request's K/V reach the prefix cache under its cache_salt, and serve only that salt."""
        self.kv_window = kv_window
        self.prefill_first = prefill_first
        # The longest prompt where prompts are prefilled whole (None: any, in chunks)
        self.whole_prompt_tokens = max_batch_tokens if whole_prompts else None
        # The most KV slots a request holds at once with a window: the window, a prefill chunk, and the
        # pages they straddle (None: its whole length)
        self.held_tokens = None if kv_window is None else kv_window + max_batch_tokens + 2 * page_size
        self.allocator = allocator
        self.ps = page_size
        self.cache = RadixCache(self.ps)
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._free_slots = list(range(max_running - 1, -1, -1))
        self._last_was_prefill = False
        self.counters = Counter()

    # ---- bookkeeping the engine reads

    def refusal(self, req: Request) -> str | None:
        """Why `req` can never run here, or None."""
        return refusal(req, self.ps, self.allocator.capacity, self.held_tokens, self.whole_prompt_tokens)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        used = sum(len(r.pages) for r in self.running)
        return {**self.counters, "pages_free": self.allocator.num_free, "pages_cached": self.cache.num_pages,
                "pages_running": used, "running": len(self.running), "waiting": len(self.waiting)}

    # ---- pages

    def _available(self) -> int:
        return self.allocator.num_free + self.cache.num_evictable

    def _take_pages(self, n: int) -> list[int] | None:
        if n > self.allocator.num_free:
            evicted = self.cache.evict(n - self.allocator.num_free)
            self.counters["evicted_pages"] += len(evicted)
            self.allocator.free(evicted)
        return self.allocator.alloc(n) if n <= self.allocator.num_free else None

    def _grow(self, r: Request, tokens: int) -> bool:
        """Give r pages for its first `tokens` tokens; False if the pool cannot."""
        n = KVPool.num_pages_for(tokens, self.ps) - len(r.pages)
        if n <= 0:
            return True
        pages = self._take_pages(n)
        if pages is None:
            return False
        r.pages += pages
        return True

    def _grow_or_preempt(self, r: Request, tokens: int) -> bool:
        """Like _grow, preempting the most recently admitted requests (r itself last) for pages."""
        while not self._grow(r, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _release(self, r: Request, cache: bool = True) -> list[int]:
        """Hand r's computed whole pages to the cache (with `cache`), free the rest, drop its lock and
        slot. Pages r gave back behind the window are cached already; what follows them is cached too
        where the tree still holds them. Returns the pages of its own freed where `cache` is False."""
        computed = r.all_ids[: r.num_computed]
        start = max(r.dropped_pages, r.shared_pages)
        own, prefix = r.pages[start:], self._held_prefix(r) if cache else None
        if prefix is None:  # not to be cached, or the pages behind the window were evicted
            self.allocator.free(own)
        else:
            n_full = min(len(computed) // self.ps, start + len(own))
            cached = prefix + own[:n_full - start]
            self.allocator.free(self.cache.insert(computed[:n_full * self.ps], cached, r.cache_salt)
                                + own[n_full - start:])
        r.dropped_pages = r.shared_pages = 0
        if r.prefix_node is not None:
            self.cache.unlock(r.prefix_node)
        r.pages, r.prefix_node = [], None
        self._free_slots.append(r.slot)
        r.slot = -1
        self.running.remove(r)
        return [] if cache else own

    # ---- scheduling

    def schedule(self) -> ScheduledBatch | None:
        decode_ready = any(self._decodable(r) for r in self.running)
        if decode_ready and self._last_was_prefill and not self.prefill_first:
            batch = self._schedule_decode() or self._schedule_prefill()
        else:
            batch = self._schedule_prefill() or self._schedule_decode()
        if batch is not None:
            self._last_was_prefill = batch.mode == "prefill"
            self.counters[f"{batch.mode}_steps"] += 1
        return batch

    def _decodable(self, r: Request) -> bool:
        return r.prefilled and r.finish_reason is None and r.num_scheduled_outputs < r.sampling.max_new_tokens

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_batch_tokens
        reqs, starts, num_new = [], [], []

        def take(r: Request) -> None:
            nonlocal budget
            n = min(len(r.fill_ids) - r.num_computed, budget)
            self._drop_behind_window(r, r.num_computed)  # before growing: within held_tokens at every moment
            if self._grow_or_preempt(r, r.num_computed + n):
                reqs.append(r), starts.append(r.num_computed), num_new.append(n)
                budget -= n

        for r in list(self.running):  # admitted requests still filling go first
            if r.state is State.RUNNING and not r.prefilled and budget > 0:
                take(r)
        while self.waiting and budget > 0 and self._free_slots:
            r = self.waiting[0]
            if r.num_scheduled_outputs > len(r.output_ids):
                break  # preempted with a token still in flight: readmit once it is read back
            if r.leader is not None and not (r.leader.output_ids or r.leader.finished):
                break  # a sample of n waits for its leader's prompt pages to reach the prefix cache
            r.fill_ids = r.all_ids
            # Compute at least one token; a request that wants its prompt's log-probabilities computes it all.
            pages, node = self.cache.match([] if r.prompt_logprobs is not None else r.fill_ids[: len(r.fill_ids) - 1],
                                           r.cache_salt)
            if self.whole_prompt_tokens is not None and r.prompt_len - len(pages) * self.ps > budget:
                break  # its prompt waits for a step it fits in whole
            first_chunk = min(len(r.fill_ids) - len(pages) * self.ps, budget)
            need = KVPool.num_pages_for(len(pages) * self.ps + first_chunk, self.ps) - len(pages)
            matched_evictable = sum(len(n.pages) for n in _path(node) if n.ref == 0)  # locked once admitted
            if need + len(self.running) > self._available() - matched_evictable:  # a page of headroom each
                break
            self.waiting.popleft()
            self.cache.lock(node)
            r.prefix_node, r.pages, r.shared_pages = node, list(pages), len(pages)
            r.num_computed = len(pages) * self.ps
            r.num_scheduled_outputs = len(r.output_ids)
            if not r.admitted:  # not a readmission after preemption, which finds its own pages
                r.cached_tokens, r.admitted = r.num_computed, True
            r.slot = self._free_slots.pop()
            r.state = State.RUNNING
            self.running.append(r)
            take(r)
            if r.state is not State.RUNNING:
                break  # it could not get its pages after all (it is back at the head of the queue)
        keep = [i for i, r in enumerate(reqs) if r.state is State.RUNNING]  # preempted after being taken: out
        reqs, starts, num_new = [reqs[i] for i in keep], [starts[i] for i in keep], [num_new[i] for i in keep]
        if not reqs:
            return None
        samples = [s + n == len(r.fill_ids) for r, s, n in zip(reqs, starts, num_new)]
        for r, n, s in zip(reqs, num_new, samples):
            r.num_computed += n
            r.num_scheduled_outputs += s
        return ScheduledBatch("prefill", reqs, starts, num_new, samples)

    def _schedule_decode(self) -> ScheduledBatch | None:
        reqs = []
        for r in list(self.running):
            if r.state is State.RUNNING and self._decodable(r) and self._grow_or_preempt(r, r.num_computed + 1):
                reqs.append(r)
        reqs = [r for r in reqs if r.state is State.RUNNING]  # some were preempted for later ones
        if not reqs:
            return None
        starts = [r.num_computed for r in reqs]
        for r in reqs:
            self._drop_behind_window(r, r.num_computed)
            r.num_computed += 1  # the last sampled token's K/V
            r.num_scheduled_outputs += 1
        n = len(reqs)
        return ScheduledBatch("decode", reqs, starts, [1] * n, [True] * n)

    def _drop_behind_window(self, r: Request, first_query: int) -> None:
        """With a window on every layer: r's pages wholly behind the window of its query at
        `first_query`, which no later query of r reads either, go from r to the prefix cache (as
        pages nobody holds, which it evicts when pages run short), or back to the pool where the
        cache no longer holds the pages before them. A step already launched reads them before a
        later step can write them: the device runs steps in order."""
        if self.kv_window is None:
            return
        behind = min(max(first_query - self.kv_window + 1, 0) // self.ps, len(r.pages), len(r.all_ids) // self.ps)
        start = max(r.dropped_pages, r.shared_pages)
        if behind <= start:
            return
        new, prefix = r.pages[start:behind], self._held_prefix(r)
        self.allocator.free(new if prefix is None else
                            self.cache.insert(r.all_ids[:behind * self.ps], prefix + new, r.cache_salt))
        r.pages[start:behind] = [DUMMY_PAGE] * (behind - start)
        r.dropped_pages = behind
        self.counters["window_pages_freed"] += behind - start

    def _held_prefix(self, r: Request) -> list[int] | None:
        """The pages of r's first max(dropped, shared) pages: r's own where it gave none back beyond
        what it shares, else the tree's for those tokens, or None where the tree no longer holds them."""
        n = max(r.dropped_pages, r.shared_pages)
        if r.dropped_pages <= r.shared_pages:
            return r.pages[:n]
        held, _ = self.cache.match(r.all_ids[:n * self.ps], r.cache_salt)
        return held if len(held) == n else None

    def _preempt(self, r: Request) -> None:
        self._release(r)
        r.state = State.WAITING
        r.num_computed = 0
        self.waiting.appendleft(r)
        self.counters["preemptions"] += 1

    # ---- results and endings

    def process(self, batch: ScheduledBatch, tokens: list[int], logprobs=None) -> list[TokenEvent]:
        """Record a step's sampled tokens in their requests (`output_ids`), and put a leader's prompt
        pages in the prefix cache once its first token is back; returns a TokenEvent per token, in
        batch order, with its log-probabilities if asked for. Whether a request ends is the output
        path's to decide (flexsgl/output.py); the engine then finishes it here. A request that has
        finished gets no event: its token was computed one step ahead."""
        events = []
        sampled = (r for r, s in zip(batch.requests, batch.samples) if s)
        for i, (r, tok) in enumerate(zip(sampled, tokens)):
            if r.finished:
                continue
            r.output_ids.append(tok)
            if r.shares_prompt:
                self._share_prompt(r)
            if len(r.output_ids) == 1:
                self.counters["prompt_tokens"] += r.prompt_len
                self.counters["prefix_hit_tokens"] += r.cached_tokens
            events.append(TokenEvent(r, tok, None if logprobs is None else logprobs[i]))
        return events

    def _share_prompt(self, r: Request) -> None:
        """Put a leader's computed prompt pages in the prefix cache (its first token is back, so they
        are computed), and hold them through the cache, so that its n - 1 samples reuse them."""
        r.shares_prompt = False
        n_full = min(r.prompt_len // self.ps, len(r.pages))
        if r.state is not State.RUNNING or n_full == 0 or r.dropped_pages > r.shared_pages:
            return  # preempted with this token in flight (its release cached what it computed), or its
            # prompt's first pages are gone behind the window
        tokens = r.prompt_ids[: n_full * self.ps]
        self.cache.insert(tokens, r.pages[:n_full], r.cache_salt)  # a page the tree holds in another stays r's own
        _, node = self.cache.match(tokens, r.cache_salt)
        self.cache.lock(node)
        if r.prefix_node is not None:
            self.cache.unlock(r.prefix_node)
        r.prefix_node = node

    def unschedule(self, batch: ScheduledBatch) -> None:
        """Take back a batch that failed before its tokens were computed and sampled, so that its
        requests' uncomputed tokens never reach the prefix cache when they are released."""
        for r, start, sampled in zip(batch.requests, batch.starts, batch.samples):
            r.num_computed = start
            r.num_scheduled_outputs -= sampled

    def finish(self, r: Request, reason: FinishReason, error: str | None = None, cache: bool = True) -> list[int]:
        """End r and release its pages. cache False: none of its own pages go to the prefix cache; returns
        them (freed), for the caller to clear."""
        freed = []
        if r.state is State.RUNNING:
            freed = self._release(r, cache)
        elif r in self.waiting:
            self.waiting.remove(r)
        r.finish_reason, r.error, r.state = reason, error, State.FINISHED
        self.counters[f"finished_{reason.value}"] += 1
        return freed


def _path(node):
    while node is not None and node.parent is not None:
        yield node
        node = node.parent
