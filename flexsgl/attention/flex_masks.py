"""Which KV slot a query sees: flex's mask_mods over the pool as one KV sequence.

A slot is visible to a query iff its page is one of the query's request's pages, at the logical
index `page_pos[page]` (flex_meta.py writes it from each step's page table; a page shared through
a prefix is at the same index in every request that uses it, and a page no request of the step
holds is at 0, so the mask indexes the page table without a clamp), and its position is not after
the query's. Each mask is correct over the whole pool on its own: not compiled, flex_meta.py
evaluates it everywhere (and SDPA applies the result); compiled flex, only on the partial KV blocks
of its BlockMask. `listed_decode_causal` is the exception: it is correct only on the pages a decode
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


def packed_paged_causal(page_table: torch.Tensor, row_req: torch.Tensor, row_pos: torch.Tensor,
                        page_pos: torch.Tensor, page_size: int):
    """Prefill (one packed `[1, rows]` query sequence, flex_blocks.py): query row i is request
    row_req[i]'s token at position row_pos[i] (-1: no token; what such a row sees is never read)."""
    def mask(b, h, q_idx, kv_idx, page_size=page_size):
        page = kv_idx // page_size
        logical = page_pos[page]
        owned = page_table[row_req[q_idx], logical] == page
        return owned & (logical * page_size + kv_idx % page_size <= row_pos[q_idx])

    return mask


def packed_causal(row_kv_start: torch.Tensor, row_pos: torch.Tensor):
    """Prefill over the step's K/V packed into rows (flex_meta.py): query row i is a token at position
    row_pos[i] (-1: none), whose request's positions 0, 1, ... are the KV rows from row_kv_start[i]
    on. Two lookups per query row and none per key: a lookup per key (comparing the key's block's
    request with the query's) made the H200 Triton kernel 1.35-1.42x slower. A request's KV rows
    end before the next request's start, so the causal bound keeps a row from later requests' keys."""
    def mask(b, h, q_idx, kv_idx):
        start = row_kv_start[q_idx]
        return (kv_idx >= start) & (kv_idx - start <= row_pos[q_idx])

    return mask


# ---- attention variants (bound_variant.py): the same layouts, mapped onto logical coordinates. Each
# returns (mask_mod, score_mod) over flex's coordinates, score_mod None where the variant changes no
# score (the kernel then has no score_mod to run, nor its tensors to load); a key is visible iff it
# exists in the query's request (it belongs to the request and lies at most at its last position so
# far) and the variant's `visible` says so at (request slot, head, query position, key position).
# `slots[row]` is a batch row's request slot, which indexes per-request parameters.

def paged_decode_variant(bound, page_table, last_pos, page_pos, slots, page_size: int):
    """Decode over the pool (as paged_causal): request b's query at position last_pos[b]."""
    def coords(b, kv_idx, page_size=page_size):
        page = kv_idx // page_size
        logical = page_pos[page]
        return page, logical, logical * page_size + kv_idx % page_size

    def mask(b, h, q_idx, kv_idx):
        page, logical, kv_pos = coords(b, kv_idx)
        own = (page_table[b, logical] == page) & (kv_pos <= last_pos[b])
        return bound.visible(own, slots[b], h, last_pos[b], kv_pos)

    def score(s, b, h, q_idx, kv_idx):
        return bound.score(s, slots[b], h, last_pos[b], coords(b, kv_idx)[2])

    return mask, None if bound.score_mod is None else score


def listed_decode_variant(bound, last_pos, page_pos, slots, page_size: int, first_slot=0):
    """Decode over a BlockMask that lists request b's own pages and nothing else (flex_ops.py, as
    listed_decode_causal): every listed slot is b's; its position comes from page_pos."""
    def kv_position(kv_idx, page_size=page_size):
        slot = kv_idx + first_slot
        return page_pos[slot // page_size] * page_size + slot % page_size

    def mask(b, h, q_idx, kv_idx):
        kv_pos = kv_position(kv_idx)
        return bound.visible(kv_pos <= last_pos[b], slots[b], h, last_pos[b], kv_pos)

    def score(s, b, h, q_idx, kv_idx):
        return bound.score(s, slots[b], h, last_pos[b], kv_position(kv_idx))

    return mask, None if bound.score_mod is None else score


def packed_paged_variant(bound, page_table, row_req, row_pos, seq_last, page_pos, slots, page_size: int):
    """Prefill (as packed_paged_causal): query row i is request row_req[i]'s token at position
    row_pos[i] (-1: none); the request's keys so far end at seq_last."""
    def coords(q_idx, kv_idx, page_size=page_size):
        page = kv_idx // page_size
        logical = page_pos[page]
        return row_req[q_idx], row_pos[q_idx], page, logical, logical * page_size + kv_idx % page_size

    def mask(b, h, q_idx, kv_idx):
        row, q_pos, page, logical, kv_pos = coords(q_idx, kv_idx)
        own = (page_table[row, logical] == page) & (kv_pos <= seq_last[row])
        return bound.visible(own, slots[row], h, q_pos, kv_pos)

    def score(s, b, h, q_idx, kv_idx):
        row, q_pos, _, _, kv_pos = coords(q_idx, kv_idx)
        return bound.score(s, slots[row], h, q_pos, kv_pos)

    return mask, None if bound.score_mod is None else score


def packed_rows_variant(bound, row_req, row_kv_start, row_pos, seq_last, slots):
    """Prefill over the step's K/V packed into rows (as packed_causal): query row i's request's
    positions 0, 1, ... are the KV rows from row_kv_start[i] on. Under a window the rows start at the
    first key a request's window reaches (flex_meta.py), and row_kv_start is where its position 0
    would sit: the previous request's last rows may then pass `kv_idx >= start`, at positions behind
    every one of its queries' windows, which the variant's window check hides."""
    def coords(q_idx, kv_idx):
        start = row_kv_start[q_idx]
        return row_req[q_idx], row_pos[q_idx], start, kv_idx - start

    def mask(b, h, q_idx, kv_idx):
        row, q_pos, start, kv_pos = coords(q_idx, kv_idx)
        own = (kv_idx >= start) & (kv_pos <= seq_last[row])
        return bound.visible(own, slots[row], h, q_pos, kv_pos)

    def score(s, b, h, q_idx, kv_idx):
        row, q_pos, _, kv_pos = coords(q_idx, kv_idx)
        return bound.score(s, slots[row], h, q_pos, kv_pos)

    return mask, None if bound.score_mod is None else score
