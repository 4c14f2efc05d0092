"""Which KV slot a query sees: flex's mask_mods over the pool as one KV sequence.

A slot is visible to a query iff its page is one of the query's request's pages, at the logical
index `page_pos[page]` (flex.py writes it from each step's page table; a page shared through a
prefix is at the same index in every request that uses it, and a page no request of the step
holds is at 0, so the mask indexes the page table without a clamp), and its position is not after
the query's. Each mask is correct over the whole pool on its own: not compiled, flex.py evaluates it
everywhere (and SDPA applies the result); compiled flex, only on the partial KV blocks of its
BlockMask. The `listed_` masks are the exception: each is correct only on the pages a BlockMask
lists for a query block, which are its request's own, and so skips the page table:
`listed_decode_causal` needs no lookup at all, `listed_prefill_causal` one page position per page.
"""

from __future__ import annotations

import torch

Q_BLOCK = 128  # rows of a BlockMask query block in compiled flex


def paged_causal(page_table: torch.Tensor, last_pos: torch.Tensor, page_pos: torch.Tensor, page_size: int):
    """Decode: request b's query sits at position last_pos[b] (every row of its query block, which
    holds one token, or one token's heads)."""
    def mask(b, h, q_idx, kv_idx, page_size=page_size):
        page = kv_idx // page_size
        logical = page_pos[page]
        owned = page_table[b, logical] == page
        return owned & (logical * page_size + kv_idx % page_size <= last_pos[b])

    return mask


def listed_decode_causal(page_table: torch.Tensor, last_pos: torch.Tensor, page_size: int):
    """Decode over a BlockMask whose KV blocks for request b are b's own pages and nothing else
    (flex_ops.py): of those, only the page holding b's query, at position last_pos[b], has slots
    after it. Per KV element it compares two integers, where paged_causal gathers from page_pos
    and from the page table."""
    last_page = page_table.gather(1, (last_pos // page_size)[:, None])[:, 0]
    last_slot = last_page.long() * page_size + last_pos % page_size

    def mask(b, h, q_idx, kv_idx, page_size=page_size):
        return (kv_idx // page_size != last_slot[b] // page_size) | (kv_idx <= last_slot[b])

    return mask


def packed_paged_causal(page_table: torch.Tensor, block_req: torch.Tensor, block_first_pos: torch.Tensor,
                        page_pos: torch.Tensor, page_size: int, rows_per_block: int):
    """Prefill (one packed `[1, rows]` query sequence): query block j holds request block_req[j]'s
    tokens from position block_first_pos[j] on, one per row."""
    def mask(b, h, q_idx, kv_idx, page_size=page_size, rows_per_block=rows_per_block):
        j = q_idx // rows_per_block
        page = kv_idx // page_size
        logical = page_pos[page]
        owned = page_table[block_req[j], logical] == page
        return owned & (logical * page_size + kv_idx % page_size <= block_first_pos[j] + q_idx % rows_per_block)

    return mask


def listed_prefill_causal(block_first_pos: torch.Tensor, page_pos: torch.Tensor, page_size: int,
                          rows_per_block: int):
    """Prefill over a BlockMask whose KV blocks for query block j are its request's own pages (flex.py):
    a slot there is visible iff its position, from its page's logical index page_pos[page], is not after
    the query's. packed_paged_causal's ownership check (two dependent gathers per KV element, through
    the request and the page table) is what the block lists already guarantee."""
    def mask(b, h, q_idx, kv_idx, page_size=page_size, rows_per_block=rows_per_block):
        position = page_pos[kv_idx // page_size] * page_size + kv_idx % page_size
        return position <= block_first_pos[q_idx // rows_per_block] + q_idx % rows_per_block

    return mask
