"""flexsgl's own MLA decode over the latent pool, one Triton launch per layer (`triton-mla`).

MLA decode in the absorbed form is attention with one shared KV head: each query head's latent
query `[kv_lora_rank + rope dims]` scores every latent vector of its request, and the output is the
softmax-weighted sum of the latents' first kv_lora_rank dims (flex_mla.py says the same of flex).
At batch 1 that is little work spread thin: DeepSeek-V2-Lite at a 544-token context reads 0.6 MB
of latent a layer, a fraction of a microsecond at the copy bandwidth, and flex's decode takes a
kernel of about 10 µs and two split-combining kernels of 1-2 µs each on the step's critical path
(docs/BENCHMARKS.md, "MLA decode"). This kernel is one launch: its programs take tasks by ticket.

- attention task (request, split): the request's KV tiles of BLOCK_N tokens are dealt out in
  contiguous runs to `splits` tasks. A task holds all the request's heads as the rows of one tile
  (padded to 16 for the tensor-core dot), so each latent is read once per request, and keeps an
  online softmax over its tiles; the tile's latents serve as keys (all dims) and values (the first
  kv_lora_rank). It writes its partial output, running max and sum of exponentials, then counts
  itself in on the request's `done` counter. With one split it writes the output directly.
- merge task (request, head, MERGE_COLS output columns): waits until the request's active splits
  have all counted in, then combines their partials by their maxima. Merging a request's 16 x 512
  outputs in one program, as triton_decode.py does for a GQA group, reads 32 KB of partials per
  split through one SM; here 2 x 16 tasks share that at DeepSeek-V2's sizes.

Merge tasks take higher tickets than every attention task, and a task only waits for tasks of lower
tickets, which programs already running hold: the launch finishes however few programs fit at once.
The last merge task of a request sets its counters back to zero, and the last ticket holder the
ticket, so each launch finds them all zero.

With programmatic dependent launch (kernels/launch.py) an attention task loads its first KV tile
before it waits for the kernel before (the latent query, which also stores the step's new latent):
only the tile holding the new token is loaded again after the wait. The query, written by that
kernel, is read after it.

Tiles, warps and merge width: the fastest of those timed on the kernel alone at batch 1 and 544
tokens. DeepSeek-V2-Lite's batch-1 step is shorter with it than with flex's latent decode; at
batch 64 the two are level (docs/BENCHMARKS.md, "MLA decode").

Decode only; like triton-decode it reads the graph manager's page table and lengths directly, so
its graph hooks have nothing to fill.
"""

from __future__ import annotations

import functools

import torch

from flexsgl.attention.base import ForwardBatch
from flexsgl.kernels.launch import pdl
from flexsgl.overrides.triton_decode import SplitKVDecodeBackend, _num_sms

MAX_SPLITS = 32
PROGRAMS_PER_SM = 2
BLOCK_N = 32  # KV tokens per tile (at most a page)
MERGE_COLS = 256  # output columns per merge task
LAUNCH = {"num_warps": 4, "num_stages": 2}


@functools.cache
def _kernel():
    global tl, load_tile, attend_tile  # module globals, where Triton looks for them
    import triton
    import triton.language as tl

    @triton.jit
    def load_tile(kv_ptr, table_ptr, stride_table, stride_kv, b, tile, seq_len, r, p,
                  R: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Tile `tile` of request b's latents: (c [BLOCK_N, R_P2], pe [BLOCK_N, P_P2], whether each token is
        within seq_len); tokens past it are read as zeros."""
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        page = tl.load(table_ptr + b * stride_table + tile * BLOCK_N // PAGE).to(tl.int64)
        rows = (page * PAGE + pos % PAGE) * stride_kv
        ok = pos < seq_len
        c = tl.load(kv_ptr + rows[:, None] + r[None, :], mask=ok[:, None] & (r < R)[None, :], other=0.0)
        pe = tl.load(kv_ptr + rows[:, None] + R + p[None, :], mask=ok[:, None] & (p < P)[None, :], other=0.0)
        return c, pe, ok

    @triton.jit
    def attend_tile(q_c, q_pe, c, pe, ok, m, l, acc, scale_log2, PRECISION: tl.constexpr):
        """One online-softmax step over a tile (scores in base 2)."""
        s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        prob = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c, input_precision=PRECISION)
        return m_new, l, acc

    @triton.jit
    def latent_decode_kernel(q_ptr, kv_ptr, table_ptr, lens_ptr, part_o_ptr, part_m_ptr, part_l_ptr, counters_ptr,
                             out_ptr, stride_table, stride_kv, B, num_splits, scale_log2,
                             H: tl.constexpr, ROWS: tl.constexpr, R: tl.constexpr, R_P2: tl.constexpr,
                             P: tl.constexpr, P_P2: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                             MERGE_COLS: tl.constexpr, SPLITS_P2: tl.constexpr, PRECISION: tl.constexpr,
                             PDL: tl.constexpr):
        chunks = tl.cdiv(R, MERGE_COLS)
        attention_tasks = B * num_splits
        t = tl.atomic_add(counters_ptr, 1, sem="relaxed")  # the ticket
        if t == tl.num_programs(0) - 1:
            tl.atomic_xchg(counters_ptr, 0, sem="relaxed")
        done_ptr = counters_ptr + 1
        merged_ptr = counters_ptr + 1 + B
        r = tl.arange(0, R_P2)
        if t < attention_tasks:
            b = t // num_splits
            split = t % num_splits
            seq_len = tl.load(lens_ptr + b)
            n_tiles = tl.cdiv(seq_len, BLOCK_N)
            per_split = tl.cdiv(n_tiles, num_splits)
            first = split * per_split
            last = tl.minimum(first + per_split, n_tiles)
            p = tl.arange(0, P_P2)
            c, pe, ok = load_tile(kv_ptr, table_ptr, stride_table, stride_kv, b, tl.minimum(first, n_tiles - 1),
                                  seq_len, r, p, R, P, PAGE, BLOCK_N)  # an empty split's load stays in its pages
            if PDL:  # the query and the new token's latent are the previous kernel's output (launch.py)
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            if first < last:
                if (first + 1) * BLOCK_N >= seq_len:  # the tile holds the new token: read it after the wait
                    c, pe, ok = load_tile(kv_ptr, table_ptr, stride_table, stride_kv, b, first, seq_len, r, p, R, P,
                                          PAGE, BLOCK_N)
                rows = tl.arange(0, ROWS)
                q_rows = (b * H + rows) * (R + P)
                row_ok = rows < H
                q_c = tl.load(q_ptr + q_rows[:, None] + r[None, :], mask=row_ok[:, None] & (r < R)[None, :], other=0.0)
                q_pe = tl.load(q_ptr + q_rows[:, None] + R + p[None, :], mask=row_ok[:, None] & (p < P)[None, :],
                               other=0.0)
                m = tl.full([ROWS], float("-inf"), tl.float32)
                l = tl.zeros([ROWS], tl.float32)
                acc = tl.zeros([ROWS, R_P2], tl.float32)
                m, l, acc = attend_tile(q_c, q_pe, c, pe, ok, m, l, acc, scale_log2, PRECISION)
                for tile in range(first + 1, last):
                    c, pe, ok = load_tile(kv_ptr, table_ptr, stride_table, stride_kv, b, tile, seq_len, r, p, R, P,
                                          PAGE, BLOCK_N)
                    m, l, acc = attend_tile(q_c, q_pe, c, pe, ok, m, l, acc, scale_log2, PRECISION)
                out_mask = row_ok[:, None] & (r < R)[None, :]
                if num_splits == 1:
                    out = out_ptr + (b * H + rows)[:, None] * R + r[None, :]
                    tl.store(out, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
                else:
                    part = (b * num_splits + split) * H + rows
                    tl.store(part_o_ptr + part[:, None] * R + r[None, :], acc, mask=out_mask)
                    tl.store(part_m_ptr + part, m, mask=row_ok)
                    tl.store(part_l_ptr + part, l, mask=row_ok)
                    tl.debug_barrier()  # every thread's partial is written before the release below
                    tl.atomic_add(done_ptr + b, 1, sem="release", scope="gpu")
        else:
            j = t - attention_tasks
            b = j // (H * chunks)
            h = (j // chunks) % H
            cols = (j % chunks) * MERGE_COLS + tl.arange(0, MERGE_COLS)
            seq_len = tl.load(lens_ptr + b)
            n_tiles = tl.cdiv(seq_len, BLOCK_N)
            active = tl.cdiv(n_tiles, tl.cdiv(n_tiles, num_splits))  # the splits that hold tiles
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            while tl.atomic_add(done_ptr + b, 0, sem="acquire", scope="gpu") < active:
                pass
            tl.debug_barrier()
            s = tl.arange(0, SPLITS_P2)
            s_ok = s < active
            part = (b * num_splits + s) * H + h
            m_s = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(part_l_ptr + part, mask=s_ok, other=0.0, cache_modifier=".cg")
            o_s = tl.load(part_o_ptr + part[:, None] * R + cols[None, :], mask=s_ok[:, None] & (cols < R)[None, :],
                          other=0.0, cache_modifier=".cg")
            m_all = tl.max(m_s, 0)
            w = tl.exp2(m_s - m_all)  # 0 for the splits past `active`
            out = tl.sum(o_s * w[:, None], 0) / tl.sum(l_s * w, 0)
            tl.store(out_ptr + (b * H + h) * R + cols, out.to(out_ptr.dtype.element_ty), mask=cols < R)
            tl.debug_barrier()  # every thread has read the counter and the partials before the count
            if tl.atomic_add(merged_ptr + b, 1, sem="relaxed") == H * chunks - 1:  # the request's last merge
                tl.atomic_xchg(done_ptr + b, 0, sem="relaxed")
                tl.atomic_xchg(merged_ptr + b, 0, sem="relaxed")

    return latent_decode_kernel


def num_splits(batch: int, device: torch.device) -> int:
    """Splits per request: enough attention tasks for PROGRAMS_PER_SM per SM, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-PROGRAMS_PER_SM * _num_sms(device) // batch)))


def counters_size(batch: int) -> int:
    """int32 counters a launch for `batch` requests uses: the ticket, and per request `done` and `merged`."""
    return 1 + 2 * batch


@torch.library.custom_op("flexsgl::latent_decode", mutates_args=())
def latent_decode(q: torch.Tensor, kv: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                  counters: torch.Tensor, page_size: int, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Absorbed MLA decode of q `[B, H, kv_lora_rank + rope]` over each request's first seq_lens[b]
    latents, found through page_table `[B, W]` in the pool `kv` (`[slots, 1, kv_lora_rank + rope]`),
    at softmax scale `scale`: `[B, H, kv_lora_rank]`. `counters` (int32, at least counters_size(B),
    zero) is left zero."""
    import triton

    b, h, d = q.shape
    if counters.numel() < counters_size(b):
        raise ValueError(f"latent_decode: counters hold {counters.numel()}, needs {counters_size(b)}")
    r, rope = kv_lora_rank, d - kv_lora_rank
    splits = num_splits(b, q.device)
    out = q.new_empty(b, h, r)
    f32 = dict(dtype=torch.float32, device=q.device)
    parts = b * splits * h if splits > 1 else 1
    part_o = torch.empty(parts, r, **f32)
    part_m = torch.empty(parts, **f32)
    part_l = torch.empty_like(part_m)
    tasks = b * splits + (b * h * -(-r // MERGE_COLS) if splits > 1 else 0)
    use_pdl = pdl(q.device)
    _kernel()[(tasks,)](
        q.contiguous(), kv, page_table, seq_lens, part_o, part_m, part_l, counters, out, page_table.stride(0),
        kv.stride(0), b, splits, scale * 1.4426950408889634, H=h, ROWS=max(16, triton.next_power_of_2(h)), R=r,
        R_P2=max(16, triton.next_power_of_2(r)), P=rope, P_P2=max(16, triton.next_power_of_2(rope)), PAGE=page_size,
        BLOCK_N=min(BLOCK_N, page_size), MERGE_COLS=MERGE_COLS, SPLITS_P2=triton.next_power_of_2(splits),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=use_pdl, **LAUNCH,
        **({"launch_pdl": True} if use_pdl else {}))
    return out


@latent_decode.register_fake
def _(q, kv, page_table, seq_lens, counters, page_size, kv_lora_rank, scale):
    return q.new_empty(*q.shape[:2], kv_lora_rank)


class TritonMLADecodeBackend(SplitKVDecodeBackend):
    """`triton-mla`: the kernel above for MLA decode; prefill is left to another backend."""

    name = "triton-mla"

    def counters_size(self, batch: int) -> int:
        return counters_size(batch)

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None) -> torch.Tensor:
        (kv,) = cache
        pool = self.pool
        return torch.ops.flexsgl.latent_decode(q, kv, fb.page_table, fb.seq_lens, self.counters, pool.page_size,
                                               pool.kv_lora_rank, pool.softmax_scale)
