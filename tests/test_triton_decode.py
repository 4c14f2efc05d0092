"""flexsgl's split-KV decode kernel (overrides/triton_decode.py) against float64 attention.

On the GPU: bf16 and fp16 at the batch sizes it is built for and above, short and long contexts
(empty splits, one page, many pages per split), GQA groups of 1 to 4, pages of 16 and 64; each
batch runs twice, so a merge counter the first launch failed to reset would show in the second.
On a CPU with triton installed, the same kernel through Triton's interpreter in float32, with the
split count forced so the in-kernel merge runs (CI's CPU has no triton: it skips there).
"""

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexsgl.overrides.triton_decode import TritonDecodeBackend
from tests.test_flex_attention import run_backend_case


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 1152), (1, 5000), (4, 700), (8, 3000), (64, 400)])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 8), (8, 8)])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_split_kv_decode_matches_float64(batch, ctx, hq, hkv, page_size, dtype):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(max(0, int(ctx * rng.uniform(0.3, 1.5)) - 1), 1) for _ in range(batch)]
    backend = None

    def keep(pool, num_heads, compiled=False):
        nonlocal backend
        backend = TritonDecodeBackend(pool, num_heads, compiled)
        return backend

    first = run_backend_case(specs, page_size, None, "cuda", dtype, rtol=1e-2, atol=1e-2, hq=hq, hkv=hkv, d=128,
                             backend_cls=keep, seed=seed)
    assert backend.counter.count_nonzero().item() == 0, f"merge counters not reset (seed={seed})"
    again = run_backend_case(specs, page_size, None, "cuda", dtype, rtol=1e-2, atol=1e-2, hq=hq, hkv=hkv, d=128,
                             backend_cls=TritonDecodeBackend, seed=seed)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


INTERPRETED = """
import sys
import torch
from flexsgl.overrides import triton_decode
from tests.test_flex_attention import CASES, run_backend_case
triton_decode.num_splits = lambda batch, hkv, device: int(sys.argv[1])
for page_size in (16, 64):
    for hq, hkv in ((4, 2), (4, 4), (6, 2)):
        run_backend_case(CASES["decode"] + [(300, 1), (1000, 1)], page_size, None, "cpu", torch.float32,
                         rtol=1e-4, atol=1e-5, hq=hq, hkv=hkv, d=16,
                         backend_cls=triton_decode.TritonDecodeBackend)
"""


@pytest.mark.parametrize("splits", [1, 3, 32])
def test_split_kv_decode_interpreted_matches_float64(splits):
    """In a fresh interpreter: triton reads TRITON_INTERPRET when it is imported."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter check is for machines without a GPU")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (CPU CI); the GPU test covers the kernel")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", INTERPRETED, str(splits)], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
