"""Attention variants on the GPU: every shipped variant and the two written in
tests/test_attention_variants.py, compiled, in bfloat16, with pages of 16 and 64, against float64
attention; decode replayed from a CUDA graph (its block mask rebuilt inside the graph); their prefill on
FlexAttention's FLASH backend where flash-attn-4 is installed (the default there). And whole
engines with a user's variants per layer, compiled with CUDA graphs, against transformers with those
variants written out in float64, and the families that need variants (Mistral, Gemma 2 and 3)
against transformers, their prefill on the Triton kernel and on FLASH."""

import random

import pytest
import torch

from flexsgl import LLM, SamplingParams
from flexsgl.attention.bound_variant import VariantSet
from flexsgl.attention.flash_mods import flash_miscompiles
from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.attention.flex_options import FLASH, FLASH_VARIANTS_ENV, flash_prefill_runs
from flexsgl.cache.pool import KVPool, PageAllocator
from tests.attention_reference import dense_variant_attention, random_paged_batch
from flexsgl.compile import settings
from tests.family_parity import STEPS, check_outputs, prompts_for, well_drawn
from tests.hf_models import capture_logits, make_checkpoint
from tests.test_attention_variants import CASES, HKV, HQ, LONG_PREFILL, PAST_WINDOW, REFERENCE, per_layer_variants
from tests.variant_hf import hf_with_variants
from tests.test_gemma import make_gemma2, make_gemma3
from tests.test_gpu import check_tracks_hf
from tests.test_mistral import make_mistral

pytestmark = pytest.mark.gpu
D = 64  # the references' heads (their sinks, slopes and temperatures are per head), a GPU's head size


def run_gpu_case(name, specs, page_size, graphed: bool, seed: int, packed: bool = True, head_dim: int = D,
                 flash: bool = False):
    """flash: prefill must run on FlexAttention's FLASH backend (the options the backend picks say so)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    variant, ref_visible, ref_score, sink = REFERENCE[name]
    dev = torch.device("cuda")
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, HKV, head_dim, torch.bfloat16, dev)
    pool.k[0].normal_(), pool.v[0].normal_()
    fb, q, k, v, dense = random_paged_batch(pool, PageAllocator(pages, shuffle_seed=seed), specs, HQ, dev,
                                            torch.bfloat16, rng)
    variants = VariantSet([variant], HQ, 0, HQ, slots=2 * len(specs), device=dev)
    bound = variants.layers[0]
    ctx = {"prompt_len": [rng.randrange(1, p + n + 1) for p, n in specs], "win": [rng.randrange(1, 49) for _ in specs]}
    for param in ("prompt_len", "win"):
        if param in variants.request_tensors:
            variants.request_tensors[param][fb.req_slots] = torch.tensor(ctx[param], dtype=torch.int32, device=dev)
    backend = FlexAttentionBackend(pool, num_heads=HQ, compiled=True, variants=variants)
    backend.packs_prefill = packed
    if flash:  # the options the step reads: a plain causal layer's are plain prefill's (flex.attention)
        if bound.plain:
            assert (backend.packed_kernel_options if packed else backend.kernel_options) == FLASH
        else:  # FLASH unless its code generator would get the mods wrong (flash_mods.py): then Triton's
            assert (backend.variant_options[bound.id][packed] == FLASH) == (flash_miscompiles(variant) is None)
    pool.store(0, k.to(dev, torch.bfloat16), v.to(dev, torch.bfloat16), fb.out_slots)
    qd = q.to(dev, torch.bfloat16)
    sink_t = bound.layer_sink(None)
    if graphed:  # as the graph manager runs it: bind, then the mask rebuilt inside the recorded step
        bs = fb.batch_size
        backend.init_graph_state(bs, fb.page_table.shape[1])
        backend.bind_graph(bs, fb)
        for _ in range(2):
            backend.graph_step(bs, fb)
            backend.forward(qd, pool.layer_cache(0), fb, bound, sink_t)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.graph_step(bs, fb)
            out = backend.forward(qd, pool.layer_cache(0), fb, bound, sink_t)
        out.zero_()
        graph.replay()
    else:
        backend.prepare(fb)
        assert (fb.attn.rows is None) == all(n > 512 for _, n in specs)  # long requests: the tokens as they come
        torch._dynamo.reset()
        with settings():  # as the engine's compiled steps run
            out = torch.compile(FlexAttentionBackend.forward, dynamic=True)(backend, qd, pool.layer_cache(0), fb,
                                                                           bound, sink_t)
    ref = dense_variant_attention(q, dense, specs, lambda i, h, qp, kv: ref_visible(i, h, qp, kv, ctx),
                                  None if ref_score is None else lambda s, i, h, qp, kv: ref_score(s, i, h, qp, kv, ctx),
                                  sink)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-2, atol=2e-2, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("name", list(REFERENCE))
@pytest.mark.parametrize("page_size", [16, 64])
def test_variant_decode_in_a_cuda_graph_matches_float64(name, page_size):
    run_gpu_case(name, CASES["decode"], page_size, graphed=True, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("name", list(REFERENCE))
@pytest.mark.parametrize("page_size,case,packed", [(16, "ragged-prefill", True), (64, "long-prefill", False)])
def test_variant_prefill_compiled_matches_float64(name, page_size, case, packed):
    """Each case compiles afresh (seconds on the GPU): short requests over the step's K/V packed into
    rows with pages of 16, each from a query block of its own; long ones over the pages with cached
    prefixes with pages of 64, the tokens as they come (flex_blocks.py)."""
    run_gpu_case(name, {**CASES, **LONG_PREFILL}[case], page_size, graphed=False, seed=random.randrange(1 << 30),
                 packed=packed)


@pytest.mark.parametrize("name", list(REFERENCE))
@pytest.mark.parametrize("page_size,case,packed", [(16, "long-prefill", True), (128, "prefix-extend", False)])
def test_variant_prefill_on_the_flash_backend_matches_float64(name, page_size, case, packed, monkeypatch):
    """Where prefill runs on FlexAttention's FLASH backend (flash-attn-4 installed; head_dim 128, bf16,
    KV blocks of 128: packed rows, or pages of 128), every variant's prefill runs there by default,
    compiled with dynamic shapes as the engine compiles it; but
    `user_head_temperature`, whose torch.where between constants FLASH computes wrongly, runs on the
    Triton kernel."""
    if not flash_prefill_runs(128, 128, torch.bfloat16):
        pytest.skip("FlexAttention's FLASH backend needs flash-attn-4 and an SM90 or SM100 GPU")
    monkeypatch.delenv(FLASH_VARIANTS_ENV, raising=False)
    run_gpu_case(name, {**CASES, **LONG_PREFILL}[case], page_size, graphed=False, seed=random.randrange(1 << 30),
                 packed=packed, head_dim=128, flash=True)


@pytest.mark.parametrize("name", ["sliding_window", "gemma_gpt_oss_like"])
@pytest.mark.parametrize("case", list(PAST_WINDOW))
@pytest.mark.parametrize("flash", [False, True], ids=["triton", "flash"])
def test_windowed_prefill_past_long_prefixes_matches_float64(name, case, flash, monkeypatch):
    """A window's packed rows start at the block each request's window reaches (flex_meta.py), past
    prefixes of up to 700 keys; on the Triton kernel and on FLASH (where flash-attn-4 runs)."""
    if flash and not flash_prefill_runs(128, 128, torch.bfloat16):
        pytest.skip("FlexAttention's FLASH backend needs flash-attn-4 and an SM90 or SM100 GPU")
    if flash:
        monkeypatch.delenv(FLASH_VARIANTS_ENV, raising=False)
    else:
        monkeypatch.setenv(FLASH_VARIANTS_ENV, "0")
    run_gpu_case(name, PAST_WINDOW[case], 16, graphed=False, seed=random.randrange(1 << 30), head_dim=128,
                 flash=flash)


@pytest.mark.parametrize("page_size", [16, 64])
def test_engine_with_variants_graphed_tracks_hf(tmp_path, monkeypatch, page_size):
    """A user's variants per layer (per_layer_variants: a window with a softcap, ALiBi, a per-head
    temperature) in a compiled float32 engine whose decode replays CUDA graphs, over a ragged batch
    beyond the window prefilled in chunks, against HF on the CPU with each layer's attention written
    out in float64 (tests/variant_hf.py): every step's logits within 1e-4 of HF's, 32 greedy tokens
    equal. (Mistral's own window, graphed, is test_family_engine_tracks_hf's.)"""
    engine, written = per_layer_variants(heads=4)
    make_hf = lambda path, seed: (make_checkpoint("qwen3", path, seed, head_dim=D),  # noqa: E731
                                  hf_with_variants(path, written))[1]
    hf, seed, prompts = well_drawn(tmp_path, make_hf, lambda rng, vocab: prompts_for(rng, vocab, 24),
                                   own_attention=False)
    llm = LLM(str(tmp_path), attention=engine, device="cuda", dtype="float32", page_size=page_size, compile=True,
              cuda_graph_bs=[1, 2, 4], max_num_batched_tokens=40, max_total_tokens=8192)
    assert sorted(llm.runner.graphs.graphs) == [1, 2, 4], f"seed={seed}"
    llm.allocator.shuffle(seed)
    seen = capture_logits(llm, monkeypatch)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=STEPS, temperature=0.0))
    check_outputs(hf, llm, seen, prompts, outs, seed, f"graphed, pages of {page_size}")


FAMILIES = {"mistral": make_mistral, "gemma2": make_gemma2, "gemma3": make_gemma3}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("flash", [False, True], ids=["triton", "flash"])
def test_family_engine_tracks_hf(tmp_path, monkeypatch, family, flash):
    """A family whose layers take attention variants (Mistral's window; Gemma 2's window and score
    softcap; Gemma 3's window and per-kind RoPE), head_dim 128, served as `flexsgl serve` serves it:
    bf16, compiled, decode replayed from CUDA graphs, against transformers in float32 and bf16. With
    flash, prefill runs its variants on FlexAttention's FLASH backend (the default, pages of 128);
    without, on the Triton kernel (FLEXSGL_FLASH_VARIANTS=0, pages of 16)."""
    if flash:
        if not flash_prefill_runs(128, 128, torch.bfloat16):
            pytest.skip("FlexAttention's FLASH backend needs flash-attn-4 and an SM90 or SM100 GPU")
        monkeypatch.delenv(FLASH_VARIANTS_ENV, raising=False)
    else:
        monkeypatch.setenv(FLASH_VARIANTS_ENV, "0")
    seed = random.randrange(1 << 30)
    FAMILIES[family](tmp_path, seed, head_dim=128)
    llm = check_tracks_hf(str(tmp_path), monkeypatch, seed, 128 if flash else 16, max_total_tokens=32768,
                          cuda_graph_bs=[1, 2, 8], override="flex")
    assert llm.runner.backends.prefill.flash_variants == flash, f"seed={seed}"


FA3_VARIANTS = ["causal", "sliding_window", "softcap", "attention_sinks", "gemma_gpt_oss_like"]


@pytest.mark.parametrize("name", FA3_VARIANTS)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("case", ["ragged-prefill", "prefix-extend", "decode"])
def test_fa3_runs_the_variants_it_declares(name, page_size, case):
    """FA3 (sgl_kernel) takes the window, softcap and sinks of a variant as its own arguments: against
    the same float64 reference flex is checked with."""
    pytest.importorskip("sgl_kernel")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA3 runs on SM90")
    from flexsgl.overrides.fa3 import FA3Backend

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    variant, ref_visible, ref_score, sink = REFERENCE[name]
    dev, specs = torch.device("cuda"), CASES[case]
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, HKV, D, torch.bfloat16, dev)
    fb, q, k, v, dense = random_paged_batch(pool, PageAllocator(pages, shuffle_seed=seed), specs, HQ, dev,
                                            torch.bfloat16, rng)
    bound = VariantSet([variant], HQ, 0, HQ, slots=2 * len(specs), device=dev).layers[0]
    backend = FA3Backend(pool, num_heads=HQ)
    pool.store(0, k.to(dev, torch.bfloat16), v.to(dev, torch.bfloat16), fb.out_slots)
    backend.prepare(fb)
    out = backend.forward(q.to(dev, torch.bfloat16), pool.layer_cache(0), fb, bound, bound.layer_sink(None))
    ref = dense_variant_attention(q, dense, specs, lambda i, h, qp, kv: ref_visible(i, h, qp, kv, {}),
                                  None if ref_score is None else lambda s, i, h, qp, kv: ref_score(s, i, h, qp, kv, {}),
                                  sink)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-2, atol=2e-2, msg=lambda m: f"seed={seed}: {m}")
