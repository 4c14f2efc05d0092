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
    specs = CASES[case]
    rng = random.Random()
    hq, hkv, d = 4, 2, 16
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, hkv, d, torch.float32, "cpu")
    # Pre-fill the whole pool with noise, so stale slots would show up if the mask let them through.
    pool.k[0].normal_(), pool.v[0].normal_()
    alloc = PageAllocator(pages, shuffle_seed=rng.randrange(1 << 30))
    fb, q, k, v, dense = random_paged_batch(pool, alloc, specs, hq, "cpu", torch.float32, rng)
    if eager_extent:
        fb.num_kv_pages = int(fb.page_table.max()) + 1
    backend = FlexAttentionBackend(pool)
    fb.backend = backend
    backend.prepare(fb)
    out = backend.forward(q.float(), k.float(), v.float(), 0, fb)
    ref = dense_attention(q, dense, specs)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
