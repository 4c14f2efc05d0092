"""FlashInfer's batch MLA paged attention over the latent pool (`fi-mla`): prefill and decode of
MLA models (DeepSeek-V2), SM80/SM90.

`BatchMLAPagedAttentionWrapper` takes absorbed queries split into their latent part (q_nope,
kv_lora_rank values) and rope part (q_pe), and the cache as compressed KV `[pages, page_size,
kv_lora_rank]` and rope keys `[pages, page_size, rope dims]`: both are views of the latent pool read
as `[pages, page_size, kv_lora_rank + rope dims]`, nothing is copied. One causal plan serves decode
(one query per request) and prefill over cached prefixes (queries aligned to the end of each
request's KV). Its kernels are built for kv_lora_rank 512 and 64 rope dims (DeepSeek's).

Planning is on the host from the runner's host copies of lengths and pages, as for GQA
(flexsgl/overrides/flashinfer.py, whose page lists, workspace and op handles this reuses), through
two alternating pinned buffers; CUDA graphs get one wrapper per captured size over static buffers.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from flexsgl.attention.base import AttentionBackend, ForwardBatch
from flexsgl.cache.latent_pool import LatentKVPool
from flexsgl.overrides.flashinfer import active_wrapper, csr_pages, float_workspace, register

INT_WORKSPACE_BYTES = 8 << 20  # FlashInfer's int workspace size


@torch.library.custom_op("flexsgl::flashinfer_mla", mutates_args=())
def flashinfer_mla(q: torch.Tensor, kv_cache: torch.Tensor, handle: int, page_size: int,
                   kv_lora_rank: int) -> torch.Tensor:
    kv = kv_cache.view(-1, page_size, kv_cache.shape[-1])
    r = kv_lora_rank
    return active_wrapper(handle).run(q[..., :r], q[..., r:], kv[..., :r], kv[..., r:])


@flashinfer_mla.register_fake
def _(q, kv_cache, handle, page_size, kv_lora_rank):
    return q.new_empty(*q.shape[:-1], kv_lora_rank)


class FlashInferMLABackend(AttentionBackend):
    name = "fi-mla"

    def __init__(self, pool: LatentKVPool, num_heads: int, compiled: bool = False, variants=None):
        import flashinfer.mla

        self.mla = flashinfer.mla
        self.pool, self.device, self.hq = pool, pool.device, num_heads
        self.dtype = pool.kv[0].dtype
        self.workspace = float_workspace(self.device)
        self.pinned = [torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.flip = 0
        self.wrapper = self.mla.BatchMLAPagedAttentionWrapper(self.workspace)
        self.active = None
        self.handle = register(self)

    def plan(self, wrapper, fb: ForwardBatch) -> None:
        ps = self.pool.page_size
        kv_indptr, _, indices = csr_pages(fb.host_seq_lens, fb.host_pages, ps)
        qo_indptr = [0, *accumulate(fb.host_q_lens)]
        b = len(fb.host_seq_lens)
        host = torch.tensor(qo_indptr + kv_indptr + list(fb.host_seq_lens), dtype=torch.int32, pin_memory=True)
        pages = torch.tensor(indices, dtype=torch.int32, pin_memory=True).to(self.device, non_blocking=True)
        wrapper._pin_memory_int_workspace_buffer = self.pinned[self.flip]  # see flashinfer.py's docstring
        self.flip ^= 1
        wrapper.plan(host[:b + 1], host[b + 1:2 * b + 2], pages, host[2 * b + 2:], self.hq, self.pool.kv_lora_rank,
                     self.pool.rope_dim, ps, True, self.pool.softmax_scale, self.dtype, self.dtype)
        self.active = wrapper

    def prepare(self, fb: ForwardBatch) -> None:
        self.plan(self.wrapper, fb)

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None) -> torch.Tensor:
        (kv,) = cache
        return torch.ops.flexsgl.flashinfer_mla(q, kv, self.handle, self.pool.page_size,
                                                self.pool.kv_lora_rank)

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        i32 = dict(dtype=torch.int32, device=self.device)
        self.g_qo_indptr = torch.arange(max_bs + 1, **i32)
        self.g_kv_indptr = torch.zeros(max_bs + 1, **i32)
        self.g_indices = torch.zeros(max_bs * max_pages, **i32)
        self.g_kv_lens = torch.ones(max_bs, **i32)
        self.graph_wrappers = {}

    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        self.graph_wrappers[bs] = self.mla.BatchMLAPagedAttentionWrapper(
            self.workspace, use_cuda_graph=True, qo_indptr=self.g_qo_indptr[:bs + 1],
            kv_indptr=self.g_kv_indptr[:bs + 1], kv_indices=self.g_indices, kv_len_arr=self.g_kv_lens[:bs])

    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        self.plan(self.graph_wrappers[bs], fb)
