"""A flex step's metadata and how the flex backend builds it: FlexMeta, and FlexMetaBuilder, the flex
backends' base, which writes each page's logical position and builds a step's masks on the device
from its page table.

Layout: the pool is one long KV sequence, `[1, Hkv, pages * page_size, D]`, and a KV block is a
page. Decode queries are `[B, 1]`, one per request; prefill queries are one packed sequence
`[1, rows]`: where requests are long, the step's tokens as they come, in query blocks of Q_BLOCK
rows that may each hold the tail of one request and the head of the next; otherwise each request
from a block of its own. Each attention variant's window picks its layout
(flex_blocks.rows_as_they_come), so a step's variants may differ in it. Compiled, the BlockMask lists for
each query block the pages wholly before its first row as *full* KV blocks (no mask_mod call) and
the pages that reach its causal frontier as *partial* ones where the mask_mod (flex_masks.py) runs,
which reads each row's request and position; a block of two requests lists both requests' pages
as partial (the block lists: flex_blocks.py). Mask memory is query blocks x pages per request (on the
CPU, compiled, x pool pages: Inductor's CPU kernel wants full-width index rows). Not compiled, the
mask_mod is evaluated once per step over every (query, key) pair (`_dense_meta`).

Decode through flex_ops.py's op, where its kernel splits each request's KV over several programs
(small batches), lists every visible page as partial instead: Inductor's flex-decoding kernel,
given full blocks, cuts its KV splits from the KV length, which is the whole pool here, so one
program would read all of a request's pages while the other splits idle. With one split per
request (decode_full_blocks), full blocks stay: they save the mask_mod's work on every page but
the last.

Compiled prefill does not read the pages: each layer copies the step's K/V (the cached prefixes and
the new tokens) out of the pool into rows, request after request, each request from a 128-row block
boundary (`FlexMeta.kv_rows`, the slot each row reads), so a request's KV blocks are consecutive
and a query block lists its requests' blocks as over the pages, where the mask compares a key's row
with the query row's request start and position (`packed_causal`: no page lookups, nothing per
key). A windowed variant's rows start, per request, at the block its first query's window
reaches. The KV block is 128 rows whatever the page size, so FlexAttention's FLASH backend runs at
any page size (options: flex_options.packed_prefill_options), and the kernel's time does not depend
on the page size, as it does over the pages (figures: docs/BENCHMARKS.md). A step whose prefixes
hold more than PACKED_PREFIX_MAX_TOKENS rows to copy attends over the pages as decode does; a windowed
variant counts only the rows it copies, so its layers may pack where plain causal ones do not.

`page_pos[p]`, the logical index page p holds in the requests that use it, is written on the
device before each step (record_page_positions).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from flexsgl.attention.base import ForwardBatch
from flexsgl.attention.flex_blocks import (QueryRows, block_lists, block_rules, kv_blocks, query_rows,
                                          rows_as_they_come)
from flexsgl.attention.flex_masks import (Q_BLOCK, packed_causal, packed_paged_causal, packed_paged_variant,
                                          packed_rows_variant, paged_causal, paged_decode_variant)
from flexsgl.attention.flex_options import kv_splits
from flexsgl.cache.pool import DUMMY_PAGE, KVPool

@dataclass
class FlexMeta:
    block_mask: BlockMask | None  # None when not compiled: the mask is `mask_state[0]`, dense
    # Decode: queries `[B, 1]`, one per request. Prefill: one packed sequence `[1, rows]`, the tokens
    # as they come or each request from a query block of its own (flex_blocks.query_rows), where
    # `rows` places each token.
    query_shape: tuple[int, int]
    rows: tuple[torch.Tensor, torch.Tensor] | None  # each token's (sequence, row); None: a plain view
    mask_state: list[torch.Tensor]  # tensors the mask_mod reads besides the batch's page table
    # Not compiled, on the CPU: the pool slots of the pages the step's requests hold, the only KV
    # attention reads (None: every slot up to the step's extent, fb.num_kv_pages pages).
    kv_slots: torch.Tensor | None = None
    # Compiled decode with one KV head (MLA) on flex's main kernel, that is where flex_ops.py's op does
    # not run (the CPU): query `[B, 1, Hq, D]`, a request's heads are the rows of one query block,
    # so the kernel reads each request's KV once, not once per head.
    heads_as_rows: bool = False
    # Compiled prefill: the pool slot each packed KV row reads, request after request (-1: a padding
    # row, read as zeros); attention reads these rows, not the pages.
    kv_rows: torch.Tensor | None = None
    # An attention variant's score_mod over flex's coordinates (compiled), or, not compiled, over the
    # dense scores `[nb, Hq, nq, N]` (the coordinates bound in).
    score_mod: Callable | None = None
    # The step's metadata for each of the engine's attention variants other than plain causal, by
    # bound variant id (bound_variant.py); this one is plain causal attention's.
    variants: dict[int, "FlexMeta"] = field(default_factory=dict)

    def step_tensors(self) -> list[torch.Tensor]:
        """Every tensor whose values change from step to step (what graph_step rewrites)."""
        bm = self.block_mask
        blocks = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices] if bm else []
        own = [t for t in blocks if t is not None] + self.mask_state
        return own + [t for key in sorted(self.variants) for t in self.variants[key].step_tensors()]


PACKED_PREFIX_MAX_TOKENS = 65536  # cached tokens a packed prefill step may copy per layer


def skipped_blocks(seq_len: int, q_len: int, window: int | None) -> int:
    """The Q_BLOCK-row blocks of a request's keys that lie wholly before its first query's window
    (none without a window): what a packed prefill leaves out of its rows."""
    return 0 if window is None else max(seq_len - q_len - window + 1, 0) // Q_BLOCK


def packs_kv(fb: ForwardBatch, window: int | None = None) -> bool:
    """Whether a compiled prefill step attends over its K/V packed into rows, for attention over
    `window` keys (None: causal): where the cached prefix rows each layer copies out of the pool
    (under a window, from the block it reaches) hold at most PACKED_PREFIX_MAX_TOKENS."""
    if fb.host_q_lens is None:
        return False
    copied = sum(s - n - skipped_blocks(s, n, window) * Q_BLOCK for s, n in zip(fb.host_seq_lens, fb.host_q_lens))
    return copied <= PACKED_PREFIX_MAX_TOKENS


class FlexMetaBuilder:
    """The flex backends' step metadata (FlexMeta), built each step on the device: the page
    positions the masks read, then a BlockMask over the pages or over packed rows (compiled), or a
    dense mask (not compiled), for plain causal attention and for each of the engine's other
    attention variants."""

    heads_as_rows = False  # compiled decode on the main kernel lays a request's heads out as rows (FlexMeta)
    packs_prefill = True  # compiled prefill reads the step's K/V copied into rows (FlexMeta.kv_rows)
    flash_variants = False  # variants' prefill runs on the FLASH backend, which wants full-block lists

    def __init__(self, pool: KVPool, num_heads: int | None = None, compiled: bool = False, variants=None):
        """compiled: the model runs under torch.compile (queries in blocks of Q_BLOCK rows; on CUDA
        decode goes through flex_ops.py's op); otherwise the mask is evaluated once per step and SDPA
        applies it. variants: the engine's VariantSet (bound_variant.py), whose
        variants other than plain causal get metadata of their own each step."""
        self.pool = pool
        self.variants = [] if variants is None else variants.non_plain
        self.num_heads = num_heads
        self.compiled = compiled
        self.decode_op = compiled and pool.device.type == "cuda"  # flex_ops.py
        self.page_pos = torch.zeros(pool.num_pages, dtype=torch.int32, device=pool.device)

    def decode_full_blocks(self, batch: int) -> bool:
        """Whether decode at this batch size lists full KV blocks (see the module docstring)."""
        heads, dim = self.kv_shape()
        return not self.decode_op or kv_splits(batch, heads, self.pool.page_size, dim) == 1

    def kv_shape(self) -> tuple[int, int]:
        """(KV heads, key head dim) of the pool."""
        return tuple(self.pool.k[0].shape[1:])

    def metadata(self, fb: ForwardBatch, fixed_shapes: bool = False) -> FlexMeta:
        """fixed_shapes: for a CUDA graph's buffers, whose shapes do not follow the step's pages."""
        if self.variants or not (fb.mode == "decode" and self.decode_op):
            self.record_page_positions(fb.page_table, fb.seq_lens)  # plain decode's op needs none
        compact = not fixed_shapes and fb.page_table.device.type == "cpu" and fb.host_pages is not None
        build = self._decode_meta
        if fb.mode != "decode":
            build = functools.partial(self._prefill_layout_meta, align=Q_BLOCK if self.compiled else 1, layouts={})
        meta = build(fb, compact)
        meta.variants = {bound.id: build(fb, compact, bound) for bound in self.variants}
        return meta

    def record_page_positions(self, page_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """page_pos[page_table[b, j]] = j for each request's pages, on the device; every other page
        is at 0, so no entry reaches past any step's table. Entries past a request's last page are
        not its pages (padding, or a graph's static table left from an earlier step): they count as
        the dummy page, which padding rows read at index 0."""
        b, w = page_table.shape
        logical = torch.arange(w, dtype=torch.int32, device=page_table.device).expand(b, w)
        n_pages = (seq_lens + self.pool.page_size - 1) // self.pool.page_size
        pages = torch.where(logical < n_pages[:, None], page_table, DUMMY_PAGE)
        self.page_pos.zero_().scatter_(0, pages.reshape(-1).long(), logical.reshape(-1))
        self.page_pos.narrow(0, DUMMY_PAGE, 1).zero_()  # a fill: `[DUMMY_PAGE] = 0` copies from the host

    def _decode_meta(self, fb: ForwardBatch, compact: bool, bound=None) -> FlexMeta:
        """One query block per request, its one token at position seq_len - 1; `bound`: an attention
        variant's (None: plain causal attention)."""
        b, ps = fb.batch_size, self.pool.page_size
        last = fb.seq_lens.long() - 1
        # The decode op reads only the block lists and applies a mask of its own (flex_ops.py).
        mask_mod = score_mod = None
        if not self.decode_op:
            mask_mod, score_mod = (paged_causal(fb.page_table, last, self.page_pos, ps), None) if bound is None \
                else paged_decode_variant(bound, fb.page_table, last, self.page_pos, fb.req_slots, ps)
        if not self.compiled:
            return self._dense_meta(fb, mask_mod, (b, 1), compact, score_mod, self._dense_heads(bound))
        valid = torch.ones(b, dtype=torch.bool, device=last.device)
        full = self.decode_full_blocks(b) and (bound is None or bound.full_blocks)
        window = None if bound is None else bound.window
        blocks = [x if x is None else x[:, None, None] for x in
                  kv_blocks(fb.page_table, ps, torch.arange(b, device=last.device), last, last, valid, window, full)]
        if self.heads_as_rows:
            return self._meta(fb, blocks, mask_mod, (b, self.num_heads), None, [last], Q_BLOCK, heads_as_rows=True)
        # Inductor's CPU flex kernel wants the query in a 4-D buffer of its own, not a view.
        rows = (torch.arange(b, device=last.device), torch.zeros_like(last)) if last.device.type == "cpu" else None
        return self._meta(fb, blocks, mask_mod, (b, 1), rows, [last], Q_BLOCK, score_mod=score_mod)

    def _prefill_layout_meta(self, fb: ForwardBatch, compact: bool, bound=None, *, align: int,
                             layouts: dict) -> FlexMeta:
        """_prefill_meta over the query layout `bound`'s window asks for (flex_blocks.rows_as_they_come),
        each layout built once a step: `layouts` holds them by whether the rows are the tokens as they come."""
        come = rows_as_they_come(fb, align, None if bound is None else bound.window)
        if come not in layouts:
            layouts[come] = query_rows(fb, align, come)
        return self._prefill_meta(fb, compact, bound, qr=layouts[come])

    def _prefill_meta(self, fb: ForwardBatch, compact: bool, bound=None, *, qr: QueryRows) -> FlexMeta:
        """The step's queries as one packed sequence, laid out as qr says (flex_blocks.query_rows);
        compiled, in blocks of Q_BLOCK rows, each reading the pages of the requests it holds; not
        compiled, the mask is evaluated densely, a block is a row, and nothing is padded."""
        if self.compiled and self.packs_prefill and packs_kv(fb, None if bound is None else bound.window):
            return self._packed_prefill_meta(fb, qr, bound)
        ps = self.pool.page_size
        # Every integer a mask reads is int32, like the page table and page_pos: the FLASH backend's
        # mask_mod code keeps one integer type.
        mask_state = [qr.row_req, qr.row_pos]
        seq_last = (fb.seq_lens - 1).int()
        if bound is None:
            mask_mod, score_mod = packed_paged_causal(fb.page_table, *mask_state, self.page_pos, ps), None
        else:
            mask_mod, score_mod = packed_paged_variant(bound, fb.page_table, *mask_state, seq_last, self.page_pos,
                                                       fb.req_slots.int(), ps)
        if not self.compiled:  # a block is a token, in packed order: the queries are a plain view
            return self._dense_meta(fb, mask_mod, (1, qr.num_rows), compact, score_mod, self._dense_heads(bound))
        blocks = self._full_listed(block_lists(fb.page_table, ps, qr, *block_rules(bound, seq_last[qr.piece_req])))
        return self._meta(fb, [x if x is None else x[None, None] for x in blocks], mask_mod, (1, qr.num_rows), qr.rows,
                          mask_state, Q_BLOCK, score_mod=score_mod)

    def _packed_prefill_meta(self, fb: ForwardBatch, qr: QueryRows, bound=None) -> FlexMeta:
        """Compiled prefill over the step's K/V packed into rows: request r's positions from its first
        KV block on, so its KV blocks are consecutive and the block lists are block_lists' over a
        table of those (see the module docstring). Under `bound`'s window a request's rows start at
        the block of the first key its first query sees: the keys before it are neither copied nor
        read, and the block lists count positions from that block."""
        dev = qr.row_pos.device
        seq_lens = fb.seq_lens.long()
        window = None if bound is None else bound.window
        skipped = [skipped_blocks(s, n, window) for s, n in zip(fb.host_seq_lens, fb.host_q_lens)]
        skip = torch.zeros_like(seq_lens) if window is None else torch.tensor(skipped, device=dev)
        host_blocks = [-(-s // Q_BLOCK) - k for s, k in zip(fb.host_seq_lens, skipped)]
        kv_per_req = (seq_lens + Q_BLOCK - 1) // Q_BLOCK - skip
        kv_first = torch.cumsum(kv_per_req, 0) - kv_per_req  # each request's first KV block
        origin = (kv_first - skip) * Q_BLOCK  # the row of each request's position 0, had it been copied
        n_kv = sum(host_blocks)
        kv_req = torch.repeat_interleave(torch.arange(fb.batch_size, device=dev), kv_per_req * Q_BLOCK,
                                         output_size=n_kv * Q_BLOCK)
        pos = torch.arange(n_kv * Q_BLOCK, device=dev) - origin[kv_req]
        page = fb.page_table[kv_req, (pos // self.pool.page_size).clamp_(max=fb.page_table.shape[1] - 1)].long()
        kv_rows = torch.where(pos < seq_lens[kv_req], page * self.pool.page_size + pos % self.pool.page_size, -1)
        # Each request's KV blocks, as a page table of Q_BLOCK-row blocks. Inductor's CPU flex kernel
        # wants index rows as wide as the KV sequence has blocks.
        width = n_kv if dev.type == "cpu" else max(host_blocks)
        table = (kv_first[:, None] + torch.arange(width, device=dev)).clamp_(max=n_kv - 1).int()
        seq_last = seq_lens - 1
        shift = (skip * Q_BLOCK)[qr.piece_req] * qr.piece_valid  # positions before a piece's first packed row
        shifted = replace(qr, piece_first=qr.piece_first - shift, piece_last=qr.piece_last - shift)
        blocks = [x if x is None else x[None, None] for x in self._full_listed(
                  block_lists(table, Q_BLOCK, shifted, *block_rules(bound, seq_last[qr.piece_req] - shift)))]
        mask_state = [origin.int()[qr.row_req.long()], qr.row_pos]  # int32: see _prefill_meta
        if bound is None:
            mask_mod, score_mod = packed_causal(*mask_state), None
        else:
            mask_mod, score_mod = packed_rows_variant(bound, qr.row_req, *mask_state, seq_last.int(),
                                                      fb.req_slots.int())
        block_mask = BlockMask.from_kv_blocks(*blocks, BLOCK_SIZE=(Q_BLOCK, Q_BLOCK), mask_mod=mask_mod,
                                              seq_lengths=(qr.num_rows, n_kv * Q_BLOCK), compute_q_blocks=False)
        return FlexMeta(block_mask, (1, qr.num_rows), qr.rows, mask_state, kv_rows=kv_rows, score_mod=score_mod)

    def _full_listed(self, blocks: tuple) -> tuple:
        """A prefill's block lists (kv_blocks'), with empty full-block lists where there are none and
        the FLASH backend runs variants: its lowering refuses a mask without them."""
        num_partial, partial_idx, num_full, _ = blocks
        if num_full is None and self.flash_variants:
            return num_partial, partial_idx, torch.zeros_like(num_partial), torch.zeros_like(partial_idx)
        return blocks

    def _dense_heads(self, bound) -> int | None:
        """The query heads a dense mask is built for: this rank's, where `bound`'s mask reads the head."""
        return self.num_heads if bound is not None and bound.reads_head else None

    def _dense_meta(self, fb: ForwardBatch, mask_mod, query_shape, compact: bool, score_mod=None,
                    heads: int | None = None) -> FlexMeta:
        """Not compiled: the mask_mod evaluated over every (query, key) pair once per step, which
        the backend's attend() applies with SDPA (or, for a variant's score_mod or sink, with the scores written
        out). torch's eager flex_attention would evaluate it in every layer under four nested vmaps,
        whose Python cost per call (about 10 ms on the development CPU) would dominate a small
        model's step. compact (on the CPU, outside graph buffers): the KV is only the slots of the
        pages the step's requests hold, which the prefix cache spreads over the pool; attention over
        the whole extent dominated steps of many requests. `heads`: the query heads, where the
        mask reads the head (BoundVariant.reads_head): a mask per head, `[nb, heads, nq, N]`."""
        ps = self.pool.page_size
        dev = fb.page_table.device
        nb, nq = query_shape
        kv_slots = None
        if compact:
            pages = torch.tensor(sorted(set(chain.from_iterable(fb.host_pages))), dtype=torch.long)
            kv_slots = (pages[:, None] * ps + torch.arange(ps)).flatten()
        kv_idx = kv_slots if kv_slots is not None else torch.arange(fb.num_kv_pages * ps, device=dev)
        b, q_idx = torch.arange(nb, device=dev), torch.arange(nq, device=dev)
        if heads is None:
            visible = mask_mod(b[:, None, None], None, q_idx[None, :, None], kv_idx[None, None, :])
        else:
            visible = mask_mod(b[:, None, None, None], torch.arange(heads, device=dev)[None, :, None, None],
                               q_idx[None, None, :, None], kv_idx[None, None, None, :])
        dense_score = None
        if score_mod is not None:
            def dense_score(s):  # s: [nb, Hq, nq, N]
                h = torch.arange(s.shape[1], device=dev)[None, :, None, None]
                return score_mod(s, b[:, None, None, None], h, q_idx[None, None, :, None], kv_idx[None, None, None])
        return FlexMeta(None, query_shape, None, [visible], kv_slots, score_mod=dense_score)

    def _meta(self, fb: ForwardBatch, blocks, mask_mod, query_shape, rows, mask_state, q_block: int,
              heads_as_rows: bool = False, score_mod=None) -> FlexMeta:
        """Compiled: the step's BlockMask over its page lists."""
        ps = self.pool.page_size
        num_partial, partial_idx, num_full, full_idx = blocks
        if fb.page_table.device.type == "cpu" and partial_idx.shape[-1] < fb.num_kv_pages:
            # Inductor's CPU flex kernel wants an index row as wide as the KV sequence has blocks.
            pad = (0, fb.num_kv_pages - partial_idx.shape[-1])
            partial_idx = F.pad(partial_idx, pad)
            full_idx = None if full_idx is None else F.pad(full_idx, pad)
        block_mask = BlockMask.from_kv_blocks(
            num_partial, partial_idx.contiguous(), num_full, None if full_idx is None else full_idx.contiguous(),
            BLOCK_SIZE=(q_block, ps),
            mask_mod=mask_mod, seq_lengths=(query_shape[1], fb.num_kv_pages * ps), compute_q_blocks=False)
        return FlexMeta(block_mask, query_shape, rows, mask_state, heads_as_rows=heads_as_rows, score_mod=score_mod)
