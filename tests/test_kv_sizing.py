"""The KV pool's size: the one the config resolved to, or on a GPU what the memory left after the
weights allows (mem_fraction_static of it, less one step's activations), against hand-computed values.
The GPU's free memory is given, so these run on the CPU."""

import pytest
import torch

from flexsgl.cache import sizing
from flexsgl.config import EngineConfig
from flexsgl.model.source import resolve

TINY = resolve("tiny", "dummy").config  # vocab 512, hidden 128, MLP 256, 2 layers of 2 KV heads of 32 dims
GiB = 1 << 30


def test_a_gpu_cache_takes_its_fraction_of_the_free_memory_less_a_steps_activations(monkeypatch):
    rc = EngineConfig(override="flex", max_num_batched_tokens=100, max_running_requests=4,
                      mem_fraction_static=0.5).resolve(TINY, torch.device("cuda"))
    assert rc.dtype == torch.bfloat16 and rc.max_total_tokens is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * GiB, 80 * GiB))
    # activations: 100 tokens x (2 x 256 + 4 x 128) x 2 bytes x 2 = 409600, logits 4 x 512 x 16 = 32768,
    # 1 GiB, and the prefill backend's 1000 bytes: 1074185192. A token's K and V: 2 x 2 layers x 2 heads
    # x 32 x 2 bytes = 512. (0.5 x 4 GiB - 1074185192) // 512 = 2096286 tokens: 32755 pages of 64, + the dummy page.
    assert sizing.kv_cache_pages(rc, TINY, lambda tokens, itemsize: 1000 if (tokens, itemsize) == (100, 2) else 0) \
        == 32756


def test_too_little_gpu_memory_for_a_page_is_refused(monkeypatch):
    rc = EngineConfig(override="flex").resolve(TINY, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (GiB, 80 * GiB))  # less than a step's activations
    with pytest.raises(ValueError, match=r"^The KV cache must hold at least one page \(64 tokens\); it would hold 0\.$"):
        sizing.kv_cache_pages(rc, TINY)


def test_the_size_asked_for_is_kept_and_refused_beyond_free_memory(monkeypatch):
    rc = EngineConfig(max_total_tokens=1000, page_size=64).resolve(TINY, torch.device("cpu"))
    assert sizing.kv_cache_pages(rc, TINY) == 17  # ceil(1000 / 64) pages + the dummy page
    rc = EngineConfig(max_total_tokens=1 << 21).resolve(TINY, torch.device("cpu"))
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: GiB)
    # (2**21 / 64 + 1) pages x 64 tokens x 1024 bytes (float32 K and V) = 2.0 GiB
    with pytest.raises(ValueError, match=r"^A KV cache of 2097152 tokens needs 2\.0 GiB, and the cpu has 1\.0 GiB "
                                         r"free; lower max_total_tokens\.$"):
        sizing.kv_cache_pages(rc, TINY)
