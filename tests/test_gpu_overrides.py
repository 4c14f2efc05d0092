"""Kernel overrides on the GPU (device machine, `pytest -m gpu`; skipped without CUDA or the package).

1. Each override, flex and float64 attention on the same random paged batches (prefill with
   prefixes, decode, ragged lengths, mixed): bf16-level error against float64, the bound of
   tests/test_gpu.py (1e-2 absolute + relative), and against flex within twice that; at every other
   head dim the registry says an override takes, against float64.
2. Each override inside the compiled bf16 engine, decode replayed from CUDA graphs, against HF
   transformers (the check of tests/test_gpu.py, on a head_dim-128 checkpoint the kernels take).
3. Greedy tokens on a Qwen3-8B-shaped dummy model in float16, flex against each override (float16:
   in bf16, rounding noise amplified through 36 random layers exceeds most top-2 margins, so too
   few steps would be decisive to say anything). Rule: per request,
   walk the steps while the two runs have produced the same tokens so far; at each step the noise
   is the largest logit difference between the runs at that step, and the tokens must agree
   wherever flex's top-2 margin exceeds twice it. A disagreement below that margin is legitimate
   rounding noise and ends the comparison for that request (the contexts differ from there). At
   least a quarter of all steps must be decisive, so the check cannot pass vacuously.
"""

import gc
import random

import pytest
import torch

from flexsgl import LLM, SamplingParams
from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.attention.registry import SPECS, backend_class, why_not
from tests.hf_models import capture_logits
from tests.test_flex_attention import CASES, run_backend_case
from tests.test_gpu import check_engine_tracks_hf

pytestmark = pytest.mark.gpu

KERNEL_CASES = ([("fa3", c) for c in CASES] + [("fi", c) for c in CASES] + [("fi-decode", "decode")]
                + [("triton-decode", "decode")])


def skip_unless_runs(name: str) -> None:
    reason = why_not(SPECS[name], torch.device("cuda"))
    if reason:
        pytest.skip(f"{name}: {reason}")


@pytest.mark.parametrize("name,case", KERNEL_CASES)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("hq,hkv", [(16, 4), (16, 8)])  # 4 and 2 query heads per KV head (8B-like, 0.6B-like)
def test_override_matches_float64_and_flex(name, case, page_size, hq, hkv):
    skip_unless_runs(name)
    seed = random.randrange(1 << 30)
    shape = dict(hq=hq, hkv=hkv, d=128, seed=seed)
    ours = run_backend_case(CASES[case], page_size, None, "cuda", torch.bfloat16, rtol=1e-2, atol=1e-2,
                            backend_cls=backend_class(SPECS[name]), **shape)
    flex = run_backend_case(CASES[case], page_size, torch.compile(FlexAttentionBackend.forward, dynamic=False),
                            "cuda", torch.bfloat16, rtol=1e-2, atol=1e-2, compiled=True, **shape)
    torch.testing.assert_close(ours.float(), flex.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"seed={seed}: {m}")


OTHER_HEAD_DIMS = [(name, case, d) for name, case in KERNEL_CASES for d in SPECS[name].head_dims or () if d != 128]


@pytest.mark.parametrize("name,case,d", OTHER_HEAD_DIMS)
def test_override_matches_float64_at_every_head_dim_it_claims(name, case, d):
    """The head dims other than 128 that the registry says each override's kernels take, against float64
    attention at pages of 64, 4 query heads per KV head (the bound of the test above)."""
    reason = why_not(SPECS[name], torch.device("cuda"), head_dim=d)
    if reason:
        pytest.skip(f"{name}: {reason}")
    run_backend_case(CASES[case], 64, None, "cuda", torch.bfloat16, rtol=1e-2, atol=1e-2,
                     backend_cls=backend_class(SPECS[name]), hq=16, hkv=4, d=d)


def fp8_queries(q: torch.Tensor) -> torch.Tensor:
    """q rounded to FP8 at one scale (its absmax / 448), as FA3 rounds its queries over an FP8 cache."""
    scale = q.abs().max().float() / 448
    return (q.float() / scale).to(torch.float8_e4m3fn).double() * scale.double()


@pytest.mark.parametrize("name,case", KERNEL_CASES)
@pytest.mark.parametrize("page_size", [16, 64])
def test_override_reads_an_fp8_cache(name, case, page_size):
    """Over an FP8 pool (kv_cache_dtype fp8_e4m3), bfloat16 queries: each override against float64
    attention over the FP8 values, within 1e-2. FA3 takes FP8 queries there (rounded as fp8_queries
    does, in the reference too) and multiplies its probabilities by V in FP8: each probability off by
    up to 2^-4 of itself moves an output by up to 2^-4 of the largest |V| it attends, its bound
    beside 1e-2, while its mean error stays at bfloat16's level (a wrong page or scale is far off)."""
    skip_unless_runs(name)
    seed = random.randrange(1 << 30)
    fa3 = name == "fa3"
    run_backend_case(CASES[case], page_size, None, "cuda", torch.bfloat16, rtol=1e-2, atol=1e-2,
                     backend_cls=backend_class(SPECS[name]), hq=16, hkv=4, d=128, seed=seed,
                     kv_dtype=torch.float8_e4m3fn, query_rounding=fp8_queries if fa3 else None,
                     atol_of_v=2.0**-4 if fa3 else 0.0, mean_atol=1e-2 if fa3 else None)


@pytest.mark.parametrize("override", ["flex", "fa3", "fi", "fa3-prefill,fi-decode", "fa3-prefill,triton-decode",
                                      "fa3-prefill,fi-decode,triton-decode<=2"])  # graphs 1, 2: triton; 8: fi
def test_override_engine_tracks_hf(tmp_path, monkeypatch, override):
    for name in override.split(","):
        skip_unless_runs(name.partition("<=")[0])
    check_engine_tracks_hf(tmp_path, monkeypatch, "qwen3", 64, head_dim=128, override=override)


_FLEX_8B = {}  # seed -> the flex run, shared by the three overrides' tests


def run_8b(override: str, prompts, steps: int, monkeypatch):
    llm = LLM("qwen3-8b", load_format="dummy", device="cuda", dtype="float16", override=override,
              max_total_tokens=16384, page_size=64, compile=False, disable_cuda_graph=True, max_running_requests=16)
    with monkeypatch.context() as m:
        seen = capture_logits(llm, m)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=steps, temperature=0.0))
        logits = [torch.stack(seen[o.request_id]).float() for o in outs]
    tokens = [o.token_ids for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, logits


@pytest.mark.parametrize("override", ["fa3", "fi", "fa3-prefill,fi-decode", "fa3-prefill,triton-decode"])
def test_qwen3_8b_greedy_agrees_with_flex(monkeypatch, override):
    for name in override.split(","):
        skip_unless_runs(name)
    seed = _FLEX_8B.setdefault("seed", random.randrange(1 << 30))
    rng = random.Random(seed)
    prompts = [[rng.randrange(151000) for _ in range(n)] for n in (7, 130, 300, 513)]
    steps = 24
    if "flex" not in _FLEX_8B:
        _FLEX_8B["flex"] = run_8b("flex", prompts, steps, monkeypatch)
    ref_tokens, ref_logits = _FLEX_8B["flex"]
    tokens, logits = run_8b(override, prompts, steps, monkeypatch)
    decisive_steps = compared = 0
    for i in range(len(prompts)):
        for t in range(steps):
            ref = ref_logits[i][t]
            noise = (logits[i][t] - ref).abs()
            best = ref.argmax()
            # Decisive: no token's gap to flex's choice is within both logits' differences, so the
            # override's logits cannot rank any token above it.
            margin = ref[best] - ref
            margin[best] = float("inf")
            decisive = bool((margin > noise[best] + noise).all())
            compared += 1
            if decisive:
                decisive_steps += 1
                assert tokens[i][t] == ref_tokens[i][t], (
                    f"prompt {i} step {t}: {override} chose {tokens[i][t]}, flex {ref_tokens[i][t]}, and every "
                    f"token's margin exceeds the two backends' logit differences (seed={seed})")
            elif tokens[i][t] != ref_tokens[i][t]:
                break
    print(f"{override}: {decisive_steps} decisive of {compared} compared steps")
    assert decisive_steps >= 0.25 * len(prompts) * steps, (
        f"only {decisive_steps} of {compared} compared steps were decisive (seed={seed})")
