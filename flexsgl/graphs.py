"""The CUDA-graph manager: captures and replays decode steps for a list of batch sizes.

One manager serves every attention backend. It owns the static inputs a graph reads. Per
captured size, one block of bytes holds the step's positions, KV slots, token slots (each row's
slot in the runner's `token_buf`) and lengths, so a step uploads them in one host -> device copy.
The page table `[max size, table width]` is shared: a size reads its leading rows. Capture goes
largest size first into one memory pool:

    bind_graph(bs, static batch) -> load(bs, dummy step) -> warm up -> record
    replay:                          load(bs, step)       -> replay

`load` is the only host routine that writes a step into the buffers, for capture and replay alike:
it uploads the step's inputs, then calls the backend's `fill_graph`. What is recorded is a whole
greedy decode step: the backend's `graph_step` (metadata it derives on the device from the static
inputs), the token ids gathered from `token_buf`, the model, the rows' argmax, and that argmax
written back into `token_buf`. A step whose rows all decode greedily (no penalties, no min_tokens)
needs nothing more than reading its tokens back; any other step samples from the graph's logits
and overwrites its rows' `token_buf` entries. The runner pads a batch to the next captured size
with rows whose KV slot and pages are the reserved dummy page and whose token slot is
`token_buf`'s last entry, which no request holds, so padding never touches a request.

`emulate=True` (CPU tests) runs the bound step on the static buffers instead of a graph: the
buffer, bind and load logic is the same, only the recording is skipped.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from flexsgl.attention.base import ForwardBatch
from flexsgl.cache.pool import DUMMY_PAGE
from flexsgl.log import progress
from flexsgl.sampling import row_argmax

# A page table up to this many entries goes up whole, straight into the static table (one copy);
# a larger one goes up as wide as the step's longest request and is copied into the table's columns.
WHOLE_TABLE_ENTRIES = 1 << 16


class GraphManager:
    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], backend, device: torch.device,
                 sizes, table_width: int, num_kv_pages: int, page_size: int, token_buf: torch.Tensor,
                 emulate: bool = False):
        self.forward, self.backend, self.device = forward, backend, device
        self.sizes = sorted(set(sizes), reverse=True)
        self.table_width, self.num_kv_pages, self.page_size = table_width, num_kv_pages, page_size
        self.token_buf, self.pad_slot = token_buf, token_buf.numel() - 1
        self.emulate = emulate
        n = self.sizes[0]
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.long, device=device)
        self.page_table = torch.full((n, table_width), DUMMY_PAGE, **i32)
        self.fixed = {"q_lens": torch.ones(n, **i32), "q_offsets": torch.arange(n, **i32),
                      "logits_index": torch.arange(n, **i64)}  # the same for every decode step
        self.inputs = {bs: torch.empty(self.input_bytes(bs), dtype=torch.uint8, device=device) for bs in self.sizes}
        for bs in self.sizes:  # padding rows until a step is loaded: what bind_graph sees
            self._upload_inputs(bs, *self._padding(bs)[:4])
        backend.init_graph_state(n, table_width)
        self.batches: dict[int, ForwardBatch] = {}
        self.token_slots: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def input_bytes(bs: int) -> int:
        """Bytes of a size's input block: positions, KV slots and token slots (int64), then lengths (int32)."""
        return bs * (3 * 8 + 4)

    @staticmethod
    def input_views(block, bs: int, int64=torch.int64, int32=torch.int32) -> tuple:
        """(positions, out_slots, token_slots, seq_lens) over a size's input block, a byte array of
        input_bytes(bs): the layout host (numpy, with numpy's dtypes) and device share."""
        i64, i32 = block[:24 * bs].view(int64), block[24 * bs:].view(int32)
        return i64[:bs], i64[bs:2 * bs], i64[2 * bs:], i32

    def static_batch(self, bs: int) -> ForwardBatch:
        positions, out_slots, token_slots, seq_lens = self.input_views(self.inputs[bs], bs)
        self.token_slots[bs] = token_slots
        return ForwardBatch(mode="decode", input_ids=torch.zeros_like(positions), positions=positions,
                            out_slots=out_slots, page_table=self.page_table[:bs], seq_lens=seq_lens,
                            max_q_len=1, num_kv_pages=self.num_kv_pages, backend=self.backend,
                            **{k: v[:bs] for k, v in self.fixed.items()})

    def load(self, bs: int, positions: list[int], out_slots: list[int], token_slots: list[int],
             seq_lens: list[int], tables: list[list[int]]) -> ForwardBatch:
        """Write a step of bs rows (padding included) into the buffers the graph for bs reads, then let
        the backend write its metadata for them; returns the graph's batch. Table columns past a
        request's last page are never read, by any backend."""
        static = self.batches[bs]
        self._upload_inputs(bs, positions, out_slots, token_slots, seq_lens)
        width = self.table_width if bs * self.table_width <= WHOLE_TABLE_ENTRIES else max(map(len, tables))
        table = torch.empty(bs, width, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        rows = table.numpy()
        rows.fill(DUMMY_PAGE)
        for row, pages in zip(rows, tables):
            row[:len(pages)] = pages
        static.page_table[:, :width].copy_(table, non_blocking=True)
        static.host_seq_lens, static.host_q_lens, static.host_pages = seq_lens, [1] * bs, tables
        self.backend.fill_graph(bs, static)
        return static

    def _upload_inputs(self, bs: int, *columns: list[int]) -> None:
        """Pack positions, out_slots, token_slots and seq_lens as the block lays them out, in one copy."""
        host = torch.empty(self.input_bytes(bs), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        for view, values in zip(self.input_views(host.numpy(), bs, np.int64, np.int32), columns):
            view[:] = values
        self.inputs[bs].copy_(host, non_blocking=True)

    def _padding(self, bs: int) -> tuple:
        """load's arguments for bs padding rows: one token each, on the dummy page."""
        return ([0] * bs, [DUMMY_PAGE * self.page_size] * bs, [self.pad_slot] * bs, [1] * bs, [[DUMMY_PAGE]] * bs)

    def step(self, bs: int, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph records: (logits, each row's argmax), that argmax also written into token_buf."""
        self.backend.graph_step(bs, fb)
        slots = self.token_slots[bs]
        fb.input_ids = self.token_buf[slots]
        logits = self.forward(fb)
        greedy = row_argmax(logits)
        self.token_buf.index_copy_(0, slots, greedy)
        return logits, greedy

    def capture(self) -> None:
        pool = None if self.emulate else torch.cuda.graph_pool_handle()
        for bs in progress(self.sizes, desc="capturing decode graphs", unit="graph"):
            fb = self.batches[bs] = self.static_batch(bs)
            self.backend.bind_graph(bs, fb)
            self.load(bs, *self._padding(bs))
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

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, argmax per row) of a loaded step; its argmax is already in token_buf."""
        bs = fb.batch_size
        if self.emulate:
            return self.step(bs, self.batches[bs])
        self.graphs[bs].replay()
        return self.outputs[bs]
