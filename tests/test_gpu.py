"""GPU checks (run on the device machine with `pytest -m gpu`; skipped without CUDA).

bf16 bounds, and why:
- Attention kernel: inputs are rounded to bf16 before the float64 reference sees them, so the
  only error is the kernel's own: probabilities rounded to bf16 before P @ V (relative 2^-8 per
  term, averaging down over the keys) and the output rounded to bf16 (2^-9). Outputs are O(1),
  so 1e-2 absolute + 1e-2 relative holds with margin and still catches any masking mistake
  (a wrong visible set moves outputs by O(0.1-1)).
- Whole model: bf16 logits differ from float32 by the rounding of every activation. The yardstick
  is transformers' own bf16 run over the same tokens, and the error of a step is the largest
  logit difference from float32 there. Two bounds, one per kind of fault:
  - systematic precision loss: for each prompt, our mean error over its steps is at most 1.5x
    transformers' bf16 mean error over the same steps. The mean over 32 steps is stable (on the
    CPU, not compiled, ours/theirs is 0.7-1.0 over 42 prompts of 7 seeds), and masking mistakes
    move it far past 1.5x (a prefill mask that sees one token ahead: 1.9-5.7x per prompt; a decode
    mask that hides the current token or the first page: 5-120x). Where both errors are the rounding
    of the logits themselves, the ratio says nothing: the tiny preset's one-token prompt at one seed
    erred by 0.006 at every step against transformers' 0.004, both about an ulp of bf16 at its
    logits (1.65x compiled, 0.99x eager; its other prompts 0.86-1.03x, H200). So a mean error within
    2 ulp of bf16 at the steps' largest logits passes too;
  - a bad step: no step of any prompt is off by more than twice the worst step of transformers'
    bf16 over all prompts (or 2% of the logit scale, whichever is larger). The worst of one
    prompt's 32 steps is too noisy a yardstick: one step's error can be 2-4x the typical one
    when a sharp attention head amplifies bf16 rounding upstream of it, in ours and in theirs
    alike, so per prompt the ratio of worst steps ran from 0.4 to 2.4 on correct code.
  Greedy tokens must equal float32's argmax at every step where float32's top-2 margin is larger
  than twice our measured error there; below that margin bf16 noise may legitimately flip the choice.
"""

import random

import pytest
import torch
import transformers


from flexsgl import LLM, SamplingParams
from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.attention import flex_ops
from flexsgl.attention.flex_options import flash_prefill_runs
from flexsgl.model.presets import DEFAULT_MODEL, EMBEDDED, PRESETS
from tests.hf_models import capture_logits, make_checkpoint
from tests.test_flex_attention import CASES, GQA_RATIOS, HEAD_DIMS, TOLERANCE, run_backend_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "paged"])
def test_compiled_flex_bf16_matches_float64(case, page_size, packed):
    """Prefill over the step's K/V packed into rows (the engine's choice) and over the pages."""
    forward = torch.compile(FlexAttentionBackend.forward, dynamic=False)
    run_backend_case(CASES[case], page_size, forward, "cuda", torch.bfloat16, rtol=1e-2, atol=1e-2,
                     compiled=True, hq=8, hkv=2, d=64, packs_prefill=packed)


@pytest.mark.parametrize("case", ["ragged-prefill", "mixed", "decode"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("gqa", GQA_RATIOS)
def test_compiled_flex_on_every_served_shape(case, d, gqa):
    """Compiled flex (prefill in the model's graph, over the pages or, without cached prefixes, over
    the packed new K/V; decode through the flex_decode op) in bf16 on each head dim and GQA ratio
    flexsgl serves."""
    forward = torch.compile(FlexAttentionBackend.forward, dynamic=False)
    run_backend_case(CASES[case], 64, forward, "cuda", torch.bfloat16, *TOLERANCE[torch.bfloat16],
                     compiled=True, hq=2 * gqa, hkv=2, d=d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["ragged-prefill", "mixed", "decode"])
def test_compiled_flex_in_full_and_half_precision(case, dtype):
    forward = torch.compile(FlexAttentionBackend.forward, dynamic=False)
    run_backend_case(CASES[case], 64, forward, "cuda", dtype, *TOLERANCE[dtype], compiled=True, hq=8, hkv=2, d=64)


@pytest.mark.parametrize("full_blocks", [True, False], ids=["full", "partial"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_flex_decode_reads_a_large_pool_in_shards(monkeypatch, full_blocks, page_size):
    """A pool past what the flex-decoding kernel indexes is read a shard of pages at a time, the
    partial outputs merged by their log-sum-exp (flex_ops.py). The limit is lowered to 5 pages here,
    so the batch's shuffled pages spread over several shards, some holding none of a request's."""
    hkv, d = 2, 64
    monkeypatch.setattr(flex_ops, "MAX_KERNEL_ELEMENTS", 5 * page_size * hkv * d + 7)
    run_backend_case(CASES["decode"], page_size, FlexAttentionBackend.forward, "cuda", torch.bfloat16,
                     *TOLERANCE[torch.bfloat16], compiled=True, hq=8, hkv=hkv, d=d, full_blocks=full_blocks)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "paged"])
def test_flex_over_a_pool_past_2_31_elements(packed):
    """One layer's pool of 2**31 + 2**22 elements (8 KV heads x 128 dims, 4.3 GB each for K and V in bf16),
    the batch's pages shuffled across it: decode reads it in two shards; prefill's kernels (the step's
    K/V copied into rows, or the pages read in place) index it with 64 bits."""
    page_size = 64 if packed else 128
    pages = (2**31 + 2**22) // (8 * 128 * page_size)
    for case in ("decode", "prefix-extend"):
        run_backend_case(CASES[case], page_size, torch.compile(FlexAttentionBackend.forward, dynamic=False), "cuda",
                         torch.bfloat16, *TOLERANCE[torch.bfloat16], compiled=True, hq=32, hkv=8, d=128,
                         pool_pages=pages, packs_prefill=packed)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_bf16_engine_tracks_hf(tmp_path, monkeypatch, arch, page_size):
    check_engine_tracks_hf(tmp_path, monkeypatch, arch, page_size, override="flex")


def test_flash_prefill_engine_tracks_hf(tmp_path, monkeypatch):
    """Pages of 128 at head_dim 128 in bf16: prefill runs on FlexAttention's FLASH backend where
    flash-attn-4 is installed (tools/stage_flash.sh stages it for the GPU machine)."""
    if not flash_prefill_runs(128, 128, torch.bfloat16):
        pytest.skip("FlexAttention's FLASH backend does not run here (flash-attn-4 on SM90/SM100)")
    check_engine_tracks_hf(tmp_path, monkeypatch, "qwen3", 128, head_dim=128, override="flex")


def test_bf16_engine_at_batch_1_tracks_hf(tmp_path, monkeypatch):
    """One request at a time: decode replays the batch-1 graph, whose projections run the
    matrix-vector kernel (flexsgl/kernels/gemv.py) instead of cuBLAS."""
    check_engine_tracks_hf(tmp_path, monkeypatch, "qwen3", 64, override="flex", one_at_a_time=True)


def check_engine_tracks_hf(tmp_path, monkeypatch, arch, page_size, head_dim=16, one_at_a_time=False, **llm_kw):
    """The compiled bf16 engine, decode replayed from CUDA graphs, against HF float32 and bf16, on a
    tiny random checkpoint of `arch`."""
    seed = random.randrange(1 << 30)
    make_checkpoint(arch, tmp_path, seed, head_dim=head_dim)
    check_tracks_hf(str(tmp_path), monkeypatch, seed, page_size, one_at_a_time,
                    max_total_tokens=32768, cuda_graph_bs=[1, 2, 8], **llm_kw)


def check_tracks_hf(path, monkeypatch, seed, page_size, one_at_a_time=False, compiled=True, **llm_kw):
    """The bf16 engine on the HF checkpoint at `path` against transformers in float32 and bf16.
    one_at_a_time: run the prompts one after another (decode at batch 1) instead of together;
    compiled: whether the engine compiles where `compile` is not given. Returns the engine."""
    hf32, hf16 = (transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dt, experts_implementation="eager")
                  .cuda().eval() for dt in (torch.float32, torch.bfloat16))
    for hf in (hf32, hf16):  # the modeling code's own attention and experts (not grouped_mm's on a GPU)
        hf.config._attn_implementation = "eager"
        hf.config._experts_implementation = "eager"
    rng = random.Random(seed)
    prompts = [[rng.randrange(hf32.config.vocab_size) for _ in range(n)] for n in (1, 9, 64, 65, 200, 333)]
    steps = 32
    llm = LLM(path, device="cuda", dtype="bfloat16", page_size=page_size, **llm_kw)
    llm.allocator.shuffle(seed)
    graphs = sorted(llm_kw["cuda_graph_bs"]) if llm_kw.get("cuda_graph_bs") else []
    assert sorted(llm.runner.graphs.graphs if llm.runner.graphs else []) == graphs
    assert llm.compile == llm_kw.get("compile", compiled)
    seen = capture_logits(llm, monkeypatch)
    sp = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)  # a trained model stops early
    outs = [llm.generate(p, sp)[0] for p in prompts] if one_at_a_time else llm.generate(prompts, sp)
    decisive_steps, errs, their_errs, ulps, scale = 0, [], [], [], 0.0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert len(out.token_ids) == steps
        ids = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.no_grad():
            ref = hf32(ids).logits[0, len(prompt) - 1:-1].float()
            theirs = hf16(ids).logits[0, len(prompt) - 1:-1].float()
        ours = torch.stack(seen[out.request_id]).float()
        scale = max(scale, ref.abs().max().item())
        err = (ours - ref).abs().max(-1).values  # per step
        their_err = (theirs - ref).abs().max(-1).values
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().amax(-1))) - 7)  # bf16's at each step's largest logit
        # One prompt's 32 steps: within 2x transformers' own bf16 error (two roundings of the same sums in
        # other orders differ by more than 1.5x on some prompts: 1.62x and 1.72x seen); all prompts: 1.5x.
        assert err.mean() <= max(2 * their_err.mean(), 2 * ulp.mean()), (
            f"prompt {i}: mean error {err.mean():.3g} > 2 x transformers' bf16 {their_err.mean():.3g} and > 2 ulp "
            f"{2 * ulp.mean():.3g} (seed={seed})")
        errs.append(err)
        their_errs.append(their_err)
        ulps.append(ulp)
        top2 = ref.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 2 * err
        chosen = torch.tensor(out.token_ids, device="cuda")
        agree = chosen == ref.argmax(-1)
        assert agree[decisive].all(), f"prompt {i}: greedy token differs where the margin is decisive (seed={seed})"
        decisive_steps += int(decisive.sum())
    mean, their_mean, ulp_mean = (torch.cat(t).mean() for t in (errs, their_errs, ulps))
    assert mean <= max(1.5 * their_mean, 2 * ulp_mean), (
        f"mean error over every prompt {mean:.3g} > 1.5 x transformers' bf16 {their_mean:.3g} and > 2 ulp "
        f"{2 * ulp_mean:.3g} (seed={seed})")
    bound = max(2 * max(e.max().item() for e in their_errs), 0.02 * scale)
    for i, err in enumerate(errs):
        assert err.max().item() <= bound, (
            f"prompt {i}: error {err.max():.3g} at step {int(err.argmax())} > {bound:.3g} (seed={seed})")
    assert decisive_steps > 0.5 * steps * len(prompts), f"too few decisive steps to mean anything (seed={seed})"
    return llm


SMALL_MODES = {
    # not compiled, flex evaluates its mask densely over the pool: a small pool
    "eager": dict(compile=False, disable_cuda_graph=True, max_total_tokens=32768),
    "compiled": dict(disable_cuda_graph=True),
    "compiled+graphs": dict(cuda_graph_bs=[1, 2, 8]),
}


@pytest.mark.parametrize("mode", list(SMALL_MODES))
@pytest.mark.parametrize("model", ["embedded", "tiny"])
def test_small_models_through_flex_track_hf(tmp_path, monkeypatch, model, mode):
    """The embedded model (head_dim 64) and the tiny preset's shapes (head_dim 32) through flex,
    eager and compiled, with and without CUDA graphs; compiled runs size the pool by default: for
    these models more than one flex-decoding kernel indexes, so decode reads it in shards."""
    seed = random.randrange(1 << 30)
    if model == "embedded":
        path = str(EMBEDDED[DEFAULT_MODEL])
    else:
        torch.manual_seed(seed)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**PRESETS["tiny"]["config"]))
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        hf.save_pretrained(tmp_path)
        path = str(tmp_path)
    check_tracks_hf(path, monkeypatch, seed, 64, override="flex", **SMALL_MODES[mode])


@pytest.mark.parametrize("override", ["flex", "auto"])
def test_one_request_at_a_time_of_the_embedded_model_runs_uncompiled_in_graphs(tmp_path, monkeypatch, override):
    """`flexsgl generate`'s one prompt of the embedded model: compile left to its default is off
    (resolved_config.lone_small_run), decode replayed from CUDA graphs, through flex and through
    auto's kernels (fa3-prefill; triton-decode, or fi-decode where its kernel is compiled)."""
    seed = random.randrange(1 << 30)
    check_tracks_hf(str(EMBEDDED[DEFAULT_MODEL]), monkeypatch, seed, 64, compiled=False, override=override,
                    max_running_requests=1, cuda_graph_bs=[1])
