"""Where flex's queries and keys sit in a step: query blocks of packed prefill rows, the positions of
their rows, and which KV blocks (pages, or blocks of packed rows) each query block reads, full or
partial (flex_meta.py builds its BlockMasks from them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexsgl.attention.base import ForwardBatch
from flexsgl.step_shape import MIN_COMPILED_SIZE


def kv_blocks(table: torch.Tensor, block: int, req, first_pos, last_pos, valid, window: int | None = None,
              full: bool = True, hi_pos=None):
    """For query blocks of requests `req` whose rows sit at positions first_pos..last_pos, where
    `table[r]` lists request r's KV blocks of `block` positions each in order: which KV blocks they
    read. Those from the first row's first visible key (position 0, or first_pos - window + 1) to the
    last row's last (last_pos, or hi_pos where keys after the query are visible too) are visible;
    of them, those every row sees whole (after the last row's window start, up to the first row)
    are *full* (no mask_mod call) where `full`, and the others *partial*. Returns (partial count,
    partial blocks, full count, full blocks), each with a leading query-block dimension; with `full`
    False every visible block is partial and there are no full blocks (None, None)."""
    w = table.shape[1]
    hi = (last_pos if hi_pos is None else hi_pos) // block
    lo = torch.zeros_like(hi) if window is None else (first_pos - window + 1).clamp(min=0) // block
    n_visible = torch.where(valid, hi - lo + 1, 0)
    rows = table[req]
    cols = torch.arange(w, device=req.device)
    if not full:
        visible_idx = torch.gather(rows, 1, (lo[:, None] + cols).clamp_(max=w - 1))
        return n_visible.to(torch.int32), visible_idx, None, None
    full_lo = torch.zeros_like(hi) if window is None else -(-(last_pos - window + 1).clamp(min=0) // block)
    n_full = torch.where(valid, ((first_pos + 1) // block - full_lo).clamp(min=0), 0)
    n_left = torch.where(n_full > 0, full_lo - lo, n_visible)  # partial blocks before the full ones
    partial = torch.where(cols < n_left[:, None], lo[:, None] + cols, lo[:, None] + n_full[:, None] + cols)
    partial_idx = torch.gather(rows, 1, partial.clamp_(max=w - 1))
    full_idx = torch.gather(rows, 1, (full_lo[:, None] + cols).clamp_(max=w - 1))
    return (n_visible - n_full).to(torch.int32), partial_idx, n_full.to(torch.int32), full_idx


def block_rules(bound, seq_last) -> tuple:
    """kv_blocks' (window, full, hi_pos) for a prefill of `bound`'s variant (None: plain causal);
    seq_last: each query block's request's last position so far."""
    if bound is None:
        return None, True, None
    return bound.window, bound.full_blocks, None if bound.causal else seq_last


def query_blocks(fb: ForwardBatch, align: int):
    """Packed prefill's query blocks of `align` rows, each request starting a block of its own:
    (request of each block, block index, each request's first block, real blocks, all blocks). Compiled,
    at least MIN_COMPILED_SIZE blocks; padding blocks belong to the last request and see nothing."""
    dev = fb.page_table.device
    per_req = (fb.q_lens.long() + align - 1) // align
    n_real = sum(-(-n // align) for n in fb.host_q_lens)
    n_blocks = max(n_real, MIN_COMPILED_SIZE) if align > 1 else n_real
    first_block = torch.cumsum(per_req, 0) - per_req
    req = torch.repeat_interleave(torch.arange(fb.batch_size, device=dev), per_req, output_size=n_real)
    req = F.pad(req, (0, n_blocks - n_real), value=fb.batch_size - 1)
    return req, torch.arange(n_blocks, device=dev), first_block, n_real, n_blocks


def block_positions(fb: ForwardBatch, req, index, first_block, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of each query block's first and last rows (query_blocks' blocks)."""
    prefix = (fb.seq_lens - fb.q_lens).long()[req]  # tokens cached before this step
    in_req = index - first_block[req]
    return prefix + in_req * align, prefix + torch.minimum((in_req + 1) * align, fb.q_lens.long()[req]) - 1


def packed_rows(fb: ForwardBatch, first_block: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, row) of each packed token in the `[1, rows]` query sequence."""
    token_req, token_row = query_index(fb)
    return torch.zeros_like(token_row), first_block[token_req] * align + token_row


def query_index(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, index among its request's tokens in this step) of each packed token."""
    req = torch.repeat_interleave(torch.arange(fb.batch_size, device=fb.q_lens.device), fb.q_lens.long(),
                                  output_size=fb.num_tokens)
    return req, torch.arange(fb.num_tokens, device=req.device) - fb.q_offsets.long()[req]
