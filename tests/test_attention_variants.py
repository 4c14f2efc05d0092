"""Attention variants on flex, over random paged layouts, against float64 attention that applies each
variant's definition written out independently here (logical positions, no pages).

Every shipped variant and two variants written here as a user would write them run eager (the dense
mask and, for score mods and sinks, the scores written out) and compiled (flex's BlockMask with the
variant's blocks: pages outside a window are never listed) on the CPU."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from flexsgl.attention import flex_blocks, flex_meta
from flexsgl.attention.bound_variant import PROMPT_LEN, VariantSet
from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.attention.flex_masks import Q_BLOCK
from flexsgl.attention.request_variants import RequestVariants
from flexsgl.attention.variant import AttentionVariant, PerHead, PerRequest, VariantError, check
from flexsgl.attention import variants as V
from flexsgl.cache.pool import KVPool, PageAllocator
from flexsgl.compile import settings
from tests.attention_reference import dense_variant_attention, random_paged_batch

HQ, HKV, D = 4, 2, 16
CASES = {
    "ragged-prefill": [(0, 37), (0, 5), (0, 130), (0, 64)],
    "prefix-extend": [(64, 40), (13, 1), (100, 77), (7, 150)],
    "decode": [(0 + n, 1) for n in (1, 63, 64, 65, 200, 17)],
    "mixed": [(90, 1), (0, 70), (33, 12), (129, 1)],
}
# Long requests, two to a query block at most: compiled prefill takes the tokens as they come
# (flex_blocks.py), where CASES' short ones start a block each.
LONG_PREFILL = {"long-prefill": [(0, 530), (45, 600), (0, 520), (70, 560)]}
# Prefixes whose early 128-row blocks lie wholly behind a window of 24: a windowed variant's packed
# rows leave them out. Short requests (a block each), and long ones as they come (shared blocks).
PAST_WINDOW = {"past-window": [(300, 40), (13, 1), (700, 130), (260, 150), (0, 60)],
               "long-past-window": [(300, 530), (645, 600), (0, 520), (470, 560)]}


def _causal(q, kv):
    return kv <= q


def user_local_window():
    """A user's variant: a per-request window (at most 48), and a mask that also drops every third key
    older than 8 positions."""
    def mask(b, h, q_pos, kv_pos, p):
        return (q_pos - kv_pos < p.win[b]) & (((q_pos - kv_pos) < 8) | (kv_pos % 3 != 1))

    return AttentionVariant("user_local_window", mask_mod=mask, window=48, params={"win": PerRequest(48)})


def user_head_temperature():
    """A user's variant: each head's scores divided by its own temperature, and a bias that favours
    the first token of the sequence."""
    def score(s, b, h, q_pos, kv_pos, p):
        return s / p.temp[h] + torch.where(kv_pos == 0, 1.5, 0.0)

    return AttentionVariant("user_head_temperature", score_mod=score,
                            params={"temp": PerHead(lambda n: torch.linspace(0.5, 2.0, n))})


# name -> (variant, reference visible(i, h, q, kv, ctx), reference score(s, i, h, q, kv, ctx) or None,
# sink [Hq] or None). ctx holds the per-request values the test writes (prompt lengths, windows).
SINK = torch.tensor([0.5, -1.0, 2.0, 0.0])


def written_slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes for a power of two of heads, written out: 2^(-8 (h + 1) / heads)."""
    return torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64)


def written_temperatures(heads: int) -> torch.Tensor:
    """user_head_temperature's temperatures, written out."""
    return torch.linspace(0.5, 2.0, heads, dtype=torch.float64)


def _reference_cases():
    slopes, temps = written_slopes(HQ), written_temperatures(HQ)
    return {
        "causal": (V.causal(), lambda i, h, q, kv, c: _causal(q, kv), None, None),
        "sliding_window": (V.sliding_window(20), lambda i, h, q, kv, c: _causal(q, kv) & (q - kv < 20), None, None),
        "softcap": (V.softcap(5.0), lambda i, h, q, kv, c: _causal(q, kv),
                    lambda s, i, h, q, kv, c: 5.0 * torch.tanh(s / 5.0), None),
        "attention_sinks": (AttentionVariant("sinks", sink=PerHead(SINK)),
                            lambda i, h, q, kv, c: _causal(q, kv), None, SINK),
        "alibi": (V.alibi(), lambda i, h, q, kv, c: _causal(q, kv),
                  lambda s, i, h, q, kv, c: s - slopes[h] * (q - kv), None),
        "chunked_local": (V.chunked_local(16), lambda i, h, q, kv, c: _causal(q, kv) & (q // 16 == kv // 16),
                          None, None),
        "prefix_lm": (V.prefix_lm(), lambda i, h, q, kv, c: _causal(q, kv) | (kv < c["prompt_len"][i]), None, None),
        # a variant without a mask_mod leaves the other's causal=False standing
        "softcap_and_prefix_lm": (V.softcap(5.0) & V.prefix_lm(),
                                  lambda i, h, q, kv, c: _causal(q, kv) | (kv < c["prompt_len"][i]),
                                  lambda s, i, h, q, kv, c: 5.0 * torch.tanh(s / 5.0), None),
        "user_local_window": (user_local_window(),
                              lambda i, h, q, kv, c: _causal(q, kv) & (q - kv < c["win"][i])
                              & ((q - kv < 8) | (kv % 3 != 1)), None, None),
        "user_head_temperature": (user_head_temperature(), lambda i, h, q, kv, c: _causal(q, kv),
                                  lambda s, i, h, q, kv, c: s / temps[h] + torch.where(kv == 0, 1.5, 0.0), None),
        "gemma_gpt_oss_like": (V.sliding_window(24) & V.softcap(10.0) & AttentionVariant("sinks", sink=PerHead(SINK)),
                               lambda i, h, q, kv, c: _causal(q, kv) & (q - kv < 24),
                               lambda s, i, h, q, kv, c: 10.0 * torch.tanh(s / 10.0), SINK),
    }


REFERENCE = _reference_cases()


def run_variant_case(name, specs, page_size, compiled=False, packs_prefill=True, seed=None, decode_full=True,
                     flash_lists=False):
    """flash_lists: block lists as for the FLASH backend (empty full-block lists, not none)."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    torch.manual_seed(seed)
    variant, ref_visible, ref_score, sink = REFERENCE[name]
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, HKV, D, torch.float32, "cpu")
    pool.k[0].normal_(), pool.v[0].normal_()  # stale slots would show if the mask let them through
    fb, q, k, v, dense = random_paged_batch(pool, PageAllocator(pages, shuffle_seed=seed), specs, HQ, "cpu",
                                            torch.float32, rng)
    variants = VariantSet([variant], HQ, 0, HQ, slots=2 * len(specs), device=torch.device("cpu"))
    bound = variants.layers[0]
    ctx = {"prompt_len": [rng.randrange(1, p + n + 1) for p, n in specs],
           "win": [rng.randrange(1, 49) for _ in specs]}
    for param in ("prompt_len", "win"):
        if param in variants.request_tensors:
            variants.request_tensors[param][fb.req_slots] = torch.tensor(ctx[param], dtype=torch.int32)
    if PROMPT_LEN in variants.request_tensors:  # every row a prompt row here: no output recomputed
        variants.request_tensors[PROMPT_LEN][fb.req_slots] = torch.tensor([p + n for p, n in specs], dtype=torch.int32)
    backend = FlexAttentionBackend(pool, num_heads=HQ, compiled=compiled, variants=variants)
    backend.packs_prefill = packs_prefill
    if not decode_full:
        backend.decode_full_blocks = lambda batch: False
    backend.flash_variants = flash_lists
    backend.prepare(fb)
    if flash_lists:
        assert not fb.attn.variants[bound.id].block_mask.full_kv_num_blocks.any(), "a mask_mod decides every block"
    pool.store(0, k.float(), v.float(), fb.out_slots)
    forward = FlexAttentionBackend.forward
    if compiled:
        torch._dynamo.reset()
        forward = torch.compile(forward, dynamic=False)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=compiled):
        out = forward(backend, q.float(), pool.layer_cache(0), fb, bound, bound.layer_sink(None))
    ref = dense_variant_attention(q, dense, specs, lambda i, h, qp, kv: ref_visible(i, h, qp, kv, ctx),
                                  None if ref_score is None else lambda s, i, h, qp, kv: ref_score(s, i, h, qp, kv, ctx),
                                  sink)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")
    return backend, fb


@pytest.mark.parametrize("name", list(REFERENCE))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_variant_eager_matches_float64(name, case, page_size):
    run_variant_case(name, CASES[case], page_size)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("score", [False, True], ids=["sdpa", "scores-written-out"])
def test_a_mask_that_reads_the_head_runs_uncompiled(monkeypatch, case, score):
    """The uncompiled path's dense mask, per head where the mask reads h (built once for all heads,
    it failed every request: h was None), alone (SDPA) and beside a score_mod, against float64; a
    PerHead value read in the mask too."""
    widths = PerHead(torch.tensor([2, 7, 30, 1000]))
    variant = AttentionVariant("head_mask", mask_mod=lambda b, h, q, kv, p: (h % 2 == 0) | (q - kv < p.w[h]),
                               score_mod=(lambda s, b, h, q, kv: s * 0.5) if score else None, params={"w": widths})
    ref_visible = lambda i, h, q, kv, c: _causal(q, kv) & ((h % 2 == 0) | (q - kv < widths.values[h]))  # noqa: E731
    monkeypatch.setitem(REFERENCE, "head_mask", (variant, ref_visible,
                                                 (lambda s, i, h, q, kv, c: s * 0.5) if score else None, None))
    run_variant_case("head_mask", CASES[case], 16)


# Each compile costs seconds on the CPU: one case per layout, covering every kind of mod between them.
@pytest.mark.parametrize("name,case,packed", [
    ("gemma_gpt_oss_like", "ragged-prefill", True),  # window, score_mod, sink; prefill over packed rows
    ("alibi", "mixed", True),  # a per-head parameter in a score_mod
    ("prefix_lm", "prefix-extend", False),  # keys after the query; prefill over the pages
    ("user_local_window", "decode", False),  # a per-request parameter in a user's mask; decode
    ("gemma_gpt_oss_like", "long-prefill", False),  # the tokens as they come, over the pages
    ("prefix_lm", "long-prefill", True),  # the tokens as they come, keys after the query, packed rows
])
def test_variant_compiled_matches_float64(name, case, packed):
    _, fb = run_variant_case(name, {**CASES, **LONG_PREFILL}[case], 16, compiled=True, packs_prefill=packed)
    assert (fb.attn.rows is None) == (case in LONG_PREFILL)


@pytest.mark.parametrize("case", list(PAST_WINDOW))
@pytest.mark.parametrize("flash_lists", [False, True], ids=["full-lists", "flash-lists"])
def test_windowed_prefill_packs_only_what_the_window_reaches(case, flash_lists):
    """Compiled prefill over packed rows: a window of 24 keys copies each request's K/V from the
    128-row block holding its first query's first visible key on (hand-counted here), where plain
    causal attention copies every position; attention as float64's."""
    specs = PAST_WINDOW[case]
    backend, fb = run_variant_case("gemma_gpt_oss_like", specs, 16, compiled=True, flash_lists=flash_lists)
    blocks = lambda n: -(-n // 128)  # noqa: E731
    windowed = fb.attn.variants[backend.variants[0].id].kv_rows
    assert windowed.numel() == 128 * sum(blocks(p + n) - max(p - 23, 0) // 128 for p, n in specs)
    assert fb.attn.kv_rows.numel() == 128 * sum(blocks(p + n) for p, n in specs)


@pytest.mark.parametrize("name,case,packed", [("prefix_lm", "prefix-extend", False),
                                               ("user_local_window", "ragged-prefill", True),
                                               ("user_local_window", "long-prefill", True)])
def test_variant_with_empty_full_block_lists_matches_float64(name, case, packed):
    """A variant whose mask_mod decides every block, its prefill's block lists as the FLASH backend takes
    them (an empty full-block list beside the partial one): compiled, the same attention."""
    run_variant_case(name, {**CASES, **LONG_PREFILL}[case], 16, compiled=True, packs_prefill=packed, flash_lists=True)


@pytest.mark.parametrize("page_size", [16, 64])
def test_windowed_decode_lists_only_pages_in_the_window(page_size):
    """Compiled decode's BlockMask for a window of W keys lists exactly the pages holding the last W
    positions (at most ceil(W / page_size) + 1), whatever the context; plain causal lists them all."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(rng.randrange(1, 3000), 1) for _ in range(5)]
    window = rng.randrange(1, 200)
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, HKV, D, torch.float32, "cpu")
    fb, *_ = random_paged_batch(pool, PageAllocator(pages, shuffle_seed=seed), specs, HQ, "cpu", torch.float32, rng)
    variants = VariantSet([V.sliding_window(window)], HQ, 0, HQ, slots=2 * len(specs), device=torch.device("cpu"))
    for full in (True, False):
        backend = FlexAttentionBackend(pool, num_heads=HQ, compiled=True, variants=variants)
        backend.decode_full_blocks = lambda batch: full
        meta = backend.metadata(fb)
        bm = meta.variants[variants.layers[0].id].block_mask
        for b, (prefix, _) in enumerate(specs):
            last = prefix
            want = {int(fb.page_table[b, j]) for j in range(max(0, last - window + 1) // page_size,
                                                             last // page_size + 1)}
            listed = set(bm.kv_indices[b, 0, 0, :bm.kv_num_blocks[b, 0, 0]].tolist())
            if full:
                listed |= set(bm.full_kv_indices[b, 0, 0, :bm.full_kv_num_blocks[b, 0, 0]].tolist())
            assert listed == want and len(want) <= -(-window // page_size) + 1, f"seed={seed}: request {b}"
        plain = meta.block_mask
        n_plain = (plain.kv_num_blocks + (plain.full_kv_num_blocks if full else 0))[:, 0, 0].tolist()
        assert n_plain == [-(-(p + 1) // page_size) for p, _ in specs], f"seed={seed}"


def test_windowed_prefill_packs_where_plain_causal_reads_the_pages(monkeypatch):
    """A step whose prefixes hold more than PACKED_PREFIX_MAX_TOKENS (lowered here) rows to copy:
    plain causal attention reads the pages, a window of 24, whose rows copy only what it reaches, packs
    them; attention as float64's."""
    monkeypatch.setattr(flex_meta, "PACKED_PREFIX_MAX_TOKENS", 512)
    specs = PAST_WINDOW["past-window"]
    assert sum(p for p, _ in specs) > 512 >= sum(p - max(p - 23, 0) // 128 * 128 for p, _ in specs)
    backend, fb = run_variant_case("gemma_gpt_oss_like", specs, 16, compiled=True)
    assert fb.attn.kv_rows is None and fb.attn.variants[backend.variants[0].id].kv_rows is not None


@pytest.mark.parametrize("window", [None, 32, 1024, 4096])
def test_prefill_layout_follows_each_variants_window(window):
    """Compiled prefill lays a step's queries out per variant (flex_blocks.rows_as_they_come): the
    tokens as they come, unless a block two requests share would list at least MAX_SHARED_GROWTH
    times, and MIN_SHARED_EXTRA KV blocks more than, the heaviest block with a block per request.
    Both layouts' BlockMasks are built here and their heaviest lists read; each variant's layout,
    and plain causal attention's beside it, is the one that comparison asks for. Long windows past
    long prefixes (4,096) always ask for a block per request, short ones (32, 1,024) never."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(rng.randrange(4200, 6000), rng.randrange(520, 700)) for _ in range(3)]
    page_size = 64
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, HKV, D, torch.float32, "cpu")
    fb, *_ = random_paged_batch(pool, PageAllocator(pages, shuffle_seed=seed), specs, HQ, "cpu", torch.float32, rng)
    per_layer = [None] if window is None else [None, V.sliding_window(window)]
    variants = VariantSet(per_layer, HQ, 0, HQ, slots=2 * len(specs), device=torch.device("cpu"))
    backend = FlexAttentionBackend(pool, num_heads=HQ, compiled=True, variants=variants)
    meta = backend.metadata(fb)
    bound = variants.layers[-1]
    chosen = meta if bound is None else meta.variants[bound.id]

    def far_heavier(layer_bound) -> tuple[bool, int, int]:
        """Whether the tokens as they come read far more in their heaviest block (the two BlockMasks')."""
        def heaviest(as_they_come: bool) -> int:
            qr = flex_blocks.query_rows(fb, Q_BLOCK, as_they_come)
            bm = backend._prefill_meta(fb, False, layer_bound, qr=qr).block_mask
            return int((bm.kv_num_blocks + bm.full_kv_num_blocks).max())
        come, own = heaviest(True), heaviest(False)
        return come >= flex_blocks.MAX_SHARED_GROWTH * own and come - own >= flex_blocks.MIN_SHARED_EXTRA, come, own

    heavier, come, own = far_heavier(bound)
    assert (chosen.rows is None) == (not heavier), f"seed={seed}: {come} against {own} KV blocks"
    if window is not None:
        assert (chosen.rows is None) == (window < 4096), f"seed={seed}: {come} against {own} KV blocks"
        plain_heavier, come, own = far_heavier(None)
        assert (meta.rows is None) == (not plain_heavier), f"seed={seed}: causal, {come} against {own} KV blocks"


def _mod_scalar_symbols(gm: torch.fx.GraphModule, shape_env) -> list[str]:
    """The symbols among the captured values of each flex_attention call's score_mod and mask_mod in
    `gm` that stand for no tensor's size or stride: what FlexAttention's FLASH lowering refuses in a
    mod (has_unsupported_captured_scalars, torch/_inductor/kernel/flex/flex_flash_attention.py)."""
    from torch._dynamo.source import TensorPropertySource

    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "flex_attention" in str(n.target)]
    assert calls, "no flex_attention call in the compiled graph"
    out = []
    for node in calls:
        for captured in node.args[7] + node.args[8]:  # score_mod's, then mask_mod's other buffers
            value = captured.meta.get("example_value") if isinstance(captured, torch.fx.Node) else captured
            if isinstance(value, torch.SymInt | torch.SymFloat):
                out += [f"{sym} ({[s.name for s in shape_env.var_to_sources.get(sym, [])]})"
                        for sym in value.node.expr.free_symbols
                        if not any(isinstance(s, TensorPropertySource) for s in shape_env.var_to_sources.get(sym, []))]
    return out


# The shipped variants with Python integers in them (a window, a chunk size), and a float beside one.
INT_VARIANTS = {"sliding_window": V.sliding_window(20), "chunked_local": V.chunked_local(16),
                "window_and_softcap": V.sliding_window(24) & V.softcap(10.0), "user_local_window": user_local_window()}


@pytest.mark.parametrize("name", list(INT_VARIANTS))
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("rows", ["as-they-come", "a-block-each"])
def test_variant_constants_stay_static_in_the_dynamic_prefill_compile(name, packed, rows):
    """Prefill compiled with dynamic shapes, as the engine compiles it on CUDA, with the variant handed
    to the compiled function as an argument (where dynamo makes a Python int symbolic unless it is
    reached through an nn.Module): the variant's mods capture no symbol but tensor sizes, so the
    FLASH lowering can take them, and a second prefill of other lengths runs the same graph. Each
    query layout (flex_blocks.query_rows) is a graph of its own: long requests' tokens as they come,
    or short ones each from a query block of its own."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    variant = INT_VARIANTS[name]
    lengths = (520, 700) if rows == "as-they-come" else (3, 40)
    batches = [[(0 if packed else rng.randrange(1, 100), rng.randrange(*lengths)) for _ in range(rng.randrange(3, 5))]
               for _ in range(2)]
    pages = sum(KVPool.num_pages_for(p + n, 16) for specs in batches for p, n in specs) + 5
    pool = KVPool(1, pages, 16, HKV, D, torch.float32, "cpu")
    alloc = PageAllocator(pages, shuffle_seed=seed)
    variants = VariantSet([variant], HQ, 0, HQ, slots=8, device=torch.device("cpu"))
    bound = variants.layers[0]
    backend = FlexAttentionBackend(pool, num_heads=HQ, compiled=True, variants=variants)
    backend.packs_prefill = packed
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, torch._guards.TracingContext.get().fake_mode.shape_env))
        return gm.forward

    torch._dynamo.reset()
    forward = torch.compile(FlexAttentionBackend.forward, dynamic=True, backend=capture)
    for specs in batches:
        fb, q, *_ = random_paged_batch(pool, alloc, specs, HQ, "cpu", torch.float32, rng)
        backend.prepare(fb)
        assert (fb.attn.variants[bound.id].kv_rows is not None) == packed, f"seed={seed}"
        assert (fb.attn.variants[bound.id].rows is None) == (rows == "as-they-come"), f"seed={seed}"
        with settings():
            forward(backend, q.float(), pool.layer_cache(0), fb, bound, bound.layer_sink(None))
    assert len(graphs) == 1, f"seed={seed}: {len(graphs)} compiles for two prefills of other lengths"
    assert _mod_scalar_symbols(*graphs[0]) == [], f"seed={seed}"


def test_bad_variants_are_refused_in_one_sentence():
    with pytest.raises(VariantError, match="takes 3 arguments"):
        AttentionVariant("bad", mask_mod=lambda b, h, q: q > 0)
    with pytest.raises(VariantError, match="window must be a positive"):
        AttentionVariant("bad", window=0)

    def data_dependent(b, h, q_pos, kv_pos):  # a shape that depends on the values: vmap refuses it
        return (kv_pos[kv_pos <= q_pos] >= 0).any()

    with pytest.raises(VariantError, match="cannot run as FlexAttention mods"):
        check(AttentionVariant("bad", mask_mod=data_dependent))
    with pytest.raises(VariantError, match="must return a bool"):
        check(AttentionVariant("bad", mask_mod=lambda b, h, q, kv: q - kv))
    with pytest.raises(VariantError, match="both set a sink"):
        AttentionVariant("a", sink="sinks") & AttentionVariant("b", sink="sinks")
    with pytest.raises(VariantError, match="Unknown attention variant"):
        V.resolve("no_such_variant")


def test_variants_resolve_from_their_names():
    v = V.resolve("sliding_window:window=4096")
    assert v.window == 4096 and v.features() == {"window": 4096}
    assert V.resolve("softcap:cap=30").features() == {"softcap": 30.0}
    assert V.resolve("alibi").features() is None  # flex only
    both = V.resolve("sliding_window:window=8") & V.resolve("softcap:cap=2.5")
    assert both.features() == {"window": 8, "softcap": 2.5}
    assert V.resolve("tests.test_attention_variants:user_local_window").name == "user_local_window"


def test_flash_log_sum_exp_scale_follows_torchs_own():
    """flex.FLASH_LSE_SCALE undoes what this torch's flex_attention does to the FLASH backend's
    log-sum-exp (sinks use it): before 2.13 it scales every backend's by ln 2, since then only the
    base-2 ones'."""
    import inspect

    from torch.nn.attention import flex_attention as fa

    from flexsgl.attention.flex import FLASH_LSE_SCALE

    flash_left_alone = 'stats_are_log2=kernel_options["BACKEND"] != "FLASH"' in inspect.getsource(fa)
    assert FLASH_LSE_SCALE == pytest.approx(1.0 if flash_left_alone else 1 / math.log(2))


def test_flash_keeps_only_the_mods_its_code_generator_computes_correctly():
    """flash_mods.flash_miscompiles names the one construct the FLASH backend got wrong on an H200
    (`user_head_temperature`'s torch.where between two numbers: 0.49 from float64) and passes what it
    computed correctly there: every shipped variant and the other test variants, the same bias
    written as a product, a choice between a score and a number, and a mask's choice of booleans;
    and refuses the construct wherever it appears: with a captured 0-dim tensor, inside a mask."""
    from flexsgl.attention.flash_mods import flash_miscompiles

    refused = {name for name, (variant, *_) in REFERENCE.items() if flash_miscompiles(variant) is not None}
    assert refused == {"user_head_temperature"}
    assert "torch.where" in flash_miscompiles(REFERENCE["user_head_temperature"][0])
    one5 = torch.tensor(1.5)
    cases = {
        "bias as a product": (lambda s, b, h, q, kv: s + (kv == 0).to(torch.float32) * 1.5, None, False),
        "score or a number": (lambda s, b, h, q, kv: torch.where(kv == 0, s, 0.0), None, False),
        "boolean mask": (None, lambda b, h, q, kv: torch.where(q - kv < 5, True, False), False),
        "captured constant": (lambda s, b, h, q, kv: s + torch.where(kv == 0, one5, 0.0), None, True),
        "numbers inside a mask": (None, lambda b, h, q, kv: torch.where(kv == 0, 2, 1) > q, True),
    }
    for name, (score, mask, wrong) in cases.items():
        variant = AttentionVariant(name, score_mod=score, mask_mod=mask)
        assert (flash_miscompiles(variant) is not None) == wrong, name


def test_a_variants_prefill_takes_flash_where_it_runs_unless_told_not_to(monkeypatch):
    """As on an SM90 GPU with flash-attn-4: a variant's prefill takes the FLASH backend over KV blocks
    of 128 (pages of 128, or packed rows) at head_dim 128 in bf16, and the Triton kernel elsewhere;
    FLEXSGL_FLASH_VARIANTS=0 keeps it on Triton; a variant whose mods FLASH computes wrongly is refused
    it with the reason, and one where FLASH cannot run is not traced at all."""
    from flexsgl.attention import flex_options
    from flexsgl.attention.flash_mods import flash_refusal
    from flexsgl.attention.flex_options import FLASH, FLASH_VARIANTS_ENV, variant_prefill_options

    monkeypatch.setattr(flex_options, "_flash_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))
    monkeypatch.delenv(FLASH_VARIANTS_ENV, raising=False)
    window, temperature = REFERENCE["sliding_window"][0], REFERENCE["user_head_temperature"][0]
    bf16 = torch.bfloat16

    def on_flash(variant, head_dim, page_size):  # (over pages, over packed rows)
        refused = flash_refusal(variant, head_dim, page_size, bf16)
        return tuple(variant_prefill_options(head_dim, page_size, bf16, packed, refused) == FLASH
                     for packed in (False, True))

    assert on_flash(window, 128, 128) == (True, True)
    assert on_flash(window, 128, 16) == (False, True)  # a page of 16 is no FLASH KV block; packed rows are
    assert on_flash(window, 64, 128) == (False, False)  # FLASH runs at head_dim 128
    assert "torch.where" in flash_refusal(temperature, 128, 128, bf16)
    assert on_flash(temperature, 128, 128) == (False, False)
    assert flash_refusal(temperature, 64, 128, bf16) is None  # no FLASH to refuse: nothing traced or logged
    monkeypatch.setenv(FLASH_VARIANTS_ENV, "0")
    assert on_flash(window, 128, 128) == (False, False)
    assert flash_refusal(temperature, 128, 128, bf16) is None


def per_request_window() -> AttentionVariant:
    """A sliding window whose size each request gives (`attention_params={"w": W}`), at most 64."""
    def mask(b, h, q_pos, kv_pos, p):
        return q_pos - kv_pos < p.w[b]

    return AttentionVariant("per_request_window", mask_mod=mask, window=64,
                            params={"w": PerRequest(64, low=1, high=64)})


def _fresh_logits(path, attention, prompt, greedy, monkeypatch, given=None):
    """`prompt`'s logits and tokens on an engine of its own: no cache to hit, one prefill step."""
    from flexsgl import LLM, SamplingParams
    from tests.hf_models import capture_logits

    llm = LLM(str(path), attention=attention, device="cpu", max_total_tokens=4096, page_size=16)
    with monkeypatch.context() as patch:
        seen = capture_logits(llm, patch)
        out = llm.generate([prompt], SamplingParams(**greedy, attention_params=given))[0]
    return torch.stack(seen[out.request_id]), out.token_ids


def test_per_request_parameters_reach_each_request(tmp_path, monkeypatch):
    """Through the engine (plan, upload, the variant's request tensors): requests given different
    windows in one batch each get the logits and tokens of an engine whose every request has that
    window as a fixed one (sliding_window, which the HF parity tests check), on a random checkpoint."""
    from flexsgl import LLM, SamplingParams
    from tests.hf_models import capture_logits, logits_rel_error, make_checkpoint

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    make_checkpoint("qwen3", tmp_path, seed)
    prompts = [[rng.randrange(1, 320) for _ in range(rng.randrange(30, 90))] for _ in range(3)]
    windows = [rng.randrange(2, 24) for _ in prompts]
    greedy = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    per_request = LLM(str(tmp_path), attention=per_request_window(), device="cpu", max_total_tokens=4096,
                      page_size=16)
    with monkeypatch.context() as patch:
        seen = capture_logits(per_request, patch)
        got = per_request.generate(prompts, [SamplingParams(**greedy, attention_params={"w": w}) for w in windows])
    for prompt, w, out in zip(prompts, windows, got):
        ref, tokens = _fresh_logits(tmp_path, V.sliding_window(w), prompt, greedy, monkeypatch)
        rel = logits_rel_error(torch.stack(seen[out.request_id]), ref)
        assert rel < 1e-4 and out.token_ids == tokens, f"window {w}: {rel:.2e}, seed={seed}"


def per_layer_variants(heads: int, window: int = 24, cap: float = 20.0):
    """A user's choice per layer and each written out for tests/variant_hf.py: layer 0 a sliding
    window with a softcap, layer 1 ALiBi (slopes for `heads` heads), layer 2 the per-head
    temperature written above; layers past them plain. Returns (the engine's `attention=`, the written
    forms tests/variant_hf.py takes)."""
    from tests.variant_hf import anywhere

    slopes, temps = written_slopes(heads), written_temperatures(heads)
    engine = {"0": V.sliding_window(window) & V.softcap(cap), "1": V.alibi(), "2": user_head_temperature()}
    written = {0: (lambda h, q, kv: q - kv < window, lambda s, h, q, kv: cap * torch.tanh(s / cap)),
               1: (anywhere, lambda s, h, q, kv: s - slopes[h] * (q - kv)),
               2: (anywhere, lambda s, h, q, kv: s / temps[h] + torch.where(kv == 0, 1.5, 0.0))}
    return engine, written


def test_a_users_variants_per_layer_track_hf_with_them_written_out(tmp_path, monkeypatch):
    """Through the whole engine (a ragged batch beyond the window, prefill in chunks of 40 tokens,
    pages of 16): per_layer_variants on a random Qwen3 checkpoint against HF's modeling code with
    each layer's attention written out in float64 (tests/variant_hf.py). Every step's logits within
    1e-4 of HF's and 32 greedy tokens equal."""
    from flexsgl import LLM, SamplingParams
    from tests.family_parity import STEPS, check_outputs, prompts_for, well_drawn
    from tests.hf_models import capture_logits, make_checkpoint
    from tests.variant_hf import hf_with_variants

    engine, written = per_layer_variants(heads=4)
    make_hf = lambda path, seed: (make_checkpoint("qwen3", path, seed),  # noqa: E731
                                  hf_with_variants(path, written))[1]
    hf, seed, prompts = well_drawn(tmp_path, make_hf, lambda rng, vocab: prompts_for(rng, vocab, 24),
                                   own_attention=False)
    llm = LLM(str(tmp_path), attention=engine, device="cpu", page_size=16, max_num_batched_tokens=40)
    llm.allocator.shuffle(seed)
    seen = capture_logits(llm, monkeypatch)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=STEPS, temperature=0.0))
    check_outputs(hf, llm, seen, prompts, outs, seed, "per-layer variants")


def test_a_parameter_refuses_values_outside_its_type_and_bounds():
    """A fraction for a whole-number parameter, a value its int32 tensor would wrap, one outside its
    bounds (a window above the variant's would be hidden by it), a non-finite float: each refused
    naming what the parameter takes. The bounds' own edges run."""
    from flexsgl import LLM, SamplingParams
    from flexsgl.errors import SamplingParamsError

    assert PerRequest(48).dtype == torch.int32 and PerRequest(0.5).dtype == torch.float32
    scaled = AttentionVariant("scaled", score_mod=lambda s, b, h, q, kv, p: s * p.t[b],
                              params={"t": PerRequest(1.0, low=0.25, high=4.0)})
    llm = LLM("tiny", attention={"0": per_request_window(), "1:": scaled}, load_format="dummy", device="cpu",
              max_total_tokens=1024)
    cases = [({"w": v}, "whole numbers from 1 to 64") for v in (2.5, 65, 0, 2**31, -2**31 - 1, float("inf"))]
    cases += [({"t": v}, "finite numbers of torch.float32 from 0.25 to 4") for v in (4.5, 0.0, float("inf"))]
    for given, takes in cases:
        [(name, bad)] = given.items()
        with pytest.raises(SamplingParamsError, match=rf"give {name} {re.escape(repr(bad))}, and it takes {takes}"):
            llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, attention_params=given))
    outs = llm.generate([[1, 2, 3]] * 3, [SamplingParams(max_new_tokens=2, attention_params=p)
                                          for p in ({"w": 2.0, "t": 0.25}, {"w": 1, "t": 4}, {"w": 64})])
    assert all(o.error is None and len(o.token_ids) == 2 for o in outs)


@pytest.mark.parametrize("case", ["prefix-lm", "per-request-window"])
def test_prefix_cache_reuses_only_kv_computed_alike(tmp_path, monkeypatch, case):
    """A token's K/V after the first layer depend on the attention before it: under prefix-LM on the
    whole prompt, under a per-request window on the window. Requests sharing a cached prefix with
    one that computed it otherwise get a fresh engine's logits all the same, those that computed it
    alike reuse it, and prefix-LM prompts are never split across steps (a budget of 64 tokens for
    prompts of 20-60, queued together). Reference: each request on an engine of its own."""
    from flexsgl import LLM, SamplingParams
    from tests.hf_models import capture_logits, logits_rel_error, make_checkpoint

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    make_checkpoint("qwen3", tmp_path, seed)
    base = [rng.randrange(1, 320) for _ in range(40)]
    tail = lambda: [rng.randrange(1, 320) for _ in range(rng.randrange(1, 20))]  # noqa: E731
    if case == "prefix-lm":
        attention, given = V.prefix_lm(), [None] * 5
        prompts = [base, base + tail(), base + tail(), base[:20] + tail(), list(base)]
    else:
        attention, given = per_request_window(), [{"w": 4}, {"w": 20}, {"w": 4}, None, {"w": 64}]
        prompts = [base, base + tail(), base + tail(), base + tail(), base + tail()]
    greedy = dict(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tmp_path), attention=attention, device="cpu", max_total_tokens=4096, page_size=16,
              max_num_batched_tokens=64)
    # prefix-LM's requests but the first queued together (whole prompts in a shared budget); the
    # windows' one at a time, so each finds the pages of those before it in the cache
    calls = [[0], [1, 2, 3, 4]] if case == "prefix-lm" else [[i] for i in range(5)]
    outs = []
    with monkeypatch.context() as patch:
        seen = capture_logits(llm, patch)
        for call in calls:
            outs += llm.generate([prompts[i] for i in call],
                                 [SamplingParams(**greedy, attention_params=given[i]) for i in call])
    for i, out in enumerate(outs):
        ref, tokens = _fresh_logits(tmp_path, attention, prompts[i], greedy, monkeypatch, given[i])
        rel = logits_rel_error(torch.stack(seen[out.request_id]), ref)
        assert rel < 1e-4 and out.token_ids == tokens, f"{case} request {i}: {rel:.2e}, seed={seed}"
    # Prefix-LM: only the same prompt again reuses (all of it); a window: the same window again
    # (request 2 after 0), and the default given or not (4 after 3).
    hits = [o.cached_tokens for o in outs]
    want = [0, 0, 0, 0, 32] if case == "prefix-lm" else [0, 0, 32, 0, 32]
    assert hits == want, f"{case}: cached tokens {hits}, seed={seed}"


def test_a_prompt_longer_than_a_step_is_refused_where_prompts_are_seen_whole():
    from flexsgl import LLM, SamplingParams

    llm = LLM("tiny", attention=V.prefix_lm(), load_format="dummy", device="cpu", max_total_tokens=1024,
              max_num_batched_tokens=16)
    long, short = llm.generate([list(range(1, 30)), list(range(1, 10))], SamplingParams(max_new_tokens=3))
    assert long.finish_reason == "refused" and "longer than a prefill step (16 tokens" in long.error
    assert short.error is None and len(short.token_ids) == 3


def test_layer_specs_pick_layers_compose_with_and_and_refuse_a_layer_given_two():
    """`--attention`'s form: parts by layer (`@selector`), `&` composing on the same layers; a layer
    two parts name is refused rather than one part dropped."""
    from flexsgl.attention.layer_variants import user_variants

    got = user_variants("alibi@0::2;softcap:cap=30@1::2", 4)
    assert [v.name for v in got] == ["alibi", "softcap(30)", "alibi", "softcap(30)"]
    assert got[0] is got[2]  # one object per part: one compiled layer serves both
    both = user_variants("alibi&softcap:cap=30", 3)
    assert both[0].name == "alibi&softcap(30)" and all(v is both[0] for v in both)
    assert both[0].params.keys() == {"slopes"} and both[0].kernel is None
    # a kernel takes one softcap: two compose to flex alone (the second had replaced the first for kernels)
    assert (V.softcap(2.0) & V.softcap(30.0)).kernel is None
    assert (V.softcap(2.0) & V.causal()).kernel == {"softcap": 2.0}
    partial = user_variants("sliding_window:window=8@1", 3)
    assert partial[0] is None and partial[2] is None and partial[1].window == 8
    for bad in ("alibi;softcap:cap=30", "alibi@0;softcap:cap=30@0", "alibi@all;causal@2",
                {"all": "alibi", "1": "softcap:cap=30"}):
        with pytest.raises(VariantError, match=r"Layer \d is given two attention variants"):
            user_variants(bad, 3)


def test_a_variant_that_cannot_run_is_refused_in_one_sentence():
    """Values and mods that would run as nonsense or fail inside a step: each a VariantError naming
    the variant or parameter, before any request runs."""
    from flexsgl import LLM
    from flexsgl.attention.layer_variants import user_variants

    cases = [
        (lambda: V.softcap(0), "cap must be a positive number"),
        (lambda: V.softcap(-1.5), "cap must be a positive number"),
        (lambda: PerRequest("abc"), "default must be a number"),
        (lambda: PerRequest(1, dtype=torch.bool), "dtype must be one of"),
        (lambda: PerRequest(3_000_000_000), "no value of its dtype torch.int32"),
        (lambda: PerRequest(1.5, dtype=torch.int32), "no value of its dtype"),
        (lambda: PerRequest(64, low=1, high=32), r"default 64 lies outside its bounds \[1, 32\]"),
        (lambda: PerRequest(1.0, low=float("nan")), "low must be a finite number"),
        (lambda: PerRequest(1, high="8"), "high must be a finite number"),
        (lambda: check(AttentionVariant("f64", score_mod=lambda s, b, h, q, kv: s.double() + 1)),
         "'f64': its score_mod must return the score, a float32 tensor"),
        (lambda: user_variants("alibi@4:", 4), "select no layer"),
        (lambda: RequestVariants([AttentionVariant("a", score_mod=lambda s, b, h, q, kv, p: s + p.w[b],
                                                   params={"w": PerRequest(1.0)}),
                                  AttentionVariant("b", score_mod=lambda s, b, h, q, kv, p: s - p.w[b],
                                                   params={"w": PerRequest(2.0)})]),
         "per-request parameter 'w' differently"),
        (lambda: AttentionVariant("x", causal="no"), "causal must be True or False"),
        (lambda: check(AttentionVariant("boolean", score_mod=lambda s, b, h, q, kv: s > 0)),
         "'boolean': its score_mod must return the score, a float32 tensor"),
        (lambda: check(AttentionVariant("t", score_mod=lambda s, b, h, q, kv, p: s / p.temp[h],
                                        params={"temp": PerHead(lambda n: 1 / 0)})),
         "'t''s parameter 'temp' could not be made for 4 heads \\(ZeroDivisionError"),
        (lambda: check(AttentionVariant("t", score_mod=lambda s, b, h, q, kv, p: s / p.temp[h],
                                        params={"temp": PerHead(torch.ones(3))})),
         "'t''s parameter 'temp' has shape \\(3,\\), and the model has 4 query heads"),
    ]
    for make, match in cases:
        with pytest.raises(VariantError, match=match):
            make()
    for sink, what in (("sinks", "nothing"), ("o_proj", "Linear")):  # the embedded model has no sinks
        with pytest.raises(VariantError, match=f"its sink '{sink}' names {what} in this model's attention layers"):
            LLM("tiny", load_format="dummy", device="cpu", max_total_tokens=512,
                attention=AttentionVariant("s", sink=sink))


def test_a_non_causal_variants_outputs_survive_preemption(monkeypatch):
    """A block-causal mask (keys of the query's 16-token block and before; causal=False): a request
    preempted and recomputed in one prefill (prompt and outputs) gives the tokens it gives with
    room to spare; its recomputed outputs saw later outputs of their block (4 of 6 differed)."""
    from flexsgl import LLM, SamplingParams
    from tests.hf_models import capture_logits, same_greedy_tokens

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randrange(30, 60))] for _ in range(6)]
    blocks = AttentionVariant("blocks", mask_mod=lambda b, h, q, kv: kv // 16 <= q // 16, causal=False)
    greedy = SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True)
    outs = {}
    for tight in (False, True):
        llm = LLM(attention=blocks, compile=False, page_size=16,
                  **(dict(max_total_tokens=320, max_running_requests=6) if tight else {}))
        outs[tight] = [o.token_ids for o in llm.generate(prompts, greedy)]
        if tight:
            assert llm.stats()["preemptions"] > 0, "the pool was meant to preempt"
    for prompt, got, ref in zip(prompts, outs[True], outs[False]):
        if got != ref:  # a near-tie? the request alone, its logits recorded
            with monkeypatch.context() as patch:
                alone = LLM(attention=blocks, compile=False, page_size=16)
                seen = capture_logits(alone, patch)
                ref = alone.generate([prompt], greedy)[0]
            assert same_greedy_tokens(got, ref.token_ids, seen[ref.request_id]), f"seed={seed}"
