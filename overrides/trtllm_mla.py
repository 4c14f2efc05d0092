"""TRT-LLM's MLA decode kernels through FlashInfer (`trtllm-mla`): decode of MLA models on SM100.

`flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla` takes each request's absorbed query,
`[batch, 1, heads, kv_lora_rank + rope dims]`, and the latent pool as it is, read as `[pages, 1,
page_size, kv_lora_rank + rope dims]`, with the runner's page table as its block table and the
softmax scale as `bmm1_scale`; it returns `[batch, 1, heads, kv_lora_rank]`. Its constraints, checked
when it is chosen: pages of 32 or 64 tokens (`unsupported`), a block table whose width is a
multiple of 128 / page_size (the table is padded with the dummy page to that), int32 block table
and lengths, a zero-initialised workspace, and DeepSeek's latent sizes (512 + 64, or 256 + 64;
the registry's head sizes). The kernel call is one `torch.library` custom op, so compiled steps
and CUDA graphs treat it as one opaque op; its schedule needs no host planning.

No SM100 GPU has run this backend: tests/test_trtllm_mla.py checks everything up to the kernel
call, with the kernel replaced by a float64 reference that checks the arguments it receives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexsgl.attention.base import AttentionBackend, ForwardBatch
from flexsgl.cache.latent_pool import LatentKVPool

WORKSPACE_BYTES = 128 << 20
PAGE_SIZES = (32, 64)
TABLE_ALIGN_TOKENS = 128  # the block table's width, in tokens, must be a multiple of this


def decode_kernel():
    """FlashInfer's TRT-LLM MLA decode function (imported on first use)."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

    return trtllm_batch_decode_with_kv_cache_mla


def block_table(page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """The page table padded (with the dummy page, 0) to the width the kernel takes."""
    pad = -page_table.shape[1] % (TABLE_ALIGN_TOKENS // page_size)
    return F.pad(page_table, (0, pad)) if pad else page_table


@torch.library.custom_op("flexsgl::trtllm_mla_decode", mutates_args=())
def trtllm_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                      workspace: torch.Tensor, page_size: int, kv_lora_rank: int, qk_nope_head_dim: int,
                      scale: float) -> torch.Tensor:
    table = block_table(page_table, page_size)
    d = kv_cache.shape[-1]
    out = decode_kernel()(
        query=q.unsqueeze(1), kv_cache=kv_cache.view(-1, 1, page_size, d), workspace_buffer=workspace,
        qk_nope_head_dim=qk_nope_head_dim, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=d - kv_lora_rank,
        block_tables=table, seq_lens=seq_lens, max_seq_len=table.shape[1] * page_size, bmm1_scale=scale)
    return out.view(q.shape[0], q.shape[1], kv_lora_rank)


@trtllm_mla_decode.register_fake
def _(q, kv_cache, page_table, seq_lens, workspace, page_size, kv_lora_rank, qk_nope_head_dim, scale):
    return q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)


class TrtllmMLABackend(AttentionBackend):
    name = "trtllm-mla"

    def __init__(self, pool: LatentKVPool, num_heads: int | None = None, compiled: bool = False, variants=None):
        self.pool = pool
        # Zeroed once: the kernel keeps semaphores in it.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)

    @staticmethod
    def unsupported(page_size: int, device: torch.device) -> str | None:
        if page_size not in PAGE_SIZES:
            return (f"TRT-LLM's MLA kernels read pages of {' or '.join(map(str, PAGE_SIZES))} tokens, and "
                    f"page_size is {page_size}")
        return None

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.mode != "decode":
            raise ValueError(f"{self.name} runs decode only; pair it with a prefill backend.")

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None) -> torch.Tensor:
        p, (kv,) = self.pool, cache
        return torch.ops.flexsgl.trtllm_mla_decode(q, kv, fb.page_table, fb.seq_lens, self.workspace,
                                                   p.page_size, p.kv_lora_rank, p.qk_nope_head_dim, p.softmax_scale)

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        pass  # the graph reads the runner's static page table and lengths; nothing of its own

    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        pass

    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        pass
