"""How the models' weights are split across ranks (Megatron-style), and the layers that need it.

    qkv_proj, gate_up_proj  column-parallel: each rank holds its rows (its q heads and its KV heads;
                            its slice of the MLP's intermediate dimension), no communication
    o_proj, down_proj       row-parallel: each rank holds its columns and computes a partial sum;
                            rank 0 adds the residual (and the bias, which it alone holds) to its
                            own, and one all-reduce adds them up
    embed_tokens            vocabulary-parallel: each rank holds ceil(vocab / tp) rows, looks up
                            the ids in its range (zeros elsewhere), and an all-reduce adds them
    lm_head                 vocabulary-parallel: each rank computes its vocabulary slice of the
                            logits; a step whose rows only take their argmax gathers three numbers
                            a row (`vocab_parallel_argmax`), any other gathers the slices side by
                            side, padding rows dropped (`gather_logits`)
    norms                   replicated; where FlashInfer's all-reduce runs (flexsgl/distributed/
                            allreduce.py), the norm after a row-parallel projection rides in its
                            all-reduce with the residual add (`row_linear_norm`)

KV heads are split like q heads when there are at least as many as ranks; with fewer, each is
replicated: rank r uses KV head r * num_kv_heads // tp (its q heads are the ones that read it).

DeepSeek-V2 (MLA) splits by attention heads too: of `qkv_a_proj` the q rows of the rank's heads
(where q is one projection; with q_lora_rank the q_a rows are replicated) and the whole latent
projection (every rank computes, stores and reads the same latents: the latent cache is
replicated); `q_b_proj` and `kv_b_proj` by heads (column-parallel), `o_proj` by heads
(row-parallel). Its MLPs split as above: the dense ones, the shared experts, and each routed
expert along its intermediate dimension (tensor parallelism over the experts, not expert
parallelism: every rank holds a slice of every expert, flexsgl/model/weight_loaders.py
StackedExperts, and the router is replicated, so every rank routes alike).

`split_of` gives, for each parameter, which slice of the full (TP=1) tensor a rank holds; the
parameter's weight loader (flexsgl/model/weight_loaders.py Parts) reads only that slice from
safetensors, or generates only it for dummy weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flexsgl.distributed import allreduce
from flexsgl.distributed.allreduce import all_reduce
from flexsgl.distributed.group import all_gather_last, first_rank
from flexsgl.kernels import gemv
from flexsgl.sampling.sampler import row_argmax


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
    """How parameter `name` is split for `rank` of `size`, against full config `cfg`; None when
    every rank holds all of it (routed experts: StackedExperts)."""
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    if module in ("embed_tokens", "lm_head"):
        v, rows = cfg.vocab_size, vocab_rows(cfg.vocab_size, size)
        start = min(rank * rows, v)
        return Split(0, [Piece(start, min(rows, v - start), 0)], [v])
    if ".experts." in name:
        return None
    if module in ("gate_up_proj", "down_proj"):
        width = cfg.intermediate_size
        if ".shared_experts." in name:
            width = cfg.moe.intermediate_size * cfg.moe.n_shared_experts
        return _mlp_split(module, width, rank, size)
    if cfg.mla is not None:
        return _mla_split(module, cfg, rank, size)
    d, hq_all, hkv_all = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    hq = hq_all // size
    if module == "qkv_proj":
        k0, hk = kv_heads(hkv_all, rank, size)
        return Split(0, [Piece(rank * hq * d, hq * d, 0), Piece(k0 * d, hk * d, hq * d),
                         Piece(k0 * d, hk * d, (hq + hk) * d)], [hq_all * d, hkv_all * d, hkv_all * d])
    if module == "o_proj":
        return Split(1, [Piece(rank * hq * d, hq * d, 0)], [hq_all * d])
    if parts[-1] == "sinks":  # one learned logit per q head (GPT-OSS)
        return Split(0, [Piece(rank * hq, hq, 0)], [hq_all])
    return None


ROW_PARALLEL = ("o_proj", "down_proj")  # the projections whose input features the ranks split


def row_parallel_bias(name: str) -> bool:
    """Whether parameter `name` is the bias of a row-parallel projection, which rank 0 alone holds
    (weight_loaders.FirstRankOnly); split_of does not apply to it."""
    parts = name.split(".")
    return len(parts) > 1 and parts[-1] == "bias" and parts[-2] in ROW_PARALLEL


def _mlp_split(module: str, width: int, rank: int, size: int) -> Split:
    """gate_up_proj: the rank's slice of gate's rows and of up's; down_proj: its columns."""
    inter = width // size
    if module == "gate_up_proj":
        return Split(0, [Piece(rank * inter, inter, 0), Piece(rank * inter, inter, inter)], [width, width])
    return Split(1, [Piece(rank * inter, inter, 0)], [width])


def _mla_split(module: str, cfg, rank: int, size: int) -> Split | None:
    """MLA's projections, split by attention heads (the module docstring)."""
    m, hq_all = cfg.mla, cfg.num_heads
    hq, qk = hq_all // size, m.qk_nope_head_dim + m.qk_rope_head_dim
    if module == "qkv_a_proj":
        if m.q_lora_rank is not None:  # q_a and the latent: replicated
            return None
        return Split(0, [Piece(rank * hq * qk, hq * qk, 0), Piece(0, m.latent_dim, hq * qk)],
                     [hq_all * qk, m.latent_dim])
    per = {"q_b_proj": qk, "kv_b_proj": m.qk_nope_head_dim + m.v_head_dim}.get(module)
    if per is not None:
        return Split(0, [Piece(rank * hq * per, hq * per, 0)], [hq_all * per])
    if module == "o_proj":
        return Split(1, [Piece(rank * hq * m.v_head_dim, hq * m.v_head_dim, 0)], [hq_all * m.v_head_dim])
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


def embedding(cfg) -> nn.Module:
    """A model's token embedding: split by vocabulary over the ranks under tensor parallelism, else
    whole (`cfg`: the rank's ModelConfig)."""
    if cfg.tp_size > 1:
        return VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.tp_rank, cfg.tp_size)
    return nn.Embedding(cfg.vocab_size, cfg.hidden_size)


def gather_logits(local: torch.Tensor, vocab: int) -> torch.Tensor:
    """The ranks' vocabulary slices of the logits, `[T, vocab / tp]` each, as `[T, vocab]`."""
    return all_gather_last(local)[:, :vocab]


def vocab_parallel_argmax(local: torch.Tensor, vocab: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's argmax over the whole vocabulary [T] int64, whether each row's logits are all
    finite [T] bool) from this rank's slice `[T, vocab_rows]` of the logits: one all-gather of
    three numbers a row (`slice_summary`), then `pick_argmax`."""
    every = all_gather_last(slice_summary(local, vocab, rank))  # [T, ranks * 3]
    return pick_argmax(every.view(every.shape[0], every.shape[1] // 3, 3))


def slice_summary(local: torch.Tensor, vocab: int, rank: int) -> torch.Tensor:
    """`[T, 3]` float32: per row of this rank's logits slice, its maximum, that maximum's token id
    (the first, as row_argmax) and the slice's sum (NaN and infinities carry into it). The ids
    ride in float32, exact below 2^24."""
    rows = local.shape[1]
    start = rank * rows
    valid = min(rows, vocab - start)  # the last rank's slice runs past the vocabulary
    assert valid > 0 and vocab < 1 << 24, f"a vocabulary of {vocab} over ranks of {rows} rows"
    mine = local[:, :valid]
    where = row_argmax(mine)
    best = mine.gather(1, where[:, None]).squeeze(1)
    return torch.stack([best.float(), (where + start).float(), mine.sum(-1, dtype=torch.float32)], dim=-1)


def pick_argmax(every: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [T] int64, finite [T] bool) from every rank's slice_summary `[T, ranks, 3]`, rank 0
    first: the token of the rank with the largest maximum, the first such rank on a tie (so the
    first index of the row's maximum, as row_argmax over the whole row)."""
    winner = every[:, :, 0].argmax(dim=-1, keepdim=True)
    tokens = every[:, :, 1].gather(1, winner).squeeze(1).long()
    return tokens, torch.isfinite(every[:, :, 2].sum(-1))


def row_linear(x: torch.Tensor, proj: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
    """residual + the ranks' partial proj(x) summed (a row-parallel projection without bias): rank 0
    adds the residual to its partial sum (the batch-1 gemv kernel's epilogue), then one all-reduce."""
    return all_reduce(gemv.linear(x, proj, residual if first_rank() else None))


def row_silu_linear(gate_up: torch.Tensor, proj: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
    """residual + the ranks' partial proj(silu(gate) * up) summed, as row_linear."""
    return all_reduce(gemv.silu_linear(gate_up, proj, residual if first_rank() else None))


def row_linear_norm(x: torch.Tensor, proj: nn.Linear, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s, RMSNorm(s) * weight) for s = residual + the ranks' partial proj(x) summed, the add and
    the norm inside FlashInfer's all-reduce where it takes the rows; elsewhere (row_linear(...), None),
    the norm left to the next projection's kernel."""
    if allreduce.fuses_norm(residual):
        return allreduce.all_reduce_add_norm(gemv.linear(x, proj, None), residual, weight, eps)
    return row_linear(x, proj, residual), None


def row_silu_linear_norm(gate_up: torch.Tensor, proj: nn.Linear, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """row_linear_norm for proj(silu(gate) * up)."""
    if allreduce.fuses_norm(residual):
        return allreduce.all_reduce_add_norm(gemv.silu_linear(gate_up, proj, None), residual, weight, eps)
    return row_silu_linear(gate_up, proj, residual), None
