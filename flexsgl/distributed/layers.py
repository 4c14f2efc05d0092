"""How the decoder's weights are split across ranks (Megatron-style), and the layers that need it.

    qkv_proj, gate_up_proj  column-parallel: each rank holds its rows (its q heads and its KV heads;
                            its slice of the MLP's intermediate dimension), no communication
    o_proj, down_proj       row-parallel: each rank holds its columns and computes a partial sum;
                            one all-reduce adds them, then the residual is added once
    embed_tokens            vocabulary-parallel: each rank holds ceil(vocab / tp) rows, looks up
                            the ids in its range (zeros elsewhere), and an all-reduce adds them
    lm_head                 vocabulary-parallel: each rank computes its vocabulary slice of the
                            logits, an all-gather puts them side by side, padding rows dropped
    norms                   replicated

KV heads are split like q heads when there are at least as many as ranks; with fewer, each is
replicated: rank r uses KV head r * num_kv_heads // tp (its q heads are the ones that read it).
`split_of` gives, for each parameter, which slice of the full (TP=1) tensor a rank holds; the
parameter's weight loader (flexsgl/model/weight_loaders.py Parts) reads only that slice from
safetensors, and takes it from the full tensor for dummy weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flexsgl.distributed.group import all_gather_last, all_reduce
from flexsgl.kernels import gemv


def kv_heads(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, how many) that `rank` of `size` holds."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, per
    return rank * num_kv_heads // size, 1


def vocab_rows(vocab: int, size: int) -> int:
    """Rows of the embedding and lm_head per rank: the vocabulary padded to a multiple of `size`."""
    return -(-vocab // size)


@dataclass(frozen=True)
class Piece:
    """Part of a parameter a rank holds: `length` entries from `start` of a full part (an HF tensor,
    or one part of a fused parameter), placed at `at` along the split dimension of the rank's own."""

    start: int
    length: int
    at: int


@dataclass(frozen=True)
class Split:
    dim: int
    pieces: list[Piece]  # one per fused part (q, k, v; gate, up), else one
    full_parts: list[int]  # sizes of the full parts along `dim`


def split_of(name: str, cfg, rank: int, size: int) -> Split | None:
    """How decoder parameter `name` is split for `rank` of `size`, against full config `cfg`; None
    when every rank holds all of it."""
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    d, hq_all, hkv_all, inter_all = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    hq, inter = hq_all // size, inter_all // size
    if module == "qkv_proj":
        k0, hk = kv_heads(hkv_all, rank, size)
        return Split(0, [Piece(rank * hq * d, hq * d, 0), Piece(k0 * d, hk * d, hq * d),
                         Piece(k0 * d, hk * d, (hq + hk) * d)], [hq_all * d, hkv_all * d, hkv_all * d])
    if module == "gate_up_proj":
        return Split(0, [Piece(rank * inter, inter, 0), Piece(rank * inter, inter, inter)], [inter_all, inter_all])
    if module == "o_proj":
        return Split(1, [Piece(rank * hq * d, hq * d, 0)], [hq_all * d])
    if module == "down_proj":
        return Split(1, [Piece(rank * inter, inter, 0)], [inter_all])
    if module in ("embed_tokens", "lm_head"):
        v, rows = cfg.vocab_size, vocab_rows(cfg.vocab_size, size)
        start = min(rank * rows, v)
        return Split(0, [Piece(start, min(rows, v - start), 0)], [v])
    return None


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; ids outside them look up zeros, and the ranks' lookups add up."""

    def __init__(self, vocab: int, hidden: int, rank: int, size: int):
        super().__init__()
        rows = vocab_rows(vocab, size)
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.rows = rank * rows, rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(torch.where(mine.unsqueeze(-1), x, 0))


def gather_logits(local: torch.Tensor, vocab: int) -> torch.Tensor:
    """The ranks' vocabulary slices of the logits, `[T, vocab / tp]` each, as `[T, vocab]`."""
    return all_gather_last(local)[:, :vocab]


def row_linear(x: torch.Tensor, proj: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
    """residual + the ranks' partial proj(x) summed (a row-parallel projection without bias)."""
    return residual + all_reduce(gemv.linear(x, proj, None))


def row_silu_linear(gate_up: torch.Tensor, proj: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
    """residual + the ranks' partial proj(silu(gate) * up) summed."""
    return residual + all_reduce(gemv.silu_linear(gate_up, proj, None))
