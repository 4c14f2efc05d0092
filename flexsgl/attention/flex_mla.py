"""FlexAttention over the latent pool of an MLA model: the `flex` backend for MLA models.

The same block masks over the same page tables as for GQA (flexsgl/attention/flex.py, whose
metadata (flex_meta.py), graph hooks and page positions this backend inherits); only the attention
call differs. Queries arrive absorbed into the latent space, `[T, H, kv_lora_rank + rope dims]`
(flexsgl/model/deepseek_v2.py), and attend over the latent pool read as one shared KV head: the
key is a token's whole latent vector, the value its first kv_lora_rank dims (a view of the same
tensor, no copy). The output is `[T, H, kv_lora_rank]`, still in latent space.

Compiled decode reads each request's latent KV once for all its heads, as MLA decode kernels do.
On CUDA it runs through flex_ops.py's op, whose flex-decoding kernel puts the query heads that share
a KV head (here all of them) in one tile and splits the KV over several programs. Compiled on the
CPU, the main kernel runs with a token's heads as the rows of its query (`[B, 1, H, D]`, FlexMeta's
heads_as_rows): that kernel gives each query head a tile of its own, so with the heads as heads
every head's program would read the request's whole latent KV.

Compiled prefill takes the MHA form instead (`expands_latents`, `forward_expanded`), as SGLang and
vLLM do for MLA prefill: the step's latents, cached prefixes included, are copied into rows as for
GQA (flex_meta.py's packed prefill, up to its PACKED_PREFIX_MAX_TOKENS) and expanded through
kv_b_proj into each head's K (`[k_nope, k_pe]`, nope + rope dims) and V (v_head_dim), and the
queries are not absorbed. Absorbed attention scores each (query, key) pair over 576 dims (1,024 in
flex's tiles) and sums 512-dim values; expanded, over 192 and 128. Decode reads each latent once per
step and keeps the absorbed form. Outside the packed case (not compiled, or prefixes past that
bound) prefill stays absorbed over the pages.
"""

from __future__ import annotations

import math

import torch

from flexsgl.attention.base import ForwardBatch
from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.attention.flex_meta import PACKED_PREFIX_MAX_TOKENS
from flexsgl.attention.flex_options import packed_prefill_options
from flexsgl.cache.latent_pool import LatentKVPool


class FlexMLABackend(FlexAttentionBackend):
    name = "flex"

    def __init__(self, pool: LatentKVPool, num_heads: int | None = None, compiled: bool = False, variants=None):
        super().__init__(pool, num_heads, compiled)
        self.heads_as_rows = compiled and not self.decode_op  # compiled on the CPU

    def kv_shape(self) -> tuple[int, int]:
        return 1, self.pool.kv[0].shape[-1]

    def cuda_kernel_options(self) -> dict:
        # A latent row is 576 values (DeepSeek-V2), which flex's kernels round up to 1024: smaller
        # tiles than its defaults keep a query block, a key block and a value block within shared
        # memory; a KV tile still divides a page.
        return {"BLOCK_M": 32, "BLOCK_N": math.gcd(self.pool.page_size, 32), "num_stages": 1}

    @staticmethod
    def prefill_scratch_bytes(mcfg, tokens: int, itemsize: int) -> int:
        """The expanded K and V of a step's rows, cached prefixes included (about 10 KB a token at
        DeepSeek-V2's sizes), and as much again for the products they are made of."""
        m = mcfg.mla
        rows = tokens + PACKED_PREFIX_MAX_TOKENS
        return rows * mcfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * itemsize * 2

    def packed_cuda_kernel_options(self) -> dict:
        # Packed prefill attends in the MHA form: the queries' and keys' nope + rope dims.
        return packed_prefill_options(self.pool.qk_nope_head_dim + self.pool.rope_dim, self.pool.kv[0].dtype)

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None) -> torch.Tensor:
        # The latent's options over packed rows too (the engine's prefill there is forward_expanded).
        latent = cache[0]
        return self.attention(q, latent, latent[..., :self.pool.kv_lora_rank], fb, scale=self.pool.softmax_scale,
                              options=self.kernel_options)

    def expands_latents(self, fb: ForwardBatch) -> bool:
        return fb.mode != "decode" and fb.attn.kv_rows is not None

    def forward_expanded(self, q: torch.Tensor, w_kv: torch.Tensor, cache, fb: ForwardBatch) -> torch.Tensor:
        """q `[T, H, nope + rope]` (q_pe rotated) over the step's latents expanded by w_kv (kv_b_proj's
        weight, `[H, nope + v, kv_lora_rank]`) into each head's K `[k_nope, k_pe]` and V; `[T, H, v]`."""
        pool = self.pool
        latent = self.kv_sequence(cache[0], fb)[0, 0]  # [N, kv_lora_rank + rope]: the step's rows
        c, k_pe = latent.split([pool.kv_lora_rank, pool.rope_dim], dim=-1)
        heads, width, _ = w_kv.shape
        w_uk, w_uv = w_kv.split([pool.qk_nope_head_dim, width - pool.qk_nope_head_dim], dim=1)
        # Each its own product, so that V is contiguous: Inductor's CPU flex kernel (torch 2.13) read a
        # V that was a strided view of one [H, N, nope + v] product wrongly, with no error.
        k = torch.cat([c @ w_uk.transpose(1, 2), k_pe.expand(heads, *k_pe.shape)], dim=-1)  # [H, N, nope + rope]
        v = c @ w_uv.transpose(1, 2)  # [H, N, v]
        return self.attend(q, k[None], v[None], fb.attn, scale=pool.softmax_scale)
