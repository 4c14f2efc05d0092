"""FlexAttention over the paged KV pool: the default backend.

Layout: the pool is one long KV sequence, `[1, Hkv, pages * page_size, D]`, and a KV block is a
page. Queries are laid out per request, `[B, Hq, Lq, D]` (Lq = 1 for decode), and broadcast
against that single KV sequence. The BlockMask is built on the device straight from the page
table: for each (request, query block) the pages wholly before its first query row are *full*
blocks (no mask_mod call), and the pages that reach the block's causal frontier are *partial*
blocks where the mask_mod runs. Mask memory is B x query blocks x pages per request (on
the CPU, compiled, x pool pages: Inductor's CPU kernel wants full-width index rows).

The mask_mod is correct on its own over the whole pool (eager flex evaluates it everywhere):
a KV slot is visible to request b's query row iff its page is b's page at the logical index
`page_pos[page]`, and its position is not after the query's. `page_pos[p]` is the logical index page
p holds in the requests using it (a page shared through a prefix is at the same index in each of
them); the backend writes it on the device from each step's page table, before the step runs.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexsgl.attention.base import ForwardBatch
from flexsgl.cache.pool import DUMMY_PAGE, KVPool
from flexsgl.compile import MIN_COMPILED_SIZE

Q_BLOCK = 128

# Eager flex (CPU, tests) is a deliberate choice here, not a missed torch.compile.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


@dataclass
class FlexMeta:
    block_mask: BlockMask
    q_len: int  # padded query length per request
    # (request, row) of each packed token in the padded `[B, q_len]` layout; None: a plain view does.
    q_index: tuple[torch.Tensor, torch.Tensor] | None
    mask_state: list[torch.Tensor]  # tensors the mask_mod reads besides the batch's page table

    def step_tensors(self) -> list[torch.Tensor]:
        """Every tensor whose values change from step to step (what fill_graph rewrites)."""
        bm = self.block_mask
        return [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, *self.mask_state]


class FlexAttentionBackend:
    name = "flex"
    graphable = True
    compiles_per_shape = True

    def __init__(self, pool: KVPool, num_heads: int | None = None, compiled: bool = False):
        """compiled: the model runs under torch.compile (queries padded to a block, so kernels see
        fewer shapes); otherwise flex runs eagerly and the mask is evaluated once per step."""
        self.pool = pool
        self.compiled = compiled
        ps = pool.page_size
        self.page_pos = torch.zeros(pool.num_pages, dtype=torch.int32, device=pool.device)
        self.kernel_options = None
        if pool.device.type == "cuda" and ps % 128:  # the kernel's KV tile (up to 128) must divide a page
            self.kernel_options = {"BLOCK_N": math.gcd(ps, 64)}

    @staticmethod
    def unsupported(page_size: int, device: torch.device) -> str | None:
        """Why this backend cannot run with these settings, or None."""
        if device.type == "cuda" and page_size % 16:
            return (f"on a GPU, FlexAttention's kernels read a page as one KV block of at least 16 "
                    f"tokens, so page_size must be a multiple of 16 (got {page_size})")
        return None

    @staticmethod
    def max_pool_elements(device: torch.device) -> int | None:
        """Inductor's flex-decoding template (torch 2.11) fails to compile once the KV tensor needs
        64-bit indexing ("Ternary expression with dynamic condition has inconsistent types int64 and
        int32"): seen on an H100 with the 3.4M-parameter embedded model, whose default pool held
        34M tokens, 4.4G elements per layer. A pool that flex reads on a GPU stays below 2**31."""
        return 2**31 - 1 if device.type == "cuda" else None

    def prepare(self, fb: ForwardBatch) -> None:
        fb.attn = self.metadata(fb)

    def metadata(self, fb: ForwardBatch) -> FlexMeta:
        self.record_page_positions(fb.page_table, fb.seq_lens)
        if fb.mode == "decode":
            q_len = 1
            # Inductor's CPU flex kernel wants the query in a 4-D buffer of its own, not a view.
            q_index = _query_index(fb) if fb.input_ids.device.type == "cpu" else None
        else:
            q_len = fb.max_q_len
            if self.compiled:  # whole blocks, and at least two: see MIN_COMPILED_SIZE
                q_len = max(-(-q_len // Q_BLOCK), MIN_COMPILED_SIZE) * Q_BLOCK
            q_index = _query_index(fb)
        block_mask, mask_state = self.block_mask(fb, q_len)
        return FlexMeta(block_mask, q_len, q_index, mask_state)

    # CUDA graphs: the BlockMask of a captured size lives in tensors the graph reads; a step's
    # mask is built as usual from the static batch and copied into them.
    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        self.graph_meta: dict[int, FlexMeta] = {}

    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        fb.attn = self.graph_meta[bs] = self.metadata(fb)

    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        for dst, src in zip(self.graph_meta[bs].step_tensors(), self.metadata(fb).step_tensors()):
            dst.copy_(src)

    def record_page_positions(self, page_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """page_pos[page_table[b, j]] = j for each request's pages, on the device. Entries past a
        request's last page are not its pages (padding, or a graph's static table left from an
        earlier step): they count as the dummy page, which padding rows read at index 0."""
        b, w = page_table.shape
        logical = torch.arange(w, dtype=torch.int32, device=page_table.device).expand(b, w)
        n_pages = (seq_lens + self.pool.page_size - 1) // self.pool.page_size
        pages = torch.where(logical < n_pages[:, None], page_table, DUMMY_PAGE)
        self.page_pos.scatter_(0, pages.reshape(-1).long(), logical.reshape(-1))
        self.page_pos[DUMMY_PAGE] = 0

    def block_mask(self, fb: ForwardBatch, q_len: int) -> tuple[BlockMask, list[torch.Tensor]]:
        ps = self.pool.page_size
        page_table, q_lens = fb.page_table, fb.q_lens
        b, w = page_table.shape
        prefix = (fb.seq_lens - q_lens).long()  # tokens already in the cache before this step
        starts = torch.arange(0, q_len, Q_BLOCK, device=page_table.device)  # [nqb] first row of each block
        valid = starts[None, :] < q_lens[:, None]
        first_pos = prefix[:, None] + starts[None, :]
        last_pos = prefix[:, None] + torch.minimum(starts[None, :] + Q_BLOCK, q_lens[:, None].long()) - 1
        n_visible = torch.where(valid, last_pos // ps + 1, 0)
        n_full = torch.where(valid, (first_pos + 1) // ps, 0)
        cols = torch.arange(w, device=page_table.device)
        partial_cols = (n_full[..., None] + cols).clamp_(max=w - 1)  # [B, nqb, W]
        partial_idx = torch.gather(page_table[:, None, :].expand(b, len(starts), w), 2, partial_cols)
        full_idx = page_table[:, None, :].expand(b, len(starts), w)
        mask_mod = self.mask_mod(page_table, prefix)
        mask_state = [prefix]
        if not self.compiled:
            # Eager flex evaluates mask_mod over every (query, key) pair in every layer, under four
            # vmaps whose per-index cost dominates a small model's step: evaluate it once per step.
            dev = page_table.device
            visible = mask_mod(torch.arange(b, device=dev)[:, None, None], None,
                               torch.arange(q_len, device=dev)[None, :, None],
                               torch.arange(fb.num_kv_pages * ps, device=dev)[None, None, :])
            mask_mod = lambda b, h, q_idx, kv_idx: visible[b, q_idx, kv_idx]  # noqa: E731
            mask_state = [visible]
        if self.compiled and page_table.device.type == "cpu" and w < fb.num_kv_pages:
            # Inductor's CPU flex kernel wants an index row as wide as the KV sequence has blocks.
            pad = (0, fb.num_kv_pages - w)
            partial_idx, full_idx = F.pad(partial_idx, pad), F.pad(full_idx, pad)
        return BlockMask.from_kv_blocks(
            (n_visible - n_full).to(torch.int32)[:, None],
            partial_idx[:, None].contiguous(),
            n_full.to(torch.int32)[:, None],
            full_idx[:, None].contiguous(),
            BLOCK_SIZE=(Q_BLOCK, ps),
            mask_mod=mask_mod,
            seq_lengths=(q_len, fb.num_kv_pages * ps),
            compute_q_blocks=False,
        ), mask_state

    def mask_mod(self, page_table: torch.Tensor, prefix: torch.Tensor):
        ps, page_pos, w = self.pool.page_size, self.page_pos, page_table.shape[1]

        def paged_causal(b, h, q_idx, kv_idx):
            page = kv_idx // ps
            logical = page_pos[page]
            owned = page_table[b, logical.clamp(0, w - 1)] == page
            return owned & (logical * ps + kv_idx % ps <= prefix[b] + q_idx)

        return paged_causal

    def forward(self, q, layer: int, fb: ForwardBatch) -> torch.Tensor:
        meta: FlexMeta = fb.attn
        t, hq, d = q.shape
        b = fb.batch_size
        if meta.q_index is None:
            qb = q.view(b, 1, hq, d)
        else:
            qb = q.new_zeros(b, meta.q_len, hq, d).index_put_(meta.q_index, q)
        n = fb.num_kv_pages * self.pool.page_size
        kb = self.pool.k[layer][None, :n].transpose(1, 2)
        vb = self.pool.v[layer][None, :n].transpose(1, 2)
        out = flex_attention(qb.transpose(1, 2), kb, vb, block_mask=meta.block_mask,
                             enable_gqa=hq != kb.shape[1], kernel_options=self.kernel_options)
        out = out.transpose(1, 2)  # [B, Lq, Hq, D]
        if meta.q_index is None:
            return out.reshape(t, hq, d)
        return out[meta.q_index]


def _query_index(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, row within its padded query block) of each packed token."""
    req = torch.repeat_interleave(torch.arange(fb.batch_size, device=fb.q_lens.device), fb.q_lens.long(),
                                  output_size=fb.num_tokens)
    return req, torch.arange(fb.num_tokens, device=req.device) - fb.q_offsets.long()[req]
