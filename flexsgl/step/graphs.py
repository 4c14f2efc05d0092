"""The CUDA-graph manager: captures and replays decode steps for a list of batch sizes.

One manager serves every attention backend. It owns the static inputs a graph reads. Per
captured size, one block of bytes holds the step's positions, KV slots, token slots (each row's
slot in the token buffer) and lengths, so a step uploads them in one host -> device copy. The
page table `[max size, table width]` is shared: a size reads its leading rows. step/inputs.py
writes every step into these buffers, the padding step a size is captured on as well as the steps
it replays. Capture goes largest size first into one memory pool:

    capture: (padding step written) -> bind_graph(bs, static batch) -> fill_graph -> warm up -> record
    replay:  (step written)         ->                                   fill_graph -> replay

`fill_graph` is the backend's one host routine that writes a step's metadata for its graph, at
capture and replay alike. What is recorded is a whole greedy decode step: the backend's
`graph_step` (metadata it derives on the device from the static inputs), the token ids read from
the token buffer, the model, the rows' argmax (`argmax`: under tensor parallelism over the ranks'
vocabulary slices, with each row's finiteness), and that argmax written back into the token buffer.
A step whose rows all decode greedily (no penalties, no min_tokens) needs nothing more than reading
its tokens back; any other step samples from the graph's logits and overwrites its rows' tokens.
Padding rows (step/plan.py) read and write the token buffer's pad slot, which no request holds.

`emulate=True` (CPU tests) runs the bound step on the static buffers instead of a graph: the
buffer, bind and fill logic is the same, only the recording is skipped.
"""

from __future__ import annotations

from typing import Callable

import torch

from flexsgl.attention.base import ForwardBatch
from flexsgl.cache.pool import DUMMY_PAGE
from flexsgl.step.token_buffer import TokenBuffer


class GraphManager:
    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], argmax: Callable, backend,
                 device: torch.device, sizes, table_width: int, num_kv_pages: int, tokens: TokenBuffer,
                 emulate: bool = False):
        """`forward`: the decode step's model call; `argmax`: the model's (CausalLM.argmax)."""
        self.forward, self.argmax, self.backend, self.device = forward, argmax, backend, device
        self.sizes = sorted(set(sizes), reverse=True)
        self.tokens, self.emulate = tokens, emulate
        n = self.sizes[0]
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.long, device=device)
        self.page_table = torch.full((n, table_width), DUMMY_PAGE, **i32)
        fixed = {"q_lens": torch.ones(n, **i32), "q_offsets": torch.arange(n, **i32),
                 "logits_index": torch.arange(n, **i64)}  # the same for every decode step
        self.inputs = {bs: torch.empty(self.input_bytes(bs), dtype=torch.uint8, device=device) for bs in self.sizes}
        backend.init_graph_state(n, table_width)
        self.token_slots: dict[int, torch.Tensor] = {}
        self.batches: dict[int, ForwardBatch] = {}
        for bs in self.sizes:
            positions, out_slots, self.token_slots[bs], seq_lens = self.input_views(self.inputs[bs], bs)
            self.batches[bs] = ForwardBatch(
                mode="decode", input_ids=torch.zeros_like(positions), positions=positions, out_slots=out_slots,
                page_table=self.page_table[:bs], seq_lens=seq_lens, max_q_len=1, num_kv_pages=num_kv_pages,
                backend=backend, req_slots=self.token_slots[bs], **{k: v[:bs] for k, v in fixed.items()})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pool = None if emulate else torch.cuda.graph_pool_handle()

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

    def step(self, bs: int, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a graph records: (logits, each row's argmax, each row's finiteness or None), as the
        model's `argmax` gives them; that argmax also written into the token buffer."""
        self.backend.graph_step(bs, fb)
        slots = self.token_slots[bs]
        fb.input_ids = self.tokens.read(slots)
        logits = self.forward(fb)
        greedy, finite = self.argmax(logits)
        self.tokens.write(slots, greedy)
        return logits, greedy, finite

    def capture(self, bs: int) -> None:
        """Record size bs over the step its buffers hold (sizes largest first, into one memory pool)."""
        fb = self.batches[bs]
        self.backend.bind_graph(bs, fb)
        self.backend.fill_graph(bs, fb)
        if self.emulate:
            return
        # Warm up (compile, autotune, lazy init) outside the graph, on a side stream as capture wants.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(bs, fb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.outputs[bs] = self.step(bs, fb)
        self._pool = graph.pool()
        self.graphs[bs] = graph

    def release(self, sync: bool = True) -> None:
        """Destroy the captured graphs (no step replays afterwards). A tensor-parallel rank does this
        before it leaves its process group: NCCL's communicator is not destroyed while a graph that
        captured its collectives lives (pytorch/pytorch#115388). `sync`: wait for the device to
        finish what it runs first (not where a peer died and a collective may never finish)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self._pool = None
        if sync and not self.emulate:
            torch.cuda.synchronize(self.device)

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """step's outputs for a written step; its argmax is already in the token buffer."""
        bs = fb.batch_size
        self.backend.fill_graph(bs, fb)
        if self.emulate:
            return self.step(bs, fb)
        self.graphs[bs].replay()
        return self.outputs[bs]
