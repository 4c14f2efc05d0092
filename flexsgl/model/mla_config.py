"""The settings of multi-head latent attention (MLA) and DeepSeek MoE, read from a DeepSeek-V2
`config.json` (ModelConfig.from_hf calls `deepseek_v2_fields` for that architecture)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexsgl.errors import CheckpointError, short_repr

TOPK_METHODS = ("greedy", "group_limited_greedy")
SCORING_FUNCS = ("softmax",)
YARN_KEYS = ("factor", "original_max_position_embeddings")
YARN_OPTIONAL_KEYS = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")


@dataclass(frozen=True)
class MLAConfig:
    """Per token the cache keeps one latent vector: the normed compressed KV (`kv_lora_rank`) and
    the shared rotary key (`qk_rope_head_dim`)."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q is one projection of the hidden state
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # 1/sqrt(qk head dim), times YaRN's mscale_all_dim factor squared

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    first_k_dense_replace: int  # layers before this one are dense MLPs
    routed_scaling_factor: float
    topk_method: str  # "greedy" or "group_limited_greedy" (top experts within the best `topk_group` groups)
    n_group: int
    topk_group: int
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1 (then no routed_scaling_factor)
    dense_layers: tuple[int, ...] = ()  # layers past first_k_dense_replace that are dense MLPs too

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` is a MoE layer (else a dense MLP)."""
        return layer >= self.first_k_dense_replace and layer not in self.dense_layers


def check_yarn(get, rope: dict) -> None:
    """YaRN's required keys are numbers, and so are its optional ones where given (get: config._Keys)."""
    for key in YARN_KEYS:
        get.number(rope, key)
    for key in YARN_OPTIONAL_KEYS:
        if rope.get(key) is not None:
            get.number(rope, key)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_v2_fields(get, d: dict, rope: dict, source: str) -> dict:
    """ModelConfig fields of a DeepSeek-V2 config beyond the common ones (get: config._Keys)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if get.typed("attention_bias", bool, False):
        raise CheckpointError(f"{source} sets attention_bias, which flexsgl's DeepSeek-V2 does not run.")
    nope, rope_dim, v = get.positive("qk_nope_head_dim"), get.positive("qk_rope_head_dim"), get.positive("v_head_dim")
    if rope_dim % 2:
        raise CheckpointError(f"{source}: 'qk_rope_head_dim' must be even for rotary embeddings, got {rope_dim}.")
    scale = (nope + rope_dim) ** -0.5
    if rope_type == "yarn":
        check_yarn(get, rope)
        if rope.get("mscale_all_dim"):
            scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    mla = MLAConfig(kv_lora_rank=get.positive("kv_lora_rank"), q_lora_rank=get.positive("q_lora_rank", None),
                    qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=v, softmax_scale=scale)
    experts = get.positive("n_routed_experts", None)
    moe = None
    if experts is not None:
        method = get.typed("topk_method", str, "greedy")
        if method not in TOPK_METHODS:
            raise CheckpointError(f"{source} sets topk_method to {short_repr(method)}, which flexsgl does not run "
                                  f"(it runs {' or '.join(TOPK_METHODS)}).")
        scoring = get.typed("scoring_func", str, "softmax")
        if scoring not in SCORING_FUNCS:
            raise CheckpointError(f"{source} sets scoring_func to {short_repr(scoring)}; flexsgl runs softmax.")
        n_group, topk_group = get.positive("n_group", 1), get.positive("topk_group", 1)
        if experts % n_group or topk_group > n_group:
            raise CheckpointError(f"{source}: 'n_routed_experts' ({experts}) must split into 'n_group' ({n_group}) "
                                  f"groups, of which 'topk_group' ({topk_group}) are kept.")
        top_k = get.positive("num_experts_per_tok")
        if top_k > experts:
            raise CheckpointError(f"{source}: 'num_experts_per_tok' ({top_k}) is more than 'n_routed_experts' "
                                  f"({experts}).")
        moe = MoEConfig(n_routed_experts=experts, n_shared_experts=get.typed("n_shared_experts", int, 0),
                        top_k=top_k, intermediate_size=get.positive("moe_intermediate_size"),
                        first_k_dense_replace=get.typed("first_k_dense_replace", int, 0),
                        routed_scaling_factor=get.number(d, "routed_scaling_factor", 1.0), topk_method=method,
                        n_group=n_group, topk_group=topk_group,
                        # DeepSeek renormalises only more than one expert's weights
                        norm_topk_prob=get.typed("norm_topk_prob", bool, False) and top_k > 1)
    # As HF's DeepseekV2Config: rotary embeddings span the rope dims only.
    return {"mla": mla, "moe": moe, "head_dim": rope_dim}


def deepseek_v2_params(cfg) -> int:
    """Parameter count of a DeepSeek-V2 ModelConfig."""
    h, m, n = cfg.hidden_size, cfg.mla, cfg.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * n * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * qk
    attn = q + h * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
    attn += n * m.v_head_dim * h
    dense = 3 * h * cfg.intermediate_size
    moe = cfg.moe
    n_dense = cfg.num_layers if moe is None else min(moe.first_k_dense_replace, cfg.num_layers)
    sparse = 0 if moe is None else (3 * h * moe.intermediate_size * (moe.n_routed_experts + moe.n_shared_experts)
                                    + moe.n_routed_experts * h)
    layers = cfg.num_layers * (attn + 2 * h) + n_dense * dense + (cfg.num_layers - n_dense) * sparse
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return layers + cfg.vocab_size * h + head + h
