"""MLA attention backends over the latent pool against float64 attention on random paged layouts.

MLA in the absorbed form is attention with one shared KV head whose key is the latent vector and
whose value is its first kv_lora_rank dims, at the model's softmax scale; the float64 reference is
tests/attention_reference.py's dense attention on exactly that. GPU tests (`-m gpu`): flex and
fi-mla on the same batches in bf16, and the bf16 engine with each (and with triton-mla, whose kernel
tests/test_triton_mla.py checks) against HF transformers.
"""

import functools
import random

import pytest
import torch

from flexsgl.attention import flex_ops
from flexsgl.attention.flex_mla import FlexMLABackend
from flexsgl.attention.registry import SPECS, backend_class, why_not
from flexsgl.cache.latent_pool import LatentKVPool
from flexsgl.cache.pool import KVPool, PageAllocator
from flexsgl.model.mla_config import MLAConfig
from tests.attention_reference import dense_attention, random_paged_batch
from tests.hf_models import make_deepseek_checkpoint
from tests.test_flex_attention import CASES

gpu = pytest.mark.gpu


class LatentAsKV:
    """The latent pool seen as a one-head K/V pool (K = V = the latent), for random_paged_batch."""

    def __init__(self, pool: LatentKVPool):
        self.pool, self.page_size, self.num_pages, self.k = pool, pool.page_size, pool.num_pages, pool.kv

    def store(self, layer, k, v, slots):
        self.pool.store(layer, k[:, 0], slots)


def mla_batch(specs, page_size, device, dtype, backend_cls, compiled, hq, rank, rope, seed, nope=16, v_dim=16,
              packs_prefill=False):
    """A random paged batch of latents in a one-layer pool (noise in every other slot, so a slot the
    mask let through would show), the backend prepared for it: (backend, pool, fb, q, dense, scale).
    packs_prefill: flex's compiled prefill copies the step's latents into rows (the MHA form's input),
    else it attends over the pages, as absorbed prefill does in the engine."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    scale = rng.uniform(0.5, 1.5) / (rank + rope) ** 0.5
    pool = LatentKVPool(1, pages, page_size, MLAConfig(rank, None, nope, rope, v_dim, scale), dtype, device)
    pool.kv[0].normal_()
    fb, q, latent, _, dense = random_paged_batch(LatentAsKV(pool), PageAllocator(pages, shuffle_seed=seed), specs,
                                                 hq, device, dtype, rng)
    backend = backend_cls(pool, num_heads=hq, compiled=compiled)
    backend.packs_prefill = packs_prefill
    backend.prepare(fb)
    pool.store(0, latent[:, 0].to(device, dtype), fb.out_slots)
    return backend, pool, fb, q, dense, scale


def run_mla_case(specs, page_size, device, dtype, rtol, atol, backend_cls=FlexMLABackend, forward=None,
                 compiled=False, hq=4, rank=32, rope=8, seed=None):
    """`backend_cls` on a random batch (mla_batch) against float64 (the absorbed form); returns its output."""
    seed = random.randrange(1 << 30) if seed is None else seed
    backend, pool, fb, q, dense, scale = mla_batch(specs, page_size, device, dtype, backend_cls, compiled, hq, rank,
                                                   rope, seed)
    out = (forward or type(backend).forward)(backend, q.to(device, dtype), pool.layer_cache(0), fb)
    # dense_attention scales by 1/sqrt(D); the query carries the rest of the model's scale.
    ref = dense_attention(q * scale * (rank + rope) ** 0.5, [(k, k[..., :rank]) for k, _ in dense], specs)
    assert out.shape == (q.shape[0], hq, rank)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=rtol, atol=atol, msg=lambda m: f"seed={seed}: {m}")
    return out


def run_expanded_case(specs, page_size, device, dtype, rtol, atol, hq=4, rank=32, rope=8, nope=16, v_dim=24):
    """Compiled flex prefill in the MHA form (FlexMLABackend.forward_expanded) against float64 MHA over
    each head's K = [c W_UK^T, k_pe] and V = c W_UV^T, expanded from the same latents."""
    seed = random.randrange(1 << 30)
    backend, pool, fb, _, dense, scale = mla_batch(specs, page_size, device, dtype, FlexMLABackend, True, hq, rank,
                                                   rope, seed, nope, v_dim, packs_prefill=True)
    assert backend.expands_latents(fb), "compiled prefill did not pack its latents into rows"
    g = torch.Generator().manual_seed(seed)
    w_kv = (torch.randn(hq, nope + v_dim, rank, generator=g, dtype=torch.float64) / rank ** 0.5).to(dtype).double()
    q = torch.randn(fb.num_tokens, hq, nope + rope, generator=g, dtype=torch.float64).to(dtype).double()
    out = torch.compile(FlexMLABackend.forward_expanded, dynamic=False)(
        backend, q.to(device, dtype), w_kv.to(device, dtype), pool.layer_cache(0), fb)
    expanded = []
    for latent, _ in dense:  # [tokens, 1, rank + rope]
        c, k_pe = latent[:, 0, :rank], latent[:, 0, rank:]
        kv = torch.einsum("nr,hdr->nhd", c, w_kv)
        expanded.append((torch.cat([kv[..., :nope], k_pe[:, None].expand(-1, hq, -1)], dim=-1), kv[..., nope:]))
    ref = dense_attention(q * scale * (nope + rope) ** 0.5, expanded, specs)
    assert out.shape == (q.shape[0], hq, v_dim)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=rtol, atol=atol, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_flex_mla_matches_float64(case, page_size):
    run_mla_case(CASES[case], page_size, "cpu", torch.float32, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["prefix-extend", "decode"])
def test_compiled_flex_mla_on_cpu_matches_float64(case):
    """Compiled, decode lays each request's heads out as the rows of its query (flex_meta.py's FlexMeta)."""
    run_mla_case(CASES[case], 16, "cpu", torch.float32, rtol=1e-4, atol=1e-5, compiled=True,
                 forward=torch.compile(FlexMLABackend.forward, dynamic=False))


@pytest.mark.parametrize("case", ["ragged-prefill", "prefix-extend", "mixed"])
def test_compiled_expanded_prefill_on_cpu_matches_float64(case):
    """Compiled prefill copies the step's latents, cached prefixes included, into rows and attends in
    the MHA form (flex_mla.py)."""
    run_expanded_case(CASES[case], 16, "cpu", torch.float32, rtol=1e-4, atol=1e-5)


# ---- GPU: DeepSeek-V2's latent sizes (512 + 64), 16 heads, bf16; flex also on others

# latent shapes on the GPU: DeepSeek-V2's (FlashInfer's MLA takes only these), a tiny model's, one between
LATENT_SHAPES = {"v2": dict(hq=16, rank=512, rope=64), "tiny": dict(hq=4, rank=32, rope=8),
                 "mid": dict(hq=8, rank=256, rope=32)}


def skip_unless_runs(name: str) -> None:
    reason = why_not(SPECS[name], torch.device("cuda"), "mla", 576, "bfloat16")
    if reason:
        pytest.skip(f"{name}: {reason}")


@gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size", [64])
@pytest.mark.parametrize("latent", list(LATENT_SHAPES))
def test_fi_mla_and_flex_match_float64_on_gpu(case, page_size, latent):
    """Compiled flex on each latent shape, and FlashInfer's MLA on DeepSeek-V2's, against float64 and
    each other."""
    shape = dict(LATENT_SHAPES[latent], seed=random.randrange(1 << 30))
    flex = run_mla_case(CASES[case], page_size, "cuda", torch.bfloat16, 1e-2, 1e-2, compiled=True,
                        forward=torch.compile(FlexMLABackend.forward, dynamic=False), **shape)
    if latent != "v2":
        return
    skip_unless_runs("fi-mla")
    ours = run_mla_case(CASES[case], page_size, "cuda", torch.bfloat16, 1e-2, 1e-2,
                        backend_cls=backend_class(SPECS["fi-mla"], "mla"), **shape)
    torch.testing.assert_close(ours.float(), flex.float(), rtol=2e-2, atol=2e-2)


@gpu
def test_latent_decode_compiles_its_reductions_with_the_heuristic_config(monkeypatch):
    """The latent decode's compile setting (flex_ops.HEURISTIC_REDUCTIONS) reaches its generated kernels,
    whose launchers then take Inductor's heuristic config instead of timing candidates; compiled
    afresh here (no cache), its output against float64."""
    from torch._inductor.utils import run_and_get_code

    # empty compiled-function caches for this test, the process's own restored after it
    monkeypatch.setattr(flex_ops, "_warm", set())
    monkeypatch.setattr(flex_ops, "_compiled", functools.cache(flex_ops._compiled.__wrapped__))
    with torch._inductor.config.patch(force_disable_caches=True):
        _, code = run_and_get_code(
            run_mla_case, CASES["decode"], 64, "cuda", torch.bfloat16, 1e-2, 1e-2, compiled=True,
            forward=torch.compile(FlexMLABackend.forward, dynamic=False), hq=16, rank=512, rope=64)
    assert any(f"'{flex_ops.HEURISTIC_REDUCTIONS}': True" in c for c in code), "no kernel took the setting"


@gpu
def test_flex_mla_decode_reads_a_large_pool_in_shards(monkeypatch):
    """The latent pool read a shard of pages at a time (flex_ops.py), its V a view of its K: the
    limit lowered to 4 pages here, so the batch's shuffled pages spread over several shards."""
    monkeypatch.setattr(flex_ops, "MAX_KERNEL_ELEMENTS", 4 * 64 * (512 + 64) + 3)
    run_mla_case(CASES["decode"], 64, "cuda", torch.bfloat16, 1e-2, 1e-2, compiled=True,
                 forward=torch.compile(FlexMLABackend.forward, dynamic=False), hq=16, rank=512, rope=64)


@gpu
@pytest.mark.parametrize("case", ["ragged-prefill", "prefix-extend"])
def test_expanded_prefill_matches_float64_on_gpu(case):
    """DeepSeek-V2's sizes: 512 + 64 latent dims, 128 nope and v dims, 16 heads, pages of 64."""
    run_expanded_case(CASES[case], 64, "cuda", torch.bfloat16, 1e-2, 1e-2, hq=16, rank=512, rope=64, nope=128,
                      v_dim=128)


@gpu
@pytest.mark.parametrize("one_at_a_time", [False, True], ids=["together", "batch1"])
# fi-mla,fi-mla,triton-mla<=2: the graphs of batch 1 and 2 on triton-mla, that of 8 on fi-mla
@pytest.mark.parametrize("override,latent", [("flex", "v2"), ("fi-mla", "v2"), ("triton-mla", "v2"),
                                             ("fi-mla,fi-mla,triton-mla<=2", "v2"), ("flex", "tiny"),
                                             ("triton-mla", "tiny")])
def test_bf16_mla_engine_tracks_hf(tmp_path, monkeypatch, override, latent, one_at_a_time):
    """The compiled bf16 engine with decode from CUDA graphs, on a tiny DeepSeek-V2 with the real
    latent sizes (v2: 512 + 64) or a tiny model's (32 + 8, on the backends that take them), against
    transformers in float32 and bf16 (tests/test_gpu.py's bounds); the prompts together, and one at a
    time (decode at batch 1: the matrix-vector kernels and fused routing)."""
    from tests.test_gpu import check_tracks_hf

    for name in {*override.replace("<=2", "").split(",")} - {"flex"}:
        skip_unless_runs(name)
    seed = random.randrange(1 << 30)
    latent_sizes = dict(kv_lora_rank=512, qk_rope_head_dim=64) if latent == "v2" else {}  # the tiny defaults
    make_deepseek_checkpoint(tmp_path, seed, q_lora_rank=48, qk_nope_head_dim=32, v_head_dim=32,
                             initializer_range=0.05, **latent_sizes)
    check_tracks_hf(str(tmp_path), monkeypatch, seed, 64, one_at_a_time, override=override, max_total_tokens=32768,
                    cuda_graph_bs=[1, 2, 8])
