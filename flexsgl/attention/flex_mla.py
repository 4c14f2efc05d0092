"""FlexAttention over the latent pool of an MLA model: the `flex` backend for MLA models.

The same block masks over the same page tables as for GQA (flexsgl/attention/flex.py, whose
metadata, graph hooks and page positions this backend inherits); only the attention call differs.
Queries arrive absorbed into the latent space, `[T, H, kv_lora_rank + rope dims]`
(flexsgl/model/deepseek_v2.py), and attend over the latent pool read as one shared KV head: the
key is a token's whole latent vector, the value its first kv_lora_rank dims (a view of the same
tensor, no copy). The output is `[T, H, kv_lora_rank]`, still in latent space.

Compiled decode reads each request's latent KV once for all its heads, as MLA decode kernels do.
On CUDA it runs through flex_ops.py's op, whose flex-decoding kernel puts the query heads that share
a KV head (here all of them) in one tile and splits the KV over several programs. Compiled on the
CPU, the main kernel runs with a token's heads as the rows of its query (`[B, 1, H, D]`, FlexMeta's
heads_as_rows): that kernel gives each query head a tile of its own, so with the heads as heads
every head's program would read the request's whole latent KV.
"""

from __future__ import annotations

import math

import torch

from flexsgl.attention.base import ForwardBatch
from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.cache.latent_pool import LatentKVPool


class FlexMLABackend(FlexAttentionBackend):
    name = "flex"
    # Prefill attends over the pages: a latent row is one 576-value head, whose kernel options are
    # cuda_kernel_options', and its prefill was not measured over packed rows.
    packs_prefill = False

    def __init__(self, pool: LatentKVPool, num_heads: int | None = None, compiled: bool = False):
        super().__init__(pool, num_heads, compiled)
        self.heads_as_rows = compiled and not self.decode_op  # compiled on the CPU

    def kv_shape(self) -> tuple[int, int]:
        return 1, self.pool.kv[0].shape[-1]

    def cuda_kernel_options(self) -> dict:
        # A latent row is 576 values (DeepSeek-V2), which flex's kernels round up to 1024: smaller
        # tiles than its defaults keep a query block, a key block and a value block within shared
        # memory; a KV tile still divides a page.
        return {"BLOCK_M": 32, "BLOCK_N": math.gcd(self.pool.page_size, 32), "num_stages": 1}

    def forward(self, q, cache, fb: ForwardBatch) -> torch.Tensor:
        latent = cache[0]
        return self.attention(q, latent, latent[..., :self.pool.kv_lora_rank], fb, scale=self.pool.softmax_scale)
