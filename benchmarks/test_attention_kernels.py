"""Attention per backend on fixed paged shapes: one layer's K/V store (`pool.store`) and `forward`
(attend), decode and prefill.

The batch is laid out as the engine lays it out: pages of `PAGE` tokens handed out in a shuffled
order, the whole pool filled with random K/V, `backend.prepare(fb)` once, then store and attend
timed (`inner` calls per round; on CUDA inside one CUDA graph). extra_info holds µs per call and the
rate: decode as GB/s of KV read, prefill as causal TFLOP/s. Backends that cannot run here are
skipped with the registry's reason.
"""

from __future__ import annotations

import random

import pytest
import torch
from common import CUDA, DEVICE, per_call, repeated

from flexsgl.attention.base import ForwardBatch
from flexsgl.attention.registry import SPECS, backend_class, why_not
from flexsgl.cache.pool import DUMMY_PAGE, KVPool, PageAllocator

if CUDA:  # the DESIGN.md shapes: 32 query / 8 KV heads, d=128, bf16
    HQ, HKV, D, DTYPE, PAGE = 32, 8, 128, torch.bfloat16, 64
    # batch x context; 64 and 128: either side of where `auto` hands decode from triton-decode to fi-decode
    DECODE = [(1, 4096), (8, 4096), (32, 1024), (32, 4096), (64, 1536), (128, 2048)]
    PREFILL = [(8, 1024), (4, 4096), (1, 16384)]  # batch x prompt length
    INNER = {"decode": 20, "prefill": 5}
else:
    HQ, HKV, D, DTYPE, PAGE = 4, 2, 32, torch.float32, 16
    DECODE = [(4, 256)]
    PREFILL = [(2, 128)]
    INNER = {"decode": 1, "prefill": 1}

CASES = [("decode", bs, n) for bs, n in DECODE] + [("prefill", bs, n) for bs, n in PREFILL]


def paged_batch(phase: str, bs: int, n: int, seed: int = 0):
    """A pool of random K/V and a ForwardBatch: decode = one new token on a context of n per request,
    prefill = n new tokens per request on an empty cache. Returns (pool, fb, q, k, v)."""
    rng = random.Random(seed)
    pages_per_req = KVPool.num_pages_for(n, PAGE)
    pool = KVPool(1, bs * pages_per_req + 1, PAGE, HKV, D, DTYPE, DEVICE)
    pool.k[0].normal_(), pool.v[0].normal_()
    alloc = PageAllocator(pool.num_pages, shuffle_seed=rng.randrange(1 << 30))
    tables, positions, slots, q_lens, offsets = [], [], [], [], []
    for _ in range(bs):
        pages = alloc.alloc(pages_per_req)
        new = range(n - 1, n) if phase == "decode" else range(n)
        offsets.append(len(positions))
        positions += new
        slots += [pages[p // PAGE] * PAGE + p % PAGE for p in new]
        q_lens.append(len(new))
        tables.append(pages)
    t = len(positions)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    i64 = lambda x: torch.tensor(x, dtype=torch.long, device=DEVICE)  # noqa: E731
    fb = ForwardBatch(
        mode=phase, input_ids=torch.zeros(t, dtype=torch.long, device=DEVICE), positions=i64(positions),
        out_slots=i64(slots), page_table=i32(tables), seq_lens=i32([n] * bs), q_lens=i32(q_lens),
        q_offsets=i32(offsets), logits_index=i64([o + q - 1 for o, q in zip(offsets, q_lens)]),
        max_q_len=max(q_lens), num_kv_pages=pool.num_pages, host_seq_lens=[n] * bs, host_q_lens=q_lens,
        host_pages=tables)
    assert DUMMY_PAGE not in {p for tb in tables for p in tb}
    q, k, v = (torch.randn(t, h, D, dtype=DTYPE, device=DEVICE) for h in (HQ, HKV, HKV))
    return pool, fb, q, k, v


def work(phase: str, bs: int, n: int) -> tuple[str, float]:
    """What one call must do: decode reads the KV (bytes), prefill computes causal attention (FLOPs)."""
    itemsize = torch.tensor([], dtype=DTYPE).element_size()
    if phase == "decode":
        return "GB/s", bs * n * 2 * HKV * D * itemsize / 1e9
    return "TFLOP/s", bs * 4 * HQ * D * n * (n + 1) / 2 / 1e12


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("phase,bs,n", CASES, ids=[f"{p}-{b}x{n}" for p, b, n in CASES])
def test_attention(benchmark, name, phase, bs, n):
    spec = SPECS[name]
    reason = why_not(spec, DEVICE, "gqa")
    if reason is None and phase not in spec.phases:
        reason = f"it runs {', '.join(spec.phases)} only"
    if reason is None:
        reason = backend_class(spec).unsupported(PAGE, DEVICE)
    if reason:
        pytest.skip(f"{name}: {reason}")
    benchmark.group = f"attention {phase} {bs}x{n}"
    pool, fb, q, k, v = paged_batch(phase, bs, n)
    backend = backend_class(spec)(pool, num_heads=HQ, compiled=CUDA)
    fb.backend = backend

    def forward(q, k, v):
        pool.store(0, k, v, fb.out_slots)
        return backend.forward(q, pool.layer_cache(0), fb)

    if CUDA and name == "flex":  # the engine runs flex compiled; eager flex materialises the scores
        torch._dynamo.reset()  # a fresh compile per shape, never a silent eager fallback at the recompile limit
        forward = torch.compile(forward, dynamic=False)
    with torch.inference_mode():
        backend.prepare(fb)
        out = forward(q, k, v)
        assert out.shape == (fb.num_tokens, HQ, D) and torch.isfinite(out).all()
        inner = INNER[phase]
        run, how = repeated(lambda: forward(q, k, v), inner)
        benchmark.pedantic(run, rounds=10 if CUDA else 1, warmup_rounds=1 if CUDA else 0)
    unit, amount = work(phase, bs, n)
    benchmark.extra_info.update({"backend": name, "timed": how, "calls_per_round": inner, "dtype": str(DTYPE),
                                 "heads": f"{HQ}/{HKV}", "head_dim": D, "page_size": PAGE})
    seconds = per_call(benchmark, inner)
    if seconds:
        benchmark.extra_info.update({"us_per_call": seconds * 1e6, unit: amount / seconds})
