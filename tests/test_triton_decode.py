"""flexsgl's split-KV decode kernel (overrides/triton_decode.py) against float64 attention.

On the GPU: bf16 and fp16 at the batch sizes it is built for and above, short and long contexts
(empty splits, one page, many pages per split), GQA groups of 1 to 4, pages of 16 and 64; each
batch runs twice, so a merge counter the first launch failed to reset would show in the second.
On the CPU, the same kernel through Triton's interpreter in float32 and float16 on small heads,
with the split count forced so the in-kernel merge runs.
"""

import random

import pytest
import torch

from flexsgl.overrides import triton_decode
from flexsgl.overrides.triton_decode import TritonDecodeBackend
from tests.test_flex_attention import CASES, run_backend_case


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 1152), (1, 5000), (4, 700), (8, 3000), (64, 400)])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 8), (8, 8)])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_split_kv_decode_matches_float64(batch, ctx, hq, hkv, page_size, dtype):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(max(0, int(ctx * rng.uniform(0.3, 1.5)) - 1), 1) for _ in range(batch)]
    first, backend = run_triton_decode(specs, page_size, "cuda", dtype, rtol=1e-2, atol=1e-2, hq=hq, hkv=hkv, d=128,
                                       seed=seed)
    assert backend.counters.count_nonzero().item() == 0, f"merge counters not reset (seed={seed})"
    again = run_backend_case(specs, page_size, None, "cuda", dtype, rtol=1e-2, atol=1e-2, hq=hq, hkv=hkv, d=128,
                             backend_cls=TritonDecodeBackend, seed=seed)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("splits", [1, 3, 32])  # 3 and 32: the merge runs in the kernel; 32: empty splits too
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2), (6, 2)])  # GQA groups of 2, 1 and 3 (padded to 4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])  # bf16: see conftest
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf - -inf in padded rows
def test_split_kv_decode_interpreted_matches_float64(monkeypatch, splits, page_size, hq, hkv, dtype):
    monkeypatch.setattr(triton_decode, "num_splits", lambda batch, hkv, device: splits)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    seed = random.randrange(1 << 30)
    _, backend = run_triton_decode(CASES["decode"] + [(300, 1)], page_size, "cpu", dtype, hq=hq, hkv=hkv, d=16,
                                   seed=seed, **tol)
    assert backend.counters.count_nonzero().item() == 0, f"merge counters not reset (seed={seed})"


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf - -inf in padded rows
def test_split_kv_decode_interpreted_reads_an_fp8_pool(monkeypatch, splits):
    """An FP8 pool (kv_cache_dtype fp8_e4m3): the kernel casts each page's K and V to the query's dtype
    as it loads them; against float64 attention over the FP8 values."""
    monkeypatch.setattr(triton_decode, "num_splits", lambda batch, hkv, device: splits)
    seed = random.randrange(1 << 30)
    run_triton_decode(CASES["decode"] + [(300, 1)], 16, "cpu", torch.float32, hq=4, hkv=2, d=16, seed=seed,
                      rtol=1e-4, atol=1e-5, kv_dtype=torch.float8_e4m3fn)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 1152), (8, 3000), (64, 400)])
def test_split_kv_decode_reads_an_fp8_pool(batch, ctx):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(max(0, int(ctx * rng.uniform(0.3, 1.5)) - 1), 1) for _ in range(batch)]
    run_triton_decode(specs, 64, "cuda", torch.bfloat16, rtol=1e-2, atol=1e-2, hq=32, hkv=8, d=128, seed=seed,
                      kv_dtype=torch.float8_e4m3fn)


def run_triton_decode(specs, page_size, device, dtype, **case):
    """tests.test_flex_attention.run_backend_case for triton-decode; returns (output, the backend)."""
    built = []

    def build(pool, num_heads, compiled=False):
        built.append(TritonDecodeBackend(pool, num_heads, compiled))
        return built[-1]

    out = run_backend_case(specs, page_size, None, device, dtype, backend_cls=build, **case)
    return out, built[0]
