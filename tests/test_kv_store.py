"""The GQA store path (flexsgl/cache/store.py), the one way attention layers write K/V.

Both paths, the plain PyTorch expressions followed by the scatter and the fused custom op (its
PyTorch body here, forced on the CPU the way CUDA picks it), compiled with fullgraph under
inference mode as the engine runs them: q, K and V against float64, the cache written in place
(the same storage, no cache-sized buffer in the compiled code) and only at the step's slots, and
the path `store_path` picked for the pool is the one that runs.
"""

import random

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from flexsgl.cache.pool import KVPool
from flexsgl.cache.store import store_path
from flexsgl.kernels import rope_store
from flexsgl.model.config import ModelConfig
from flexsgl.model.decoder import Attention
from flexsgl.model.layers import RotaryEmbedding
from tests.test_rope_store import float64_reference

HQ, HKV, D, PAGES, PAGE = 4, 2, 16, 64, 16


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"], ids=["qk_norm", "no_norm"])
def test_store_path_writes_the_pool_in_place(monkeypatch, fused, arch):
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    monkeypatch.setattr(rope_store, "applies", lambda device, head_dim: fused)
    cfg = ModelConfig(arch, 100, 64, 128, 1, HQ, HKV, D, 1e-6, 1e6, 4096, False)
    attn = Attention(cfg, 0).requires_grad_(False)
    if attn.q_norm is not None:
        attn.q_norm.weight.uniform_(0.5, 1.5), attn.k_norm.weight.uniform_(0.5, 1.5)
    rope = RotaryEmbedding(D, 4096, 1e6, None)
    pool = KVPool(1, PAGES, PAGE, HKV, D, torch.float32, "cpu")
    pool.k[0].normal_(), pool.v[0].normal_()
    store, attn.cache = store_path(pool, HQ), pool.layer_cache(0)
    norms = () if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
    eps = 0.0 if attn.q_norm is None else attn.q_norm.eps
    before_k, before_v = pool.k[0].clone(), pool.v[0].clone()
    k_ptr, v_ptr = pool.k[0].data_ptr(), pool.v[0].data_ptr()
    t = 7
    qkv = torch.randn(t, (HQ + 2 * HKV) * D)
    positions = torch.randint(0, 4096, (t,))
    slots = torch.randperm(PAGES * PAGE)[:t]

    def step(qkv, positions, slots):
        return store.norm_rope_store(attn.cache, qkv, norms, eps, rope, positions, slots) * 2

    with torch.inference_mode():
        q2, codes = run_and_get_code(torch.compile(step, fullgraph=True), qkv, positions, slots)
    c = dict(qkv=qkv, q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
             k_norm=attn.k_norm.weight if attn.k_norm is not None else None, eps=1e-6, cos=rope.cos, sin=rope.sin,
             positions=positions, num_heads=HQ, k_cache=pool.k[0])
    ref_q, ref_k, ref_v = float64_reference(c)
    for name, ours, ref in (("q", q2 / 2, ref_q), ("k", pool.k[0][slots], ref_k), ("v", pool.v[0][slots], ref_v)):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}, seed={seed}: {m}")
    untouched = torch.ones(PAGES * PAGE, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool.k[0][untouched], before_k[untouched]), f"K written outside its slots (seed={seed})"
    assert torch.equal(pool.v[0][untouched], before_v[untouched]), f"V written outside its slots (seed={seed})"
    assert (pool.k[0].data_ptr(), pool.v[0].data_ptr()) == (k_ptr, v_ptr)
    code = "\n".join(codes)
    cache_shape = f"({PAGES * PAGE}, {HKV}, {D})"
    copies = [line for line in code.splitlines() if "empty_strided" in line and cache_shape in line]
    assert not copies, f"the compiled step copies the cache: {copies}"
    assert ("torch.ops.flexsgl.rope_store.default(" in code) == fused, "the other store path ran"
