"""Attention variants: attention you change in Python, defined once in logical coordinates.

A variant says, for one attention call, which keys a query sees and how their scores change:

    mask_mod(b, h, q_pos, kv_pos[, p]) -> bool           True: the key is visible
    score_mod(score, b, h, q_pos, kv_pos[, p]) -> score  the score before the softmax

`b` is the request (index per-request parameters with it), `h` the query head, `q_pos` and
`kv_pos` absolute token positions in the request's sequence: no pages, no pool slots, no packing.
They are FlexAttention's mods over those coordinates, and flexsgl maps them onto its paged block
masks for prefill (packed rows, cached prefixes, chunks) and decode. `p` holds the variant's
parameters as tensors (`p.name`): per request (`PerRequest`, set per request through
`SamplingParams.attention_params`; `PromptLength`, the request's prompt length) or per head
(`PerHead`). Their values live in device tensors that the engine rewrites in place, so changing
them never recompiles and CUDA graphs replay them.

Besides the mods, a variant declares what flexsgl can use to read less or to hand it to a kernel:

- `causal` (default True): keys after the query are hidden (besides the mask_mod). False lets
  the mask_mod alone decide among the keys cached so far (prefix-LM).
- `window` W: keys W or more positions behind the query are hidden. Attention then reads
  O(W) pages a step, and where every layer has a window, pages behind it go back to the pool.
  A mask_mod that only ever looks back at most W positions should declare that W too.
- `sink`: a per-head logit in every softmax's denominator (an extra key whose value is zero), as
  GPT-OSS uses: the name of a per-head tensor of the model's attention layer (a learned
  weight), or a `PerHead` parameter.
- `scale`: the softmax scale (default 1/sqrt(head dim)).
- `kernel`: what a kernel override may run instead of the mods, as the features it understands
  (`{"softcap": 50.0}`, `{"chunk": 8192}`); a window and a sink are features by themselves. A
  variant whose mods are not all covered runs on flex only: left out, `kernel` is None (flex only)
  for a variant with a mod, and `{}` for one without (a window, a sink, a scale).

Variants compose with `&`: both masks hold, the score mods apply left to right, the smaller window
wins; a variant without a mask_mod leaves another's causal=False standing (softcap & prefix-LM is
prefix-LM with a softcap). `docs/ATTENTION.md` has runnable examples; flexsgl/attention/variants.py
the shipped ones.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch


class VariantError(ValueError):
    """An attention variant that cannot run, or cannot run here; the message says why in one sentence."""


@dataclass(frozen=True)
class PerRequest:
    """A value per request: `SamplingParams(attention_params={name: value})`, else `default`. Its
    dtype, unless given: float32 for a float default, else int32, the type of every integer flex's
    masks read (FlexAttention's FLASH lowering keeps one integer type). An integer parameter takes
    whole numbers only. `low` and `high` bound what a request may give (inclusive): a window given
    per request should say `high=` the variant's `window`, which would hide the keys beyond it. A
    request giving a value outside them is refused."""

    default: float | int
    dtype: torch.dtype | None = None
    low: float | int | None = None
    high: float | int | None = None

    def __post_init__(self):
        if isinstance(self.default, bool) or not isinstance(self.default, (int, float)) or self.default != self.default:
            raise VariantError(f"A PerRequest parameter's default must be a number, got {self.default!r}.")
        if self.dtype is None:
            object.__setattr__(self, "dtype", torch.float32 if isinstance(self.default, float) else torch.int32)
        if self.dtype not in PER_REQUEST_DTYPES:
            raise VariantError(f"A PerRequest parameter's dtype must be one of "
                               f"{', '.join(str(d) for d in PER_REQUEST_DTYPES)}, got {self.dtype!r}.")
        if self.dtype.is_floating_point:
            ok = abs(self.default) <= torch.finfo(self.dtype).max
        else:
            info = torch.iinfo(self.dtype)
            ok = float(self.default).is_integer() and info.min <= self.default <= info.max
        if not ok:
            raise VariantError(f"A PerRequest parameter's default {self.default!r} is no value of its dtype "
                               f"{self.dtype} (a whole number in range, or a finite one).")
        for name in ("low", "high"):
            bound = getattr(self, name)
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                      or not math.isfinite(bound)):
                raise VariantError(f"A PerRequest parameter's {name} must be a finite number, got {bound!r}.")
        if not (self.low is None or self.low <= self.default) or not (self.high is None or self.default <= self.high):
            raise VariantError(f"A PerRequest parameter's default {self.default!r} lies outside its bounds "
                               f"[{self.low}, {self.high}].")

    def value(self, given) -> float | int:
        return self.default if given is None else given


# the types a per-request value may have in flex's masks and scores
PER_REQUEST_DTYPES = (torch.int32, torch.int64, torch.float32)


@dataclass(frozen=True)
class PromptLength:
    """The request's prompt length (tokens): per request, set by the engine."""

    dtype: torch.dtype = torch.int32


@dataclass(frozen=True, eq=False)
class PerHead:
    """A value per query head, for every request: a tensor `[num_heads]`, or a function of the model's
    head count that returns one. Under tensor parallelism each rank holds its heads' values."""

    values: torch.Tensor | Callable[[int], torch.Tensor]

    def tensor(self, num_heads: int, what: str = "A PerHead parameter") -> torch.Tensor:
        """The values `[num_heads]`; VariantError, naming the parameter as `what`, where they cannot be had."""
        try:
            values = torch.as_tensor(self.values(num_heads) if callable(self.values) else self.values)
        except Exception as e:  # the user's function failed, or gave no numbers
            raise VariantError(f"{what} could not be made for {num_heads} heads ({type(e).__name__}: "
                               f"{str(e)[:200]}).") from None
        if values.shape != (num_heads,):
            raise VariantError(f"{what} has shape {tuple(values.shape)}, and the model has {num_heads} query heads.")
        return values


Param = PerRequest | PromptLength | PerHead


@dataclass(frozen=True, eq=False)
class AttentionVariant:
    """One attention variant (module docstring). Compose with `&`."""

    name: str
    mask_mod: Callable | None = None
    score_mod: Callable | None = None
    causal: bool = True
    window: int | None = None
    sink: str | PerHead | None = None
    scale: float | None = None
    params: dict[str, Param] = field(default_factory=dict)
    kernel: dict | None = ...  # None: the mods are flex's alone; left out (...): see the module docstring

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise VariantError(f"An attention variant needs a name (a non-empty string), got {self.name!r}.")
        where = f"Attention variant {self.name!r}"
        if not isinstance(self.causal, bool):
            raise VariantError(f"{where}: causal must be True or False, got {self.causal!r}.")
        for mod, kind, n in ((self.mask_mod, "mask_mod", 4), (self.score_mod, "score_mod", 5)):
            if mod is not None:
                _check_signature(mod, kind, n, where)
        if self.window is not None and (not isinstance(self.window, int) or isinstance(self.window, bool)
                                        or self.window < 1):
            raise VariantError(f"{where}: window must be a positive number of tokens, got {self.window!r}.")
        if self.scale is not None and (not isinstance(self.scale, (int, float)) or not 0 < self.scale < math.inf):
            raise VariantError(f"{where}: scale must be a positive number, got {self.scale!r}.")
        if not (self.sink is None or isinstance(self.sink, (str, PerHead))):
            raise VariantError(f"{where}: sink must name a per-head tensor of the attention layer or be a "
                               f"PerHead, got {type(self.sink).__name__}.")
        for name, param in self.params.items():
            if not name.isidentifier() or not isinstance(param, (PerRequest, PromptLength, PerHead)):
                raise VariantError(f"{where}: parameter {name!r} must be an identifier mapped to a PerRequest, "
                                   f"PromptLength or PerHead.")
        if self.kernel is ...:  # mods no kernel is told about are flex's alone
            object.__setattr__(self, "kernel", None if self.mask_mod or self.score_mod else {})
        if self.kernel is not None and not isinstance(self.kernel, dict):
            raise VariantError(f"{where}: kernel must be a dict of kernel features or None.")

    # ---- composition

    def __and__(self, other: "AttentionVariant") -> "AttentionVariant":
        if not isinstance(other, AttentionVariant):
            return NotImplemented
        where = f"Attention variants {self.name!r} and {other.name!r}"
        for attr in ("sink", "scale"):
            if getattr(self, attr) is not None and getattr(other, attr) is not None:
                raise VariantError(f"{where} both set a {attr}; a composed variant has one.")
        clash = [n for n in self.params.keys() & other.params.keys() if self.params[n] != other.params[n]]
        if clash:
            raise VariantError(f"{where} both define the parameter {clash[0]!r} differently.")
        windows = [w for w in (self.window, other.window) if w is not None]
        # a kernel takes one of each feature: two softcaps or two chunks compose to what none computes
        covered = self.kernel is not None and other.kernel is not None and not self.kernel.keys() & other.kernel.keys()
        return AttentionVariant(
            f"{self.name}&{other.name}", mask_mod=_and_masks(self, other), score_mod=_chain_scores(self, other),
            causal=_and_causal(self, other), window=min(windows) if windows else None,
            sink=self.sink if self.sink is not None else other.sink,
            scale=self.scale if self.scale is not None else other.scale,
            params={**self.params, **other.params},
            kernel={**self.kernel, **other.kernel} if covered else None)

    # ---- what the engine reads

    @property
    def plain(self) -> bool:
        """Whether this is plain causal attention (with perhaps another scale): flex's fast path."""
        return (self.mask_mod is None and self.score_mod is None and self.causal and self.window is None
                and self.sink is None)

    def features(self) -> dict | None:
        """The kernel features this variant needs of a kernel override (None: flex only)."""
        if self.kernel is None:
            return None
        features = dict(self.kernel)
        if not self.causal:
            return None
        if self.window is not None:
            features["window"] = self.window
        if self.sink is not None:
            features["sinks"] = self.sink
        return features

    def with_scale(self, scale: float | None) -> "AttentionVariant":
        return self if scale is None else replace(self, scale=scale)


def _and_causal(a: AttentionVariant, b: AttentionVariant) -> bool:
    """Whether `a & b` is causal. Both masks hold, so a causal variant with a mask_mod (whose mask
    assumes causality) keeps it causal; a causal one without (a score_mod, a window: the default
    mask) says nothing about it, so another's causal=False stands."""
    if (a.causal and a.mask_mod is not None) or (b.causal and b.mask_mod is not None):
        return True
    return a.causal and b.causal


def _check_signature(mod: Callable, kind: str, n: int, where: str) -> None:
    """A mod takes n positional arguments, or n + 1 with the parameters `p` last."""
    if not callable(mod):
        raise VariantError(f"{where}: its {kind} must be a function, got {type(mod).__name__}.")
    try:
        sig = inspect.signature(mod)
    except (TypeError, ValueError):
        return  # a builtin or C function: the trial run in `check` decides
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
        return
    if len(positional) not in (n, n + 1):
        args = "score, b, h, q_pos, kv_pos" if kind == "score_mod" else "b, h, q_pos, kv_pos"
        raise VariantError(f"{where}: its {kind} takes {len(positional)} arguments; a {kind} takes ({args}) "
                           f"or ({args}, p).")


def takes_params(mod: Callable, n: int) -> bool:
    """Whether a mod of n coordinates takes the parameters `p` as well."""
    try:
        sig = inspect.signature(mod)
    except (TypeError, ValueError):
        return False
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return len(positional) == n + 1


def with_params(mod: Callable | None, n: int) -> Callable | None:
    """`mod` as a function of its n coordinates and `p`, whichever form it was written in: decided
    once here, so that nothing inspects it while a compiler traces it."""
    if mod is None or takes_params(mod, n):
        return mod
    return lambda *args: mod(*args[:n])


def call_mask(mod: Callable, b, h, q_pos, kv_pos, p):
    return with_params(mod, 4)(b, h, q_pos, kv_pos, p)


def call_score(mod: Callable, score, b, h, q_pos, kv_pos, p):
    return with_params(mod, 5)(score, b, h, q_pos, kv_pos, p)


def _and_masks(a: AttentionVariant, b: AttentionVariant):
    masks = [with_params(m, 4) for m in (a.mask_mod, b.mask_mod) if m is not None]
    if len(masks) < 2:
        return masks[0] if masks else None
    first, second = masks

    def mask(b_, h, q_pos, kv_pos, p):
        return first(b_, h, q_pos, kv_pos, p) & second(b_, h, q_pos, kv_pos, p)

    return mask


def _chain_scores(a: AttentionVariant, b: AttentionVariant):
    scores = [with_params(s, 5) for s in (a.score_mod, b.score_mod) if s is not None]
    if len(scores) < 2:
        return scores[0] if scores else None
    first, second = scores

    def score(s, b_, h, q_pos, kv_pos, p):
        return second(first(s, b_, h, q_pos, kv_pos, p), b_, h, q_pos, kv_pos, p)

    return score


class Params:
    """`p`: a variant's parameters by name, as device tensors (`p.window[b]`, `p.slopes[h]`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.__dict__.update(tensors)

    def __repr__(self) -> str:
        return f"Params({', '.join(self.__dict__)})"


def check(variant: AttentionVariant, num_heads: int = 4) -> None:
    """Run the variant's mods once on a few coordinates, as FlexAttention evaluates them (under vmap,
    element by element): a mod that fails there (data-dependent shapes, a wrong return type, an
    unknown parameter) raises VariantError in one sentence, before any model loads."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    where = f"Attention variant {variant.name!r}"
    p = Params(trial_params(variant, num_heads, requests=2, device=torch.device("cpu")))
    b, h, n = 2, num_heads, 16
    try:
        if variant.mask_mod is not None:
            mask = lambda b_, h_, q, kv: call_mask(variant.mask_mod, b_, h_, q, kv, p)  # noqa: E731
            out = mask(torch.tensor(0), torch.tensor(0), torch.tensor(3), torch.tensor(1))
            if not (isinstance(out, torch.Tensor) and out.dtype == torch.bool):
                raise VariantError(f"{where}: its mask_mod must return a bool tensor, got "
                                   f"{getattr(out, 'dtype', type(out).__name__)}.")
            create_block_mask(mask, b, h, n, n, device="cpu", BLOCK_SIZE=n)  # under vmap, as flex runs it
        if variant.score_mod is not None:
            score = lambda s, b_, h_, q, kv: call_score(variant.score_mod, s, b_, h_, q, kv, p)  # noqa: E731
            out = score(torch.tensor(0.5), torch.tensor(0), torch.tensor(0), torch.tensor(3), torch.tensor(1))
            if not (isinstance(out, torch.Tensor) and out.dtype == torch.float32):  # float64 breaks flex's p @ v
                raise VariantError(f"{where}: its score_mod must return the score, a float32 tensor as it is "
                                   f"given, got {getattr(out, 'dtype', type(out).__name__)}.")
            q = torch.randn(b, h, n, 8)
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = flex_attention(q, q, q, score_mod=score)
            if not torch.isfinite(out).all():
                raise VariantError(f"{where}: its score_mod gives non-finite attention on random scores.")
    except VariantError:
        raise
    except Exception as e:  # vmap refuses data-dependent shapes, a missing parameter is an AttributeError
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise VariantError(f"{where}: its mods cannot run as FlexAttention mods ({type(e).__name__}: "
                           f"{msg[:200]}).") from None


def trial_params(variant: AttentionVariant, num_heads: int, requests: int, device) -> dict[str, torch.Tensor]:
    """Parameter tensors for `requests` request slots and `num_heads` heads, holding defaults."""
    out = {}
    for name, param in variant.params.items():
        if isinstance(param, PerHead):
            out[name] = param.tensor(num_heads, f"Attention variant {variant.name!r}'s parameter {name!r}").to(device)
        elif isinstance(param, PromptLength):
            out[name] = torch.zeros(requests, dtype=param.dtype, device=device)
        else:
            out[name] = torch.full((requests,), param.default, dtype=param.dtype, device=device)
    return out
