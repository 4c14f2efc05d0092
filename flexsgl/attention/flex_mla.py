"""FlexAttention over the latent pool of an MLA model: the `flex` backend for MLA models.

The same block masks over the same page tables as for GQA (flexsgl/attention/flex.py, whose
metadata, graph hooks and page positions this backend inherits); only the attention call differs.
Queries arrive absorbed into the latent space, `[T, H, kv_lora_rank + rope dims]`
(flexsgl/model/deepseek_v2.py), and attend over the latent pool read as one shared KV head: the
key is a token's whole latent vector, the value its first kv_lora_rank dims (a view of the same
tensor, no copy). The output is `[T, H, kv_lora_rank]`, still in latent space.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import flex_attention

from flexsgl.attention.base import ForwardBatch
from flexsgl.attention.flex import FlexAttentionBackend, FlexMeta
from flexsgl.cache.latent_pool import LatentKVPool


class FlexMLABackend(FlexAttentionBackend):
    name = "flex"

    def __init__(self, pool: LatentKVPool, num_heads: int | None = None, compiled: bool = False):
        super().__init__(pool, num_heads, compiled)
        if pool.device.type == "cuda":
            # A latent row is 576 values (DeepSeek-V2), which flex's kernels round up to 1024: smaller
            # tiles than its defaults keep a query block, a key block and a value block within
            # shared memory; a KV tile still divides a page.
            self.kernel_options = {"BLOCK_M": 32, "BLOCK_N": math.gcd(pool.page_size, 32), "num_stages": 1}

    def forward(self, q, layer: int, fb: ForwardBatch) -> torch.Tensor:
        meta: FlexMeta = fb.attn
        t, hq, d = q.shape
        b, r = fb.batch_size, self.pool.kv_lora_rank
        if meta.q_index is None:
            qb = q.view(b, 1, hq, d)
        else:
            qb = q.new_zeros(b, meta.q_len, hq, d).index_put_(meta.q_index, q)
        kv = self.pool.kv[layer][None, :fb.num_kv_pages * self.pool.page_size].transpose(1, 2)  # [1, 1, N, D]
        out = flex_attention(qb.transpose(1, 2), kv, kv[..., :r], block_mask=meta.block_mask,
                             scale=self.pool.softmax_scale, enable_gqa=True, kernel_options=self.kernel_options)
        out = out.transpose(1, 2)  # [B, Lq, H, r]
        return out.reshape(t, hq, r) if meta.q_index is None else out[meta.q_index]
