"""The server's Prometheus metrics, in the text exposition format: requests running and waiting,
KV pages, prefix-cache hit tokens, finished requests by reason, and TTFT and TPOT histograms.

The HTTP process's event loop writes them: the engine's counters and gauges as they arrive with
each step (engine_client.py), TTFT and TPOT from when each request's tokens arrive.
"""

from __future__ import annotations

import threading
from collections import Counter

# Seconds; the buckets vLLM uses for TTFT and for time per output token.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self.counts[i] += 1
            self.sum += value
            self.count += 1

    def lines(self, name: str, help: str) -> list[str]:
        with self.lock:
            counts, total, n = list(self.counts), self.sum, self.count
        out = [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {n}', f"{name}_sum {total}", f"{name}_count {n}"]


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.engine_stats: dict = {}  # LLM.stats(), replaced after every step
        self.total_pages = 0
        self.requests_received = 0
        self.finished: Counter = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def render(self) -> str:
        s = self.engine_stats
        gauges = [
            ("num_requests_running", "Requests running (admitted, holding KV pages).", s.get("running", 0)),
            ("num_requests_waiting", "Requests waiting to be admitted.", s.get("waiting", 0)),
            ("kv_pages_used", "KV pages held by running requests.", s.get("pages_running", 0)),
            ("kv_pages_cached", "KV pages held by the prefix cache only (evictable when unreferenced).",
             s.get("pages_cached", 0)),
            ("kv_pages_free", "KV pages free.", s.get("pages_free", 0)),
            ("kv_pages_total", "KV pages in the pool (the dummy page excluded).", self.total_pages),
        ]
        counters = [
            ("prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache.",
             s.get("prefix_hit_tokens", 0)),
            ("prompt_tokens_total", "Prompt tokens of requests that produced a token.", s.get("prompt_tokens", 0)),
            ("requests_received_total", "HTTP requests handed to the engine.", self.requests_received),
            ("preemptions_total", "Requests preempted for KV pages.", s.get("preemptions", 0)),
        ]
        out = []
        for name, help, value in gauges:
            out += [f"# HELP flexsgl_{name} {help}", f"# TYPE flexsgl_{name} gauge", f"flexsgl_{name} {value}"]
        for name, help, value in counters:
            out += [f"# HELP flexsgl_{name} {help}", f"# TYPE flexsgl_{name} counter", f"flexsgl_{name} {value}"]
        name = "flexsgl_requests_finished_total"
        out += [f"# HELP {name} Requests finished, by reason.", f"# TYPE {name} counter"]
        out += [f'{name}{{reason="{r}"}} {n}' for r, n in sorted(dict(self.finished).items())]
        out += self.ttft.lines("flexsgl_time_to_first_token_seconds", "Time from arrival to the first token.")
        out += self.tpot.lines("flexsgl_time_per_output_token_seconds",
                               "Mean time between a request's tokens after its first.")
        return "\n".join(out) + "\n"
