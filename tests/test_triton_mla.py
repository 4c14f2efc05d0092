"""flexsgl's MLA decode kernel (overrides/triton_mla.py) against float64 attention in the absorbed form.

On the GPU: DeepSeek-V2's latent sizes (512 + 64, 16 heads) and a tiny model's (32 + 8, 4 heads,
padded in the kernel), bf16 and fp16, batches that split each request's KV (1 to 64), one that
does not (300), short and long contexts (empty splits, one tile, many tiles per split), pages of 16
and 64; each batch runs twice, so counters the first launch failed to reset would show in the
second. On the CPU, the same kernel through Triton's interpreter in float32 and float16, with the
split count forced so the merge tasks run.
"""

import random

import pytest
import torch

from flexsgl.overrides import triton_mla
from flexsgl.overrides.triton_mla import TritonMLADecodeBackend
from tests.test_flex_attention import CASES
from tests.test_mla_attention import run_mla_case

SHAPES = {"v2": dict(hq=16, rank=512, rope=64), "tiny": dict(hq=4, rank=32, rope=8)}


def run_triton_mla(specs, page_size, device, dtype, seed, **case):
    """tests.test_mla_attention.run_mla_case for triton-mla; returns (output, the backend)."""
    built = []

    def build(pool, num_heads, compiled=False):
        built.append(TritonMLADecodeBackend(pool, num_heads, compiled))
        return built[-1]

    out = run_mla_case(specs, page_size, device, dtype, backend_cls=build, seed=seed, **case)
    return out, built[0]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 544), (1, 5000), (4, 700), (8, 3000), (64, 400), (300, 90)])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_latent_decode_matches_float64(batch, ctx, shape, page_size, dtype):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(max(0, int(ctx * rng.uniform(0.3, 1.5)) - 1), 1) for _ in range(batch)]
    first, backend = run_triton_mla(specs, page_size, "cuda", dtype, seed, rtol=1e-2, atol=1e-2, **SHAPES[shape])
    assert backend.counters.count_nonzero().item() == 0, f"counters not reset (seed={seed})"
    again, _ = run_triton_mla(specs, page_size, "cuda", dtype, seed, rtol=1e-2, atol=1e-2, **SHAPES[shape])
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("splits", [1, 3, 32])  # 3 and 32: merge tasks run; 32: empty splits too
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("hq", [4, 3])  # 3: padded query rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])  # bf16: see conftest
def test_latent_decode_interpreted_matches_float64(monkeypatch, splits, page_size, hq, dtype):
    monkeypatch.setattr(triton_mla, "num_splits", lambda batch, device: splits)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    seed = random.randrange(1 << 30)
    _, backend = run_triton_mla(CASES["decode"] + [(300, 1)], page_size, "cpu", dtype, seed, hq=hq, rank=32, rope=8,
                                **tol)
    assert backend.counters.count_nonzero().item() == 0, f"counters not reset (seed={seed})"


def test_latent_decode_refuses_prefill():
    from flexsgl.cache.latent_pool import LatentKVPool
    from flexsgl.model.mla_config import MLAConfig

    pool = LatentKVPool(1, 4, 16, MLAConfig(32, None, 16, 8, 16, 0.1), torch.float32, "cpu")
    backend = TritonMLADecodeBackend(pool, 4)
    fb = type("FB", (), {"mode": "prefill", "batch_size": 1})()
    with pytest.raises(ValueError, match="triton-mla runs decode only; pair it with a prefill backend."):
        backend.prepare(fb)
