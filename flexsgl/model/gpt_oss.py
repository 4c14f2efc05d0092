"""GPT-OSS: a GQA decoder whose attention has biases and a learned sink per head, sliding-window and
global layers alternating, and a mixture of experts on every layer.

Attention is the dense decoder's (flexsgl/model/decoder.py Attention: q/k/v fused, the K/V store,
the backend) with biases on q/k/v and o, and `sinks` `[Hq]`, the logit each head's softmax holds in
its denominator besides the keys'. The layers' attention variants (gpt_oss_config.gpt_oss_variants:
window & sinks on the layers `layer_types` marks sliding, sinks alone on the others, one object per
kind) name that parameter, and the backend applies it (flex through the log-sum-exp, FA3 through its
`sinks` argument). RoPE is rotate-half with YaRN's frequencies and attention factor
(layers.RotaryEmbedding), `truncate` as the config says.

The MLP routes each token by the router's logits (a linear layer with a bias): the top-k experts,
weighed by the softmax over those k logits. Each expert computes gate and up with their biases, the
clamped SwiGLU `(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = gate.clamp(max=limit)`,
and down with its bias. The experts run as DeepSeek's do (flexsgl/model/moe.py Experts: grouped
products, no host sync; gathered where grouped_mm does not run), with their biases and this
activation; the one-token MoE kernel (kernels/moe_layer.py, DeepSeek's routing and SiLU) is not used.

HF checkpoints store the experts transposed (`gate_up_proj [E, H, 2I]` with gate and up interleaved
in its columns, `down_proj [E, I, H]`); their weight loaders (weight_loaders.py TransposedExperts)
put them into the stacked layout.

Under tensor parallelism (flexsgl/distributed/layers.py) a rank holds its q/k/v heads with their
biases and sinks, o_proj's columns, and every expert's slice of the intermediate dimension (the
router is replicated, so every rank routes alike); rank 0 alone holds o_proj's and the experts'
down biases, and each block's partial sums are all-reduced. MXFP4 checkpoints are refused when the
config is read (flexsgl/model/config.py).
"""

from __future__ import annotations

import torch
from torch import nn

from flexsgl.distributed import layers as tp
from flexsgl.distributed.allreduce import all_reduce
from flexsgl.distributed.group import first_rank
from flexsgl.kernels import gemv
from flexsgl.model.causal_lm import CausalLM
from flexsgl.model.config import ModelConfig
from flexsgl.model.decoder import Attention
from flexsgl.model.layers import RMSNorm, RotaryEmbedding
from flexsgl.model.moe import Experts
from flexsgl.model.weight_loaders import TransposedExperts, packed_name


class GptOssRMSNorm(RMSNorm):
    """RMSNorm as GPT-OSS computes it: the weight applied in float32, one rounding to x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class GptOssAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.empty(self.hq))  # this rank's heads' under tensor parallelism


class GptOssExperts(Experts):
    """Experts with biases and GPT-OSS's clamped SwiGLU, loaded from HF's transposed layout."""

    def __init__(self, num_experts: int, hidden: int, inter: int, alpha: float, limit: float):
        super().__init__(num_experts, hidden, inter, bias=True)
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj.weight_loader = self.gate_up_proj_bias.weight_loader = TransposedExperts(interleaved=True)
        self.down_proj.weight_loader = TransposedExperts(interleaved=False)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssMLP(nn.Module):
    """The router and the experts, named as in HF checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.parallel = moe.top_k, cfg.tp_size > 1
        self.router = nn.Linear(cfg.hidden_size, moe.n_routed_experts, bias=True)
        self.experts = GptOssExperts(moe.n_routed_experts, cfg.hidden_size, moe.intermediate_size,
                                     cfg.swiglu_alpha, cfg.swiglu_limit)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts by router logit, and their weights: the softmax over those k
        logits (float32)."""
        top, experts = gemv.linear(h, self.router, None).topk(self.top_k, dim=-1)
        return experts, top.float().softmax(dim=-1)

    def forward(self, x: torch.Tensor, norm, residual: torch.Tensor) -> torch.Tensor:
        """residual + mlp(norm(x)); under tensor parallelism each rank's experts give a partial sum
        (rank 0's with the down bias and the residual), all-reduced."""
        h = norm(x)
        experts, weights = self.route(h)
        out = self.experts(h, experts, weights)
        if not self.parallel:
            return residual + out
        return all_reduce(out + residual if first_rank() else out)


class GptOssLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, layer_id)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMLP(cfg)
        self.parallel = cfg.tp_size > 1

    def forward(self, x, positions, rope, fb):
        attn = self.self_attn
        qkv = gemv.norm_linear(x, self.input_layernorm, attn.qkv_proj)
        out = attn.attend(qkv, positions, rope, fb)
        x = tp.row_linear(out, attn.o_proj, x) if self.parallel else gemv.linear(out, attn.o_proj, residual=x)
        return self.mlp(x, self.post_attention_layernorm, residual=x)


class GptOssModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = tp.embedding(cfg)
        self.layers = nn.ModuleList(GptOssLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)


QKV = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, GptOssModel(cfg))
        self.assign_split_loaders()

    def checkpoint_name(self, hf_name: str) -> tuple[str, int | None]:
        """The parameter an HF tensor fills and its part there (None: all of it)."""
        return packed_name(hf_name, QKV)

    def place_layer(self, layer: nn.Module, device: torch.device) -> None:
        layer.mlp.experts.place(device)  # a MoE block on every layer
