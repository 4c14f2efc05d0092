"""The attention kernel matrix: every backend on the same paged batches, beside the hardware floor.

    python benchmarks/attention_matrix.py [--pages 16,64,128] [--gqa 4,8] [--phases decode,prefill]
        [--batches 1,8,32,128,256] [--contexts 1024,4096,16384] [--backends ...] [--window W]
        [--layout rule|come|each] [--json PATH]      (a GPU)

`--window W` runs every backend with a sliding window of W keys (the `sliding_window` attention
variant; FA3 as its window_size), against a float64 reference with the same window, and the decode
floor counts the keys in the window only. `--layout` sets flex's prefill query layout: the engine's
rule (flex_blocks.rows_as_they_come, the default), the tokens as they come (`come`), or each request
from a query block of its own (`each`), the copies in and out timed with the kernel.

Shapes: decode at batch 1, 8, 32, 128, 256 with contexts of 1k, 4k and 16k tokens; ragged prefill
of 8k and 32k new tokens in all (requests of 512 to 4096 new tokens, drawn with a fixed seed),
without and with cached prefixes (each request then extends a cached prefix of 256 to 8192
tokens); GQA 4 (32 query / 8 KV heads) and 8 (64 / 8); head_dim 128, bf16; pages of 16, 64, 128
tokens, handed out in shuffled order as the engine's allocator does.

Backends: flex compiled, on the kernels the engine picks (decode through its per-batch-size op,
prefill compiled per shape, on FlexAttention's FLASH backend where flash-attn-4 is staged by
tools/stage_flash.sh and the KV block is 128, a window's too unless FLEXSGL_FLASH_VARIANTS=0;
`flex-flash`: prefill with FLASH set as every kernel option), each
kernel override the registry lets run here (fa3, fi-decode, triton-decode), and SDPA over the same
K/V gathered into contiguous per-request tensors (the dense lower bound, gather not timed). `fa4`:
flash-attn-4's kernel called directly on the same pages, prefill only (the FLASH backend's ceiling).
`flex-dense`: flex's Triton kernel on the same K/V made contiguous, under a plain document-causal
mask, prefill only (the Triton path's ceiling).

Timing: `INNER` calls captured in one CUDA graph, CUDA events around each replay, the median of
`ROUNDS` replays. Floors: decode reads every cached K/V byte once (over the copy bandwidth measured
here); prefill does 4 * Hq * D FLOPs per causal (query, key) pair (over the GPU's dense bf16 peak,
--peak-tflops). Every cell's output is checked on 64 sampled query rows against float64 attention;
`err` is the largest absolute error, and a cell over 0.02 is marked `!`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexsgl.attention import flex_meta  # noqa: E402
from flexsgl.attention.base import ForwardBatch  # noqa: E402
from flexsgl.attention.bound_variant import VariantSet  # noqa: E402
from flexsgl.attention.flex_options import FLASH  # noqa: E402
from flexsgl.attention.variants import sliding_window  # noqa: E402
from flexsgl.attention.registry import SPECS, backend_class, sm_version, why_not  # noqa: E402
from flexsgl.bench import copy_bandwidth  # noqa: E402
from flexsgl.bench.cuda_timing import graph_median_s  # noqa: E402
from flexsgl.cache.pool import KVPool, PageAllocator  # noqa: E402

D, DTYPE, KV_HEADS = 128, torch.bfloat16, 8
DECODE_BATCHES, DECODE_CONTEXTS = (1, 8, 32, 128, 256), (1024, 4096, 16384)
PREFILL_TOTALS, NEW_RANGE, PREFIX_RANGE = (8192, 32768), (512, 4096), (256, 8192)
INNER = {"decode": 10, "prefill": 2}
ROUNDS, CHECK_ROWS, TOLERANCE = 7, 64, 0.02
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}  # dense bf16, SXM


def ragged(total: int, with_prefix: bool, seed: int) -> list[tuple[int, int]]:
    """(cached prefix, new tokens) per request, new tokens summing to `total`."""
    rng = random.Random(seed)
    specs, left = [], total
    while left:
        new = min(left, rng.randint(*NEW_RANGE))
        specs.append((rng.randint(*PREFIX_RANGE) if with_prefix else 0, new))
        left -= new
    return specs


def paged_batch(specs, page: int, hq: int, seed: int = 0):
    """A pool holding each request's prefix + new K/V (random), the step's ForwardBatch and queries."""
    gen = torch.Generator("cuda").manual_seed(seed)
    pages = [KVPool.num_pages_for(p + n, page) for p, n in specs]
    pool = KVPool(1, sum(pages) + 1, page, KV_HEADS, D, DTYPE, "cuda")
    pool.k[0].normal_(generator=gen), pool.v[0].normal_(generator=gen)
    alloc = PageAllocator(pool.num_pages, shuffle_seed=seed)
    tables = [alloc.alloc(n) for n in pages]
    positions = [torch.arange(p, p + n) for p, n in specs]
    slots = [torch.tensor(t)[pos // page] * page + pos % page for t, pos in zip(tables, positions)]
    q_lens = [n for _, n in specs]
    seq_lens = [p + n for p, n in specs]
    offsets = [0, *torch.tensor(q_lens).cumsum(0).tolist()][:-1]
    w = max(pages)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    t = sum(q_lens)
    fb = ForwardBatch(
        mode="decode" if all(n == 1 for n in q_lens) else "prefill",
        input_ids=torch.zeros(t, dtype=torch.long, device="cuda"), positions=torch.cat(positions).cuda(),
        out_slots=torch.cat(slots).cuda(), page_table=i32([tb + [0] * (w - len(tb)) for tb in tables]),
        seq_lens=i32(seq_lens), q_lens=i32(q_lens), q_offsets=i32(offsets),
        logits_index=torch.tensor([o + n - 1 for o, n in zip(offsets, q_lens)], device="cuda"),
        max_q_len=max(q_lens), num_kv_pages=pool.num_pages, host_seq_lens=seq_lens, host_q_lens=q_lens,
        host_pages=tables)
    q = torch.randn(t, hq, D, dtype=DTYPE, device="cuda", generator=gen)
    return pool, fb, q, tables


def gathered(pool: KVPool, tables, seq_lens) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each request's K and V `[len, Hkv, D]` in order, out of its pages."""
    ps, out = pool.page_size, []
    for t, n in zip(tables, seq_lens):
        slots = (torch.tensor(t, device="cuda")[:, None] * ps + torch.arange(ps, device="cuda")).flatten()[:n]
        out.append((pool.k[0][slots], pool.v[0][slots]))
    return out


def reference_rows(q, kv, specs, rows, window: int | None = None) -> torch.Tensor:
    """float64 attention of the packed query rows `rows` (over the last `window` keys where given)."""
    starts = [0, *torch.tensor([n for _, n in specs]).cumsum(0).tolist()]
    out = []
    for row in rows:
        r = next(i for i in range(len(specs)) if starts[i] <= row < starts[i + 1])
        pos = specs[r][0] + row - starts[r]
        first = 0 if window is None else max(0, pos - window + 1)
        k, v = (x[first:pos + 1].double() for x in kv[r])
        qi = q[row].double()  # [Hq, D]
        g = qi.shape[0] // k.shape[1]
        s = torch.einsum("hd,khd->hk", qi, k.repeat_interleave(g, 1)) / D ** 0.5
        out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v.repeat_interleave(g, 1)))
    return torch.stack(out)


def sdpa(q, kv, specs):
    """SDPA per request over its contiguous K/V; bottom-right causal alignment for extends."""
    from torch.nn.attention.bias import causal_lower_right

    outs, off = [], 0
    for (k, v), (p, n) in zip(kv, specs):
        qi = q[off:off + n].transpose(0, 1)[None]
        off += n
        mask = None if n == 1 else causal_lower_right(n, p + n)
        o = F.scaled_dot_product_attention(qi, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                                           enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def fa4(pool, fb, q):
    """flash-attn-4's CuTe DSL kernel called directly (no FlexAttention) on the pool's pages, or why not.

    The pool's flat `[slots, Hkv, D]` K/V are viewed as `[pages, page_size, Hkv, D]` (same memory, no
    copy); the page table (padded with the dummy page) and KV lengths are the batch's own. On SM90 a
    page the size of the kernel's KV tile (128 tokens at D 128) is loaded by TMA, any other page size
    by cp.async. Causal masking is aligned to the end of each request's KV, as for the other backends."""
    if fb.mode != "prefill":
        return "it runs prefill only"
    sm = sm_version(torch.device("cuda"))
    if sm // 10 not in (9, 10, 11):
        return f"its paged kernels run on SM 90 to 110, and this GPU is SM {sm}"
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        return f"flash-attn-4 does not import ({e}); tools/stage_flash.sh stages it"
    k, v = (x.view(pool.num_pages, pool.page_size, KV_HEADS, D) for x in pool.layer_cache(0))
    cu_seqlens_q = F.pad(torch.cumsum(fb.q_lens, 0, dtype=torch.int32), (1, 0))
    max_k = max(fb.host_seq_lens)
    # It returns (out, lse); lse is None unless asked for.
    return lambda: flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_seqlens_q, seqused_k=fb.seq_lens, page_table=fb.page_table,
        max_seqlen_q=fb.max_q_len, max_seqlen_k=max_k, softmax_scale=D ** -0.5, causal=True)[0]


def flex_dense(fb, q, kv, specs):
    """Flex's Triton kernel on each request's K/V made contiguous, packed into one sequence, under the
    document-causal mask FlexAttention's own examples use (no pages, no page lookups): the Triton flex
    path's ceiling, prefill only. Options: 128x64 tiles, 8 warps, 3 stages, the fastest measured here."""
    if fb.mode != "prefill":
        return "it runs prefill only"
    k, v = (torch.cat([x[i] for x in kv])[None].transpose(1, 2).contiguous() for i in (0, 1))
    doc_q, pos_q, doc_k, pos_k = (torch.cat(parts).cuda() for parts in zip(*[
        (torch.full((n,), r), torch.arange(p, p + n), torch.full((p + n,), r), torch.arange(p + n))
        for r, (p, n) in enumerate(specs)]))

    def mask(b, h, q_idx, kv_idx):
        return (doc_q[q_idx] == doc_k[kv_idx]) & (pos_k[kv_idx] <= pos_q[q_idx])

    block_mask = create_block_mask(mask, 1, 1, q.shape[0], k.shape[2], device="cuda", _compile=True)
    qs = q[None].transpose(1, 2).contiguous()
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    options = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return lambda: compiled(qs, k, v, block_mask=block_mask, enable_gqa=True,
                            kernel_options=options)[0].transpose(0, 1)


def attend_fn(name: str, pool, fb, q, hq: int, kv, window: int | None = None):
    """A callable running `name` on this batch (with a sliding window of `window` keys), or the reason
    it cannot run here."""
    specs = [(s - n, n) for s, n in zip(fb.host_seq_lens, fb.host_q_lens)]  # (cached prefix, new) per request
    variants = None if window is None else VariantSet([sliding_window(window)], hq, 0, hq, len(specs) + 1,
                                                      torch.device("cuda"))
    bound = None if variants is None else variants.layers[0]
    if window is not None and name not in ("flex", "flex-flash", "fa3", "fa3-prefill"):
        return "it runs no window here"
    fb.req_slots = torch.arange(len(specs), device="cuda")
    if name == "sdpa":
        return lambda: sdpa(q, kv, specs)
    if name == "fa4":
        return fa4(pool, fb, q)
    if name == "flex-dense":
        return flex_dense(fb, q, kv, specs)
    flash = name == "flex-flash"
    if flash and fb.mode != "prefill":
        return "it runs prefill only"
    spec = SPECS["flex" if flash else name]
    reason = why_not(spec, torch.device("cuda"), "gqa", variants=() if variants is None else [b.variant for b in variants.layers])
    if reason is None and fb.mode not in spec.phases:
        reason = f"it runs {', '.join(spec.phases)} only"
    cls = backend_class(spec) if reason is None else None
    reason = reason or cls.unsupported(pool.page_size, torch.device("cuda"))
    if reason:
        return reason
    backend = cls(pool, num_heads=hq, compiled=True, variants=variants)
    if flash:  # a window's prefill too, as variant_prefill_options gives it where FLASH runs
        backend.kernel_options = backend.packed_kernel_options = dict(FLASH)
        backend.variant_options = {vid: (dict(FLASH), dict(FLASH)) for vid in backend.variant_options}
        backend.flash_variants = True
    fb.backend = backend
    backend.prepare(fb)
    fn = lambda: backend.forward(q, pool.layer_cache(0), fb, bound)  # noqa: E731
    if spec.name == "flex" and fb.mode == "prefill":  # decode compiles inside its op (flex_ops.py); prefill here
        torch._dynamo.reset()
        fn = torch.compile(fn, dynamic=False)
    return fn


def cases(pages, gqas, batches=DECODE_BATCHES, contexts=DECODE_CONTEXTS):
    for page in pages:
        for gqa in gqas:
            for bs in batches:
                for ctx in contexts:
                    yield "decode", f"{bs}x{ctx}", [(ctx - 1, 1)] * bs, page, gqa
            for total in PREFILL_TOTALS:
                for with_prefix in (False, True):
                    specs = ragged(total, with_prefix, seed=total + with_prefix)
                    label = f"{total // 1024}k new in {len(specs)}" + (" +prefix" if with_prefix else "")
                    yield "prefill", label, specs, page, gqa


def floor_us(phase, specs, hq, bandwidth, peak_tflops, window: int | None = None) -> float:
    """Decode: every key read once (those in the window); prefill: every visible (query, key) pair."""
    if phase == "decode":
        return sum(min(p + n, window or p + n) for p, n in specs) * 2 * KV_HEADS * D * 2 / bandwidth * 1e6
    if window is None:
        pairs = sum(n * p + n * (n + 1) / 2 for p, n in specs)
    else:
        pairs = sum(min(pos + 1, window) for p, n in specs for pos in range(p, p + n))
    return 4 * hq * D * pairs / (peak_tflops * 1e12) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="16,64,128")
    ap.add_argument("--gqa", default="4,8")
    ap.add_argument("--phases", default="decode,prefill")
    ap.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes")
    ap.add_argument("--contexts", default=",".join(map(str, DECODE_CONTEXTS)), help="decode contexts")
    ap.add_argument("--backends", default="flex,fa3,fi-decode,triton-decode,sdpa")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by GPU name)")
    ap.add_argument("--window", type=int, default=None, help="a sliding window of this many keys")
    ap.add_argument("--layout", choices=("rule", "come", "each"), default="rule", help="flex's prefill query layout")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.layout != "rule":  # the metadata builder asks this for each variant's layout
        flex_meta.rows_as_they_come = lambda fb, align, window=None: a.layout == "come"
    name = torch.cuda.get_device_name()
    peak = a.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 989.0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{name}: copy bandwidth {bandwidth / 1e9:,.0f} GB/s, bf16 peak {peak:,.0f} TFLOP/s; µs per call "
          f"(x floor), err = max |out - float64| on {CHECK_ROWS} rows", flush=True)
    rows = []
    backends = a.backends.split(",")
    phases = a.phases.split(",")
    ints = lambda arg: [int(x) for x in arg.split(",")]  # noqa: E731
    for phase, label, specs, page, gqa in cases(ints(a.pages), ints(a.gqa), ints(a.batches), ints(a.contexts)):
        if phase not in phases:
            continue
        hq = KV_HEADS * gqa
        with torch.inference_mode():
            pool, fb, q, tables = paged_batch(specs, page, hq)
            check = torch.randperm(fb.num_tokens, generator=torch.Generator().manual_seed(0))[:CHECK_ROWS].sort().values
            kv = gathered(pool, tables, fb.host_seq_lens)
            ref = reference_rows(q, kv, specs, check.tolist(), a.window)
            floor = floor_us(phase, specs, hq, bandwidth, peak, a.window)
            cells = {}
            for b in backends:
                try:
                    fn = attend_fn(b, pool, fb, q, hq, kv, a.window)
                    if isinstance(fn, str):
                        continue  # cannot run here (the registry's reason)
                    err = (fn()[check.cuda()].double() - ref).abs().max().item()
                    cells[b] = {"us": graph_median_s(fn, INNER[phase], ROUNDS) * 1e6, "err": err}
                except Exception as e:  # noqa: BLE001 - one failing cell must not end the matrix
                    cells[b] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            del pool, fb, q, kv
            torch.cuda.empty_cache()
        row = {"phase": phase, "shape": label, "page_size": page, "gqa": gqa, "window": a.window, "layout": a.layout,
               "floor_us": floor, "cells": cells}
        rows.append(row)
        shown = "  ".join(f"{b} {c['us']:,.1f} ({c['us'] / floor:.2f}x){'!' if c['err'] > TOLERANCE else ''}"
                          if "us" in c else f"{b} failed: {c['error']}" for b, c in cells.items())
        print(f"{phase:7} {label:22} page {page:3} gqa {gqa}  floor {floor:,.1f}  {shown}", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"gpu": name, "copy_bandwidth": bandwidth, "peak_tflops": peak,
                                                "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
