"""sgl_kernel FlashAttention-3 over the paged pool (SM90): prefill with prefixes, and decode.

FA3's `flash_attn_with_kvcache` reads the pool as it is, `[pages, page_size, Hkv, D]`, through the
batch's page table and KV lengths, with the queries packed (`cu_seqlens_q`). Causal masking is
aligned to the end of each request's KV, which is where this step's tokens are. The call is a
`torch.library` custom op with a fake implementation, so the model compiles around it.

An FP8 pool (kv_cache_dtype fp8_e4m3): FA3 reads FP8 K/V only with FP8 queries, so the op rounds
the queries to FP8 at one scale for the step (their absmax / 448, so none saturates) and passes it
as the kernel's `q_descale`; the output comes back in the engine's dtype. The layer's K and V
scales are already folded into the query and the output (flexsgl/model/decoder.py).

Under CUDA graphs the kernel reads the graph manager's static page table and lengths directly;
the only metadata of its own, the query offsets, is fixed for decode (one token per request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexsgl.attention.base import AttentionBackend, ForwardBatch
from flexsgl.cache.pool import KVPool
from flexsgl.quant.fp8 import FP8, quantize_rows


@torch.library.custom_op("flexsgl::fa3_paged_attention", mutates_args=())
def fa3_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                        cache_seqlens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                        page_size: int, window: int = -1, softcap: float = 0.0, chunk: int = 0,
                        scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """window: keys up to window - 1 positions behind the query (-1: all); softcap: 0 for none;
    chunk: attention within chunks of this many positions (0: none); sinks: per-head sink logits."""
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    hkv, d = k_cache.shape[-2:]
    dtype, descale = q.dtype, {}
    if k_cache.dtype == FP8:  # FP8 K/V take FP8 queries: one scale for the step (module docstring)
        fp8, q_scale = quantize_rows(q.reshape(1, -1))
        q = fp8.view(q.shape)
        descale = {"q_descale": q_scale.view(1, 1).expand(cache_seqlens.shape[0], hkv)}
    out = flash_attn_with_kvcache(
        q.contiguous(), k_cache.view(-1, page_size, hkv, d), v_cache.view(-1, page_size, hkv, d),
        cache_seqlens=cache_seqlens, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, causal=True, window_size=(window - 1 if window > 0 else -1, 0),
        softcap=softcap, attention_chunk=chunk or None, softmax_scale=scale,
        sinks=None if sinks is None else sinks.to(dtype), **descale)
    return out.to(dtype)


@fa3_paged_attention.register_fake
def _(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, page_size, window=-1,
      softcap=0.0, chunk=0, scale=None, sinks=None):
    return torch.empty_like(q)


@dataclass
class FA3Meta:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int


class FA3Backend(AttentionBackend):
    name = "fa3"

    def __init__(self, pool: KVPool, num_heads: int | None = None, compiled: bool = False, variants=None):
        self.pool = pool

    def prepare(self, fb: ForwardBatch) -> None:
        cu = F.pad(torch.cumsum(fb.q_lens, 0, dtype=torch.int32), (1, 0))
        fb.attn = FA3Meta(cu, fb.max_q_len)

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None) -> torch.Tensor:
        """variant: the layer's bound attention variant, whose kernel features (window, softcap,
        chunk, scale, sinks) FA3 takes as arguments (the registry lets no other variant reach it)."""
        meta: FA3Meta = fb.attn
        k, v = cache
        features = {} if variant is None else variant.variant.features() or {}
        return torch.ops.flexsgl.fa3_paged_attention(
            q, k, v, fb.page_table, fb.seq_lens, meta.cu_seqlens_q, meta.max_seqlen_q, self.pool.page_size,
            features.get("window", -1), features.get("softcap", 0.0), features.get("chunk", 0),
            None if variant is None else variant.scale, sink)

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=self.pool.device)

    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        fb.attn = FA3Meta(self.cu_seqlens_q[:bs + 1], 1)

    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        """Nothing to write: FA3 reads the manager's page table and lengths, and decode's query
        offsets never change."""
