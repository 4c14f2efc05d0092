"""Where flex's queries and keys sit in a prefill step: the query sequence's rows and blocks, and
which KV blocks (pages, or blocks of packed rows) each query block reads, full or partial
(flex_meta.py builds its BlockMasks from them).

Compiled, a query block is `align` (128) rows. Where the step's requests average at least
MIN_BLOCKS_PER_REQUEST blocks of new tokens and no block would hold more than MAX_BLOCK_REQUESTS,
the rows are the step's tokens as they come, so the attention reads the projections' output as it
is and writes the output projection's input, with no copy either way. A block may then hold the
tail of one request and the head of the next, and reads both requests' KV blocks, all of them
partial, in one program. Otherwise (short requests, whose copy costs little, and where one program
reading two requests' KV would leave too few programs to fill the GPU) each request starts a block
of its own, and the queries are copied into those rows and back. So does a step whose shared blocks
would read far more than any block of one request, as past long cached prefixes or under a window,
where the step would wait on them. The window is the attention variant's, so each variant of a step
has its layout (rows_as_they_come). A request's rows in a block are a *piece*: the KV blocks of a
block are its pieces' own, each piece's worked out as for a block of one request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexsgl.attention.base import ForwardBatch
from flexsgl.step_shape import MIN_COMPILED_SIZE

MAX_BLOCK_REQUESTS = 2  # requests one query block may hold, the tokens as they come
MIN_BLOCKS_PER_REQUEST = 4  # query blocks of new tokens a request averages, the tokens as they come
MAX_SHARED_GROWTH = 1.75  # a shared block's reads over the heaviest block's with a block per request
MIN_SHARED_EXTRA = 16  # KV blocks a shared block reads past that heaviest one's, at the least


@dataclass
class QueryRows:
    """A prefill step's query sequence `[1, num_rows]`, in blocks of `align` rows.

    rows: each token's (0, row) where requests start blocks of their own; None where token i is row i.
    row_req, row_pos: int32 `[num_blocks * align]`, each row's request and position (-1: no token;
    what such a row sees is never read). The pieces (one request's rows within one block, block
    after block), int64 `[P]`: request, positions of the first and last row, whether it holds any
    token (padding blocks do not); None where a block is one row (not compiled).
    block_pieces: each block's first piece and its second (-1: none); None where piece i is block i."""
    num_rows: int
    num_blocks: int
    rows: tuple[torch.Tensor, torch.Tensor] | None
    row_req: torch.Tensor
    row_pos: torch.Tensor
    piece_req: torch.Tensor | None
    piece_first: torch.Tensor | None
    piece_last: torch.Tensor | None
    piece_valid: torch.Tensor | None
    block_pieces: tuple[torch.Tensor, torch.Tensor] | None


def rows_as_they_come(fb: ForwardBatch, align: int, window: int | None = None) -> bool:
    """Whether a prefill step's query rows, for attention over `window` keys (None: causal), are the
    step's tokens as they come (the module docstring): always at align 1 (not compiled); compiled,
    where its requests are long and no block holds more than MAX_BLOCK_REQUESTS, unless a shared
    block would be the step's heaviest by far. A block of two requests reads both requests' KV
    blocks; past long cached prefixes, or under a window, that is nearly twice what a block of one
    reads, and the step waits on that block. A block per request costs the queries' copy into rows
    and back instead, which a few more KV blocks do not outweigh (a window of 1,024 adds about 9 to a
    shared block: 128-row blocks), and a window's worth of 4,096 (about 33) does. So a block per
    request where the heaviest block as they come reads at least MAX_SHARED_GROWTH times, and
    MIN_SHARED_EXTRA KV blocks more than, the heaviest block with a block per request (KV blocks of
    `align` positions, each query row reading up to its own position)."""
    if align == 1:
        return True
    q_lens, seq_lens = fb.host_q_lens, fb.host_seq_lens
    shared = _pieces(_offsets(q_lens), q_lens, seq_lens, align)
    if sum(q_lens) < MIN_BLOCKS_PER_REQUEST * align * len(q_lens) or max(map(len, shared)) > MAX_BLOCK_REQUESTS:
        return False
    heaviest = _heaviest_block(shared, align, window)
    own = _heaviest_block(_pieces(_block_starts(q_lens, align), q_lens, seq_lens, align), align, window)
    return heaviest < MAX_SHARED_GROWTH * own or heaviest - own < MIN_SHARED_EXTRA


def query_rows(fb: ForwardBatch, align: int, as_they_come: bool) -> QueryRows:
    """The query rows of a prefill step, the tokens as they come or each request from a block of its
    own (rows_as_they_come picks). Compiled (align > 1) with a block per request: at least
    MIN_COMPILED_SIZE blocks, those past the tokens seeing nothing; align 1 (not compiled, where the
    mask is evaluated densely): a row per token, and no pieces."""
    q_lens, seq_lens, dev = fb.host_q_lens, fb.host_seq_lens, fb.page_table.device
    starts = _offsets(q_lens) if as_they_come else _block_starts(q_lens, align)  # and the rows' end
    num_rows = starts[-1]
    real_blocks = -(-num_rows // align)
    # FLASH wants exactly the blocks of the rows; a block each has at least MIN_COMPILED_SIZE
    num_blocks = real_blocks if as_they_come else max(real_blocks, MIN_COMPILED_SIZE)
    token_req, token_index = query_index(fb)
    row_of_token = torch.arange(fb.num_tokens, device=dev) if as_they_come else \
        token_index + torch.tensor(starts[:-1], device=dev)[token_req]
    prefix = (fb.seq_lens - fb.q_lens).long()
    row_req = torch.zeros(num_blocks * align, dtype=torch.int32, device=dev).index_copy_(
        0, row_of_token, token_req.int())
    row_pos = torch.full((num_blocks * align,), -1, dtype=torch.int32, device=dev).index_copy_(
        0, row_of_token, (prefix[token_req] + token_index).int())
    rows = None if as_they_come else (torch.zeros_like(row_of_token), row_of_token)
    if align == 1:
        return QueryRows(num_rows, num_blocks, rows, row_req, row_pos, None, None, None, None, None)
    pieces, firsts, second = [], [], [-1] * num_blocks  # pieces: (request, first position, last position, holds tokens)
    for b, block in enumerate(_pieces(starts, q_lens, seq_lens, align)):
        firsts.append(len(pieces))
        if len(block) > 1:
            second[b] = len(pieces) + 1
        pieces.extend((*piece, 1) for piece in block)
    for b in range(real_blocks, num_blocks):
        firsts.append(len(pieces))
        pieces.append((len(q_lens) - 1, 0, 0, 0))
    req, first, last, valid = torch.tensor(pieces, dtype=torch.long).T.to(dev)
    block_pieces = None
    if max(second) >= 0:
        block_pieces = tuple(torch.tensor(x, device=dev) for x in (firsts, second))
    return QueryRows(num_rows, num_blocks, rows, row_req, row_pos, req, first, last, valid > 0, block_pieces)


def _offsets(q_lens: list[int]) -> list[int]:
    """Each request's first row with the tokens as they come, and the rows' end."""
    offsets = [0]
    for n in q_lens:
        offsets.append(offsets[-1] + n)
    return offsets


def _block_starts(q_lens: list[int], align: int) -> list[int]:
    """Each request's first row where each starts a block of `align` rows, and the rows' end."""
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + -(-n // align) * align)
    return starts


def _pieces(starts: list[int], q_lens: list[int], seq_lens: list[int], align: int) -> list[list[tuple]]:
    """Each query block's pieces, block after block, requests starting at rows `starts`: (request,
    position of its first row, position of its last row)."""
    blocks = []
    for r, (s, n, total) in enumerate(zip(starts, q_lens, seq_lens)):
        for b in range(s // align, (s + n - 1) // align + 1):
            lo, hi = max(s, b * align), min(s + n, (b + 1) * align) - 1
            if len(blocks) <= b:
                blocks.append([])
            blocks[b].append((r, total - n + lo - s, total - n + hi - s))
    return blocks


def _heaviest_block(blocks: list[list[tuple]], kv_block: int, window: int | None) -> int:
    """The most KV blocks of `kv_block` positions one query block reads: its pieces' visible blocks,
    from the first row's first key in `window` (None: position 0) to the last row's position."""
    def visible(first: int, last: int) -> int:
        lo = 0 if window is None else max(first - window + 1, 0) // kv_block
        return last // kv_block - lo + 1
    return max(sum(visible(first, last) for _, first, last in block) for block in blocks)


def block_lists(table: torch.Tensor, block: int, qr: QueryRows, window: int | None = None, full: bool = True,
                hi_pos=None):
    """kv_blocks' lists for each of qr's query blocks: its pieces' own, where `table[r]` lists request
    r's KV blocks of `block` positions in order. A block of one piece lists that piece's; a block of
    two lists every KV block either piece sees as partial (the mask tells the requests apart), and
    no full ones. hi_pos: kv_blocks' (each piece's request's last position), or None."""
    lists = kv_blocks(table, block, qr.piece_req, qr.piece_first, qr.piece_last, qr.piece_valid, window, full, hi_pos)
    if qr.block_pieces is None:
        return lists
    first, second = qr.block_pieces
    num_partial, partial_idx, num_full, full_idx = (None if x is None else x[first] for x in lists)
    seen, seen_idx, _, _ = kv_blocks(table, block, qr.piece_req, qr.piece_first, qr.piece_last, qr.piece_valid,
                                     window, False, hi_pos)
    shared, other = second >= 0, second.clamp(min=0)
    n_first = seen[first][:, None].long()
    w = table.shape[1]
    cols = torch.arange(2 * w, device=table.device)
    both = torch.where(cols < n_first, seen_idx[first].gather(1, cols.clamp(max=w - 1).expand(len(first), -1)),
                       seen_idx[other].gather(1, (cols - n_first).clamp(0, w - 1)))
    num_partial = torch.where(shared, seen[first] + seen[other], num_partial)
    partial_idx = torch.where(shared[:, None], both, F.pad(partial_idx, (0, w)))
    if num_full is not None:
        num_full = torch.where(shared, 0, num_full)
        full_idx = F.pad(full_idx, (0, w))
    return num_partial, partial_idx, num_full, full_idx


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


def query_index(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, index among its request's tokens in this step) of each packed token."""
    req = torch.repeat_interleave(torch.arange(fb.batch_size, device=fb.q_lens.device), fb.q_lens.long(),
                                  output_size=fb.num_tokens)
    return req, torch.arange(fb.num_tokens, device=req.device) - fb.q_offsets.long()[req]
