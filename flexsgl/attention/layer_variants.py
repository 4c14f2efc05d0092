"""Which attention variant each layer runs: the model's own (a sliding window on Mistral's layers,
softcap and alternating windows on Gemma's, sinks on GPT-OSS's) composed with the one the user
chose for that layer.

The user's choice (`LLM(model, attention=...)`, `--attention`) is a variant for every layer, or
variants for chosen layers:

    attention=sliding_window(512)                        every layer
    attention={"0::2": alibi(), "1::2": "softcap:cap=30"}  layers by slice, index, "i,j,k" or "all"
    --attention "alibi@0::2;softcap:cap=30@1::2"         the same on the command line
    --attention "alibi&softcap:cap=30"                   both on every layer (variants.resolve composes)

A variant named by a string is resolved by variants.resolve. A layer given two variants is refused
(compose them with `&`). Layers the user leaves out keep the model's own attention. Each distinct
composition is one object shared by its layers, so one compiled decoder layer serves all of them.
"""

from __future__ import annotations

from flexsgl.attention.variant import AttentionVariant, VariantError, check
from flexsgl.attention.variants import resolve


def user_variants(spec, num_layers: int) -> list[AttentionVariant | None]:
    """The user's variant for each layer (None: none chosen) from `spec` (module docstring)."""
    out: list[AttentionVariant | None] = [None] * num_layers
    if spec is None:
        return out
    if isinstance(spec, str):
        pairs = [_split_layers(p.strip()) for p in spec.split(";") if p.strip()]
    elif isinstance(spec, AttentionVariant):
        pairs = [("all", spec)]
    elif isinstance(spec, dict):
        pairs = list(spec.items())
    else:
        raise VariantError(f"attention must be a variant, a name, or a dict of layers to variants, got "
                           f"{type(spec).__name__}.")
    resolved: dict[int, AttentionVariant] = {}  # one object per distinct spec
    for layers, variant in pairs:
        v = resolve(variant)
        for i in select_layers(layers, num_layers):
            if out[i] is not None:
                raise VariantError(f"Layer {i} is given two attention variants ({out[i].name} and {v.name}); "
                                   f"give it one, composed with & where both should apply.")
            out[i] = resolved.setdefault(id(v), v)
    return out


def _split_layers(part: str) -> tuple[str, str]:
    variant, _, layers = part.partition("@")
    return (layers.strip() or "all"), variant.strip()


def select_layers(selector, num_layers: int) -> list[int]:
    """Layer indices from "all", an int, "start:stop[:step]" or "i,j,k"; VariantError if out of range
    (a slice that selects none included)."""
    if isinstance(selector, int) and not isinstance(selector, bool):
        picked = [selector]
    elif isinstance(selector, str) and selector.strip() == "all":
        return list(range(num_layers))
    elif isinstance(selector, str) and ":" in selector:
        try:
            bounds = [int(x) if x.strip() else None for x in selector.split(":")]
            picked = list(range(num_layers))[slice(*bounds)]
        except (ValueError, TypeError):
            raise VariantError(f"Layers {selector!r} are not a slice like '0::2'.") from None
        if not picked:
            raise VariantError(f"Layers {selector!r} select no layer; the model has {num_layers} layers.")
        return picked
    elif isinstance(selector, str):
        try:
            picked = [int(x) for x in selector.split(",")]
        except ValueError:
            raise VariantError(f"Layers {selector!r} are not 'all', an index, 'i,j,k' or a slice like '0::2'.") \
                from None
    else:
        raise VariantError(f"Layers must be 'all', an index or a slice string, got {selector!r}.")
    bad = [i for i in picked if not -num_layers <= i < num_layers]
    if bad:
        raise VariantError(f"Layer {bad[0]} does not exist; the model has {num_layers} layers.")
    return [i % num_layers for i in picked]


def layer_variants(own: list[AttentionVariant | None], user: list[AttentionVariant | None],
                   num_heads: int) -> list[AttentionVariant | None]:
    """Each layer's variant: the model's own composed with the user's (None: plain causal). Every
    distinct result is checked once (variant.check), so a variant that cannot run is refused here."""
    composed: dict[tuple[int, int], AttentionVariant | None] = {}
    out = []
    for mine, theirs in zip(own, user):
        key = (id(mine), id(theirs))
        if key not in composed:
            v = mine if theirs is None else theirs if mine is None else mine & theirs
            if v is not None and (v.mask_mod is not None or v.score_mod is not None):
                check(v, num_heads)
            composed[key] = v
        out.append(composed[key])
    return out


def kv_window(per_layer) -> int | None:
    """The window every layer keeps to, where every layer has one (the largest of them): keys
    further behind a query are never read again. None where a layer sees its whole context."""
    windows = [None if v is None else v.window for v in per_layer]
    return None if not windows or None in windows else max(windows)
