"""HF transformers' model of a checkpoint, each layer's attention replaced by a float64 one that
applies an attention variant as a test writes it out (logical positions: no pages, blocks or
flex; tests/attention_reference.py's dense_variant_attention): the reference for an engine serving
that checkpoint with those variants."""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from tests.attention_reference import dense_variant_attention

# layer index -> (visible(h, q_pos, kv_pos) -> bool, score(s, h, q_pos, kv_pos) -> s, or None);
# s is q.k scaled by 1/sqrt(head_dim), h the query head; causality is added to every layer
Written = dict[int, tuple[Callable, Callable | None]]

_names = itertools.count()


def anywhere(h, q_pos, kv_pos):
    """visible: nothing beyond causality."""
    return torch.ones((), dtype=torch.bool)


def hf_with_variants(path, written: Written):
    """The model at `path` in float32, its attention at layer i the float64 attention `written[i]`
    defines (plain causal attention at layers `written` leaves out)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        visible, score = written.get(module.layer_idx, (anywhere, None))
        tokens = lambda t: t[0].transpose(0, 1).double()  # noqa: E731  [1, H, S, D] -> [S, H, D]
        out = dense_variant_attention(
            tokens(query), [(tokens(key), tokens(value))], [(0, query.shape[2])],
            lambda i, h, q, kv: (kv <= q) & visible(h, q, kv),
            None if score is None else lambda s, i, h, q, kv: score(s, h, q, kv), scale=scaling)
        return out.to(query.dtype)[None], None

    name = f"flexsgl_written_variants_{next(_names)}"  # one per model: the registry is global
    AttentionInterface.register(name, attention)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name).eval()
