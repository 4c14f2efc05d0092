"""Attention variants as one engine runs them: each distinct variant bound to device tensors for its
parameters, and which layer runs which.

A `VariantSet` is built once per engine from the per-layer variants (the model's own, composed with
the user's: layer_variants.py). Per-request parameters live in tensors with a row per request
slot (the runner's token_buf slot, stable while a request runs), written when a request's prefill
step is planned; per-head ones hold this rank's heads. A `BoundVariant` gives the logical
visibility and score of its variant in those tensors; the FlexAttention masks (flex_masks.py) map
pool slots, packed rows and query blocks onto the logical coordinates it takes.

A variant's Python constants (its window, and whatever its mods close over: a chunk size, a softcap)
reach a compiled step as constants of the graph, not as symbols, however the step reaches the
variant (`VariantMods`): the engine compiles its prefill with dynamic shapes, which makes every
other Python integer the step reads symbolic. The kernels then specialize on them, and a mod
captures no symbolic integer (which FlexAttention's FLASH lowering refuses).
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

from flexsgl.attention.variant import (AttentionVariant, Params, PerHead, PerRequest, PromptLength, VariantError,
                                      with_params)

_ids = itertools.count()
# The request's prompt length, a parameter every non-causal variant reads (VariantMods.visible): a
# preempted request recomputes its outputs in one prefill, and those must not see later ones.
PROMPT_LEN = "_prompt_len"
BOUND: dict[int, "BoundVariant"] = {}  # by id: flex_ops' decode op finds a layer's variant by its id


class VariantMods(nn.Module):
    """A variant's visibility and score rules with the constants they read: its window, causality
    and mods (as functions of their coordinates and `p`, whichever form they were written in).
    An nn.Module for what Dynamo does with one: an integer it reaches through a module's
    attributes, a mod's closure included, is a constant of the graph, guarded by value
    (`torch._dynamo.config.allow_unspec_int_on_nn_module`, off by default); an integer reached
    through a step's arguments is symbolic under dynamic shapes. A model whose variants differ in
    a constant compiles once per value; requests never recompile, as their parameters are tensors.
    Held by a BoundVariant, not registered with any model."""

    def __init__(self, variant: AttentionVariant):
        super().__init__()
        self.window, self.causal = variant.window, variant.causal
        self.mask_mod, self.score_mod = with_params(variant.mask_mod, 4), with_params(variant.score_mod, 5)

    def visible(self, base, slot, h, q_pos, kv_pos, p):
        vis = base
        if self.causal:
            vis = vis & (kv_pos <= q_pos)
        elif hasattr(p, PROMPT_LEN):  # past the prompt, causal: an output token saw no later one when decoded
            vis = vis & ((kv_pos <= q_pos) | (kv_pos < getattr(p, PROMPT_LEN)[slot]))  # (nor when recomputed)
        if self.window is not None:
            vis = vis & (q_pos - kv_pos < self.window)
        if self.mask_mod is not None:
            vis = vis & self.mask_mod(slot, h, q_pos, kv_pos, p)
        return vis

    def score(self, s, slot, h, q_pos, kv_pos, p):
        return s if self.score_mod is None else self.score_mod(s, slot, h, q_pos, kv_pos, p)


class BoundVariant:
    """One variant with its parameters in device tensors (module docstring)."""

    def __init__(self, variant: AttentionVariant, params: dict[str, torch.Tensor], sink: torch.Tensor | None):
        self.variant = variant
        self.id = next(_ids)
        BOUND[self.id] = self
        self.p = Params(params)
        self.window, self.causal, self.scale = variant.window, variant.causal, variant.scale
        self.mods = VariantMods(variant)
        self.mask_mod, self.score_mod = self.mods.mask_mod, self.mods.score_mod
        self.sink_name = variant.sink if isinstance(variant.sink, str) else None
        self.sink = sink  # a PerHead sink's values (this rank's heads); a named one comes from the layer
        self.plain = variant.plain

    @functools.cached_property
    def reads_head(self) -> bool:
        """Whether the mask reads the query head h (traced once; where it cannot be, taken to): the
        uncompiled path then builds a mask per head."""
        if self.mask_mod is None:
            return False
        from torch.fx.experimental.proxy_tensor import make_fx

        coord = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
        try:
            graph = make_fx(lambda b, h, q, kv: self.visible(q >= 0, b, h, q, kv))(
                coord(0), coord(0), coord(3), coord(1)).graph
        except Exception:
            return True
        return bool([n for n in graph.nodes if n.op == "placeholder"][1].users)

    @property
    def has_sink(self) -> bool:
        return self.variant.sink is not None

    @property
    def full_blocks(self) -> bool:
        """Whether KV blocks wholly inside the causal window can skip the mask: no mask_mod of the user's."""
        return self.mask_mod is None and self.causal

    def visible(self, base, slot, h, q_pos, kv_pos):
        """`base` (which keys exist and belong to the query's request) narrowed by the variant: causality,
        the window and the mask_mod, at request slot `slot`, head h and positions q_pos, kv_pos."""
        return self.mods.visible(base, slot, h, q_pos, kv_pos, self.p)

    def score(self, s, slot, h, q_pos, kv_pos):
        return self.mods.score(s, slot, h, q_pos, kv_pos, self.p)

    def layer_sink(self, attn) -> torch.Tensor | None:
        """The sink logits `[heads]` an attention layer attends with (None: no sink)."""
        if self.sink_name is not None:
            sink, heads = getattr(attn, self.sink_name, None), getattr(attn, "hq", None)
            if not isinstance(sink, torch.Tensor) or sink.dim() != 1 or heads not in (None, sink.numel()):
                what = "nothing" if sink is None else (f"a tensor of shape {tuple(sink.shape)}"
                                                       if isinstance(sink, torch.Tensor) else type(sink).__name__)
                raise VariantError(f"Attention variant {self.variant.name!r}: its sink {self.sink_name!r} names "
                                   f"{what} in this model's attention layers, not a tensor of one logit per head.")
            return sink
        return self.sink


class VariantSet:
    """Every layer's bound variant (None: plain causal attention) and the per-request parameters."""

    def __init__(self, per_layer: list[AttentionVariant | None], num_heads: int, head_offset: int,
                 total_heads: int, slots: int, device: torch.device):
        self.device = device
        self.request_params: dict[str, PerRequest | PromptLength] = {}
        for v in filter(None, per_layer):
            self.request_params.update((n, p) for n, p in v.params.items() if not isinstance(p, PerHead))
        if any(v is not None and not v.causal for v in per_layer):  # VariantMods.visible reads it
            self.request_params[PROMPT_LEN] = PromptLength()
        self.request_tensors = {n: torch.zeros(slots, dtype=p.dtype, device=device)
                                for n, p in self.request_params.items()}
        if PROMPT_LEN in self.request_tensors:  # until a request's prefill writes it: every key is the prompt's
            self.request_tensors[PROMPT_LEN].fill_(torch.iinfo(torch.int32).max)
        bound: dict[int, BoundVariant] = {}
        for v in filter(None, per_layer):
            if id(v) not in bound:
                bound[id(v)] = self._bind(v, num_heads, head_offset, total_heads)
        self.layers = [None if v is None else bound[id(v)] for v in per_layer]
        self.bound = list(bound.values())

    def _bind(self, v: AttentionVariant, num_heads: int, offset: int, total: int) -> BoundVariant:
        heads = slice(offset, offset + num_heads)
        where = f"Attention variant {v.name!r}'s"
        params = {n: (p.tensor(total, f"{where} parameter {n!r}")[heads].to(self.device) if isinstance(p, PerHead)
                      else self.request_tensors[n]) for n, p in v.params.items()}
        if not v.causal:
            params[PROMPT_LEN] = self.request_tensors[PROMPT_LEN]
        sink = (v.sink.tensor(total, f"{where} sink")[heads].float().to(self.device) if isinstance(v.sink, PerHead)
                else None)
        return BoundVariant(v, params, sink)

    @property
    def non_plain(self) -> list[BoundVariant]:
        return [b for b in self.bound if not b.plain]

    def host_values(self, requests) -> dict[str, list]:
        """Each per-request parameter's value for each of `requests` (their slots get them at prefill)."""
        out = {}
        for name, param in self.request_params.items():
            if isinstance(param, PromptLength):
                out[name] = [r.prompt_len for r in requests]
            else:
                out[name] = [param.value((r.sampling.attention_params or {}).get(name)) for r in requests]
        return out

    def write(self, slots: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Write per-request parameter values (from host_values, on the device) at request slots."""
        for name, tensor in self.request_tensors.items():
            tensor.index_copy_(0, slots, values[name].to(tensor.dtype))


def describe_variants(per_layer) -> str:
    """For the log: which layers run which variant ('' where every layer is plain causal)."""
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(per_layer):
        if v is not None:
            groups.setdefault(v.name, []).append(i)
    if not groups:
        return ""
    n = len(per_layer)
    return "; variants: " + ", ".join(f"{name} on {'all layers' if len(ls) == n else f'{len(ls)} of {n} layers'}"
                                      for name, ls in groups.items())
