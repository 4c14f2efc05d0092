"""The server's Prometheus metrics (prometheus_client), named as vLLM's under a `flexsgl:` prefix,
each with a `model_name` label.

Requests are counted as requests: one HTTP request (whatever its prompts and n) is one request in
every counter and histogram here, and its tokens are all its choices' tokens.

- Gauges (the engine's, once it is ready and after every step): num_requests_running,
  num_requests_waiting (engine requests: one per choice, as the scheduler holds them),
  kv_cache_usage_perc (the share of KV pages held by running requests, 0 to 1), kv_pages_used,
  kv_pages_cached, kv_pages_free, kv_pages_total.
- Counters: prompt_tokens_total, generation_tokens_total, request_success_total (by
  finished_reason: stop, length, abort, error; a request whose choices ended differently counts
  under the first of error, abort, length, stop), prefix_cache_queries_total and
  prefix_cache_hits_total (prompt tokens looked up, and found, in the prefix cache; the engine's),
  num_preemptions_total.
- Histograms (seconds): time_to_first_token_seconds, inter_token_latency_seconds (every gap between
  a choice's token arrivals) and time_per_output_token_seconds (the same gaps: vLLM's older name
  for them), request_time_per_output_token_seconds (a request's mean gap),
  e2e_request_latency_seconds, request_queue_time_seconds (its longest wait for admission),
  request_prefill_time_seconds (admission to the first token), request_decode_time_seconds (first
  token to last), request_inference_time_seconds (admission to the last token), and
  request_prompt_tokens and request_generation_tokens.

The HTTP process's event loop writes them: the engine's gauges and counters as they arrive with
each step (engine_client.py), latencies from when each request's events arrive.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (the /metrics media type)

prometheus_client.disable_created_metrics()  # no `_created` series beside each counter and histogram

PREFIX = "flexsgl:"
# Seconds; vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_ORDER = ("error", "abort", "length", "stop")


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, label, registry=self.registry).labels(model_name)

        def counter(name, doc, extra=()):
            c = Counter(PREFIX + name, doc, label + list(extra), registry=self.registry)
            return c if extra else c.labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        self.running = gauge("num_requests_running", "Engine requests running (admitted, holding KV pages).")
        self.waiting = gauge("num_requests_waiting", "Engine requests waiting to be admitted.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV pages held by running requests (0 to 1).")
        self.pages_used = gauge("kv_pages_used", "KV pages held by running requests.")
        self.pages_cached = gauge("kv_pages_cached", "KV pages held by the prefix cache only (evictable).")
        self.pages_free = gauge("kv_pages_free", "KV pages free.")
        self.pages_total = gauge("kv_pages_total", "KV pages in the pool (the dummy page excluded).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests.")
        self.success = counter("request_success", "Requests finished, by finish reason.", ["finished_reason"])
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Engine requests preempted for KV pages.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to a request's first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's token arrivals.", ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time between a request's token arrivals (vLLM's "
                              "older name of inter_token_latency_seconds).", ITL_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds", "A request's mean time between "
                                      "tokens after its first.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to a request's end.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time a request waited to be admitted.",
                               LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from a request's admission to its "
                                      "first token.", LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from a request's first token to its "
                                     "last.", LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Time from a request's admission to its "
                                        "last token.", LATENCY_BUCKETS)
        self.prompt_hist = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_hist = histogram("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self._seen = {"prefix_queries": 0, "prefix_hits": 0, "preemptions": 0}

    def engine(self, stats: dict, total_pages: int) -> None:
        """The engine's stats after a step (LLM.stats())."""
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        used = stats.get("pages_running", 0)
        self.pages_used.set(used)
        self.pages_cached.set(stats.get("pages_cached", 0))
        self.pages_free.set(stats.get("pages_free", 0))
        self.pages_total.set(total_pages)
        self.kv_usage.set(used / total_pages if total_pages else 0.0)
        for key, stat, counter in (("prefix_queries", "prompt_tokens", self.cache_queries),
                                   ("prefix_hits", "prefix_hit_tokens", self.cache_hits),
                                   ("preemptions", "preemptions", self.preemptions)):
            value = stats.get(stat, 0)
            if value > self._seen[key]:
                counter.inc(value - self._seen[key])
                self._seen[key] = value

    def token_gap(self, seconds: float) -> None:
        """The time between two of a choice's token arrivals."""
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def generated(self, tokens: int, admitted: float, first: float, last: float) -> None:
        """A request's token times (perf_counter seconds): when it was admitted and its first and
        last tokens arrived, `tokens` the most one choice generated."""
        if tokens > 1:
            self.request_tpot.observe((last - first) / (tokens - 1))
        self.prefill_time.observe(max(first - admitted, 0.0))
        self.decode_time.observe(last - first)
        self.inference_time.observe(max(last - admitted, 0.0))

    def finished(self, reasons: list[str], prompt_tokens: int, generated: int, e2e: float,
                 queue: float | None) -> None:
        """One request's end: its choices' finish reasons and token counts, its latency and queue time."""
        reason = next((r for r in FINISH_ORDER if r in reasons), reasons[0] if reasons else "abort")
        self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.prompt_hist.observe(prompt_tokens)
        self.generation_hist.observe(generated)
        self.e2e.observe(e2e)
        if queue is not None:
            self.queue.observe(queue)

    def render(self) -> bytes:
        return generate_latest(self.registry)
