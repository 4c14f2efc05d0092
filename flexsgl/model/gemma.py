"""Gemma 2 and Gemma 3 (text), as transformers' Gemma2ForCausalLM and Gemma3ForCausalLM compute them.

What differs from the dense decoder (flexsgl/model/decoder.py), whose attention layer and fused
q/k/v and gate/up projections this model reuses:

- the embedding is scaled by sqrt(hidden_size), that normalizer cast to the model dtype first;
- RMSNorm scales by (1 + weight), in float32, then casts (`GemmaRMSNorm`); four per layer: before
  and after attention, before and after the MLP, each block's output normed before its residual add;
- the MLP is GeGLU: gelu_tanh(gate) * up;
- each layer is a sliding-window (local) or a global layer (`ModelConfig.layer_types`); its
  attention variant comes from flexsgl/model/gemma_config.py (window, Gemma 2's softcap, the
  query_pre_attn_scalar scale), one object per kind;
- Gemma 3 norms q and k per head before RoPE, and its local layers rotate with their own base
  (`rope_local_theta`), its global layers with the global base and its linear scaling;
- the LM head's logits are soft-capped where `final_softcap` is set; the embeddings are tied.

The norms before the projections are PyTorch expressions (the batch-1 kernel of
flexsgl/kernels/gemv.py folds in the standard RMSNorm only), followed by the plain projection
(that kernel at decode batch 1 on CUDA). Gemma 3's q/k norms run in the store path
(flexsgl/cache/store.py), whose RMSNorm is `weight * norm(x)`: their parameters hold 1 + the
checkpoint's weight (`ONE_PLUS`), added in float32 once at load. In float32 that is HF's
expression exactly; in bfloat16 the stored 1 + w and the normed value are each rounded to bfloat16
before their product, where HF multiplies in float32 and rounds once.

Under tensor parallelism it splits as the dense decoder does (flexsgl/distributed/layers.py): the
vocabulary-parallel embedding, q/k/v and gate/up by rows, o_proj and down_proj by columns. Each
row-parallel output is all-reduced before its post-norm, which needs the whole sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flexsgl.distributed import layers as tp
from flexsgl.distributed.allreduce import all_reduce
from flexsgl.kernels import gemv
from flexsgl.model.causal_lm import CausalLM
from flexsgl.model.config import ModelConfig
from flexsgl.model.decoder import Attention, DecoderForCausalLM
from flexsgl.model.layers import GatedMLP, RotaryEmbedding, rope_inv_freq
from flexsgl.model.weight_loaders import Whole


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back to x's dtype (HF's Gemma2RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class OnePlus(Whole):
    """A norm weight held as 1 + the checkpoint's, computed in float32 and rounded once."""

    def load(self, param: torch.Tensor, read, part) -> None:
        w = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        read(None, w)
        param.copy_(1.0 + w)


ONE_PLUS = OnePlus()


class GemmaRotaryEmbedding(RotaryEmbedding):
    """RoPE tables, with linear scaling where `scaling` is {"rope_type": "linear", "factor": f}:
    every frequency divided by f (Gemma 3's global layers from 4B up)."""

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, None)
        if self.scaling is not None:
            inv_freq = inv_freq / self.scaling["factor"]
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        return freqs.cos(), freqs.sin()


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.sliding = cfg.layer_types[layer_id] == "sliding_attention"
        self.self_attn = Attention(cfg, layer_id)
        attn = self.self_attn
        if attn.q_norm is not None:
            attn.q_norm.weight.weight_loader = attn.k_norm.weight.weight_loader = ONE_PLUS
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = GemmaRMSNorm(h, eps), GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = GemmaRMSNorm(h, eps), GemmaRMSNorm(h, eps)
        self.parallel = cfg.tp_size > 1

    def row_parallel(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        """proj(x), summed over the ranks' partial products under tensor parallelism."""
        out = gemv.linear(x, proj, None)
        return all_reduce(out) if self.parallel else out

    def forward(self, x, positions, rope, fb):
        attn, mlp = self.self_attn, self.mlp
        qkv = gemv.linear(self.input_layernorm(x), attn.qkv_proj, None)
        out = self.row_parallel(attn.attend(qkv, positions, rope, fb), attn.o_proj)
        x = x + self.post_attention_layernorm(out)
        gate, up = gemv.linear(self.pre_feedforward_layernorm(x), mlp.gate_up_proj, None).chunk(2, dim=-1)
        down = self.row_parallel(F.gelu(gate, approximate="tanh") * up, mlp.down_proj)
        return x + self.post_feedforward_layernorm(down)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = tp.embedding(cfg)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = GemmaRotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        local = cfg.rope_local_theta is not None  # Gemma 3: the local layers' own base, no scaling
        self.rotary_local = GemmaRotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_local_theta, None) \
            if local else self.rotary
        self.normalizer: torch.Tensor | None = None  # sqrt(hidden_size) in the model dtype (materialize)


class GemmaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, GemmaModel(cfg))
        self.assign_split_loaders()

    # The decoder's own: HF names to the fused q/k/v and gate/up parts.
    checkpoint_name = DecoderForCausalLM.checkpoint_name

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the parameters (the model is built on the meta device), compute the rotary
        tables and the embedding normalizer."""
        super().materialize(device, dtype)
        m = self.model
        if m.rotary_local is not m.rotary:
            m.rotary_local.build(device)
        # HF keeps sqrt(hidden_size) as a float32 tensor and casts it to the weights' dtype
        m.normalizer = torch.tensor(self.cfg.hidden_size ** 0.5, dtype=torch.float32).to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        """The logits (in the model's dtype) of the tokens at `fb.logits_index`, soft-capped as HF
        does (divide, tanh, multiply, each in the model dtype) where the config sets a cap."""
        m = self.model
        x = m.embed_tokens(input_ids) * m.normalizer
        for layer in m.layers:
            x = layer(x, positions, m.rotary_local if layer.sliding else m.rotary, fb)
        logits = gemv.linear(m.norm(x[fb.logits_index]), self.lm_head, None)
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
