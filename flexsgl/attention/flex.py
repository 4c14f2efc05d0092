"""FlexAttention over the paged KV pool: the default backend.

Layout: the pool is one long KV sequence, `[1, Hkv, pages * page_size, D]`, and a KV block is a
page. Decode queries are `[B, 1]`, one per request; prefill queries are packed into one sequence
`[1, rows]` in which each request starts a query block of its own, so a ragged batch pays at most
a block's padding per request, not the longest request's length. The BlockMask is built on the
device from the page table: for each query block, the pages wholly before its first row are *full*
KV blocks (no mask_mod call) and the pages that reach its causal frontier are *partial* ones where
the mask_mod (flex_masks.py) runs. Mask memory is query blocks x pages per request (on the CPU,
compiled, x pool pages: Inductor's CPU kernel wants full-width index rows).

An FP8 pool (kv_cache_dtype fp8_e4m3) is read as it is where FlexAttention's Triton kernels run
(compiled, on CUDA: they cast K and V to the query's dtype as they load them; the scales are the
attention layer's, model/decoder.py); elsewhere, and for packed rows, the step's K/V are cast first.

Decode through flex_ops.py's op, where its kernel splits each request's KV over several programs
(small batches), lists every visible page as partial instead: Inductor's flex-decoding kernel,
given full blocks, cuts its KV splits from the KV length, which is the whole pool here, so one
program would read all of a request's pages while the other splits idle. With one split per
request (decode_full_blocks), full blocks stay: they save the mask_mod's work on every page but
the last.

Compiled prefill does not read the pages: each layer copies the step's K/V (the cached prefixes and
the new tokens) out of the pool into rows, request after request, each request from a 128-row block
boundary (`FlexMeta.kv_rows`, the slot each row reads), so a request's KV blocks are consecutive
and its query blocks list the blocks wholly before their first row as full and those up to their
last row as partial, where the mask compares rows with the query block's request start and first
position (`packed_causal`: no page lookups, nothing per key). The KV block is 128 rows whatever the
page size, so FlexAttention's FLASH backend runs at any page size (options:
flex_ops.packed_prefill_options), and the kernel's time does not depend on the page size, as it
does over the pages (figures: docs/BENCHMARKS.md). A step whose prefixes hold more than
PACKED_PREFIX_MAX_TOKENS attends over the pages as decode does.

Compiled on CUDA, decode runs through flex_ops.py's opaque op (a kernel per batch size, outside
the compiled decoder layer); prefill runs flex_attention inside the layer. `page_pos[p]`, the logical index page
p holds in the requests that use it, is written here on the device before each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from flexsgl.attention.base import AttentionBackend, ForwardBatch
from flexsgl.attention.flex_ops import (flex_decode, kv_splits, packed_prefill_options, prefill_options,
                                        triton_prefill_options, with_sink)
from flexsgl.attention.flex_masks import (Q_BLOCK, packed_causal, packed_paged_causal, packed_paged_variant,
                                          packed_rows_variant, paged_causal, paged_decode_variant)
from flexsgl.cache.pool import DUMMY_PAGE, KVPool
from flexsgl.attention.flex_blocks import block_positions, block_rules, kv_blocks, packed_rows, query_blocks


@dataclass
class FlexMeta:
    block_mask: BlockMask | None  # None when not compiled: the mask is `mask_state[0]`, dense
    # Decode: queries `[B, 1]`, one per request. Prefill: one packed sequence `[1, rows]` in which
    # each request starts at a query block of its own; `rows` places each token in it.
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


PACKED_PREFIX_MAX_TOKENS = 65536  # cached tokens a packed prefill step may copy per layer (flex.py)


def packs_kv(fb: ForwardBatch) -> bool:
    """Whether a compiled prefill step attends over its K/V packed into rows: where its requests'
    cached prefixes, which each layer copies out of the pool, hold at most PACKED_PREFIX_MAX_TOKENS."""
    return fb.host_q_lens is not None and sum(fb.host_seq_lens) - sum(fb.host_q_lens) <= PACKED_PREFIX_MAX_TOKENS


class FlexAttentionBackend(AttentionBackend):
    name = "flex"
    graphable = True
    compiles_per_shape = True  # its kernels are compiled per batch size and page-table width
    heads_as_rows = False  # compiled decode on the main kernel lays a request's heads out as rows (FlexMeta)
    packs_prefill = True  # compiled prefill reads the step's K/V copied into rows (FlexMeta.kv_rows)

    def __init__(self, pool: KVPool, num_heads: int | None = None, compiled: bool = False, variants=None):
        """compiled: the model runs under torch.compile (queries padded to a block, so kernels see
        fewer shapes; on CUDA decode goes through flex_ops.py's op); otherwise the mask is evaluated
        once per step and SDPA applies it. variants: the engine's VariantSet (bound_variant.py), whose
        variants other than plain causal get metadata of their own each step."""
        self.pool = pool
        self.variants = [] if variants is None else variants.non_plain
        self.num_heads = num_heads
        self.compiled = compiled
        self.decode_op = compiled and pool.device.type == "cuda"  # flex_ops.py
        self.page_pos = torch.zeros(pool.num_pages, dtype=torch.int32, device=pool.device)
        cuda = pool.device.type == "cuda"
        self.kernel_options = self.cuda_kernel_options() if cuda else None
        self.packed_kernel_options = self.packed_cuda_kernel_options() if cuda and self.packs_prefill else None
        # A variant's mods run on the Triton kernels (flex_ops.triton_prefill_options says why)
        self.variant_kernel_options = self.variant_packed_options = None
        if cuda and self.variants:
            dim, dtype = self.kv_shape()[1], self.pool.k[0].dtype
            self.variant_kernel_options = triton_prefill_options(dim, self.pool.page_size, dtype)
            self.variant_packed_options = triton_prefill_options(dim, 64, dtype)

    def decode_full_blocks(self, batch: int) -> bool:
        """Whether decode at this batch size lists full KV blocks (see the module docstring)."""
        heads, dim = self.kv_shape()
        return not self.decode_op or kv_splits(batch, heads, self.pool.page_size, dim) == 1

    def kv_shape(self) -> tuple[int, int]:
        """(KV heads, key head dim) of the pool."""
        return tuple(self.pool.k[0].shape[1:])

    def cuda_kernel_options(self) -> dict:
        """Options of flex's main kernel on CUDA (compiled prefill; the CPU takes none)."""
        return prefill_options(self.kv_shape()[1], self.pool.page_size, self.pool.k[0].dtype)

    def packed_cuda_kernel_options(self) -> dict:
        """Options of flex's kernel on CUDA for compiled prefill over the step's K/V packed into rows."""
        return packed_prefill_options(self.kv_shape()[1], self.pool.k[0].dtype)

    @staticmethod
    def unsupported(page_size: int, device: torch.device) -> str | None:
        """Why this backend cannot run with these settings, or None."""
        if device.type == "cuda" and page_size % 16:
            return (f"on a GPU, FlexAttention's kernels read a page as one KV block of at least 16 "
                    f"tokens, so page_size must be a multiple of 16 (got {page_size})")
        return None

    @staticmethod
    def prefill_scratch_bytes(mcfg, tokens: int, itemsize: int) -> int:
        return 0  # the K/V copied into rows: within the KV sizing's margin at the sizes flexsgl serves

    def prepare(self, fb: ForwardBatch) -> None:
        fb.attn = self.metadata(fb)

    def metadata(self, fb: ForwardBatch, fixed_shapes: bool = False) -> FlexMeta:
        """fixed_shapes: for a CUDA graph's buffers, whose shapes do not follow the step's pages."""
        if self.variants or not (fb.mode == "decode" and self.decode_op):
            self.record_page_positions(fb.page_table, fb.seq_lens)  # plain decode's op needs none
        compact = not fixed_shapes and fb.page_table.device.type == "cpu" and fb.host_pages is not None
        build = self._decode_meta if fb.mode == "decode" else self._prefill_meta
        meta = build(fb, compact)
        meta.variants = {bound.id: build(fb, compact, bound) for bound in self.variants}
        return meta

    # CUDA graphs: the BlockMask of a captured size lives in tensors the graph reads. Its step's
    # values are built inside the graph, from the static batch the graph manager has filled, and
    # copied into them: a replay rebuilds the mask on the device, with no host work per step.
    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        self.graph_meta: dict[int, FlexMeta] = {}

    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        fb.attn = self.graph_meta[bs] = self.metadata(fb, fixed_shapes=True)

    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        """Nothing on the host: graph_step builds the step's mask inside the graph."""

    def graph_step(self, bs: int, fb: ForwardBatch) -> None:
        for dst, src in zip(self.graph_meta[bs].step_tensors(), self.metadata(fb, fixed_shapes=True).step_tensors()):
            dst.copy_(src)

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
            return self._dense_meta(fb, mask_mod, (b, 1), compact, score_mod)
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

    def _prefill_meta(self, fb: ForwardBatch, compact: bool, bound=None) -> FlexMeta:
        """Queries packed into one sequence; each request starts a query block (a block belongs to one
        request, so its KV block list is that request's pages). Compiled, blocks are Q_BLOCK rows (at
        most Q_BLOCK - 1 padding rows per request, at least MIN_COMPILED_SIZE blocks); not compiled,
        the mask is evaluated densely, so there a block is one row and nothing is padded."""
        if self.compiled and self.packs_prefill and packs_kv(fb):
            return self._packed_prefill_meta(fb, bound)
        align, ps = (Q_BLOCK if self.compiled else 1), self.pool.page_size
        req, index, first_block, n_real, n_blocks = query_blocks(fb, align)
        first, last = block_positions(fb, req, index, first_block, align)
        # int32 like the page table and page_pos: the FLASH backend's mask_mod code keeps one integer type
        mask_state = [req.int(), first.int()]
        seq_last = fb.seq_lens.long() - 1
        if bound is None:
            mask_mod, score_mod = packed_paged_causal(fb.page_table, *mask_state, self.page_pos, ps, align), None
        else:
            mask_mod, score_mod = packed_paged_variant(bound, fb.page_table, *mask_state, seq_last, self.page_pos,
                                                       fb.req_slots, ps, align)
        if not self.compiled:  # a block is a token, in packed order: the queries are a plain view
            return self._dense_meta(fb, mask_mod, (1, n_blocks), compact, score_mod)
        blocks = kv_blocks(fb.page_table, ps, req, first, last, index < n_real, *block_rules(bound, seq_last[req]))
        rows = packed_rows(fb, first_block, align)
        return self._meta(fb, [x if x is None else x[None, None] for x in blocks], mask_mod, (1, n_blocks * align), rows,
                          mask_state, align, score_mod=score_mod)

    def _packed_prefill_meta(self, fb: ForwardBatch, bound=None) -> FlexMeta:
        """Compiled prefill over the step's K/V packed into rows: request r's positions 0..seq_len-1
        from its first KV block on, so its KV blocks are consecutive and the block lists are
        kv_blocks' over a table of those (see the module docstring)."""
        req, index, first_block, n_real, n_blocks = query_blocks(fb, Q_BLOCK)
        dev, ps = index.device, self.pool.page_size
        seq_lens = fb.seq_lens.long()
        kv_per_req = (seq_lens + Q_BLOCK - 1) // Q_BLOCK
        kv_first = torch.cumsum(kv_per_req, 0) - kv_per_req  # each request's first KV block
        n_kv = sum(-(-n // Q_BLOCK) for n in fb.host_seq_lens)
        row_req = torch.repeat_interleave(torch.arange(fb.batch_size, device=dev), kv_per_req * Q_BLOCK,
                                          output_size=n_kv * Q_BLOCK)
        pos = torch.arange(n_kv * Q_BLOCK, device=dev) - kv_first[row_req] * Q_BLOCK
        page = fb.page_table[row_req, (pos // ps).clamp_(max=fb.page_table.shape[1] - 1)].long()
        kv_rows = torch.where(pos < seq_lens[row_req], page * ps + pos % ps, -1)  # -1: a padding row
        first, last = block_positions(fb, req, index, first_block, Q_BLOCK)
        # Each request's KV blocks, as a page table of Q_BLOCK-row blocks. Inductor's CPU flex kernel
        # wants index rows as wide as the KV sequence has blocks.
        width = n_kv if dev.type == "cpu" else max(-(-n // Q_BLOCK) for n in fb.host_seq_lens)
        table = (kv_first[:, None] + torch.arange(width, device=dev)).clamp_(max=n_kv - 1).int()
        seq_last = seq_lens - 1
        blocks = [x if x is None else x[None, None] for x in
                  kv_blocks(table, Q_BLOCK, req, first, last, index < n_real, *block_rules(bound, seq_last[req]))]
        mask_state = [(kv_first[req] * Q_BLOCK).int(), first.int()]  # int32: see _prefill_meta
        if bound is None:
            mask_mod, score_mod = packed_causal(*mask_state, Q_BLOCK), None
        else:
            mask_mod, score_mod = packed_rows_variant(bound, req, *mask_state, seq_last, fb.req_slots, Q_BLOCK)
        block_mask = BlockMask.from_kv_blocks(*blocks, BLOCK_SIZE=(Q_BLOCK, Q_BLOCK), mask_mod=mask_mod,
                                              seq_lengths=(n_blocks * Q_BLOCK, n_kv * Q_BLOCK), compute_q_blocks=False)
        return FlexMeta(block_mask, (1, n_blocks * Q_BLOCK), packed_rows(fb, first_block, Q_BLOCK), mask_state,
                        kv_rows=kv_rows, score_mod=score_mod)

    def _dense_meta(self, fb: ForwardBatch, mask_mod, query_shape, compact: bool, score_mod=None) -> FlexMeta:
        """Not compiled: the mask_mod evaluated over every (query, key) pair once per step, which
        attend() applies with SDPA (or, for a variant's score_mod or sink, with the scores written
        out). torch's eager flex_attention would evaluate it in every layer under four nested vmaps,
        whose Python cost per call (about 10 ms on the development CPU) would dominate a small
        model's step. compact (on the CPU, outside graph buffers): the KV is only the slots of the
        pages the step's requests hold, which the prefix cache spreads over the pool; attention over
        the whole extent dominated steps of many requests."""
        ps = self.pool.page_size
        dev = fb.page_table.device
        nb, nq = query_shape
        kv_slots = None
        if compact:
            pages = torch.tensor(sorted(set(chain.from_iterable(fb.host_pages))), dtype=torch.long)
            kv_slots = (pages[:, None] * ps + torch.arange(ps)).flatten()
        kv_idx = kv_slots if kv_slots is not None else torch.arange(fb.num_kv_pages * ps, device=dev)
        b, q_idx = torch.arange(nb, device=dev), torch.arange(nq, device=dev)
        visible = mask_mod(b[:, None, None], None, q_idx[None, :, None], kv_idx[None, None, :])
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

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None) -> torch.Tensor:
        k, v = cache
        return self.attention(q, k, v, fb, variant=variant, sink=sink)

    def attention(self, q, k, v, fb: ForwardBatch, scale: float | None = None, options: dict | None = None,
                  variant=None, sink: torch.Tensor | None = None) -> torch.Tensor:
        """q `[T, Hq, D]` over one layer's pool, k `[slots, Hkv, D]` and v `[slots, Hkv, Dv]`, as the
        step's metadata lays it out; returns `[T, Hq, Dv]`. variant: the layer's bound attention
        variant (None: plain causal); sink: its per-head sink logits `[Hq]`, where it has them."""
        meta: FlexMeta = fb.attn
        plain = variant is None or variant.plain
        if variant is not None and variant.scale is not None:
            scale = variant.scale
        if not plain:
            meta = meta.variants[variant.id]
            if options is None and self.compiled:
                options = self.variant_kernel_options if meta.kv_rows is None else self.variant_packed_options
        if fb.mode == "decode" and self.decode_op:
            bm = meta.block_mask
            return flex_decode(q, k, v, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                               fb.page_table, *meta.mask_state, self.pool.page_size, scale,
                               -1 if plain else variant.id, None if plain else self.page_pos,
                               None if plain else fb.req_slots, sink)
        k, v = self.kv_sequence(k, fb), self.kv_sequence(v, fb)
        if k.dtype != q.dtype and (fb.attn.kv_rows is not None or not (self.compiled and q.is_cuda)):
            # An FP8 cache where no Triton flex kernel casts it as it loads (SDPA, the CPU's flex
            # kernel), or packed rows, which are a copy anyway.
            k, v = k.to(q.dtype), v.to(q.dtype)
        return self.attend(q, k, v, meta, scale, options, sink)

    def kv_sequence(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """One layer's pool tensor `[slots, H, D]` as the step's KV sequence `[1, H, N, D]`: the
        step's K/V packed into rows where it has them (contiguous per head), else the pool's slots."""
        kv_rows = fb.attn.kv_rows
        if kv_rows is not None:
            packed = torch.where((kv_rows >= 0)[:, None, None], x[kv_rows.clamp(min=0)], 0)
            return packed[None].transpose(1, 2).contiguous()
        kv_slots = fb.attn.kv_slots
        x = x[:fb.num_kv_pages * self.pool.page_size] if kv_slots is None else x[kv_slots]
        return x[None].transpose(1, 2)

    def attend(self, q, k, v, meta: FlexMeta, scale: float | None = None, options: dict | None = None,
               sink: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q `[T, Hq, D]`, laid out as the step's metadata says, over the pool read as one
        KV sequence, k `[1, Hkv, N, D]` and v `[1, Hkv, N, Dv]`; returns `[T, Hq, Dv]`. Compiled:
        flex_attention with the step's BlockMask, score_mod and `options` (default: the backend's for
        the pages or for packed rows, as meta reads); otherwise SDPA with the mask_mod's dense values,
        or the scores written out where a score_mod or a sink changes them."""
        t, hq, d = q.shape
        nb, nq = meta.query_shape
        if meta.heads_as_rows:  # on the CPU, whose flex kernel wants the query in a buffer of its own
            qb = q.new_zeros(t, 1, hq, d).index_put_((torch.arange(t, device=q.device),), q[:, None])
            return flex_attention(qb, k, v, block_mask=meta.block_mask, scale=scale,
                                  kernel_options=self.kernel_options)[:, 0]
        if meta.rows is None:
            qb = q.view(nb, nq, hq, d)
        else:
            qb = q.new_zeros(nb, nq, hq, d).index_put_(meta.rows, q)
        if self.compiled and (sink is None or q.device.type != "cpu"):
            if options is None:
                options = self.kernel_options if meta.kv_rows is None else self.packed_kernel_options
            out = flex_attention(qb.transpose(1, 2), k, v, score_mod=meta.score_mod, block_mask=meta.block_mask,
                                 scale=scale, enable_gqa=hq != k.shape[1], kernel_options=options,
                                 return_aux=None if sink is None else AuxRequest(lse=True))
            if sink is not None:
                out = with_sink(*out, sink)
        elif self.compiled:  # a sink on the CPU, whose compiled flex returns no log-sum-exp: the mask alone
            out = _scores_written_out(qb.transpose(1, 2), k, v, *_dense_from_mods(meta, nb, hq, nq, k.shape[2], q.device),
                                      scale, sink)
        elif meta.score_mod is not None or sink is not None:
            out = _scores_written_out(qb.transpose(1, 2), k, v, meta.mask_state[0][:, None], meta.score_mod, scale, sink)
        else:  # every query as one sequence over the one KV sequence: SDPA never copies K/V per request
            out = F.scaled_dot_product_attention(qb.reshape(1, nb * nq, hq, d).transpose(1, 2), k, v,
                                                 attn_mask=meta.mask_state[0].reshape(1, 1, nb * nq, -1),
                                                 scale=scale, enable_gqa=hq != k.shape[1])
            out = out.view(hq, nb, nq, -1).permute(1, 0, 2, 3)
        out = out.transpose(1, 2)  # [nb, nq, Hq, Dv]
        return out.reshape(t, hq, v.shape[-1]) if meta.rows is None else out[meta.rows]


def _scores_written_out(q, k, v, visible, score, scale: float | None, sink: torch.Tensor | None) -> torch.Tensor:
    """Attention with the scores as one tensor, for a variant's score_mod or sink where flex does not
    run them (not compiled, or a sink on the CPU): q `[nb, Hq, nq, D]` over k, v `[1, Hkv, N, D]`,
    `visible` broadcasting to `[nb, Hq, nq, N]`, `score` a function of those scores (or None), the
    sink as one more column; returns `[nb, Hq, nq, Dv]`."""
    hq, g = q.shape[1], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if score is not None:
        s = score(s)
    s = s.masked_fill(~visible, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.float().view(1, hq, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :k.shape[2]]  # a row that sees nothing: zeros
    return (p @ v.float()).to(q.dtype)


def _dense_from_mods(meta: FlexMeta, nb: int, hq: int, nq: int, n: int, device) -> tuple:
    """(visible, score) of a compiled step's mask_mod and score_mod over every (query, key) pair: the
    mask alone is correct over the whole KV sequence (flex_masks.py)."""
    b, h, q, kv = (torch.arange(x, device=device).view(*[1] * i, x, *[1] * (3 - i)) for i, x in
                   enumerate((nb, hq, nq, n)))
    visible = meta.block_mask.mask_mod(b, h, q, kv)
    score = None if meta.score_mod is None else (lambda s: meta.score_mod(s, b, h, q, kv))
    return visible, score
