"""The KV pool's size, against hand-computed values: max_total_tokens when given; else what
max_running_requests requests at the model's context fill, in whole pages, and as much again for the
prefix cache, within what the device allows (on a GPU mem_fraction_static of the memory left after the
weights, less one step's activations; on the CPU 16384 tokens). The GPU's free memory is given, so
these run on the CPU."""

import dataclasses

import pytest
import torch

from flexsgl.cache import sizing
from flexsgl.config import EngineConfig
from flexsgl.model.source import resolve

TINY = resolve("tiny", "dummy").config  # vocab 512, hidden 128, MLP 256, 2 layers of 2 KV heads of 32 dims, context 4096
GPU, CPU = torch.device("cuda"), torch.device("cpu")
GiB = 1 << 30


def with_context(tokens: int):
    return dataclasses.replace(TINY, max_position=tokens)


def test_a_gpu_cache_takes_its_fraction_of_the_free_memory_less_a_steps_activations(monkeypatch):
    model = with_context(1 << 20)  # 4 requests of 1M tokens could fill more than the memory holds
    rc = EngineConfig(override="flex", max_num_batched_tokens=100, max_running_requests=4,
                      mem_fraction_static=0.5).resolve(model, GPU)
    assert rc.dtype == torch.bfloat16 and rc.max_total_tokens is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * GiB, 80 * GiB))
    # activations: 100 tokens x (2 x 256 + 4 x 128) x 2 bytes x 2 = 409600, logits 4 x 512 x 16 = 32768,
    # 1 GiB, and the prefill backend's 1000 bytes: 1074185192. A token's K and V: 2 x 2 layers x 2 heads
    # x 32 x 2 bytes = 512. (0.5 x 4 GiB - 1074185192) // 512 = 2096286 tokens: 32755 pages of 64, + the dummy page.
    size = sizing.kv_pool_size(rc, model, lambda tokens, itemsize: 1000 if (tokens, itemsize) == (100, 2) else 0)
    assert (size.pages, size.tokens) == (32756, 2096286)
    assert size.reason == ("what mem_fraction_static 0.5 of the 4.0 GiB free once the weights loaded holds, less "
                           "one step's activations; 4 running requests at the model's 1,048,576-token context "
                           "could fill 8,388,608")  # 4 x 16384 pages x 64 tokens x 2


def test_a_gpu_cache_stays_within_what_flexs_decode_kernel_reads_in_one_pass(monkeypatch):
    """The flex-decoding kernel's 32-bit offsets reach 2^31 - 1 elements of a layer's K (or V): TINY's
    2 heads x 32 dims make that 33,554,431 slots, fewer than 0.9 of 80 GiB holds at 512 bytes a
    token. The pool keeps to whole pages of them, its dummy page included: flex_ops reads it in one
    pass, and a page more in two."""
    from flexsgl.attention.flex_ops import shard_pages

    model = with_context(1 << 20)
    rc = EngineConfig(override="flex", max_running_requests=64, page_size=64,
                      mem_fraction_static=0.9).resolve(model, GPU)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * GiB, 80 * GiB))
    slots = rc.attention.max_pool_slots(model)
    assert slots == (2**31 - 1) // 64 == 33_554_431  # 524,287 whole pages of 64 and 63 slots
    size = sizing.kv_pool_size(rc, model, kernel_slots=slots)
    assert (size.tokens, size.pages) == (524_286 * 64, 524_287)  # with the dummy page
    held = sizing.kv_tokens_from_memory(rc, model, 80 * GiB, 2, 0)
    assert size.reason == (f"the most the decode kernel reads in one pass, where the memory holds {held:,} tokens; "
                           f"64 running "
                           f"requests at the model's 1,048,576-token context could fill 134,217,728")
    pool = torch.empty(size.pages * 64, 2, 32, device="meta")  # the pool as built: one kernel reads all of it
    assert shard_pages(pool, pool, 64) == size.pages
    bigger = torch.empty((size.pages + 1) * 64, 2, 32, device="meta")  # a page more: two kernels
    assert shard_pages(bigger, bigger, 64) < size.pages + 1


@pytest.mark.parametrize("context, page_size, running, pages", [
    (4096, 64, 4, 4 * 64 * 2),  # 64 pages a request, twice over
    (1000, 64, 3, 3 * 16 * 2),  # a request of 1000 tokens takes 16 whole pages of 64
    (1024, 64, 256, 256 * 16 * 2),  # the embedded model under a server's defaults: 524,288 tokens, 1 GiB
    (1024, 16, 1, 64 * 2),  # `generate` of one prompt
])
def test_a_gpu_cache_holds_what_the_running_requests_fill_and_as_much_again(monkeypatch, context, page_size,
                                                                           running, pages):
    model = with_context(context)
    rc = EngineConfig(override="flex", max_running_requests=running, page_size=page_size).resolve(model, GPU)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * GiB, 80 * GiB))  # room for far more
    size = sizing.kv_pool_size(rc, model)
    assert (size.pages, size.tokens) == (pages + 1, pages * page_size)
    fill = "fills" if running == 1 else "fill"
    assert size.reason == (f"what {running} running request{'s' * (running > 1)} at the model's {context:,}-token "
                           f"context {fill}, and as much again for the prefix cache")


def test_the_size_given_wins_over_what_the_requests_fill(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * GiB, 80 * GiB))
    rc = EngineConfig(override="flex", max_running_requests=1, max_total_tokens=100_000).resolve(TINY, GPU)
    assert (rc.max_total_tokens, rc.max_total_tokens_reason) == (100_000, "max_total_tokens, as given")
    size = sizing.kv_pool_size(rc, TINY)  # 1 request x 64 pages x 2 would be 8192 tokens
    assert (size.pages, size.tokens, size.reason) == (1563 + 1, 100_000, "max_total_tokens, as given")


@pytest.mark.parametrize("running, tokens, reason", [
    (1, 8192, "what 1 running request at the model's 4,096-token context fills, and as much again for the "
              "prefix cache"),  # 64 pages of 64, twice over
    (2, 16384, "what 2 running requests at the model's 4,096-token context fill, and as much again for the "
               "prefix cache"),
    (3, 16384, "flexsgl's CPU default; 3 running requests at the model's 4,096-token context could fill 24,576"),
])
def test_a_cpu_cache_is_resolved_before_loading_and_holds_at_most_16k_tokens(running, tokens, reason):
    rc = EngineConfig(max_running_requests=running).resolve(TINY, CPU)
    assert (rc.max_total_tokens, rc.max_total_tokens_reason) == (tokens, reason)
    assert sizing.kv_pool_size(rc, TINY) == sizing.KVPoolSize(tokens // 64 + 1, tokens, reason)


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
