"""flexsgl's own split-KV decode attention over the paged pool, one Triton kernel (`triton-decode`).

At batch 1 a decode step's attention is tiny work spread thin: an 8B layer reads ~4.7 MB of KV at
a 1k context, a microsecond at full bandwidth, and FlashInfer spends ~9 µs in its decode kernel
plus ~2.5 µs in a second kernel that merges its KV splits. This kernel splits each request's pages
across programs so that every SM has a page to read, and merges
the splits in the same launch: each program writes its partial result (unnormalised output,
running max, sum of exponentials), then counts itself in on a per-(request, KV head) counter; the
program that arrives last merges the partials, 16 splits per load, and resets the counter. Same
math as FlashInfer's merge, one launch instead of two. With a single split (large batches) it
writes its output directly.

Programs: one per (request, KV head, split). Each loads the request's query heads that share the
KV head (GQA group, padded to 16 rows for the tensor-core dot), then walks its pages of the pool
(`[slots, Hkv, D]`, a page is `page_size` consecutive slots), one page per step, with an online
softmax. The number of splits is fixed per batch size (enough programs for two per SM), so the
launch is the same on every replay of a CUDA graph; splits past a short request's last page are
empty and only count themselves in.

One layer inside CUDA graphs, it is ahead of FlashInfer's decode or level with it up to batch 64
and behind from 128 (docs/BENCHMARKS.md; benchmarks/test_attention_kernels.py times it against the
other decode backends), so `auto` on SM90 gives it decode batches up to 64. Inside a real decode step,
where the KV comes from DRAM rather than L2, the two take about the same time.

An FP8 pool (kv_cache_dtype fp8_e4m3) is read as it is: each page's K and V are cast to the
query's dtype as they load (the layer's scales are folded into the query and the output,
flexsgl/model/decoder.py).

Decode only (one query token per request); it reads the graph manager's page table and lengths
directly, like FA3, so its graph hooks have nothing to fill.

On SM90 it launches with PDL (flexsgl/kernels/launch.py): each program loads its first page while
the kernel before (which stores this step's query and K/V) finishes, waits on it, loads that page
again only where it is the request's last, and lets the next kernel launch, so the output projection
starts loading its weights while the attention runs. At batch 1 a split holds a page or two, so most
of the attention's reads happen before the wait.
"""

from __future__ import annotations

import functools

import torch

from flexsgl.attention.base import AttentionBackend, ForwardBatch
from flexsgl.cache.pool import KVPool
from flexsgl.kernels.launch import pdl

MAX_SPLITS = 32
PROGRAMS_PER_SM = 2
LAUNCH = {"num_warps": 2, "num_stages": 2}  # 2 warps: the H200 sweep's best at batches 1 to 64 (docs/BENCHMARKS.md)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kv_decode(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
                        count_ptr, out_ptr, stride_table, num_splits, sm_scale,
                        HKV: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, GROUP_P2: tl.constexpr,
                        D: tl.constexpr, PAGE: tl.constexpr, MERGE_SPLITS: tl.constexpr, PDL: tl.constexpr):
        bh = tl.program_id(0)  # request * HKV + KV head
        split = tl.program_id(1)
        b = bh // HKV
        h = bh % HKV
        seq_len = tl.load(lens_ptr + b)  # the lengths and the table: the step's inputs, written long before
        n_pages = tl.cdiv(seq_len, PAGE)
        per_split = tl.cdiv(n_pages, num_splits)
        first = split * per_split
        last = tl.minimum(first + per_split, n_pages)

        rows = tl.arange(0, ROWS)
        row_ok = rows < GROUP
        d = tl.arange(0, D)
        tok = tl.arange(0, PAGE)
        # The split's first page loads while the kernel before finishes (launch.py); an empty split
        # loads nothing. Only the request's last page holds what that kernel stored, this step's K/V:
        # it is read again after the wait.
        busy = first < last
        p0 = tl.minimum(first, n_pages - 1)
        page = tl.load(table_ptr + b * stride_table + p0).to(tl.int64)
        kv = ((page * PAGE + tok) * HKV + h)[:, None] * D + d[None, :]
        rows_busy = ((tok * 0 + first) < last)[:, None]  # busy, as a mask over the page's rows
        k = tl.load(k_ptr + kv, mask=rows_busy, other=0.0)
        v = tl.load(v_ptr + kv, mask=rows_busy, other=0.0)
        if PDL:  # what follows reads the previous kernel's output (the query, this step's K/V) or writes
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if busy & (first == n_pages - 1):
            k = tl.load(k_ptr + kv)
            v = tl.load(v_ptr + kv)
        q_rows = (b * HKV + h) * GROUP + rows  # the query heads that read KV head h
        q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for p in range(first, last):
            if p > first:
                page = tl.load(table_ptr + b * stride_table + p).to(tl.int64)
                kv = ((page * PAGE + tok) * HKV + h)[:, None] * D + d[None, :]
                k = tl.load(k_ptr + kv)
                v = tl.load(v_ptr + kv)
            s = tl.dot(q, tl.trans(k.to(q.dtype))) * sm_scale  # the casts: no-ops but from an FP8 pool
            s = tl.where((p * PAGE + tok)[None, :] < seq_len, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            prob = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(prob, 1)
            acc = acc * alpha[:, None] + tl.dot(prob.to(q.dtype), v.to(q.dtype))
            m = m_new

        out_ptrs = out_ptr + q_rows[:, None] * D + d[None, :]
        if num_splits == 1:
            tl.store(out_ptrs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = (bh * num_splits + split) * GROUP + rows
            tl.store(part_o_ptr + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_m_ptr + part, m, mask=row_ok)
            tl.store(part_l_ptr + part, l, mask=row_ok)
            tl.debug_barrier()  # every thread's partial is written before the release below
            arrived = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel")
            if arrived == num_splits - 1:  # the last split of (request, KV head) to finish merges
                tl.store(count_ptr + bh, 0)
                # The splits that hold pages, MERGE_SPLITS at a time: one load of their partials per
                # chunk (a split at a time was a round trip to L2 per split, most of the kernel at batch 1).
                g = tl.arange(0, GROUP_P2)
                g_ok = g < GROUP
                chunk = tl.arange(0, MERGE_SPLITS)
                m_all = tl.full([GROUP_P2], float("-inf"), tl.float32)
                l_all = tl.zeros([GROUP_P2], tl.float32)
                o_all = tl.zeros([GROUP_P2, D], tl.float32)
                n_active = tl.cdiv(n_pages, per_split)
                for c in range(0, n_active, MERGE_SPLITS):
                    ok = ((c + chunk) < n_active)[:, None] & g_ok[None, :]
                    idx = (bh * num_splits + c + chunk)[:, None] * GROUP + g[None, :]  # [MERGE_SPLITS, GROUP_P2]
                    m_s = tl.load(part_m_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(part_l_ptr + idx, mask=ok, other=0.0, cache_modifier=".cg")
                    o_s = tl.load(part_o_ptr + idx[:, :, None] * D + d[None, None, :], mask=ok[:, :, None],
                                  other=0.0, cache_modifier=".cg")
                    m_new = tl.maximum(m_all, tl.max(m_s, 0))
                    scale = tl.exp(m_s - m_new[None, :])  # 0 for the masked entries
                    keep = tl.exp(m_all - m_new)
                    l_all = l_all * keep + tl.sum(l_s * scale, 0)
                    o_all = o_all * keep[:, None] + tl.sum(o_s * scale[:, :, None], 0)
                    m_all = m_new
                g_rows = (b * HKV + h) * GROUP + g
                tl.store(out_ptr + g_rows[:, None] * D + d[None, :], (o_all / l_all[:, None]).to(out_ptr.dtype.element_ty),
                         mask=g_ok[:, None])

    return split_kv_decode


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_splits(batch: int, hkv: int, device: torch.device) -> int:
    """Splits per (request, KV head): enough programs for PROGRAMS_PER_SM per SM, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-PROGRAMS_PER_SM * _num_sms(device) // (batch * hkv))))


@torch.library.custom_op("flexsgl::split_kv_decode", mutates_args=())
def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    seq_lens: torch.Tensor, counter: torch.Tensor, page_size: int) -> torch.Tensor:
    """Decode attention of q `[B, Hq, D]` over each request's first seq_lens[b] KV slots, found
    through page_table `[B, W]` in the flat pool `[slots, Hkv, D]`. `counter` (int32, at least
    B * Hkv, zero) is left zero: each launch counts up and the merging program resets it."""
    import triton

    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if counter.numel() < b * hkv:
        raise ValueError(f"split_kv_decode: counter holds {counter.numel()}, needs {b * hkv}")
    splits = num_splits(b, hkv, q.device)
    use_pdl = pdl(q.device)
    group = hq // hkv
    group_p2 = triton.next_power_of_2(group)
    out = torch.empty_like(q)
    f32 = dict(dtype=torch.float32, device=q.device)
    part_o = torch.empty(b * hkv * splits * group, d, **f32)
    part_m = torch.empty(b * hkv * splits * group, **f32)
    part_l = torch.empty_like(part_m)
    _kernel()[(b * hkv, splits)](
        q.contiguous(), k_cache, v_cache, page_table, seq_lens, part_o, part_m, part_l, counter, out,
        page_table.stride(0), splits, d ** -0.5, HKV=hkv, GROUP=group, ROWS=max(16, group_p2),
        GROUP_P2=group_p2, D=d, PAGE=page_size, MERGE_SPLITS=16, PDL=use_pdl, **LAUNCH,
        **({"launch_pdl": True} if use_pdl else {}))
    return out


@split_kv_decode.register_fake
def _(q, k_cache, v_cache, page_table, seq_lens, counter, page_size):
    return torch.empty_like(q)


class SplitKVDecodeBackend(AttentionBackend):
    """A decode-only backend over one split-KV kernel that merges its splits in the same launch
    (this one and triton_mla.py's): int32 counters the kernel leaves at zero, sized per batch, and
    no graph hooks to fill, as the kernel reads the graph manager's page table and lengths."""

    def __init__(self, pool, num_heads: int, compiled: bool = False, variants=None):
        self.pool, self.hq = pool, num_heads
        self.counters = torch.zeros(0, dtype=torch.int32, device=pool.device)

    def counters_size(self, batch: int) -> int:
        """int32 counters a launch for `batch` requests uses."""
        raise NotImplementedError

    @staticmethod
    def unsupported(page_size: int, device: torch.device) -> str | None:
        if page_size < 16 or page_size & (page_size - 1):
            return f"its kernel reads pages of a power-of-two size from 16 tokens, and the page size is {page_size}"
        return None

    def reserve(self, batch: int) -> None:
        """Size the counters for `batch` requests (outside graph capture: this allocates)."""
        if self.counters.numel() < self.counters_size(batch):
            self.counters = torch.zeros(self.counters_size(batch), dtype=torch.int32, device=self.counters.device)

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.mode != "decode":
            raise ValueError(f"{self.name} runs decode only; pair it with a prefill backend.")
        self.reserve(fb.batch_size)

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        self.reserve(max_bs)

    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        """Nothing to bind: the kernel reads the manager's page table and lengths."""

    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        """Nothing to write, for the same reason."""


class TritonDecodeBackend(SplitKVDecodeBackend):
    """`triton-decode`: the split-KV kernel above for decode; prefill is left to another backend."""

    name = "triton-decode"

    def __init__(self, pool: KVPool, num_heads: int, compiled: bool = False, variants=None):
        super().__init__(pool, num_heads, compiled)
        self.hkv = pool.k[0].shape[1]

    def counters_size(self, batch: int) -> int:
        return batch * self.hkv  # a merge counter per (request, KV head)

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None) -> torch.Tensor:
        k, v = cache
        return torch.ops.flexsgl.split_kv_decode(q, k, v, fb.page_table,
                                                 fb.seq_lens, self.counters, self.pool.page_size)
