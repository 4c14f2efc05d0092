"""The phase router: one backend serves prefill steps, another (or the same) serves decode steps."""

from __future__ import annotations

from flexsgl.attention.base import ForwardBatch
from flexsgl.attention.registry import Choice, backend_class
from flexsgl.cache.pool import KVPool


class PhaseRouter:
    """Builds the backends a `Choice` names, once each, over the one KV pool."""

    def __init__(self, choice: Choice, pool: KVPool, num_heads: int, compiled: bool):
        built = {}
        for spec in (choice.prefill, choice.decode):
            if spec.target not in built:
                built[spec.target] = backend_class(spec)(pool, num_heads=num_heads, compiled=compiled)
        self.prefill = built[choice.prefill.target]
        self.decode = built[choice.decode.target]  # graph hooks go to this one
        self.label = choice.label

    def for_batch(self, fb: ForwardBatch):
        return self.decode if fb.mode == "decode" else self.prefill
