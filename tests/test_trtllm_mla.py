"""trtllm-mla up to the kernel call, on the CPU: the TRT-LLM MLA decode kernel (SM100 only, and no
SM100 GPU is lent here) is replaced by a float64 implementation of its documented contract that
first checks every argument it receives (shapes, dtypes, strides, the block table's alignment, the
scale); the backend's output is then checked against dense attention over each request's latents."""

import random

import pytest
import torch

import flexsgl.overrides.trtllm_mla as trtllm_mla
from flexsgl.attention.base import ForwardBatch
from flexsgl.cache.latent_pool import LatentKVPool
from flexsgl.cache.pool import DUMMY_PAGE, KVPool, PageAllocator
from flexsgl.model.mla_config import MLAConfig

R, ROPE, NOPE, H = 512, 64, 128, 16  # DeepSeek-V2's latent sizes, the kernel's


class FakeKernel:
    """trtllm_batch_decode_with_kv_cache_mla's contract in float64, checking its arguments."""

    def __init__(self, pool: LatentKVPool, layer: int, fb: ForwardBatch):
        self.pool, self.layer, self.fb, self.calls = pool, layer, fb, 0

    def __call__(self, *, query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                 block_tables, seq_lens, max_seq_len, bmm1_scale, **rest):
        self.calls += 1
        pool, ps, b = self.pool, self.pool.page_size, self.fb.batch_size
        assert not rest, f"unexpected arguments {sorted(rest)}"
        assert (qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim) == (NOPE, R, ROPE)
        assert query.shape == (b, 1, H, R + ROPE) and query.dtype == torch.bfloat16 and query.is_contiguous()
        assert kv_cache.shape == (pool.num_pages, 1, ps, R + ROPE) and kv_cache.dtype == torch.bfloat16
        assert kv_cache.is_contiguous() and kv_cache.data_ptr() == pool.kv[self.layer].data_ptr()  # the pool, no copy
        assert block_tables.dtype == torch.int32 and block_tables.is_contiguous() and block_tables.shape[0] == b
        w = self.fb.page_table.shape[1]
        assert block_tables.shape[1] % (128 // ps) == 0 and block_tables.shape[1] >= w
        assert torch.equal(block_tables[:, :w], self.fb.page_table) and not block_tables[:, w:].any()
        assert seq_lens.dtype == torch.int32 and torch.equal(seq_lens, self.fb.seq_lens)
        assert max_seq_len == block_tables.shape[1] * ps >= int(seq_lens.max())
        assert bmm1_scale == pool.softmax_scale
        assert workspace_buffer.dtype == torch.uint8 and workspace_buffer.numel() >= 128 << 20
        assert not workspace_buffer.any(), "the workspace must start zeroed"
        out = torch.empty(b, 1, H, R, dtype=query.dtype)
        for i in range(b):
            n = int(seq_lens[i])
            slots = (block_tables[i].long()[:, None] * ps + torch.arange(ps)).reshape(-1)[:n]
            kv = kv_cache.view(-1, R + ROPE)[slots].double()
            p = (query[i, 0].double() @ kv.T * bmm1_scale).softmax(-1)
            out[i, 0] = (p @ kv[:, :R]).to(out.dtype)
        return out


@pytest.mark.parametrize("page_size", [32, 64])
def test_trtllm_mla_decode_up_to_the_kernel(monkeypatch, page_size):
    seed = random.randrange(1 << 30)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    mla = MLAConfig(kv_lora_rank=R, q_lora_rank=None, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=128,
                    softmax_scale=rng.uniform(0.05, 0.2))
    pool = LatentKVPool(2, 24, page_size, mla, torch.bfloat16, "cpu")
    alloc = PageAllocator(pool.num_pages, shuffle_seed=seed)
    lens = [1, page_size, page_size + 1, rng.randrange(2, 3 * page_size)]
    tables, dense = [], []
    for n in lens:  # each request's latents, written to its pages
        pages = alloc.alloc(KVPool.num_pages_for(n, page_size))
        latent = torch.randn(n, R + ROPE, generator=g).to(torch.bfloat16)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
        pool.store(1, latent, slots)
        tables.append(pages)
        dense.append(latent.double())
    pool.kv[0].normal_(generator=g)  # another layer's latents, which must not be read
    w = max(map(len, tables))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    fb = ForwardBatch(mode="decode", input_ids=torch.zeros(len(lens), dtype=torch.long),
                      positions=torch.tensor(lens) - 1, out_slots=torch.zeros(len(lens), dtype=torch.long),
                      page_table=i32([t + [DUMMY_PAGE] * (w - len(t)) for t in tables]), seq_lens=i32(lens),
                      q_lens=i32([1] * len(lens)), q_offsets=i32(list(range(len(lens)))),
                      logits_index=torch.arange(len(lens)), max_q_len=1, num_kv_pages=pool.num_pages)
    kernel = FakeKernel(pool, 1, fb)
    monkeypatch.setattr(trtllm_mla, "decode_kernel", lambda: kernel)
    backend = trtllm_mla.TrtllmMLABackend(pool, num_heads=H)
    backend.prepare(fb)
    q = torch.randn(len(lens), H, R + ROPE, generator=g).to(torch.bfloat16)
    out = backend.forward(q, pool.layer_cache(1), fb)
    assert kernel.calls == 1 and out.shape == (len(lens), H, R) and out.dtype == torch.bfloat16
    for i, latent in enumerate(dense):
        p = (q[i].double() @ latent.T * mla.softmax_scale).softmax(-1)
        torch.testing.assert_close(out[i].double(), p @ latent[:, :R], atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"request {i} (seed={seed}): {m}")


def test_trtllm_mla_refuses_prefill():
    mla = MLAConfig(R, None, NOPE, ROPE, 128, 0.1)
    backend = trtllm_mla.TrtllmMLABackend(LatentKVPool(1, 4, 64, mla, torch.bfloat16, "cpu"), num_heads=H)
    fb = ForwardBatch(mode="prefill", input_ids=None, positions=None, out_slots=None, page_table=None,
                      seq_lens=None, q_lens=None, q_offsets=None, logits_index=None, max_q_len=2, num_kv_pages=4)
    with pytest.raises(ValueError, match="trtllm-mla runs decode only"):
        backend.prepare(fb)
