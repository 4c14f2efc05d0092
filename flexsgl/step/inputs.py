"""The device side of a step: a StepPlan's packed host -> device copies, and the ForwardBatch and
sampling tensors over them. Every step, graphed or direct, is uploaded here.

A direct step goes up in at most three copies, from pinned memory on CUDA: int32 (page table and
lengths), int64 (token ids, positions, KV slots, logits rows, token slots, sampling parameters)
and float32 (sampling parameters; none where every row is greedy). A step that replays a CUDA
graph writes into the graph's own buffers (graphs.py): its positions, KV slots, token slots and
lengths in one copy into the size's input block, its page table in another into the static
table, then its sampling parameters, if any, as a direct step does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flexsgl.sampling import batch as sampling_batch
from flexsgl.attention.base import ForwardBatch
from flexsgl.cache.pool import DUMMY_PAGE
from flexsgl.step.graphs import GraphManager
from flexsgl.sampling.sampler import SamplingTensors
from flexsgl.step.plan import StepPlan
from flexsgl.step.token_buffer import TokenBuffer
from flexsgl.sampling.token_counts import TokenCounts

NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}  # pack's host dtypes


@dataclass
class StepInputs:
    """A step on the device, ready to run."""

    fb: ForwardBatch
    sampling: SamplingTensors
    write_slots: torch.Tensor  # the token buffer slot of each sampled row
    rows: int  # rows sampled (they come first among the logits rows)
    graphed: bool  # replays a CUDA graph: fb is the graph's static batch
    prompt_targets: torch.Tensor | None = None  # [P] int64: the prompt token each next logits row predicts
    prompt_k: int = 0  # top log-probabilities of prompt tokens
    keep_logits: bool = False  # StepPlan.keep_logits

    @property
    def whole_logits(self) -> bool:
        """Whether the step reads its logits over the whole vocabulary (under tensor parallelism,
        gathered from the ranks), not only each row's argmax of its race values (sampler.race)."""
        return self.keep_logits or self.prompt_targets is not None or not self.sampling.races_only


def upload(plan: StepPlan, device: torch.device, tokens: TokenBuffer, counts: TokenCounts,
           graphs: GraphManager | None, variants=None) -> StepInputs:
    """The plan's inputs on the device: into the graph's buffers where it replays one, else fresh;
    a prefill's attention-variant parameters go into `variants`' tensors at its requests' slots."""
    if plan.graphed:
        fb = _into_graph(plan, graphs, device)
        i64 = pack(device, torch.int64, **plan.sampling_i64)
        write_slots = graphs.token_slots[fb.batch_size][:plan.flags.rows]  # decode: every request samples
    else:
        table = page_table(plan.tables, plan.width, np.empty((len(plan.tables), plan.width), dtype=np.int32))
        i32 = pack(device, torch.int32, page_table=[table.ravel()], seq_lens=plan.seq_lens, q_lens=plan.q_lens,
                   q_offsets=plan.offsets)
        i64 = pack(device, torch.int64, input_ids=plan.ids, positions=plan.positions, out_slots=plan.slots,
                   logits_index=plan.logits_index, decode_slots=plan.decode_slots, write_slots=plan.write_slots,
                   **({"prompt_targets": list(plan.prompt_targets)} if plan.prompt_targets else {}),
                   **plan.sampling_i64, **plan.variant_i64)
        fb = ForwardBatch(
            mode=plan.mode, input_ids=tokens.read(i64["decode_slots"]) if plan.mode == "decode" else i64["input_ids"],
            positions=i64["positions"], out_slots=i64["out_slots"],
            page_table=i32["page_table"].view(len(plan.tables), plan.width), seq_lens=i32["seq_lens"],
            q_lens=i32["q_lens"], q_offsets=i32["q_offsets"], logits_index=i64["logits_index"],
            max_q_len=max(plan.q_lens), num_kv_pages=plan.num_kv_pages,
            host_seq_lens=plan.seq_lens, host_q_lens=plan.q_lens, host_pages=plan.tables,
            req_slots=i64["decode_slots"])
        write_slots = i64["write_slots"]
    f32 = pack(device, torch.float32, **plan.sampling_f32, **plan.variant_f32)
    if variants is not None and (plan.variant_i64 or plan.variant_f32):
        n = len(next(iter({**plan.variant_i64, **plan.variant_f32}.values())))
        values = {name.removeprefix("variant_"): t for name, t in {**i64, **f32}.items() if name.startswith("variant_")}
        variants.write(fb.req_slots[:n], values)
    st = sampling_batch.make_tensors(plan.flags, i64, f32, counts, write_slots)
    return StepInputs(fb, st, write_slots, plan.flags.rows, plan.graphed, i64.get("prompt_targets"), plan.prompt_k,
                      plan.keep_logits)


def _into_graph(plan: StepPlan, graphs: GraphManager, device: torch.device) -> ForwardBatch:
    """Write a graphed step (padding rows included) into the buffers its graph reads; returns the
    graph's batch. Table columns past the plan's width keep an earlier step's pages: no backend reads
    a column past a request's last page."""
    bs, width, pinned = len(plan.tables), plan.width, device.type == "cuda"
    fb = graphs.batches[bs]
    block = torch.empty(GraphManager.input_bytes(bs), dtype=torch.uint8, pin_memory=pinned)
    columns = (plan.positions, plan.slots, plan.decode_slots, plan.seq_lens)
    for view, values in zip(GraphManager.input_views(block.numpy(), bs, np.int64, np.int32), columns):
        view[:] = values
    graphs.inputs[bs].copy_(block, non_blocking=True)
    table = torch.empty(bs, width, dtype=torch.int32, pin_memory=pinned)
    page_table(plan.tables, width, table.numpy())
    fb.page_table[:, :width].copy_(table, non_blocking=True)
    fb.host_seq_lens, fb.host_q_lens, fb.host_pages = plan.seq_lens, plan.q_lens, plan.tables
    return fb


def page_table(tables: list[list[int]], width: int, out: np.ndarray) -> np.ndarray:
    """`tables` as rows of `width` pages in `out` `[len(tables), width]`, padded with the dummy page."""
    out.fill(DUMMY_PAGE)
    for row, pages in zip(out, tables):
        row[:len(pages)] = pages
    return out


def pack(device: torch.device, dtype: torch.dtype, **parts) -> dict[str, torch.Tensor]:
    """One host -> device copy for all `parts` (each a list of numbers or of numpy arrays), from
    pinned memory on CUDA; returns views by name."""
    if not parts:
        return {}
    pieces = {name: v if v and isinstance(v[0], np.ndarray) else [v] for name, v in parts.items()}
    sizes = [sum(len(p) for p in ps) for ps in pieces.values()]
    host = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
    np.concatenate([np.asarray(p, dtype=NUMPY[dtype]) for ps in pieces.values() for p in ps], out=host.numpy())
    dev = host.to(device, non_blocking=True)
    out, at = {}, 0
    for name, n in zip(pieces, sizes):
        out[name] = dev[at:at + n]
        at += n
    return out
