"""Token sampling on the device, with no host sync: logit bias, penalties, min_tokens, the token
bitmask of structured outputs, greedy, temperature, top-k, top-p, min-p; and the log-probabilities
that requests ask for, read back with the tokens.

Randomness is counter-based: the noise for (request seed, output index, vocab id) comes from an
integer hash, so a request samples the same tokens whatever batch it shares and whichever device
runs it, and no generator state lives on the host. Sampling is the exponential race: the token is
argmax(p_i / E_i) with E_i ~ Exp(1), which draws i with probability p_i. Without a filter it runs
in the log domain, argmax(l_i / T - log E_i) (`race`), which needs no softmax and is computed
element by element, so vocabulary slices (tensor parallelism) race apart and compare maxima.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import chain

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class Penalties:
    """Per-row penalties and what they look at: counts of each row's output tokens, and its prompt's tokens."""

    presence: torch.Tensor  # [S] float32, 0 = off
    frequency: torch.Tensor  # [S] float32, 0 = off
    repetition: torch.Tensor  # [S] float32, 1 = off
    counts: torch.Tensor  # [S, V] int32: times each token occurs in the row's output so far
    in_prompt: torch.Tensor  # [S, V] bool: whether each token occurs in the row's prompt


@dataclass
class MinTokens:
    """Rows whose stop tokens are blocked until their output holds min_tokens tokens."""

    min_tokens: torch.Tensor  # [S] int64
    stop_ids: torch.Tensor  # [S, M] int64: EOS and stop_token_ids, each row padded with its first one (or 0)
    has_stops: torch.Tensor  # [S] bool


@dataclass
class AllowedTokens:
    """Rows that may sample only some tokens (allowed_token_ids), as bitmasks: bit j of words[i, w]
    allows token 64 w + j in row rows[i] (tokens past the words are not allowed)."""

    rows: torch.Tensor  # [R] int64
    words: torch.Tensor  # [R, W] int64


def apply_allowed(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """logits with every token a restricted row does not allow at -inf."""
    vocab, width = logits.shape[-1], allowed.words.shape[1]
    ids = torch.arange(vocab, device=logits.device)
    bits = (allowed.words[:, (ids >> 6).clamp(max=width - 1)] >> (ids & 63)) & 1
    keep = (bits == 1) & (ids < 64 * width)
    rows = logits[allowed.rows].masked_fill(~keep, float("-inf"))
    return logits.index_put((allowed.rows,), rows)


@dataclass
class LogitBias:
    """Biases added to some rows' logits: entry i adds values[i] to logits[rows[i], ids[i]]."""

    rows: torch.Tensor  # [B] int64
    ids: torch.Tensor  # [B] int64
    values: torch.Tensor  # [B] float32


@dataclass
class TokenMask:
    """The tokens each row may sample (structured outputs), in xgrammar's layout: bit j of
    words[s, w] allows token 32 w + j, for the tokens below `vocab` (the grammar's vocabulary);
    tokens from `vocab` on are allowed in the `open` rows (those without a grammar) only. One flat
    int32 buffer holds both, so it goes to the device in one copy."""

    flat: torch.Tensor  # [S * W + S] int32: the words, then one open flag per row
    rows: int
    vocab: int

    @property
    def words(self) -> torch.Tensor:
        return self.flat[:self.flat.numel() - self.rows].view(self.rows, -1)

    @property
    def open(self) -> torch.Tensor:
        return self.flat[self.flat.numel() - self.rows:] != 0

    def to(self, device: torch.device) -> "TokenMask":
        return TokenMask(self.flat.to(device, non_blocking=True), self.rows, self.vocab)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device, plus host flags that pick the cheapest path."""

    temperature: torch.Tensor | None  # [S] float32, 0 = greedy; these six are None where every row is greedy
    top_k: torch.Tensor | None  # [S] int64, 0 = off
    top_p: torch.Tensor | None  # [S] float32
    min_p: torch.Tensor | None  # [S] float32
    seed: torch.Tensor | None  # [S] int64
    step: torch.Tensor | None  # [S] int64, index of the output token being sampled
    all_greedy: bool
    any_filter: bool  # some row uses top-k, top-p or min-p
    penalties: Penalties | None = None  # some row is penalized
    min_tokens: MinTokens | None = None  # some row has min_tokens
    logprobs: int = -1  # the most top log-probabilities a row asked for; -1: no row asked
    logit_bias: LogitBias | None = None  # some row has a logit bias
    allowed: AllowedTokens | None = None  # some row has allowed_token_ids
    token_mask: TokenMask | None = None  # some row has structured outputs

    @property
    def changes_logits(self) -> bool:
        """Whether some row's logits change before sampling (bias, penalties, min_tokens, a token mask)."""
        return not (self.penalties is None and self.min_tokens is None and self.logit_bias is None
                    and self.allowed is None and self.token_mask is None)

    @property
    def races_only(self) -> bool:
        """Whether each row's token is the argmax of its `race` values, which nothing else reads:
        every row greedy or sampled by temperature alone, no change to the logits, no
        log-probabilities."""
        return not self.any_filter and not self.changes_logits and self.logprobs < 0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche, computed in int64 so every product fits."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def exponential_noise(seed: torch.Tensor, step: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise of shape [S, V] keyed by (seed, step, vocab id). vocab_ids: [V] or [S, V]."""
    h = _mix32(seed & _MASK32)
    h = _mix32(h ^ (seed >> 32))
    h = _mix32(h ^ (step & _MASK32))
    ids = vocab_ids if vocab_ids.dim() == 2 else vocab_ids[None, :]
    return -torch.log(uniform_from_bits(_mix32(h[:, None] ^ ids) >> 9))


UNIFORM_BITS = 23


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """23 random bits -> float32 strictly inside (0, 1). With 24 bits the top value rounds to 1.0 in
    float32, its Exp noise is 0, and a filtered-out token (p = 0) then wins the race as 0/0 = NaN."""
    return (bits.float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """float32 logits [S, V] with repetition, then frequency and presence penalties applied (as vLLM)."""
    seen = p.counts > 0
    rep = p.repetition[:, None]
    logits = torch.where(seen | p.in_prompt, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - p.frequency[:, None] * p.counts - p.presence[:, None] * seen


def block_stop_tokens(logits: torch.Tensor, m: MinTokens, step: torch.Tensor) -> torch.Tensor:
    """logits [S, V] with each row's stop tokens at -inf while its output is shorter than min_tokens."""
    block = ((step < m.min_tokens) & m.has_stops)[:, None].expand_as(m.stop_ids)
    kept = logits.gather(1, m.stop_ids)
    return logits.scatter(1, m.stop_ids, torch.where(block, float("-inf"), kept))


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """logits [S, V] with every token the mask does not allow at -inf."""
    vocab = logits.shape[-1]
    n = min(vocab, mask.vocab)
    ids = torch.arange(n, device=logits.device)
    allowed = (mask.words[:, ids >> 5] >> (ids & 31).int()) & 1
    head = logits[:, :n].masked_fill(allowed == 0, float("-inf"))
    if n == vocab:
        return head
    tail = logits[:, n:].masked_fill(~mask.open[:, None], float("-inf"))
    return torch.cat([head, tail], dim=1)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [S, V] (the first index of each row's maximum, as torch's), in two passes:
    each row's maximum per chunk of about a thousand entries, then the best chunk. torch's argmax
    reduces a row in one thread block, which left most of the GPU idle at decode batch 1: 25 µs for
    a [1, 102400] row on an H200, a percent of a DeepSeek-V2-Lite step."""
    chunk = _argmax_chunk(x.shape[-1])
    if chunk is None:
        return x.argmax(dim=-1)
    best, where = x.unflatten(-1, (-1, chunk)).max(dim=-1)  # [S, V / chunk]: the first maximum in each chunk
    c = best.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (c * chunk + where.gather(-1, c)).squeeze(-1)


@functools.cache
def _argmax_chunk(vocab: int, near: int = 1024, lo: int = 256, hi: int = 4096) -> int | None:
    """A divisor of vocab in [lo, hi], the nearest below `near` or else above it (None: none, or
    a row too short to split). Cached: the search is up to ~4,000 modulos of host work, and sampling
    runs every step."""
    sizes = chain(range(near, lo - 1, -1), range(near + 1, hi + 1))
    return next((d for d in sizes if vocab % d == 0 and vocab >= 8 * d), None)


def sample(logits: torch.Tensor, st: SamplingTensors, argmax: torch.Tensor | None = None) -> torch.Tensor:
    """logits [S, V] (any float dtype; sampled in float32) -> token ids [S] int64. argmax: the
    logits' row_argmax if already taken (a CUDA graph takes it); where every row is greedy and
    nothing changes the logits, it is the result itself."""
    if st.changes_logits:
        argmax = None  # of other logits
        logits = logits.float()
        if st.logit_bias is not None:
            b = st.logit_bias
            logits = logits.index_put((b.rows, b.ids), b.values, accumulate=True)
        if st.penalties is not None:
            logits = apply_penalties(logits, st.penalties)
        if st.min_tokens is not None:
            logits = block_stop_tokens(logits, st.min_tokens, st.step)
        if st.allowed is not None:
            logits = apply_allowed(logits, st.allowed)
        if st.token_mask is not None:
            logits = apply_token_mask(logits, st.token_mask)
    if st.all_greedy:
        return row_argmax(logits) if argmax is None else argmax  # upcasting first would change no value
    if not st.any_filter:
        return row_argmax(race(logits, st))
    greedy = row_argmax(logits) if argmax is None else argmax
    logits = logits.float()
    temp = torch.where(st.temperature > 0, st.temperature, 1.0)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    vocab = logits.shape[-1]
    probs, ids = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(st.top_k > 0, st.top_k, vocab)
    drop = (probs < st.min_p[:, None] * probs[:, :1]) | (rank[None, :] >= k[:, None])
    probs = probs.masked_fill(drop, 0.0)
    # top-p over what min-p and top-k kept, renormalised (vLLM's order): a token stays while the mass
    # of those before it is below top_p, i.e. while its own and the later ones' exceed 1 - top_p
    tail = probs.flip(-1).cumsum(dim=-1).flip(-1)
    probs = probs.masked_fill(tail <= (1 - st.top_p[:, None]) * tail[:, :1], 0.0)
    choice = row_argmax(probs / exponential_noise(st.seed, st.step, ids))
    token = ids.gather(1, choice[:, None]).squeeze(1)
    return torch.where(st.temperature > 0, token, greedy)


def race(logits: torch.Tensor, st: SamplingTensors, first_id: int = 0) -> torch.Tensor:
    """float32 `[S, V]` whose row argmax is each row's token where no filter applies: l / T - log E
    for a sampled row (E the exponential noise of vocab ids first_id .. first_id + V, so a slice of
    the vocabulary races as it would within the whole row), the logits themselves for a greedy one
    (as they are where every row is greedy)."""
    if st.all_greedy:
        return logits
    logits = logits.float()
    sampled = st.temperature > 0
    ids = torch.arange(first_id, first_id + logits.shape[-1], device=logits.device)
    noisy = logits / torch.where(sampled, st.temperature, 1.0)[:, None] - exponential_noise(st.seed, st.step, ids).log()
    return torch.where(sampled[:, None], noisy, logits)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The sampled tokens with their log-probabilities under the model's distribution (logits [S, V]
    before penalties and temperature) and the k most likely, packed for one read-back: float32
    [S, 3 + 2k] = token id, its log-probability, k log-probabilities, their k token ids, then the
    token's rank (vLLM's: the tokens at least as likely as it, itself and its ties included; ids and
    ranks below 2**24 are exact in float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    own = logp.gather(1, tokens[:, None])
    rank = (logp >= own).sum(-1, keepdim=True)
    top, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], tokens[:, None][:, :0])
    return torch.cat([tokens[:, None].float(), own, top, ids.float(), rank.float()], dim=1)
