"""The attention variants flexsgl ships, each written with the public API (variant.py), and the names
`--attention` takes.

    causal()                    plain causal attention, the default
    sliding_window(window)      each query sees its last `window` keys (Mistral, Gemma, GPT-OSS)
    softcap(cap)                scores squashed into (-cap, cap) by cap * tanh(score / cap) (Gemma 2)
    attention_sinks(weight)     a learned per-head logit in every softmax's denominator (GPT-OSS)
    alibi()                     a per-head linear bias on distance, slope 2^(-8 (h + 1) / H) (BLOOM, MPT)
    chunked_local(chunk)        each query sees the keys of its own chunk of `chunk` positions (Llama 4)
    prefix_lm()                 the prompt sees itself both ways; what follows it is causal

`resolve("sliding_window:window=4096")` builds one from a name and keyword arguments, as the
command line gives them; a name of the form `module:attribute` imports a user's own variant (an
AttentionVariant, or a function returning one).
"""

from __future__ import annotations

import functools
import importlib
import math
import operator

import torch

from flexsgl.attention.variant import AttentionVariant, PerHead, PromptLength, VariantError


def causal() -> AttentionVariant:
    return AttentionVariant("causal")


def sliding_window(window: int) -> AttentionVariant:
    return AttentionVariant(f"sliding_window({window})", window=window)


def softcap(cap: float) -> AttentionVariant:
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
        raise VariantError(f"softcap: cap must be a positive number, got {cap!r}.")

    def score(s, b, h, q_pos, kv_pos):
        return cap * torch.tanh(s / cap)

    return AttentionVariant(f"softcap({cap})", score_mod=score, kernel={"softcap": float(cap)})


def attention_sinks(weight: str = "sinks") -> AttentionVariant:
    return AttentionVariant("attention_sinks", sink=weight)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al.): a geometric sequence from 2^(-8/n) for the nearest power of
    two n, interleaved with the next power's odd terms when num_heads is not one."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * (i + 1) / n) for i in range(n)]
    if n < num_heads:
        slopes += [2 ** (-4 * (2 * i + 1) / n) for i in range(num_heads - n)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi() -> AttentionVariant:
    def score(s, b, h, q_pos, kv_pos, p):
        return s - p.slopes[h] * (q_pos - kv_pos)

    return AttentionVariant("alibi", score_mod=score, params={"slopes": PerHead(alibi_slopes)}, kernel=None)


def chunked_local(chunk: int) -> AttentionVariant:
    def mask(b, h, q_pos, kv_pos):
        return q_pos // chunk == kv_pos // chunk

    return AttentionVariant(f"chunked_local({chunk})", mask_mod=mask, window=chunk, kernel={"chunk": chunk})


def prefix_lm() -> AttentionVariant:
    def mask(b, h, q_pos, kv_pos, p):
        return (kv_pos <= q_pos) | (kv_pos < p.prompt_len[b])

    return AttentionVariant("prefix_lm", mask_mod=mask, causal=False, params={"prompt_len": PromptLength()},
                            kernel=None)


SHIPPED = {"causal": causal, "sliding_window": sliding_window, "softcap": softcap,
           "attention_sinks": attention_sinks, "alibi": alibi, "chunked_local": chunked_local,
           "prefix_lm": prefix_lm}
_REGISTERED: dict[str, object] = {}


def register(name: str, variant) -> None:
    """Name a variant (an AttentionVariant, or a function of keyword arguments returning one) for
    `--attention NAME` and `resolve`."""
    if not name.isidentifier():
        raise VariantError(f"An attention variant's name must be an identifier, got {name!r}.")
    _REGISTERED[name] = variant


def names() -> list[str]:
    return [*SHIPPED, *_REGISTERED]


def resolve(spec) -> AttentionVariant:
    """An AttentionVariant from `spec`: a variant, or `NAME[:key=value,...]` where NAME is shipped,
    registered, or `module:attribute`, or several such joined by `&` (composed, left to right);
    VariantError in one sentence if it cannot be had."""
    if isinstance(spec, AttentionVariant):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise VariantError(f"An attention variant is an AttentionVariant or a name like "
                           f"'sliding_window:window=4096', got {spec!r}.")
    if "&" in spec:
        return functools.reduce(operator.and_, (resolve(part) for part in spec.split("&")))
    name, kwargs = _parse(spec.strip())
    target = SHIPPED.get(name) or _REGISTERED.get(name)
    if target is None and (":" in name or "." in name):
        target = _import(name)
    if target is None:
        raise VariantError(f"Unknown attention variant {name!r}; choose one of {', '.join(names())}, or "
                           f"give module:attribute.")
    if isinstance(target, AttentionVariant):
        if kwargs:
            raise VariantError(f"Attention variant {name!r} takes no arguments, got {', '.join(kwargs)}.")
        return target
    try:
        variant = target(**kwargs)
    except TypeError as e:
        raise VariantError(f"Attention variant {name!r}: {e}.") from None
    if not isinstance(variant, AttentionVariant):
        raise VariantError(f"Attention variant {name!r} did not give an AttentionVariant, got "
                           f"{type(variant).__name__}.")
    return variant


def _parse(spec: str) -> tuple[str, dict]:
    """'name:k=v,k2=v2' (or 'module:attr:k=v') -> (name, {k: v}) with numbers as numbers."""
    head, sep, tail = spec.rpartition(":")
    if sep and "=" in tail:
        name, args = head, tail
    else:
        name, args = spec, ""
    kwargs = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise VariantError(f"Attention variant {spec!r}: arguments are key=value pairs, got {item!r}.")
        kwargs[key.strip()] = _number(value.strip())
    return name, kwargs


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _import(name: str):
    module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        target = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise VariantError(f"Could not import attention variant {name!r}: {e}.") from None
    if not (isinstance(target, AttentionVariant) or callable(target)):
        raise VariantError(f"{name!r} is neither an AttentionVariant nor a function returning one.")
    return target
