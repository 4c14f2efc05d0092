"""Gemma 2 and Gemma 3 (text) settings read from an HF config.json into ModelConfig fields, and the
attention variant each of their layers runs.

Both read what transformers' Gemma2Config / Gemma3TextConfig read, with the same defaults where a
key is absent: `layer_types` (else Gemma 2 alternates sliding and global layers from layer 0,
Gemma 3 makes every `sliding_window_pattern`-th layer global), `sliding_window`,
`query_pre_attn_scalar`, the soft caps, and for Gemma 3 the RoPE of each layer kind: transformers
5's `rope_parameters` nested by layer type, or the older flat keys (`rope_theta` and `rope_scaling`
for the global layers, `rope_local_base_freq` for the local ones). Gemma 3 never applies an
attention softcap (transformers' Gemma3Attention does not pass it), so its key is not read.
"""

from __future__ import annotations

from flexsgl.errors import CheckpointError, short_repr
from flexsgl.model.config import _windows

ACTIVATIONS = ("gelu_pytorch_tanh",)  # GeGLU with the tanh-approximate GELU
GLOBAL_ROPE_TYPES = ("default", "linear")


def gemma2_fields(get, d: dict, rope: dict, source: str) -> dict:
    fields = _common(get, d, source, pattern=2, final_softcap=30.0)
    fields["attn_softcap"] = _optional_number(get, d, "attn_logit_softcapping", 50.0)
    return fields


def gemma3_fields(get, d: dict, rope: dict, source: str) -> dict:
    fields = _common(get, d, source, pattern=get.positive("sliding_window_pattern", 6), final_softcap=None)
    nested = get.typed("rope_parameters", dict, None)
    if nested is not None and not {"full_attention", "sliding_attention"} & nested.keys():
        raise CheckpointError(f"{source}: Gemma 3's 'rope_parameters' must be nested by layer type "
                              "('full_attention', 'sliding_attention'), as transformers reads them.")
    scaling = d.get("rope_scaling")
    if nested is not None and isinstance(scaling, dict) and {**(nested.get("full_attention") or {}), **scaling} != (
            nested.get("full_attention") or {}):
        raise CheckpointError(f"{source} gives Gemma 3's RoPE both in 'rope_parameters' and, otherwise, in "
                              "'rope_scaling'; give it in one of them.")
    if nested is not None:
        full = _rope_dict(nested.get("full_attention"), "rope_parameters['full_attention']", source)
        local = _rope_dict(nested.get("sliding_attention"), "rope_parameters['sliding_attention']", source)
    else:  # the flat keys: rope (from_hf's rope_parameters or rope_scaling) scales the global layers
        full, local = rope, {}
    # A base the nested parameters lack comes from the flat keys, as transformers fills it in
    theta = get.number({"rope_theta": get.number(d, "rope_theta", 1e6), **full}, "rope_theta")
    local_theta = get.number({"rope_theta": get.number(d, "rope_local_base_freq", 1e4), **local}, "rope_theta")
    scaling = _global_scaling(get, full, source)
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise CheckpointError(f"{source}: RoPE type {short_repr(local_type)} on Gemma 3's sliding-window layers is "
                              f"not supported; flexsgl runs 'default' there.")
    return {**fields, "rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


def _common(get, d: dict, source: str, pattern: int, final_softcap: float | None) -> dict:
    """What Gemma 2 and 3 share: the layer kinds and window, the scale, the final softcap, refusals."""
    activation = d.get("hidden_activation", ACTIVATIONS[0])
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"{source} sets hidden_activation to {short_repr(activation)}; flexsgl runs Gemma's "
                              f"{' or '.join(ACTIVATIONS)}.")
    for key in ("use_bidirectional_attention", "attention_bias"):
        if d.get(key):
            raise CheckpointError(f"{source} sets {key} to {short_repr(d[key])}, which flexsgl does not run for "
                                  f"Gemma (it runs false).")
    layers = get.positive("num_hidden_layers")
    windows = _windows(get, d, layers, source)
    types = windows["layer_types"] or tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                            for i in range(layers))
    return {"layer_types": types, "sliding_window": windows["sliding_window"] or 4096,
            "query_pre_attn_scalar": get.number(d, "query_pre_attn_scalar", 256.0),
            "final_softcap": _optional_number(get, d, "final_logit_softcapping", final_softcap),
            "tie_word_embeddings": get.typed("tie_word_embeddings", bool, True)}


def _optional_number(get, d: dict, key: str, default: float | None) -> float | None:
    """A positive number, None where the config sets null, `default` where it lacks the key."""
    if key not in d:
        return default
    return None if d[key] is None else get.number(d, key)


def _rope_dict(value, what: str, source: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{source}: {what} must be a JSON object, got {short_repr(value)}.")
    return value


def _global_scaling(get, rope: dict, source: str) -> dict | None:
    """The global layers' RoPE scaling: None, or linear's {"rope_type": "linear", "factor": f}."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in GLOBAL_ROPE_TYPES:
        raise CheckpointError(f"{source}: RoPE type {short_repr(rope_type)} on Gemma 3's global layers is not "
                              f"supported; flexsgl runs {' and '.join(map(repr, GLOBAL_ROPE_TYPES))}.")
    if rope_type == "default":
        return None
    return {"rope_type": "linear", "factor": get.number(rope, "factor")}


def gemma_variants(cfg) -> list:
    """Each layer's attention variant: on the sliding-window layers the window, on every layer Gemma
    2's attention softcap and, where query_pre_attn_scalar is not head_dim, its softmax scale
    query_pre_attn_scalar**-0.5; one object per layer kind (None: plain causal)."""
    from flexsgl.attention.variants import causal, sliding_window, softcap

    cap = None if cfg.attn_softcap is None else softcap(cfg.attn_softcap)
    window = sliding_window(cfg.sliding_window)
    local, full = (window, cap) if cap is None else (window & cap, cap)
    if cfg.query_pre_attn_scalar != cfg.head_dim:
        scale = cfg.query_pre_attn_scalar ** -0.5
        local, full = local.with_scale(scale), (full or causal()).with_scale(scale)
    return [local if t == "sliding_attention" else full for t in cfg.layer_types]
