"""CausalLM: what every flexsgl model does alike once it is built.

A model holds `self.cfg`, `self.model` (its `embed_tokens`, `layers`, `norm` and `rotary`; each layer
its `self_attn` and `mlp`) and `self.lm_head`, and is built on the meta device. The loader
(flexsgl/model/loader.py) then calls `materialize`, and the engine (flexsgl/engine_core.py)
`bind_kv_pool` and `bind_variants` once before the first step; flexsgl/compile.py compiles its
`compiled_regions`. A model changes what is its own by overriding `materialize`, `place_layer`
or `forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from flexsgl.cache.store import store_path
from flexsgl.distributed import layers as tp
from flexsgl.kernels import gemv
from flexsgl.model.moe import MoE
from flexsgl.model.weight_loaders import FirstRankOnly, allocate, split_loader
from flexsgl.sampling.sampler import row_argmax


class CausalLM(nn.Module):
    def __init__(self, cfg, model: nn.Module):
        """`model` (its embed_tokens, layers, norm and rotary) and the LM head over this rank's
        vocabulary rows (all of them with one rank), tied to the embedding where `cfg` says so."""
        super().__init__()
        self.cfg, self.model = cfg, model
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_rows(cfg.vocab_size, cfg.tp_size), bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Per layer, the checkpoint's [k_scale, v_scale] for an FP8 KV cache (the loader sets them;
        # 1.0 where a checkpoint has none)
        self.kv_cache_scales: dict[int, list[float]] = {}

    def assign_split_loaders(self) -> None:
        """Each parameter's weight loader: the fused parts (q, k, v; gate, up), and under tensor
        parallelism this rank's slices of them (flexsgl/distributed/layers.py split_of), a
        row-parallel projection's bias on rank 0 only, and the loaders that split a parameter
        themselves (stacked experts) for this rank; a parameter held whole that has a loader of its
        own (Gemma's 1 + w norms) keeps it."""
        whole, rank, size = self.cfg.unsharded or self.cfg, self.cfg.tp_rank, self.cfg.tp_size
        for name, p in self.named_parameters():
            loader = getattr(p, "weight_loader", None)
            own = None if loader is None else loader.sharded(rank, size)
            if own is not None:
                p.weight_loader = own
                continue
            if tp.row_parallel_bias(name):
                p.weight_loader = FirstRankOnly(rank)
                continue
            split = tp.split_of(name, whole, rank, size)
            if split is not None or not hasattr(p, "weight_loader"):
                p.weight_loader = split_loader(split)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the parameters of this model, built on the meta device (their values come from
        flexsgl/model/loader.py), and compute its rotary tables."""
        allocate(self, device, dtype)
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.model.rotary.build(device)

    def bind_kv_pool(self, pool) -> None:
        """Give every attention layer its K/V (or latents) in the pool and the store path that writes
        them, and each layer what it keeps of the device (`place_layer`), once, before the first step."""
        store = store_path(pool, self.cfg.num_heads)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            attn.kv_store, attn.cache = store, pool.layer_cache(i)
            if pool.quantized:
                attn.kv_scales = torch.tensor(self.kv_cache_scales.get(i, [1.0, 1.0]), dtype=torch.float32,
                                              device=pool.device)
            self.place_layer(layer, pool.device)

    def place_layer(self, layer: nn.Module, device: torch.device) -> None:
        """A layer's device-dependent state: a MoE layer's experts note the device and zero their counters."""
        if isinstance(layer.mlp, MoE):
            layer.mlp.place(device)

    def bind_variants(self, variants) -> None:
        """Give every attention layer its attention variant from `variants` (a VariantSet, one per
        layer) and the sink logits it reads, if any (once, before the first step)."""
        for layer, bound in zip(self.model.layers, variants.layers):
            attn = layer.self_attn
            attn.variant = bound
            attn.sink = None if bound is None else bound.layer_sink(attn)

    def compiled_regions(self) -> list[nn.Module]:
        """What torch.compile compiles (flexsgl/compile.py): each layer, one code per kind of layer
        (dense and MoE, sliding and global)."""
        return list(self.model.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        """Returns the logits (in the model's dtype) of the tokens at `fb.logits_index` (each request's
        last token), over this rank's vocabulary slice under tensor parallelism (`whole_logits`
        gathers them). The sampler upcasts them only where it needs to: a greedy step takes the argmax
        as they are, which saves writing and re-reading a float32 copy of [batch, vocab]."""
        m = self.model
        x = m.embed_tokens(input_ids)
        for layer in m.layers:
            x = layer(x, positions, m.rotary, fb)
        return gemv.norm_linear(x[fb.logits_index], m.norm, self.lm_head)

    def argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(each row's argmax over the vocabulary, whether each row's logits are all finite) of
        `logits` as forward returns them: under tensor parallelism this rank's vocabulary slice, the
        ranks exchanging three numbers a row; with one rank the whole row, and None for the
        finiteness, which the caller checks on the logits it holds."""
        if self.cfg.tp_size > 1:
            return tp.vocab_parallel_argmax(logits, self.cfg.vocab_size, self.cfg.tp_rank)
        return row_argmax(logits), None

    def whole_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` as forward returns them, over the whole vocabulary `[T, vocab]`: under tensor
        parallelism gathered from every rank (each rank calls this at the same point of a step)."""
        return tp.gather_logits(logits, self.cfg.vocab_size) if self.cfg.tp_size > 1 else logits
