"""The batch metadata every attention backend reads, and the abstract backend every one implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

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
      req_slots: [B] long                   each request's slot (the runner's token_buf slot, which
                                            indexes attention variants' per-request parameters)
    Host values: `mode` ("prefill" or "decode": one token per request), `max_q_len`,
    `num_kv_pages`, how many pool pages attention may see (all of them when compiled), and host
    copies of the per-request lengths and pages for backends that plan on the host (FlashInfer):
    `host_seq_lens`, `host_q_lens`, `host_pages` (each request's pages, padding rows included).
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
    host_seq_lens: list[int] | None = None
    host_q_lens: list[int] | None = None
    host_pages: list[list[int]] | None = None
    backend: Any = None
    attn: Any = None  # the backend's own per-step metadata, set by backend.prepare
    req_slots: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class AttentionBackend(ABC):
    """What every attention backend is, and everything the engine asks of one: the hooks below,
    with the defaults of a backend whose attention is one opaque kernel call (graphable, one
    compile for every shape, no scratch, no limit on the pool, the latents attended as they are).
    Constructed as `Backend(pool, num_heads=..., compiled=..., variants=...)`; the registry (registry.py)
    declares what it needs (phases, GPUs, packages, head sizes, dtypes, attention kinds) before it
    is built, and asks the class itself `unsupported`, `prefill_scratch_bytes` and `max_pool_slots`.

    A backend only reads the KV pool: the model's attention layers store each step's K/V through
    their store path (flexsgl/cache/store.py) before they call `forward`.

    Decode steps replayed from CUDA graphs use the graph hooks: capture is
    `bind_graph(bs, static_fb)` then `fill_graph(bs, dummy_fb)` then record `graph_step(bs,
    static_fb)` and the model; replay is `fill_graph(bs, fb)` then replay. `fill_graph` is the one
    host routine that writes a step's values into the buffers the graph reads, so capture and
    replay cannot drift apart; `graph_step` is device work recorded in the graph, which derives a
    step's metadata from the static inputs at every replay with no host work.

    MLA models: `forward` takes queries absorbed into the latent space; a backend whose
    `expands_latents(fb)` says so for a step takes that step through `forward_expanded` instead
    (the MHA form over each head's K/V expanded from the latents; flexsgl/attention/flex_mla.py).
    """

    name: str
    graphable: bool = True  # False: say so, and decode runs without graphs
    # True: its kernels compile per batch size and page-table width (flex's want static shapes), so
    # decode gets few buckets and full-width tables (flexsgl/compile.py); False: one op, any shape.
    compiles_per_shape: bool = False

    @staticmethod
    def unsupported(page_size: int, device: torch.device) -> str | None:
        """Why the backend cannot run with pages of this size on this device, or None."""
        return None

    @staticmethod
    def prefill_scratch_bytes(mcfg, tokens: int, itemsize: int) -> int:
        """Bytes a prefill step of up to `tokens` new tokens holds beyond the model's own activations
        (what the KV sizing leaves free for it)."""
        return 0

    @staticmethod
    def max_pool_slots(mcfg) -> int | None:
        """The most pool slots of this model's KV (`mcfg`, a rank's) its decode kernel reads in one
        pass, the dummy page's included; a pool the KV sizing sizes itself stays within it (None: no
        limit)."""
        return None

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build this step's metadata into fb.attn (eager path)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...], fb: ForwardBatch, variant=None,
                sink: torch.Tensor | None = None) -> torch.Tensor:
        """Attend with q `[T, Hq, D]` over one layer's paged KV, `cache` (the pool's `layer_cache`:
        K and V, or an MLA pool's latents; this step's already stored at fb.out_slots), return
        `[T, Hq, Dv]`. variant: the layer's bound attention variant (bound_variant.py; None: plain
        causal), which the registry lets reach only a backend that serves its kernel features
        (BackendSpec.features); sink: the layer's per-head sink logits where the variant has
        them. The layer's tensors, not its index: one compiled decoder layer serves every
        layer (flexsgl/compile.py)."""

    @abstractmethod
    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        """Allocate the static buffers every captured batch size shares (max_pages: per request)."""

    @abstractmethod
    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        """At capture: set fb.attn (fb holds the static input buffers) to metadata over static buffers."""

    @abstractmethod
    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        """At capture and replay: write this step's metadata (from fb) into the buffers bound for bs."""

    def graph_step(self, bs: int, fb: ForwardBatch) -> None:
        """Recorded in the graph before the model (fb holds the static buffers, already filled).
        Nothing by default: a kernel's metadata is planned on the host, in fill_graph."""

    def expands_latents(self, fb: ForwardBatch) -> bool:
        """MLA: whether this step's attention takes each head's K/V expanded from the latents
        (`forward_expanded`, the MHA form) instead of queries absorbed into the latent space
        (`forward`). False by default: an MLA kernel attends over the latents themselves."""
        return False

    def forward_expanded(self, q: torch.Tensor, w_kv: torch.Tensor, cache: tuple[torch.Tensor, ...],
                         fb: ForwardBatch) -> torch.Tensor:
        """MLA, for a step where `expands_latents(fb)`: q `[T, H, nope + rope]` (q_pe rotated) over
        the step's latents in `cache`, expanded by w_kv (kv_b_proj's weight, `[H, nope + v,
        kv_lora_rank]`) into each head's K `[k_nope, k_pe]` and V; returns `[T, H, v]`. A backend
        that never expands has no such step."""
        raise NotImplementedError(f"the {self.name} backend attends over the latents as they are; "
                                  "it has no expanded (MHA-form) step")
