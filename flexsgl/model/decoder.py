"""The GQA decoder that serves Qwen3 and, with q/k norm off (ModelConfig.qk_norm), Llama 3; with a
mixture of experts (flexsgl/model/moe.py) for the MLP of the layers ModelConfig.moe names, Qwen3-MoE.

Parameter names follow HF's except that q/k/v and gate/up projections are fused; each parameter's
weight loader (flexsgl/model/weight_loaders.py) puts an HF tensor into its part of the fused
weight, and a per-expert tensor into its expert's slice of the stacked experts. Tokens arrive
packed, `[tokens]`. Each attention layer stores its K/V into its part of the KV pool the engine
binds to the model (`bind_kv_pool`), through the pool layout's store path (flexsgl/cache/store.py),
then attends through the backend that the ForwardBatch carries.
"""

from __future__ import annotations

import torch
from torch import nn

from flexsgl.distributed import allreduce
from flexsgl.distributed import layers as tp
from flexsgl.kernels import gemv
from flexsgl.model.causal_lm import CausalLM
from flexsgl.model.config import ModelConfig
from flexsgl.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from flexsgl.model.moe import MoE, expert_part
from flexsgl.model.weight_loaders import packed_name


class Attention(nn.Module):
    """The q/k/v and o projections (DecoderLayer runs them through flexsgl.kernels.gemv) and `attend`,
    everything between them: q/k norm, RoPE and the K/V store, through its store path
    (flexsgl/cache/store.py), then the attention backend."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=cfg.attention_bias)  # as Llama and Qwen3 have it
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kv_store = None  # CausalLM.bind_kv_pool sets it, and this layer's K/V:
        self.cache: tuple[torch.Tensor, ...] = ()
        # bind_variants sets the layer's attention variant (bound_variant.py; None: plain causal)
        # and, where the variant has a sink, its per-head logits
        self.variant = None
        self.sink: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # an FP8 cache's [K, V] scales (bind_kv_pool)

    def attend(self, qkv, positions, rope: RotaryEmbedding, fb):
        """qkv_proj's output -> attention output `[tokens, Hq * D]`, the input of o_proj. With an FP8
        cache K and V are stored divided by their scales, and since q . (s_k k) = (s_k q) . k the
        query takes K's scale and the output V's: the backend reads the FP8 values as they are."""
        norms = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        eps = 0.0 if self.q_norm is None else self.q_norm.eps
        scales = self.kv_scales
        q = self.kv_store.norm_rope_store(self.cache, qkv, norms, eps, rope, positions, fb.out_slots, scales)
        if scales is None:
            out = fb.backend.forward(q, self.cache, fb, self.variant, self.sink)
        else:  # the products in float32: a scale rounded to 16 bits would bias every score of the layer
            q = (q.float() * scales[0]).to(q.dtype)
            out = fb.backend.forward(q, self.cache, fb, self.variant, self.sink)
            out = (out.float() * scales[1]).to(out.dtype)
        return out.reshape(qkv.shape[0], self.hq * self.d)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe
        self.parallel = cfg.tp_size > 1
        self.mlp = (MoE(cfg.hidden_size, moe, self.parallel) if moe is not None and moe.sparse(layer_id)
                    else GatedMLP(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x, positions, rope, fb, normed=None, next_norm=None):
        # x + attn(norm(x)), then x + mlp(norm(x)), as four projections with the norms, the SiLU
        # gate and the residual adds folded in (one kernel each at decode batch 1; see gemv.py).
        # Under tensor parallelism o_proj and down_proj are row-parallel: the ranks' partial sums
        # are all-reduced before the residual is added (flexsgl/distributed/layers.py).
        if next_norm is not None:
            return self.forward_fused(x, normed, next_norm, positions, rope, fb)
        attn, mlp = self.self_attn, self.mlp
        qkv = gemv.norm_linear(x, self.input_layernorm, attn.qkv_proj)
        out = attn.attend(qkv, positions, rope, fb)
        x = tp.row_linear(out, attn.o_proj, x) if self.parallel else gemv.linear(out, attn.o_proj, residual=x)
        if isinstance(mlp, MoE):
            return mlp(x, self.post_attention_layernorm, residual=x)
        gate_up = gemv.norm_linear(x, self.post_attention_layernorm, mlp.gate_up_proj)
        if self.parallel:
            return tp.row_silu_linear(gate_up, mlp.down_proj, x)
        return gemv.silu_linear(gate_up, mlp.down_proj, residual=x)

    def forward_fused(self, x, normed, next_norm, positions, rope, fb):
        """forward of a dense layer where all-reduces add the residual and RMSNorm the sum in their
        own kernel (tp.row_linear_norm): `normed` is input_layernorm(x) when the last all-reduce
        made it (None: not made), and the result is (x', next_norm's RMSNorm of x' or None), for
        `next_norm` the weight of the next layer's input_layernorm (the model's norm after the last)."""
        attn, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        qkv = (gemv.norm_linear(x, self.input_layernorm, attn.qkv_proj) if normed is None
               else gemv.linear(normed, attn.qkv_proj, None))
        out = attn.attend(qkv, positions, rope, fb)
        x, h = tp.row_linear_norm(out, attn.o_proj, x, post.weight, post.eps)
        gate_up = (gemv.norm_linear(x, post, mlp.gate_up_proj) if h is None
                   else gemv.linear(h, mlp.gate_up_proj, None))
        return tp.row_silu_linear_norm(gate_up, mlp.down_proj, x, next_norm, post.eps)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = tp.embedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)


# HF module name -> (the fused module holding it, its part there)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DecoderForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DecoderModel(cfg))
        self.dense = not any(isinstance(layer.mlp, MoE) for layer in self.model.layers)  # forward's fused path
        self.assign_split_loaders()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        """CausalLM's forward; where all-reduces carry the residual add and RMSNorm (FlashInfer's
        under tensor parallelism, dense layers only), each layer hands the next its stream together
        with the next input_layernorm's output, and the last the model's norm of it."""
        m = self.model
        if not (allreduce.fusing() and self.dense):
            return super().forward(input_ids, positions, fb)
        x, h = m.embed_tokens(input_ids), None
        nexts = [layer.input_layernorm.weight for layer in m.layers[1:]] + [m.norm.weight]
        for layer, next_norm in zip(m.layers, nexts):
            x, h = layer(x, positions, m.rotary, fb, h, next_norm)
        rows = fb.logits_index
        return (gemv.norm_linear(x[rows], m.norm, self.lm_head) if h is None
                else gemv.linear(h[rows], self.lm_head, None))

    def checkpoint_name(self, hf_name: str) -> tuple[str, int | None]:
        """The parameter an HF tensor fills and its part there (None: all of it): a fused part, or
        (expert, 0 gate / 1 up / None down) of a stacked expert parameter."""
        return expert_part(hf_name) or packed_name(hf_name, FUSED)

