"""The batch metadata every attention backend reads, and the backend protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class ForwardBatch:
    """One step's tokens, packed request after request, and where their K/V live.

    Device tensors, built by the runner from host bookkeeping (host -> device copies only):
      input_ids, positions, out_slots: [T]   token ids, absolute positions, pool slots to write K/V to
      page_table: [B, W] int32              each request's pages in logical order (padded with page 0)
      seq_lens: [B] int32                   KV length of each request once this step's tokens are in
      q_lens, q_offsets: [B] int32          each request's token count in this step and its start in [T]
      logits_index: [S] long                packed index of the tokens to sample from
    Host values: `mode` ("prefill" or "decode": one token per request), `max_q_len`, and
    `num_kv_pages`, how many pool pages attention may see (all of them when compiled).
    """

    mode: str
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    q_lens: torch.Tensor
    q_offsets: torch.Tensor
    logits_index: torch.Tensor
    max_q_len: int
    num_kv_pages: int
    backend: Any = None
    attn: Any = None  # the backend's own per-step metadata, set by backend.prepare

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class AttentionBackend(Protocol):
    def prepare(self, fb: ForwardBatch) -> None:
        """Build this step's metadata into fb.attn (eager path)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        """Store k, v `[T, Hkv, D]` at fb.out_slots, attend with q `[T, Hq, D]` over the paged KV, return `[T, Hq, D]`."""

