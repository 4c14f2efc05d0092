"""flexsgl.sampling against independent numpy references, on fresh random inputs each run.

Each test draws its own seed with random.randrange and names it in every assertion message.
Distribution checks draw N tokens (one (seed, step) pair per row) and allow each token's
frequency 5 standard deviations, sqrt(p (1 - p) / N), around its expected probability, plus 5/N
so that rare tokens (a few expected draws, where the normal approximation fails) pass too.
"""

import random

import numpy as np
import pytest
import torch

from flexsgl.sampling.sampler import SamplingTensors, exponential_noise, row_argmax, sample

N = 20_000  # draws per distribution check
V = 8  # small vocab for distribution checks


def make_st(rng, temperature, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0):
    """SamplingTensors on CPU, flags set as flexsgl/runner.py sets them. Scalars broadcast to every
    row; seed=None gives each row its own request seed, drawn from `rng`."""
    rows = len(temperature)
    col = lambda x: list(x) if isinstance(x, (list, tuple, range)) else [x] * rows
    if seed is None:
        seed = [rng.randrange(2**62) for _ in range(rows)]
    temperature, top_k, top_p, min_p, step, seed = map(col, (temperature, top_k, top_p, min_p, step, seed))
    greedy = [t == 0.0 for t in temperature]
    return SamplingTensors(
        temperature=torch.tensor(temperature, dtype=torch.float32), top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=torch.tensor(top_p, dtype=torch.float32), min_p=torch.tensor(min_p, dtype=torch.float32),
        seed=torch.tensor(seed, dtype=torch.int64), step=torch.tensor(step, dtype=torch.int64),
        all_greedy=all(greedy),
        any_filter=any(k > 0 or p < 1.0 or m > 0.0 for k, p, m, g in zip(top_k, top_p, min_p, greedy) if not g),
    )


def random_logits(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2.0


def ref_probs(logits_row, temperature):
    z = logits_row.double().numpy() / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def check_distribution(tokens, expected, label):
    """Empirical frequencies of `tokens` match `expected` (zero outside its support) within 5 sigma."""
    n = len(tokens)
    freq = np.bincount(tokens.numpy(), minlength=len(expected)) / n
    bad = np.abs(freq - expected) > 5 * np.sqrt(expected * (1 - expected) / n) + 5 / n
    assert not bad.any(), f"seed={label}: frequencies {freq.round(4)} vs expected {expected.round(4)}"


def test_greedy_rows_are_argmax():
    seed = random.randrange(2**31)
    logits = random_logits(16, 512, seed)
    tokens = sample(logits, make_st(random.Random(seed), [0.0] * 16))
    assert torch.equal(tokens, logits.argmax(-1)), f"seed={seed}"


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "with-filters"])
def test_mixed_batch_keeps_greedy_rows_at_argmax(filtered):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    rows = 64
    logits = random_logits(rows, 512, seed)
    greedy = [i % 2 == 0 for i in range(rows)]
    temps = [0.0 if g else rng.uniform(0.5, 2.0) for g in greedy]
    top_k = [rng.choice([0, 5, 50]) for _ in range(rows)] if filtered else 0
    tokens = sample(logits, make_st(rng, temps, top_k=top_k, top_p=0.9 if filtered else 1.0))
    g = torch.tensor(greedy)
    assert torch.equal(tokens[g], logits.argmax(-1)[g]), f"seed={seed}"
    assert not torch.equal(tokens[~g], logits.argmax(-1)[~g]), f"seed={seed}: sampled rows all at argmax"


def test_same_seed_and_step_give_same_token_whatever_the_batch():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    logits = random_logits(1, 512, seed).expand(32, 512).contiguous()
    seeds = [rng.randrange(2**62) for _ in range(32)]
    steps = [rng.randrange(10_000) for _ in range(32)]
    first = sample(logits, make_st(rng, [1.0] * 32, seed=seeds, step=steps))
    again = sample(logits, make_st(rng, [1.0] * 32, seed=seeds, step=steps))
    assert torch.equal(first, again), f"seed={seed}"
    assert len(set(first.tolist())) > 1, f"seed={seed}: 32 different seeds all drew the same token"
    # Reversed rows, plus neighbours whose top-k sends the whole batch down the sorted path.
    perm = list(reversed(range(32)))
    moved = sample(torch.cat([logits[perm], logits[:4]]),
                   make_st(rng, [1.0] * 36, top_k=[0] * 32 + [3] * 4,
                           seed=[seeds[i] for i in perm] + seeds[:4], step=[steps[i] for i in perm] + steps[:4]))
    assert torch.equal(moved[:32], first[perm]), f"seed={seed}"


def test_steps_of_one_seed_draw_independently():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    logits = random_logits(1, V, seed)
    tokens = sample(logits.expand(N, V).contiguous(), make_st(rng, [1.0] * N, seed=rng.randrange(2**62), step=range(N)))
    p = ref_probs(logits[0], 1.0)
    check_distribution(tokens, p, seed)
    # Consecutive steps repeat a token with probability sum(p^2), no more.
    repeats = (tokens[1:] == tokens[:-1]).double().mean().item()
    q = (p**2).sum()
    assert abs(repeats - q) <= 5 * np.sqrt(q * (1 - q) / (N - 1)), f"seed={seed}: repeat rate {repeats} vs {q}"


@pytest.mark.parametrize("filtered_neighbours", [False, True], ids=["plain", "filtered-neighbours"])
def test_distribution_matches_softmax(filtered_neighbours):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    temperature = rng.uniform(0.5, 2.0)
    logits = random_logits(1, V, seed)
    # With filtered neighbours every other row uses top-k, so the whole batch takes the sorted path.
    rows = 2 * N if filtered_neighbours else N
    top_k = [0, 2] * N if filtered_neighbours else 0
    tokens = sample(logits.expand(rows, V).contiguous(), make_st(rng, [temperature] * rows, top_k=top_k))
    check_distribution(tokens[0::2] if filtered_neighbours else tokens, ref_probs(logits[0], temperature),
                       f"{seed} (T={temperature:.3f})")


def check_filtered(seed, rng, temperature, allowed, logit_seed=None, **filters):
    """Sample N rows of the logits drawn from `logit_seed` (default `seed`) with `filters`: only
    `allowed` tokens appear, in renormalised proportions."""
    logits = random_logits(1, V, seed if logit_seed is None else logit_seed)
    expected = np.where(allowed, ref_probs(logits[0], temperature), 0.0)
    expected /= expected.sum()
    tokens = sample(logits.expand(N, V).contiguous(), make_st(rng, [temperature] * N, **filters))
    seen = set(tokens.tolist())
    assert seen <= set(np.flatnonzero(allowed).tolist()), f"seed={seed} {filters}: drew {seen}, allowed {allowed}"
    check_distribution(tokens, expected, f"{seed} {filters}")


def probs_with_gap(rng, temperature, descending):
    """Logits whose `descending(p)` has a clear gap (over 1e-3, so float32 rounding cannot cross
    it) between entries j-1 and j for some j in [1, V-2]; redrawn from `rng` until one exists, since
    a dominant token at a low temperature can leave every gap tinier. Returns (logit_seed, p,
    descending(p), j) with j drawn among the clear gaps."""
    while True:
        logit_seed = rng.randrange(2**31)
        p = ref_probs(random_logits(1, V, logit_seed)[0], temperature)
        values = descending(p)
        gaps = [j for j in range(1, V - 1) if values[j - 1] - values[j] > 1e-3]
        if gaps:
            return logit_seed, p, values, rng.choice(gaps)


def test_top_k():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    temperature, k = rng.uniform(0.5, 2.0), rng.randrange(2, V)
    p = ref_probs(random_logits(1, V, seed)[0], temperature)
    allowed = np.zeros(V, bool)
    allowed[np.argsort(-p)[:k]] = True
    check_filtered(seed, rng, temperature, allowed, top_k=k)


def test_top_p():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    temperature = rng.uniform(0.5, 2.0)
    logit_seed, p, _, j = probs_with_gap(rng, temperature, lambda p: -np.cumsum(np.sort(p)[::-1]))
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    # top_p well inside (cum[j-1], cum[j]), so float32 rounding cannot move the boundary.
    top_p = float(cum[j - 1] + rng.uniform(0.2, 0.8) * (cum[j] - cum[j - 1]))
    # Reference: the smallest prefix of the sorted probabilities whose mass reaches top_p.
    n_keep = next(n for n in range(1, V + 1) if cum[n - 1] >= top_p)
    allowed = np.zeros(V, bool)
    allowed[order[:n_keep]] = True
    check_filtered(seed, rng, temperature, allowed, logit_seed, top_p=top_p)


def test_min_p():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    temperature = rng.uniform(0.5, 2.0)
    logit_seed, p, ratios, j = probs_with_gap(rng, temperature, lambda p: np.sort(p / p.max())[::-1])
    # min_p well inside the gap between two neighbouring ratios p_i / p_max.
    min_p = float(ratios[j] + rng.uniform(0.2, 0.8) * (ratios[j - 1] - ratios[j]))
    check_filtered(seed, rng, temperature, p >= min_p * p.max(), logit_seed, min_p=min_p)


def test_min_p_then_top_k_then_top_p_over_what_they_kept():
    """All three filters at once, against float64 in vLLM's order: min_p on the whole distribution,
    top_k, then top_p over the survivors renormalised (top_p once measured the mass of the whole
    distribution, keeping tokens that top_k or min_p had made too likely to need)."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    temperature = rng.uniform(0.5, 2.0)
    while True:
        logit_seed = rng.randrange(2**31)
        p = ref_probs(random_logits(1, V, logit_seed)[0], temperature)
        order = np.argsort(-p)
        ratios = p[order] / p.max()
        cut = rng.randrange(4, V)  # min_p between the ratios of sorted tokens cut-1 and cut
        if ratios[cut - 1] - ratios[cut] < 1e-3:
            continue
        min_p = float(ratios[cut] + rng.uniform(0.2, 0.8) * (ratios[cut - 1] - ratios[cut]))
        k = rng.randrange(3, cut + 1)
        kept = p[order[:min(k, cut)]] / p[order[:min(k, cut)]].sum()
        cum = np.cumsum(kept)
        gaps = [j for j in range(1, len(kept) - 1) if cum[j] - cum[j - 1] > 1e-3]
        if gaps:
            break
    j = rng.choice(gaps)
    top_p = float(cum[j - 1] + rng.uniform(0.2, 0.8) * (cum[j] - cum[j - 1]))
    n_keep = next(n for n in range(1, len(kept) + 1) if cum[n - 1] >= top_p)
    allowed = np.zeros(V, bool)
    allowed[order[:n_keep]] = True
    check_filtered(seed, rng, temperature, allowed, logit_seed, top_k=k, top_p=top_p, min_p=min_p)


def test_top_k_1_is_greedy():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    logits = random_logits(64, 512, seed)
    temps = [rng.uniform(0.5, 5.0) for _ in range(64)]
    assert torch.equal(sample(logits, make_st(rng, temps, top_k=1)), logits.argmax(-1)), f"seed={seed}"


def test_exponential_noise_is_exp1_and_keyed():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    seeds = torch.tensor([rng.randrange(2**62) for _ in range(4)])
    steps = torch.tensor([rng.randrange(1000) for _ in range(4)])
    ids = torch.arange(N)
    e = exponential_noise(seeds, steps, ids)
    assert e.shape == (4, N) and bool((e > 0).all()), f"seed={seed}"
    assert torch.equal(e[:, 5:9], exponential_noise(seeds, steps, ids[5:9].expand(4, 4))), f"seed={seed}"
    assert not torch.equal(e, exponential_noise(seeds, steps + 1, ids)), f"seed={seed}"
    # Exp(1) has mean 1 and variance 1, so each row's mean has sigma 1/sqrt(N).
    means = e.double().mean(dim=1)
    assert bool(((means - 1).abs() < 5 / np.sqrt(N)).all()), f"seed={seed}: row means {means.tolist()}"


def test_uniform_noise_stays_inside_the_open_interval():
    """Regression: the largest hash value once mapped to u = 1.0, Exp noise 0, and a token that
    min-p had filtered out (p = 0) was drawn as 0/0 = NaN."""
    from flexsgl.sampling.sampler import UNIFORM_BITS, uniform_from_bits

    extremes = torch.tensor([0, 1, (1 << UNIFORM_BITS) - 2, (1 << UNIFORM_BITS) - 1])
    u = uniform_from_bits(extremes)
    assert (u > 0).all() and (u < 1).all()
    assert (-torch.log(u) > 0).all()


@pytest.mark.parametrize("vocab", [102400, 151936, 32000, 4099, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_pass_argmax_is_torchs(vocab, dtype):
    """row_argmax against torch.argmax, ties included: bf16 logits tie often, and where a row's
    maximum occurs more than once both must give its first index (4099 is prime and 300 short:
    torch's argmax itself)."""
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, vocab, generator=g).to(dtype)
    top = x.max()
    for row, places in enumerate([[], [7, vocab - 1], [vocab // 2, vocab // 2 + 1, 3], [vocab - 2]]):
        x[row, places] = top + 1  # ties at the row's maximum, across chunks and within one
    x[4, : vocab // 2] = float("-inf")
    assert torch.equal(row_argmax(x), x.argmax(dim=-1)), f"seed={seed}"
