"""DeepSeek-V2: multi-head latent attention (MLA) over a latent KV pool, dense then MoE layers.

Attention caches, per token, one latent vector: the normed compressed KV `c` (kv_lora_rank) and
the rotated shared key `k_pe` (qk_rope_head_dim), written to the latent pool
(flexsgl/cache/latent_pool.py). Attention runs in the *absorbed* form for every step, prefill and
decode: with kv_b_proj split per head into W_UK (key) and W_UV (value),

    score(q, token) = q_nope . (W_UK c) + q_pe . k_pe = (W_UK^T q_nope) . c + q_pe . k_pe

so each head's query is projected into the latent space, `[W_UK^T q_nope, q_pe]`, and attends over
the latent cache as one shared KV head whose key is the whole latent vector and whose value is
`c`; the output, in latent space, goes through W_UV per head and then o_proj. K and V are never
expanded, and a prefill over a cached prefix reads the prefix's latents like any other.

RoPE is DeepSeek's: it rotates interleaved pairs of the rope dims (HF applies it as a complex
product), with YaRN frequencies and YaRN's attention factor on cos/sin where the config asks; the
softmax scale carries YaRN's mscale_all_dim factor (MLAConfig.softmax_scale).

Parameter names follow HF's, except that the projections reading the normed hidden state are fused
(`qkv_a_proj`: q_proj or q_a_proj, then kv_a_proj_with_mqa) and so are gate/up (`gate_up_proj`);
routed experts are stacked (flexsgl/model/moe.py). `checkpoint_name` maps an HF tensor name to the
parameter and part it fills, and each parameter's weight loader puts it there
(flexsgl/model/weight_loaders.py).

Under tensor parallelism (flexsgl/distributed/layers.py) a rank holds its attention heads (of q,
kv_b and o_proj), every latent (the latent cache is replicated: one shared vector per token, the
same on every rank, which each rank's attention backend reads for its heads), its slice of every
MLP's and every expert's intermediate dimension, and its vocabulary rows; o_proj, the MLPs and the
MoE layer end in one all-reduce each, rank 0 adding the residual to its partial sum.
"""

from __future__ import annotations

import torch
from torch import nn

from flexsgl.distributed import layers as tp
from flexsgl.kernels import gemv, latent_query
from flexsgl.kernels.latent_query import latent_query_reference
from flexsgl.kernels.norm_rope import rotate_pairs
from flexsgl.model.causal_lm import CausalLM
from flexsgl.model.config import ModelConfig
from flexsgl.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, yarn_inv_freq
from flexsgl.model.moe import MoE, expert_part
from flexsgl.model.weight_loaders import StackedExperts, fused_rows, packed_name, split_loader

LATENT_NORM_EPS = 1e-6  # HF's DeepseekV2RMSNorm default, used for q_a_layernorm and kv_a_layernorm


class InterleavedRotary(RotaryEmbedding):
    """cos/sin tables `[positions, D/2]` of DeepSeek's RoPE (the attention factor folded in), for
    the rotation of pairs (x[2i], x[2i+1]) (rotate_pairs, flexsgl/kernels/norm_rope.py). Built as
    layers.RotaryEmbedding."""

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim, theta = self.head_dim, self.theta
        if self.scaling is None:
            inv_freq, factor = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
        else:
            inv_freq, factor = yarn_inv_freq(head_dim, theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        return freqs.cos() * factor, freqs.sin() * factor


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        m = self.mla = cfg.mla
        self.layer_id, self.hq = layer_id, cfg.num_heads
        self.q_dim = cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        self.q_a_dim = self.q_dim if m.q_lora_rank is None else m.q_lora_rank
        self.qkv_a_proj = nn.Linear(cfg.hidden_size, self.q_a_dim + m.latent_dim, bias=False)
        self.qkv_a_proj.weight.weight_loader = fused_rows([self.q_a_dim, m.latent_dim])
        if m.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.q_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * m.v_head_dim, cfg.hidden_size, bias=False)
        self.kv_store = None  # CausalLM.bind_kv_pool sets it, and this layer's latents:
        self.cache: tuple[torch.Tensor, ...] = ()
        self.heads: torch.Tensor | None = None  # 0..H-1 on the pool's device: each head's slot in W_UV's kernel
        self.parallel = cfg.tp_size > 1  # o_proj row-parallel (flexsgl/distributed/layers.py)

    def forward(self, x, norm, positions, rope: InterleavedRotary, fb) -> torch.Tensor:
        """x + attention(norm(x)), `[T, hidden]`."""
        m, t = self.mla, x.shape[0]
        q, latent = gemv.norm_linear(x, norm, self.qkv_a_proj).split([self.q_a_dim, m.latent_dim], dim=-1)
        if m.q_lora_rank is not None:
            q = gemv.norm_linear(q, self.q_a_layernorm, self.q_b_proj)
        q = q.view(t, self.hq, -1)  # [T, H, nope + rope]
        w_kv = self.kv_b_proj.weight.view(self.hq, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        if fb.backend.expands_latents(fb):  # the MHA form (flexsgl/attention/flex_mla.py)
            self.store(latent, positions, rope, fb)
            q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
            q = torch.cat([q_nope, rotate_pairs(positions, rope.cos, rope.sin, q_pe)], dim=-1)
            out = fb.backend.forward_expanded(q, w_kv, self.cache, fb)  # [T, H, v]
        else:
            out = self.absorbed(q, latent, w_kv, positions, rope, fb)
        if self.parallel:
            return tp.row_linear(out.reshape(t, -1), self.o_proj, x)
        return gemv.linear(out.reshape(t, -1), self.o_proj, residual=x)

    def store(self, latent, positions, rope: InterleavedRotary, fb) -> None:
        """The step's latents, normed and rotated, into their slots of the pool."""
        self.kv_store.norm_rope_store(self.cache, latent, (self.kv_a_layernorm.weight,), LATENT_NORM_EPS, rope,
                                      positions, fb.out_slots)

    def absorbed(self, q, latent, w_kv, positions, rope: InterleavedRotary, fb) -> torch.Tensor:
        """The latents' store, then attention in the absorbed form (module docstring) of q
        `[T, H, nope + rope]`: `[T, H, v]`."""
        w_uk, w_uv = w_kv.split([self.mla.qk_nope_head_dim, self.mla.v_head_dim], dim=1)  # [H, nope, r], [H, v, r]
        if latent_query.applies(q, w_uk):  # one token: the store rides in the query's launch
            query = self.kv_store.norm_rope_store_with_query(self.cache, latent, (self.kv_a_layernorm.weight,),
                                                             LATENT_NORM_EPS, rope, positions, fb.out_slots, q, w_uk)
        else:
            self.store(latent, positions, rope, fb)
            query = latent_query_reference(q, w_uk, rope.cos, rope.sin, positions)
        out = fb.backend.forward(query, self.cache, fb)  # [W_UK^T q_nope, q_pe]
        if gemv.applies(q[:, 0], w_uv):  # one token: each head's W_UV as a slot of the matrix-vector kernel
            return torch.ops.flexsgl.stacked_gemv(out[0], w_uv, self.heads)  # [H, v]
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]


class DeepseekV2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe
        self.mlp = (MoE(cfg.hidden_size, moe, cfg.tp_size > 1)
                    if moe is not None and layer_id >= moe.first_k_dense_replace
                    else GatedMLP(cfg.hidden_size, cfg.intermediate_size))
        self.parallel = cfg.tp_size > 1

    def forward(self, x, positions, rope, fb):
        x = self.self_attn(x, self.input_layernorm, positions, rope, fb)
        if isinstance(self.mlp, MoE):
            return self.mlp(x, self.post_attention_layernorm, residual=x)
        gate_up = gemv.norm_linear(x, self.post_attention_layernorm, self.mlp.gate_up_proj)
        if self.parallel:
            return tp.row_silu_linear(gate_up, self.mlp.down_proj, x)
        return gemv.silu_linear(gate_up, self.mlp.down_proj, residual=x)


class DeepseekV2Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = tp.embedding(cfg)
        self.layers = nn.ModuleList(DeepseekV2Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = InterleavedRotary(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)


# HF module name -> (the fused module holding it, its part there)
FUSED = {"q_proj": ("qkv_a_proj", 0), "q_a_proj": ("qkv_a_proj", 0), "kv_a_proj_with_mqa": ("qkv_a_proj", 1),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DeepseekV2Model(cfg))
        if cfg.tp_size > 1:  # each parameter's loader reads this rank's slices (flexsgl/distributed/layers.py)
            for name, p in self.named_parameters():
                if ".experts." in name:
                    halves = 2 if name.endswith("gate_up_proj") else 1
                    p.weight_loader = StackedExperts(cfg.moe.n_routed_experts, halves, cfg.tp_rank, cfg.tp_size)
                else:
                    split = tp.split_of(name, cfg.unsharded, cfg.tp_rank, cfg.tp_size)
                    if split is not None:
                        p.weight_loader = split_loader(split)

    def checkpoint_name(self, hf_name: str) -> tuple[str, object]:
        """The parameter an HF tensor fills and its part there (None: all of it): a fused part, or
        (expert, 0 gate / 1 up / None down) of a stacked expert parameter."""
        return expert_part(hf_name) or packed_name(hf_name, FUSED)

    def place_layer(self, layer: nn.Module, device: torch.device) -> None:
        """The attention's head indices on the device, and a MoE layer's experts' device."""
        layer.self_attn.heads = torch.arange(layer.self_attn.hq, dtype=torch.int32, device=device)
        super().place_layer(layer, device)
