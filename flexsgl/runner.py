"""Runs one scheduled batch: builds the ForwardBatch, runs the (compiled) model, samples on the device.

A step copies its host metadata to the device in a few packed transfers (from pinned memory on
CUDA; a decode step replayed from a CUDA graph goes straight into the graph's buffers, graphs.py)
and copies the sampled tokens back asynchronously; nothing in it waits for the device. The host
reads a step's tokens only after it has launched the next one (see scheduler.py). Decode feeds
each request the token it sampled last, which stays on the device in `token_buf` (a slot per
running request, and a last one that padding rows read and write).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Callable

import numpy as np
import torch

from flexsgl.attention.base import ForwardBatch
from flexsgl.attention.router import PhaseRouter
from flexsgl.cache.pool import DUMMY_PAGE, KVPool
from flexsgl.compile import MIN_COMPILED_SIZE, compile_steps, decode_buckets
from flexsgl.graphs import GraphManager
from flexsgl.log import logger
from flexsgl.sampling import batch as sampling_batch
from flexsgl.request import TokenLogprobs
from flexsgl.sampling.sampler import sample, token_logprobs
from flexsgl.scheduler import ScheduledBatch
from flexsgl.sampling.token_counts import TokenCounts

NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}  # _upload's host dtypes


@dataclass
class StepOutput:
    """A launched step's sampled tokens on their way to the host: token ids [S] int64, or, when a
    request asked for log-probabilities, token_logprobs' packed rows [S, 2 + 2k] float32."""

    batch: ScheduledBatch
    host_tokens: torch.Tensor
    ready: torch.cuda.Event | None
    logprobs: list[TokenLogprobs | None] | None = None  # per sampled row, set by tokens()
    wait: Callable[[torch.cuda.Event], None] | None = None  # how to wait for `ready` (default: synchronize)

    def tokens(self) -> list[int]:
        """Wait for the step (the one read-back per step) and return its tokens."""
        if self.ready is not None:
            self.ready.synchronize() if self.wait is None else self.wait(self.ready)
        if self.host_tokens.dim() == 1:
            return self.host_tokens.tolist()
        rows = self.host_tokens.tolist()
        k = (len(rows[0]) - 2) // 2
        sampled = [r for r, s in zip(self.batch.requests, self.batch.samples) if s]
        self.logprobs = [None if r.sampling.logprobs is None else
                         TokenLogprobs(int(row[0]), row[1], [(int(i), v) for i, v in
                                                             zip(row[2 + k:2 + k + r.sampling.logprobs], row[2:])])
                         for r, row in zip(sampled, rows)]
        return [int(row[0]) for row in rows]


@dataclass
class StepPlan:
    """One step as host lists (picklable): what `ModelRunner.upload` turns into device tensors.
    Rank 0 makes it from a ScheduledBatch; under tensor parallelism every rank executes the same one."""

    mode: str
    tables: list[list[int]]  # page table rows, padding rows included
    width: int  # the uploaded table's width (a step replayed from a CUDA graph lays out its own)
    seq_lens: list[int]
    q_lens: list[int]
    offsets: list[int]
    ids: list  # token ids to feed (prefill; decode feeds token_buf[decode_slots])
    positions: list
    slots: list  # KV slot of each token
    logits_index: list[int]
    decode_slots: list[int]
    write_slots: list[int]  # token_buf slot of each sampled row
    sampling_i64: dict
    sampling_f32: dict
    flags: sampling_batch.HostFlags
    num_kv_pages: int


class ModelRunner:
    def __init__(self, model, pool: KVPool, backends: PhaseRouter, device: torch.device, max_running: int,
                 max_len: int, compile: bool):
        self.model, self.pool, self.backends, self.device = model, pool, backends, device
        self.tp = None  # the tensor-parallel group's channel on rank 0 (flexsgl/distributed/worker.py)
        self.wait = None  # how rank 0 waits for a step's tokens (under tensor parallelism: watching the ranks)
        self.compiled = compile
        self.max_len = max_len
        self.token_buf = torch.zeros(max_running + 1, dtype=torch.long, device=device)  # last token per slot
        self.pad_slot = max_running  # padding rows' slot in token_buf
        self.token_counts = TokenCounts(max_running, model.cfg.vocab_size, device)  # for penalties
        # Compiled steps keep shapes few: decode batches padded to buckets, page tables full width.
        self.table_width = KVPool.num_pages_for(max_len, pool.page_size) if compile else None
        self.buckets = decode_buckets(backends.decode.compiles_per_shape, max_running)
        self.graphs: GraphManager | None = None
        self.capture_s = 0.0
        self._prefill, self._decode = self._prefill_forward, self._decode_forward
        if compile:
            self._prefill, self._decode = compile_steps(model, self._prefill_forward, self._decode_forward, device)

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling so far."""
        return sum(getattr(step, "compile_s", 0.0) for step in (self._prefill, self._decode))

    def capture_graphs(self, sizes=None, emulate: bool = False) -> None:
        """Capture decode steps as CUDA graphs for `sizes` (default: the decode buckets).
        emulate: run the static-buffer path without recording (CPU tests)."""
        backend = self.backends.decode
        if not backend.graphable:
            logger.info(f"CUDA graphs off: the {backend.name} decode backend cannot be captured; "
                        "decode runs without them")
            return
        sizes = sorted(set(sizes or self.buckets))
        if sizes[-1] > self.buckets[-1]:
            raise ValueError(f"CUDA graph batch sizes go up to max_running_requests ({self.buckets[-1]}), "
                             f"got {sizes[-1]}.")
        self.table_width = self.table_width or KVPool.num_pages_for(self.max_len, self.pool.page_size)
        self.graphs = GraphManager(self._decode, backend, self.device, sizes, self.table_width,
                                   self.pool.num_pages, self.pool.page_size, self.token_buf, emulate=emulate)
        compiled_before, t0 = self.compile_s, time.perf_counter()
        with torch.inference_mode():
            self.graphs.capture()
        took, compiling = time.perf_counter() - t0, self.compile_s - compiled_before
        self.capture_s += took
        logger.info(f"captured {len(sizes)} decode graphs in {took:.1f}s"
                    + (f" ({compiling:.1f}s of it compiling)" if compiling else ""))
        # Decode batches pad to a captured size; larger ones to the compile buckets above it.
        self.buckets = sizes + [b for b in self.buckets if b > sizes[-1]]

    def _prefill_forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb.input_ids, fb.positions, fb)

    def _decode_forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Launch `batch`: plan it on the host, upload, run the model and sample (nothing waits for the
        device). Under tensor parallelism the plan goes to every other rank first, which executes it."""
        if self.tp is None:
            built = self.build(batch)
        else:
            plan = self.plan(batch)
            self.tp.send_step(plan)
            try:
                return self._forward_sample(batch, *self.upload(plan))
            except Exception as e:  # the other ranks run this step: they may now wait on rank 0 forever
                raise self.tp.failed(e) from e
        return self._forward_sample(batch, *built)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> None:
        """A tensor-parallel worker's step: the plan rank 0 made, run as rank 0 runs it (the same
        sampled tokens land in token_buf and the token counts); nothing is read back."""
        self._forward_sample(None, *self.upload(plan))

    def _forward_sample(self, batch, fb: ForwardBatch, st, write_slots, n_sampled) -> StepOutput | None:
        greedy = None  # each row's argmax, where a CUDA graph took it (and wrote it into token_buf)
        if self._graphed(fb.mode, fb.batch_size):
            logits, greedy = self.graphs.replay(fb)
            greedy = greedy[:n_sampled]
        else:
            fb.backend = self.backends.for_batch(fb)
            fb.backend.prepare(fb)
            logits = (self._decode if fb.mode == "decode" else self._prefill)(fb)
        tokens = sample(logits[:n_sampled], st, argmax=greedy)
        if tokens is not greedy:  # sampled here: the graph's argmax in token_buf is not the token
            self.token_buf.index_copy_(0, write_slots, tokens)
        self.token_counts.record(write_slots, tokens)
        if batch is None:  # a worker: rank 0 alone reads tokens back
            return None
        if st.logprobs >= 0:
            tokens = token_logprobs(logits[:n_sampled], tokens, st.logprobs)
        if self.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            return StepOutput(batch, host, ready, wait=self.wait)
        return StepOutput(batch, tokens, None)

    def build(self, batch: ScheduledBatch):
        """(ForwardBatch, SamplingTensors, write_slots, rows sampled) of `batch` on the device."""
        return self.upload(self.plan(batch))

    def plan(self, batch: ScheduledBatch) -> StepPlan:
        """The host side of a step: every list the device needs, from the scheduled requests."""
        ps = self.pool.page_size
        reqs, decode = batch.requests, batch.mode == "decode"
        n_real = len(reqs)
        # Padding rows: one token each, written to the dummy page, attending to nothing of a request.
        pad = 0
        if decode and (self.compiled or self.graphs is not None):
            pad = next(b for b in self.buckets if b >= n_real) - n_real
        elif self.compiled:  # a lone prompt gets a padding row: see MIN_COMPILED_SIZE
            pad = max(0, MIN_COMPILED_SIZE - n_real)
        tables = [r.pages for r in reqs] + [[DUMMY_PAGE]] * pad
        seq_lens = [s + n for s, n in zip(batch.starts, batch.num_new)] + [1] * pad
        q_lens = list(batch.num_new) + [1] * pad
        if decode:  # one token per request, at its next position
            ids, positions = [], list(batch.starts) + [0] * pad
            slots = [r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, batch.starts)] + [DUMMY_PAGE * ps] * pad
            offsets = list(range(n_real + pad))
        else:  # thousands of tokens: per-request numpy ranges (a per-token loop cost ~1.3 ms per 8k tokens)
            one = np.zeros(1, dtype=np.int64)
            ids = [np.asarray(r.fill_ids[s:s + n]) for r, s, n in zip(reqs, batch.starts, batch.num_new)] + [one] * pad
            positions = [np.arange(s, s + n) for s, n in zip(batch.starts, batch.num_new)] + [one] * pad
            slots = ([np.asarray(r.pages)[p // ps] * ps + p % ps for r, p in zip(reqs, positions)]
                     + [one + DUMMY_PAGE * ps] * pad)
            offsets = [0, *accumulate(q_lens)][:-1]
        width = max(len(t) for t in tables)
        if self.table_width and not self._narrow_table_ok(decode):
            width = self.table_width  # a static-shape compiled step: the full width, one shape
        sampled = [r for r, s in zip(reqs, batch.samples) if s]
        logits_index = [o + n - 1 for o, n, s in zip(offsets, q_lens, batch.samples) if s]
        if decode:
            logits_index = list(range(n_real + pad))  # pad rows too: static shapes; sampled rows come first
        elif self.compiled:  # rows past the sampled ones are computed and dropped: see MIN_COMPILED_SIZE
            logits_index += [offsets[-1]] * (MIN_COMPILED_SIZE - len(logits_index))
        sampling_i64, sampling_f32 = sampling_batch.host_parts(sampled, not decode)
        return StepPlan(
            mode=batch.mode, tables=tables, width=width, seq_lens=seq_lens, q_lens=q_lens, offsets=offsets,
            ids=ids, positions=positions, slots=slots, logits_index=logits_index,
            decode_slots=[r.slot for r in reqs] + [self.pad_slot] * pad, write_slots=[r.slot for r in sampled],
            sampling_i64=sampling_i64, sampling_f32=sampling_f32, flags=sampling_batch.host_flags(sampled),
            num_kv_pages=self.pool.num_pages if self.table_width else max(chain.from_iterable(tables)) + 1)

    def upload(self, plan: StepPlan):
        """The device side of a plan: its packed uploads and the batch and sampling tensors over them."""
        tables, width, decode = plan.tables, plan.width, plan.mode == "decode"
        if self._graphed(plan.mode, len(tables)):  # into the graph's own buffers
            fb = self.graphs.load(len(tables), plan.positions, plan.slots, plan.decode_slots, plan.seq_lens, tables)
            i64 = self._upload(torch.int64, **plan.sampling_i64)
            f32 = self._upload(torch.float32, **plan.sampling_f32)
            write_slots = self.graphs.token_slots[fb.batch_size][:plan.flags.rows]  # decode: every request samples
            st = sampling_batch.make_tensors(plan.flags, i64, f32, self.token_counts, write_slots)
            return fb, st, write_slots, plan.flags.rows
        table = list(chain.from_iterable(t + [DUMMY_PAGE] * (width - len(t)) for t in tables))
        i32 = self._upload(torch.int32, page_table=table, seq_lens=plan.seq_lens, q_lens=plan.q_lens,
                           q_offsets=plan.offsets)
        i64 = self._upload(
            torch.int64, input_ids=plan.ids, positions=plan.positions, out_slots=plan.slots,
            logits_index=plan.logits_index, decode_slots=plan.decode_slots, write_slots=plan.write_slots,
            **plan.sampling_i64)
        f32 = self._upload(torch.float32, **plan.sampling_f32)
        input_ids = self.token_buf[i64["decode_slots"]] if decode else i64["input_ids"]
        fb = ForwardBatch(
            mode=plan.mode, input_ids=input_ids, positions=i64["positions"], out_slots=i64["out_slots"],
            page_table=i32["page_table"].view(len(tables), width), seq_lens=i32["seq_lens"],
            q_lens=i32["q_lens"], q_offsets=i32["q_offsets"], logits_index=i64["logits_index"],
            max_q_len=max(plan.q_lens), num_kv_pages=plan.num_kv_pages,
            host_seq_lens=plan.seq_lens, host_q_lens=plan.q_lens, host_pages=tables,
        )
        st = sampling_batch.make_tensors(plan.flags, i64, f32, self.token_counts, i64["write_slots"])
        return fb, st, i64["write_slots"], plan.flags.rows

    def _graphed(self, mode: str, bs: int) -> bool:
        """Whether a step runs as a CUDA graph's replay."""
        return mode == "decode" and self.graphs is not None and bs in self.graphs.batches

    def _narrow_table_ok(self, decode: bool) -> bool:
        """Whether this step may upload its page table only as wide as its longest request (at batch
        256 the full width is ~160k entries per step): yes where a kernel override reads the table
        inside a dynamically compiled step. Compiled flex keeps the full width: its BlockMask shapes
        follow the table's, and a width that changed every step has not been checked on the GPU for
        recompiles. A step replayed from a CUDA graph does not ask: the graph manager lays out its
        table itself (graphs.py)."""
        backend = self.backends.decode if decode else self.backends.prefill
        return self.device.type == "cuda" and not backend.compiles_per_shape

    def _upload(self, dtype: torch.dtype, **parts) -> dict[str, torch.Tensor]:
        """One host -> device copy for all `parts` (each a list of numbers or of numpy arrays), from
        pinned memory on CUDA; returns views by name."""
        if not parts:
            return {}
        pieces = {name: v if v and isinstance(v[0], np.ndarray) else [v] for name, v in parts.items()}
        sizes = [sum(len(p) for p in ps) for ps in pieces.values()]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=self.device.type == "cuda")
        np.concatenate([np.asarray(p, dtype=NUMPY[dtype]) for ps in pieces.values() for p in ps], out=host.numpy())
        dev = host.to(self.device, non_blocking=True)
        out, at = {}, 0
        for name, n in zip(pieces, sizes):
            out[name] = dev[at:at + n]
            at += n
        return out
