"""FlashInfer over the paged pool: batch decode (`fi-decode`) and paged prefill plus decode (`fi`).

FlashInfer reads the pool as it is, `(k, v)` each `[pages, page_size, Hkv, D]` (NHD), through a
CSR page list (indptr, page indices, last-page lengths). Its wrappers are *planned* on the host
before they run; the plan takes the host copies of the lengths and pages the runner already has
(ForwardBatch.host_*), so nothing waits on the device. Decode uses the tensor-core kernels when
the model has grouped KV heads.

An FP8 pool (kv_cache_dtype fp8_e4m3) is planned as such (`kv_data_type` float8_e4m3fn, the
queries in the engine's dtype): FlashInfer's FA2 kernels read the FP8 K/V and cast them as they
load (its FA3 ones take FP8 K/V only with FP8 queries, so its prefill takes FA2 here too). The
layer's K and V scales are folded into the query and the output before and after (flexsgl/model/
decoder.py), so the kernels run with scale 1.

Kernel calls go through one `torch.library` custom op with a fake implementation; the op finds the
planned wrapper through its backend's `active` slot, so compiled code never sees the wrapper.

CUDA graphs: each captured batch size gets a wrapper built with `use_cuda_graph=True` over slices
of static indptr/indices/last-page buffers; `fill_graph` plans it for the step, which writes those
buffers, and replay runs the kernels recorded against them.

Planning copies FlashInfer's schedule from a pinned host buffer to the device asynchronously.
The engine plans step N+1 while step N may still wait to run, so two pinned buffers alternate:
the one a plan fills was last used two steps ago, which has finished (its tokens were read).
"""

from __future__ import annotations

import math
import weakref
from itertools import accumulate

import torch

from flexsgl.attention.base import AttentionBackend, ForwardBatch
from flexsgl.cache.pool import KVPool

FLOAT_WORKSPACE_BYTES = 256 << 20
# custom-op handle -> backend, held weakly: an engine's backend holds its KV pool, which must go with the engine
_BACKENDS: dict[int, weakref.ref] = {}
_WORKSPACES: dict = {}  # device -> float workspace shared by every wrapper (one kernel runs at a time)


@torch.library.custom_op("flexsgl::flashinfer_attention", mutates_args=())
def flashinfer_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, handle: int,
                         page_size: int) -> torch.Tensor:
    hkv, d = k_cache.shape[-2:]
    wrapper = active_wrapper(handle)
    return wrapper.run(q.contiguous(), (k_cache.view(-1, page_size, hkv, d), v_cache.view(-1, page_size, hkv, d)))


@flashinfer_attention.register_fake
def _(q, k_cache, v_cache, handle, page_size):
    return torch.empty_like(q)


def csr_pages(seq_lens: list[int], pages: list[list[int]], page_size: int):
    """FlashInfer's page list for requests of `seq_lens` KV tokens on `pages`: (indptr, the number
    of tokens in each request's last page, the pages each request reads, concatenated)."""
    counts = [math.ceil(s / page_size) for s in seq_lens]
    indptr = [0, *accumulate(counts)]
    last = [s - (c - 1) * page_size for s, c in zip(seq_lens, counts)]
    indices = [p for ps, c in zip(pages, counts) for p in ps[:c]]
    return indptr, last, indices


def register(backend) -> int:
    """A handle through which a custom op finds `backend` (held weakly)."""
    for gone in [h for h, ref in _BACKENDS.items() if ref() is None]:
        del _BACKENDS[gone]
    handle = max(_BACKENDS, default=-1) + 1
    _BACKENDS[handle] = weakref.ref(backend)
    return handle


def active_wrapper(handle: int):
    """The wrapper the backend behind `handle` planned for this step."""
    return _BACKENDS[handle]().active


def float_workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACES:
        _WORKSPACES[device] = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[device]


class FlashInferDecodeBackend(AttentionBackend):
    """FlashInfer decode; prefill is left to another backend (`fa3-prefill,fi-decode`)."""

    name = "fi-decode"

    def __init__(self, pool: KVPool, num_heads: int, compiled: bool = False, variants=None):
        import flashinfer

        self.flashinfer = flashinfer
        self.pool, self.device = pool, pool.device
        self.hq, self.hkv, self.d = num_heads, pool.k[0].shape[1], pool.k[0].shape[2]
        self.dtype, self.kv_dtype = pool.query_dtype, pool.k[0].dtype
        # Tensor cores whenever KV heads are shared. SGLang's rule (from 4 query heads per KV head) cost
        # 6% of the throughput workload on Qwen3-0.6B (2 per KV head) on an H200: docs/BENCHMARKS.md.
        self.tensor_cores = self.hq != self.hkv
        self.workspace = float_workspace(self.device)
        size = 8 << 20  # FlashInfer's int workspace size
        self.pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.flip = 0
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores)
        self.active = None
        self.handle = register(self)

    # ---- planning (host)

    def page_lists(self, fb: ForwardBatch):
        """(indptr, last page lengths) as pinned host tensors and the page indices on the device."""
        indptr, last, indices = csr_pages(fb.host_seq_lens, fb.host_pages, self.pool.page_size)
        host = torch.tensor(indptr + last + indices, dtype=torch.int32, pin_memory=True)
        b = len(last)
        return host[:b + 1], host[b + 1:2 * b + 1], host[2 * b + 1:].to(self.device, non_blocking=True)

    def plan_decode(self, wrapper, fb: ForwardBatch) -> None:
        indptr, last, indices = self.page_lists(fb)
        self.use_next_pinned(wrapper)
        wrapper.plan(indptr, indices, last, self.hq, self.hkv, self.d, self.pool.page_size,
                     q_data_type=self.dtype, kv_data_type=self.kv_dtype, non_blocking=True)
        self.active = wrapper

    def use_next_pinned(self, wrapper) -> None:
        wrapper._pin_memory_int_workspace_buffer = self.pinned[self.flip]  # see the module docstring
        self.flip ^= 1

    # ---- the backend hooks (flexsgl/attention/base.py)

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.mode != "decode":
            raise ValueError(f"{self.name} runs decode only; pair it with a prefill backend.")
        self.plan_decode(self.decode_wrapper, fb)

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None) -> torch.Tensor:
        k, v = cache
        return torch.ops.flexsgl.flashinfer_attention(q, k, v, self.handle,
                                                      self.pool.page_size)

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        i32 = dict(dtype=torch.int32, device=self.device)
        self.g_indptr = torch.zeros(max_bs + 1, **i32)
        self.g_indices = torch.zeros(max_bs * max_pages, **i32)
        self.g_last = torch.ones(max_bs, **i32)
        self.graph_wrappers = {}

    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        self.graph_wrappers[bs] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=self.g_indptr[:bs + 1], paged_kv_indices_buffer=self.g_indices,
            paged_kv_last_page_len_buffer=self.g_last[:bs])

    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        self.plan_decode(self.graph_wrappers[bs], fb)


class FlashInferBackend(FlashInferDecodeBackend):
    """FlashInfer for both phases: paged prefill (ragged, with prefixes) and decode."""

    name = "fi"

    def __init__(self, pool: KVPool, num_heads: int, compiled: bool = False, variants=None):
        super().__init__(pool, num_heads, compiled)
        self.prefill_wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.mode == "decode":
            return self.plan_decode(self.decode_wrapper, fb)
        indptr, last, indices = self.page_lists(fb)
        qo_indptr = torch.tensor([0, *accumulate(fb.host_q_lens)], dtype=torch.int32, pin_memory=True)
        self.use_next_pinned(self.prefill_wrapper)
        self.prefill_wrapper.plan(qo_indptr, indptr, indices, last, self.hq, self.hkv, self.d,
                                  self.pool.page_size, causal=True, q_data_type=self.dtype,
                                  kv_data_type=self.kv_dtype, non_blocking=True)
        self.active = self.prefill_wrapper
