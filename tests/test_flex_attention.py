"""The FlexAttention backend against float64 dense attention on random paged layouts."""

import random

import pytest
import torch

from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.cache.pool import KVPool, PageAllocator
from tests.attention_reference import dense_attention, random_paged_batch

CASES = {
    "ragged-prefill": [(0, 37), (0, 5), (0, 130), (0, 64)],
    "prefix-extend": [(64, 40), (13, 1), (100, 77), (7, 150)],
    "decode": [(0 + n, 1) for n in (1, 63, 64, 65, 200, 17)],
    "mixed": [(90, 1), (0, 70), (33, 12), (129, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("eager_extent", [False, True])
def test_flex_matches_float64_reference(case, page_size, eager_extent):
    run_backend_case(CASES[case], page_size, FlexAttentionBackend.forward, "cpu", torch.float32,
                     rtol=1e-4, atol=1e-5, eager_extent=eager_extent)


# The shapes flexsgl serves: head dims 32 (tiny), 64 (the embedded model), 128 (Qwen3, Llama) and 256,
# query heads per KV head 1, 2, 4 and 8, each dtype. Bounds: float32 as above; half types round the
# inputs before the reference sees them, then the kernel's own rounding (see tests/test_gpu.py).
HEAD_DIMS, GQA_RATIOS = (32, 64, 128, 256), (1, 2, 4, 8)
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("gqa", GQA_RATIOS)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_flex_on_every_served_shape(d, gqa, dtype):
    rtol, atol = TOLERANCE[dtype]
    run_backend_case(CASES["mixed"], 16, FlexAttentionBackend.forward, "cpu", dtype, rtol=rtol, atol=atol,
                     hq=2 * gqa, hkv=2, d=d)


def run_backend_case(specs, page_size, forward, device, dtype, rtol, atol, eager_extent=False, compiled=False,
                     hq=4, hkv=2, d=16, backend_cls=FlexAttentionBackend, seed=None, full_blocks=True):
    """Store a random paged batch's K/V in the pool, run `backend_cls` on it (through `forward`, or
    its own when None) and check it against float64 attention; returns its output. The same seed
    gives the same batch."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, hkv, d, dtype, device)
    # Pre-fill the whole pool with noise, so stale slots would show up if the mask let them through.
    pool.k[0].normal_(), pool.v[0].normal_()
    alloc = PageAllocator(pages, shuffle_seed=seed)
    fb, q, k, v, dense = random_paged_batch(pool, alloc, specs, hq, device, dtype, rng)
    if eager_extent:
        fb.num_kv_pages = int(fb.page_table.max()) + 1
    backend = backend_cls(pool, num_heads=hq, compiled=compiled)
    if not full_blocks:
        backend.decode_full_blocks = lambda batch: False
    backend.prepare(fb)
    cast = lambda x: x.to(device, dtype)
    pool.store(0, cast(k), cast(v), fb.out_slots)
    out = (forward or type(backend).forward)(backend, cast(q), pool.layer_cache(0), fb)
    ref = dense_attention(q, dense, specs)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=rtol, atol=atol, msg=lambda m: f"seed={seed}: {m}")
    return out


@pytest.mark.parametrize("case", ["prefix-extend", "decode"])
def test_compiled_flex_on_cpu_matches_float64_reference(case):
    """Compiled flex skips blocks the BlockMask leaves out (eager evaluates the mask everywhere),
    so this is what checks the full/partial block lists built from the page table."""
    run_backend_case(CASES[case], 16, torch.compile(FlexAttentionBackend.forward, dynamic=False), "cpu",
                     torch.float32, rtol=1e-4, atol=1e-5, compiled=True)


def test_compiled_flex_decode_without_full_blocks_on_cpu():
    """Decode as the CUDA op lays it out (flex.py): every visible page a partial KV block."""
    run_backend_case(CASES["decode"], 16, torch.compile(FlexAttentionBackend.forward, dynamic=False), "cpu",
                     torch.float32, rtol=1e-4, atol=1e-5, compiled=True, full_blocks=False)
