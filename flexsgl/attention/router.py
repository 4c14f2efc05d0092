"""The phase router: one backend serves prefill steps, another (or the same) serves decode steps,
and optionally a third serves decode batches up to a size (`DecodeBySize`)."""

from __future__ import annotations

from flexsgl.attention.base import AttentionBackend, ForwardBatch
from flexsgl.attention.registry import Choice, backend_class
from flexsgl.cache.pool import KVPool


class PhaseRouter:
    """Builds the backends a `Choice` names, once each, over the one KV pool."""

    def __init__(self, choice: Choice, pool: KVPool, num_heads: int, compiled: bool, variants=None):
        """variants: the engine's attention variants (a VariantSet, bound_variant.py), or None."""
        built = {}
        for spec in (choice.prefill, choice.decode, choice.small_decode):
            if spec is not None and spec.target not in built:
                built[spec.target] = backend_class(spec, pool.attention)(pool, num_heads=num_heads, compiled=compiled,
                                                                         variants=variants)
        self.prefill = built[choice.prefill.target]
        self.decode = built[choice.decode.target]  # graph hooks go to this one
        if choice.small_decode is not None:
            self.decode = DecodeBySize(built[choice.small_decode.target], choice.small_decode_max, self.decode)
        self.label = choice.label

    def for_batch(self, fb: ForwardBatch) -> AttentionBackend:
        return self.decode if fb.mode == "decode" else self.prefill


class DecodeBySize(AttentionBackend):
    """One decode backend over two: `small` takes batches of up to `max_small` requests, `large` the
    rest. Every hook goes to the one that owns the batch size, graph hooks included, so a captured
    size is recorded with the backend that replays it; it defines each hook itself rather than take
    a default, so none is left out (tests/test_backend_interface.py). The static declarations
    (`unsupported`, `prefill_scratch_bytes`) are asked of the backends' own classes by the
    registry, before anything is built."""

    def __init__(self, small: AttentionBackend, max_small: int, large: AttentionBackend):
        self.small, self.max_small, self.large = small, max_small, large
        self.name = f"{large.name},{small.name}<={max_small}"
        self.graphable = small.graphable and large.graphable
        self.compiles_per_shape = small.compiles_per_shape or large.compiles_per_shape

    def owner(self, bs: int) -> AttentionBackend:
        return self.small if bs <= self.max_small else self.large

    def prepare(self, fb: ForwardBatch) -> None:
        return self.owner(fb.batch_size).prepare(fb)

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None):
        return self.owner(fb.batch_size).forward(q, cache, fb, variant, sink)

    def expands_latents(self, fb: ForwardBatch) -> bool:
        return self.owner(fb.batch_size).expands_latents(fb)

    def forward_expanded(self, q, w_kv, cache, fb: ForwardBatch):
        return self.owner(fb.batch_size).forward_expanded(q, w_kv, cache, fb)

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        self.small.init_graph_state(min(max_bs, self.max_small), max_pages)
        self.large.init_graph_state(max_bs, max_pages)

    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        return self.owner(bs).bind_graph(bs, fb)

    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        return self.owner(bs).fill_graph(bs, fb)

    def graph_step(self, bs: int, fb: ForwardBatch) -> None:
        return self.owner(bs).graph_step(bs, fb)
