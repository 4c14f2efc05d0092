"""The CUDA-graph manager: captures decode steps for a list of batch sizes and replays them.

One manager serves every attention backend. It owns the static input buffers (token ids,
positions, KV slots, page table, lengths) sized for the largest batch; a captured batch size reads
the leading rows. Capture goes largest size first into one memory pool:

    bind_graph(bs, static batch) -> fill(bs, dummy batch) -> warm up -> record
    replay:                          fill(bs, step's batch) -> replay

`fill` is the only host routine that writes a step into the buffers, for capture and replay alike:
it copies the inputs, then calls the backend's `fill_graph`. What is recorded is the backend's
`graph_step` (metadata it derives on the device from the static inputs) and then the model. The
runner pads a batch to the next captured size with rows whose KV slot and pages are the reserved
dummy page, so padding never touches a real page.

`emulate=True` (CPU tests) runs the bound forward on the static buffers instead of a graph: the
buffer, bind and fill logic is the same, only the recording is skipped.
"""

from __future__ import annotations

from typing import Callable

import torch

from flexsgl.attention.base import ForwardBatch
from flexsgl.cache.pool import DUMMY_PAGE
from flexsgl.log import progress

# Inputs that change from step to step; q_lens, q_offsets and logits_index are fixed for decode.
STEP_INPUTS = ("input_ids", "positions", "out_slots", "page_table", "seq_lens")


class GraphManager:
    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], backend, device: torch.device,
                 sizes, table_width: int, num_kv_pages: int, page_size: int, emulate: bool = False):
        self.forward, self.backend, self.device = forward, backend, device
        self.sizes = sorted(set(sizes), reverse=True)
        self.table_width, self.num_kv_pages, self.page_size = table_width, num_kv_pages, page_size
        self.emulate = emulate
        n = self.sizes[0]
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.long, device=device)
        self.buffers = {
            "input_ids": torch.zeros(n, **i64),
            "positions": torch.zeros(n, **i64),
            "out_slots": torch.full((n,), DUMMY_PAGE * page_size, **i64),
            "page_table": torch.full((n, table_width), DUMMY_PAGE, **i32),
            "seq_lens": torch.ones(n, **i32),
            "q_lens": torch.ones(n, **i32),
            "q_offsets": torch.arange(n, **i32),
            "logits_index": torch.arange(n, **i64),
        }
        backend.init_graph_state(n, table_width)
        self.batches: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def static_batch(self, bs: int) -> ForwardBatch:
        views = {k: v[:bs] for k, v in self.buffers.items()}
        return ForwardBatch(mode="decode", max_q_len=1, num_kv_pages=self.num_kv_pages, backend=self.backend,
                            **views)

    def dummy_batch(self, bs: int) -> ForwardBatch:
        """A batch of padding rows only: one token each, on the dummy page."""
        fb = self.static_batch(bs)
        for name in STEP_INPUTS:
            setattr(fb, name, getattr(fb, name).clone())
        fb.input_ids.zero_(), fb.positions.zero_(), fb.seq_lens.fill_(1), fb.page_table.fill_(DUMMY_PAGE)
        fb.out_slots.fill_(DUMMY_PAGE * self.page_size)
        fb.host_seq_lens, fb.host_q_lens, fb.host_pages = [1] * bs, [1] * bs, [[DUMMY_PAGE]] * bs
        return fb

    def fill(self, bs: int, fb: ForwardBatch) -> None:
        """Write step `fb` (bs rows, padding included) into the buffers the graph for bs reads, then
        let the backend write its metadata for them. fb's page table may be narrower than the
        static one: columns past a request's last page are never read, by any backend."""
        static = self.batches[bs]
        for name in STEP_INPUTS:
            src, dst = getattr(fb, name), getattr(static, name)
            if name == "page_table":
                dst = dst[:, :src.shape[1]]
            dst.copy_(src, non_blocking=True)
        static.host_seq_lens, static.host_q_lens, static.host_pages = fb.host_seq_lens, fb.host_q_lens, fb.host_pages
        self.backend.fill_graph(bs, static)

    def step(self, bs: int, fb: ForwardBatch) -> torch.Tensor:
        """What a graph records: the backend's device-side metadata, then the model."""
        self.backend.graph_step(bs, fb)
        return self.forward(fb)

    def capture(self) -> None:
        pool = None if self.emulate else torch.cuda.graph_pool_handle()
        for bs in progress(self.sizes, desc="capturing decode graphs", unit="graph"):
            fb = self.batches[bs] = self.static_batch(bs)
            self.backend.bind_graph(bs, fb)
            self.fill(bs, self.dummy_batch(bs))
            if self.emulate:
                continue
            # Warm up (compile, autotune, lazy init) outside the graph, on a side stream as capture wants.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.step(bs, fb)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.step(bs, fb)
            pool = graph.pool()
            self.graphs[bs] = graph

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits of a decode batch padded to a captured size."""
        bs = fb.batch_size
        self.fill(bs, fb)
        if self.emulate:
            return self.step(bs, self.batches[bs])
        self.graphs[bs].replay()
        return self.outputs[bs]
