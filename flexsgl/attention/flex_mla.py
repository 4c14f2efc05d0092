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

from flexsgl.attention.base import ForwardBatch
from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.cache.latent_pool import LatentKVPool


class FlexMLABackend(FlexAttentionBackend):
    name = "flex"

    def __init__(self, pool: LatentKVPool, num_heads: int | None = None, compiled: bool = False):
        super().__init__(pool, num_heads, compiled)
        self.decode_op = False  # flex_ops.py's decode kernels are GQA's; MLA decode runs inside the step
        self.heads_as_rows = compiled

    def cuda_kernel_options(self) -> dict:
        # A latent row is 576 values (DeepSeek-V2), which flex's kernels round up to 1024: smaller
        # tiles than its defaults keep a query block, a key block and a value block within shared
        # memory; a KV tile still divides a page.
        return {"BLOCK_M": 32, "BLOCK_N": math.gcd(self.pool.page_size, 32), "num_stages": 1}

    def forward(self, q, cache, fb: ForwardBatch) -> torch.Tensor:
        kv = self.kv_sequence(cache[0], fb)  # [1, 1, N, D]
        return self.attend(q, kv, kv[..., :self.pool.kv_lora_rank], fb.attn, scale=self.pool.softmax_scale)
