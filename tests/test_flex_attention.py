"""The FlexAttention backend against float64 dense attention on random paged layouts."""

import random

import pytest
import torch

from flexsgl.attention.flex import FlexAttentionBackend
from flexsgl.attention.flex_ops import merge_partials, shard_block_list
from flexsgl.attention.flex_masks import Q_BLOCK, listed_decode_causal, packed_causal, packed_paged_causal, paged_causal
from flexsgl.cache.pool import KVPool, PageAllocator
from tests.attention_reference import dense_attention, random_paged_batch

CASES = {
    "ragged-prefill": [(0, 37), (0, 5), (0, 130), (0, 64)],
    "prefix-extend": [(64, 40), (13, 1), (100, 77), (7, 150)],
    "decode": [(0 + n, 1) for n in (1, 63, 64, 65, 200, 17)],
    "mixed": [(90, 1), (0, 70), (33, 12), (129, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("eager_extent", [False, True])
def test_flex_matches_float64_reference(case, page_size, eager_extent):
    run_backend_case(CASES[case], page_size, FlexAttentionBackend.forward, "cpu", torch.float32,
                     rtol=1e-4, atol=1e-5, eager_extent=eager_extent)


# The shapes flexsgl serves: head dims 32 (tiny), 64 (the embedded model), 128 (Qwen3, Llama) and 256,
# query heads per KV head 1, 2, 4 and 8, each dtype. Bounds: float32 as above; half types round the
# inputs before the reference sees them, then the kernel's own rounding (see tests/test_gpu.py).
HEAD_DIMS, GQA_RATIOS = (32, 64, 128, 256), (1, 2, 4, 8)
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("gqa", GQA_RATIOS)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_flex_on_every_served_shape(d, gqa, dtype):
    rtol, atol = TOLERANCE[dtype]
    run_backend_case(CASES["mixed"], 16, FlexAttentionBackend.forward, "cpu", dtype, rtol=rtol, atol=atol,
                     hq=2 * gqa, hkv=2, d=d)


def run_backend_case(specs, page_size, forward, device, dtype, rtol, atol, eager_extent=False, compiled=False,
                     hq=4, hkv=2, d=16, backend_cls=FlexAttentionBackend, seed=None, full_blocks=True,
                     packs_prefill=True, pool_pages=None, kv_dtype=None, query_rounding=None, atol_of_v=0.0,
                     mean_atol=None):
    """Store a random paged batch's K/V in the pool, run `backend_cls` on it (through `forward`, or
    its own when None) and check it against float64 attention; returns its output. The same seed
    gives the same batch. pool_pages: the pool's size (default: the batch's pages and 5 more), over
    which the batch's pages are shuffled. kv_dtype: the pool's (an FP8 cache), K and V drawn as
    its values; query_rounding: what the backend does to the queries first, done to the reference's.
    atol_of_v: added to atol as that fraction of the largest |V| attended (a kernel that rounds its
    probabilities to relative precision e is off by at most e * max|V|); mean_atol: a bound on the
    mean absolute error as well."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pages = pool_pages or sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, hkv, d, kv_dtype or dtype, device, query_dtype=dtype)
    # Pre-fill the whole pool with noise, so stale slots would show up if the mask let them through.
    for t in (pool.k[0], pool.v[0]):
        t.copy_(torch.randn(t.shape, device=device))
    alloc = PageAllocator(pages, shuffle_seed=seed)
    fb, q, k, v, dense = random_paged_batch(pool, alloc, specs, hq, device, dtype, rng)
    if eager_extent:
        fb.num_kv_pages = int(fb.page_table.max()) + 1
    backend = backend_cls(pool, num_heads=hq, compiled=compiled)
    if not full_blocks:
        backend.decode_full_blocks = lambda batch: False
    if not packs_prefill:  # flex's compiled prefill over the pages
        backend.packs_prefill = False
    backend.prepare(fb)
    cast = lambda x: x.to(device, dtype)
    pool.store(0, cast(k), cast(v), fb.out_slots)
    if compiled:  # compile afresh, and fail rather than run flex eagerly past dynamo's recompile limit
        torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=compiled):
        out = (forward or type(backend).forward)(backend, cast(q), pool.layer_cache(0), fb)
    ref = dense_attention(q if query_rounding is None else query_rounding(q), dense, specs)
    atol += atol_of_v * max(dv.abs().max().item() for _, dv in dense)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=rtol, atol=atol, msg=lambda m: f"seed={seed}: {m}")
    if mean_atol is not None:
        mean = (out.double().cpu() - ref).abs().mean().item()
        assert mean < mean_atol, f"seed={seed}: mean absolute error {mean:.3g}, bound {mean_atol}"
    return out


@pytest.mark.parametrize("case", ["ragged-prefill", "prefix-extend", "decode"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "paged"])
def test_compiled_flex_on_cpu_matches_float64_reference(case, packed):
    """Compiled flex skips blocks the BlockMask leaves out (eager evaluates the mask everywhere),
    so this is what checks the full/partial block lists built from the page table, and (ragged
    prefill, no cached prefix) those over the packed new K/V."""
    run_backend_case(CASES[case], 16, torch.compile(FlexAttentionBackend.forward, dynamic=False), "cpu",
                     torch.float32, rtol=1e-4, atol=1e-5, compiled=True, packs_prefill=packed)


def test_compiled_flex_decode_without_full_blocks_on_cpu():
    """Decode as the CUDA op lays it out (flex_meta.py): every visible page a partial KV block."""
    run_backend_case(CASES["decode"], 16, torch.compile(FlexAttentionBackend.forward, dynamic=False), "cpu",
                     torch.float32, rtol=1e-4, atol=1e-5, compiled=True, full_blocks=False)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_listed_decode_mask_sees_what_the_paged_mask_sees(page_size):
    """The CUDA decode op's mask (flex_ops.py) runs only on the pages a request's BlockMask lists,
    the request's own: there, and with every other slot unseen, it must see exactly the slots that
    paged_causal sees over the whole pool, which are the request's seq_len tokens."""
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    specs = CASES["decode"]
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, 2, 8, torch.float32, "cpu")
    fb, *_ = random_paged_batch(pool, PageAllocator(pages, shuffle_seed=seed), specs, 4, "cpu", torch.float32,
                                random.Random(seed))
    backend = FlexAttentionBackend(pool)
    backend.record_page_positions(fb.page_table, fb.seq_lens)
    last = fb.seq_lens.long() - 1
    batch, slots = torch.arange(len(specs))[:, None], torch.arange(pages * page_size)[None, :]
    paged = paged_causal(fb.page_table, last, backend.page_pos, page_size)(batch, None, 0, slots)
    listed_mask = listed_decode_causal(fb.page_table, last, page_size)
    listed = torch.zeros_like(paged)
    for b, n in enumerate(fb.host_seq_lens):
        own = (fb.page_table[b, :KVPool.num_pages_for(n, page_size)].long()[:, None] * page_size
               + torch.arange(page_size)).flatten()
        listed[b, own] = listed_mask(torch.tensor(b), None, 0, own)
    assert paged.sum(1).tolist() == fb.host_seq_lens, f"seed={seed}"
    assert torch.equal(listed, paged), f"seed={seed}"


# Prefill steps of long requests, whose query blocks hold at most two requests each, so the queries
# are the tokens as they come (flex_blocks.py), against CASES' short ones, each from a block of its own.
LONG_CASES = {"long-ragged": [(0, 530), (50, 600), (0, 520)], "two-long": [(3, 520), (0, 600)]}


@pytest.mark.parametrize("case", ["ragged-prefill", "prefix-extend", "mixed", *LONG_CASES, "random"])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "paged"])
def test_compiled_prefill_blocks_show_each_token_its_requests_earlier_slots(case, page_size, packed):
    """Compiled prefill's BlockMask and the mask it carries: each token's row sees, through the full KV
    blocks and the mask on the partial ones, exactly the slots of its request's tokens at or before its
    position, from the page table and nothing of flex's. A KV block is a page, or a block of the
    step's K/V packed into rows, each reading the pool slot kv_rows names. The rows are the tokens as
    they come where requests are long, else each request starts a block (flex_blocks.query_rows)."""
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    specs = {**CASES, **LONG_CASES}.get(case) or [(rng.randrange(300), rng.randrange(1, 300)) for _ in range(6)]
    pages = sum(KVPool.num_pages_for(p + n, page_size) for p, n in specs) + 5
    pool = KVPool(1, pages, page_size, 2, 8, torch.float32, "cpu")
    fb, *_ = random_paged_batch(pool, PageAllocator(pages, shuffle_seed=seed), specs, 4, "cpu", torch.float32, rng)
    backend = FlexAttentionBackend(pool, compiled=True)
    backend.packs_prefill = packed
    meta = backend.metadata(fb)
    bm = meta.block_mask
    assert (meta.kv_rows is not None) == packed
    if case != "random":
        assert (meta.rows is None) == (case in LONG_CASES), f"seed={seed}"
    kv_block = page_size if meta.kv_rows is None else Q_BLOCK
    offset = torch.arange(kv_block)
    slot_of = (lambda kv: kv) if meta.kv_rows is None else (lambda kv: meta.kv_rows[kv])
    n_kv = pool.num_pages * page_size if meta.kv_rows is None else meta.kv_rows.shape[0]
    token = 0
    for b, (prefix, new) in enumerate(specs):
        slot_pos = {int(fb.page_table[b, i]) * page_size + o: i * page_size + o
                    for i in range(KVPool.num_pages_for(prefix + new, page_size)) for o in range(page_size)}
        for t in range(new):
            row = token if meta.rows is None else int(meta.rows[1][token])
            j = row // Q_BLOCK
            full = bm.full_kv_indices[0, 0, j, :bm.full_kv_num_blocks[0, 0, j]]
            partial = bm.kv_indices[0, 0, j, :bm.kv_num_blocks[0, 0, j]]
            seen = {int(s) for s in slot_of((full.long()[:, None] * kv_block + offset).flatten())}
            partial_kv = (partial.long()[:, None] * kv_block + offset).flatten()
            shown = bm.mask_mod(torch.tensor(0), None, torch.tensor(row), partial_kv)
            seen |= {int(s) for s in slot_of(partial_kv[shown])}
            expected = {s for s, pos in slot_pos.items() if pos <= prefix + t}
            assert seen == expected, f"seed={seed}: request {b}, token {t}"
            # The mask alone, over the whole KV sequence, shows the same (as if flex ran it everywhere).
            everywhere = torch.arange(n_kv)
            alone = {int(s) for s in slot_of(everywhere[bm.mask_mod(torch.tensor(0), None, torch.tensor(row), everywhere)])}
            assert alone == expected, f"seed={seed}: request {b}, token {t}, mask alone"
            token += 1


@pytest.mark.parametrize("make", ["paged", "listed", "packed", "packed-rows"])
def test_mask_integers_stay_constants_under_dynamic_shapes(make):
    """Compiled with dynamic shapes (the engine's CUDA prefill), a mask's page size is a constant, not a
    graph input: FlexAttention's FLASH backend refuses masks that capture
    symbolic integers, and Triton would divide by a runtime value."""
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    page_size = random.Random(seed).choice([16, 64, 128])
    table = torch.randint(1, 50, (3, 5), dtype=torch.int32)
    last = torch.randint(0, 5 * page_size, (3,))
    page_pos = torch.randint(0, 5, (50,), dtype=torch.int32)
    mask = {"paged": lambda: paged_causal(table, last, page_pos, page_size),
            "listed": lambda: listed_decode_causal(table, last, page_size),
            "packed": lambda: packed_paged_causal(table, torch.randint(0, 3, (4 * 128,), dtype=torch.int32),
                                                  torch.randint(-1, 5 * page_size, (4 * 128,), dtype=torch.int32),
                                                  page_pos, page_size),
            "packed-rows": lambda: packed_causal(torch.randint(0, 300, (4 * 128,), dtype=torch.int32),
                                                 torch.randint(-1, 300, (4 * 128,), dtype=torch.int32))}[make]()
    inputs = []

    def backend(gm, example_inputs):
        inputs.extend(n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder")
        return gm

    holder = type("Holder", (), {})()
    holder.mask = mask

    @torch.compile(backend=backend, dynamic=True, fullgraph=True)
    def visible(b, q_idx, kv_idx, holder):
        return holder.mask(b, 0, q_idx, kv_idx)

    b = torch.randint(0, 3, (4 * 128, 1))
    q_idx, kv_idx = torch.arange(4 * 128)[:, None], torch.arange(50 * page_size)[None, :]
    expected = mask(b, 0, q_idx, kv_idx)
    assert torch.equal(visible(b, q_idx, kv_idx, holder), expected)
    sizes = {s.node.expr for t in inputs if isinstance(t, torch.Tensor) for s in t.shape if isinstance(s, torch.SymInt)}
    loose = [x for x in inputs if isinstance(x, torch.SymInt) and x.node.expr not in sizes]
    assert not loose, f"integers the mask captured became graph inputs: {loose}"


def test_shard_block_list_keeps_each_rows_pages_in_the_shard():
    """A decode kernel over a shard of the pool (flex_ops.py) reads, per request, the listed pages that
    lie in the shard, renumbered from its first page, and nothing past the row's count."""
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    b, w, pages = 7, 12, 50
    indices = torch.stack([torch.randperm(pages, generator=gen)[:w] for _ in range(b)]).int()[:, None, None]
    num = torch.randint(0, w + 1, (b, 1, 1), generator=gen, dtype=torch.int32)
    for first, end in ((0, 17), (17, 34), (34, 50)):
        count, local = shard_block_list(num, indices, first, end)
        for r in range(b):
            want = [p - first for p in indices[r, 0, 0, :num[r, 0, 0]].tolist() if first <= p < end]
            assert count[r, 0, 0] == len(want), f"seed={seed}"
            assert local[r, 0, 0, :len(want)].tolist() == want, f"seed={seed}"


def test_merged_partial_attention_equals_attention_over_the_union():
    """Attention over KV split into disjoint parts, merged by each part's log-sum-exp, is attention
    over all of it; a part a row sees nothing of (log-sum-exp -inf, output 0) adds nothing."""
    torch.manual_seed(seed := random.randrange(1 << 30))
    b, h, n, d = 3, 4, 40, 8
    q, k, v = (torch.randn(b, h, x, d, dtype=torch.float64) for x in (1, n, n))
    scores = (q @ k.transpose(-1, -2))[:, :, 0] / d ** 0.5  # [b, h, n]
    visible = torch.rand(b, 1, n) < 0.6
    visible[:, :, :5] = True  # every row sees something of the first part
    visible[0, :, 25:] = False  # row 0 sees nothing of the last part
    ref = torch.einsum("bhn,bhnd->bhd", torch.softmax(scores.masked_fill(~visible, float("-inf")), -1), v)
    outs, lses = [], []
    for part in (slice(0, 12), slice(12, 25), slice(25, n)):
        s = scores[:, :, part].masked_fill(~visible[:, :, part], float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("bhn,bhnd->bhd", p, v[:, :, part])), lses.append(lse)
    assert torch.isinf(lses[2][0]).all()
    torch.testing.assert_close(merge_partials(outs, lses), ref, msg=lambda m: f"seed={seed}: {m}")
