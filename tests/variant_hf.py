"""HF transformers' model of a checkpoint, each layer's attention replaced by a float64 one that
applies an attention variant as a test writes it out (logical positions: no pages, blocks or
flex): the reference for an engine serving that checkpoint with those variants."""

from __future__ import annotations

import itertools
from typing import Callable

import torch

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
        q, k, v = query.double(), key.double(), value.double()  # [B, H, S, D], K and V on fewer heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
        h = torch.arange(q.shape[1])[:, None, None]
        q_pos = torch.arange(k.shape[2] - q.shape[2], k.shape[2])[None, :, None]
        kv_pos = torch.arange(k.shape[2])[None, None, :]
        if score is not None:
            s = score(s, h, q_pos, kv_pos)
        s = s.masked_fill(~((kv_pos <= q_pos) & visible(h, q_pos, kv_pos)).expand(s.shape), float("-inf"))
        out = torch.softmax(s, dim=-1) @ v
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    name = f"flexsgl_written_variants_{next(_names)}"  # one per model: the registry is global
    AttentionInterface.register(name, attention)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name).eval()
