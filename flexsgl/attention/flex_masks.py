"""Which KV slot a query sees: flex's mask_mods over the pool as one KV sequence.

A slot is visible to a query iff its page is one of the query's request's pages, at the logical
index `page_pos[page]` (flex.py writes it from each step's page table; a page shared through a
prefix is at the same index in every request that uses it, and a page no request of the step
holds is at 0, so the mask indexes the page table without a clamp), and its position is not after
the query's. Each mask is correct over the whole pool on its own: not compiled, flex.py evaluates it
everywhere (and SDPA applies the result); compiled flex, only on the partial KV blocks of its
BlockMask. `listed_decode_causal` is the exception: it is correct only on the pages a decode
BlockMask lists for each request, and so it needs no page lookup at all. `packed_causal` reads no
pages: it runs over the step's K/V copied into rows, request after request.
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


def listed_decode_causal(page_table: torch.Tensor, last_pos: torch.Tensor, page_size: int, first_slot=0):
    """Decode over a BlockMask whose KV blocks for request b are b's own pages and nothing else
    (flex_ops.py): of those, only the page holding b's query, at position last_pos[b], has slots
    after it. Per KV element it compares two integers, where paged_causal gathers from page_pos
    and from the page table. first_slot: the pool slot that kv_idx 0 stands for (an int, or a 0-dim
    tensor), where the kernel reads a shard of the pool."""
    last_page = page_table.gather(1, (last_pos // page_size)[:, None])[:, 0]
    last_slot = last_page.long() * page_size + last_pos % page_size - first_slot

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


def packed_causal(block_kv_start: torch.Tensor, block_first_pos: torch.Tensor, rows_per_block: int):
    """Prefill over the step's K/V packed into rows (flex.py): query block j holds a request's tokens
    from position block_first_pos[j] on, one per row, and that request's positions 0, 1, ... are the
    KV rows from block_kv_start[j] on. Two lookups per query row and none per key: a lookup per key
    (comparing the key's block's request with the query's) made the H200 kernel 1.35-1.42x slower."""
    def mask(b, h, q_idx, kv_idx, rows_per_block=rows_per_block):
        j = q_idx // rows_per_block
        start = block_kv_start[j]
        return (kv_idx >= start) & (kv_idx - start <= block_first_pos[j] + q_idx % rows_per_block)

    return mask
