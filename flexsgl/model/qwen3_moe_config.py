"""The mixture-of-experts settings of a Qwen3-MoE `config.json` (ModelConfig.from_hf calls
`qwen3_moe_fields` for that architecture).

Qwen3-MoE is the Qwen3 decoder whose MLP is, on the layers `decoder_sparse_step` and
`mlp_only_layers` select, a mixture of experts routed as DeepSeek's `greedy` method routes
(softmax over the experts, the top `num_experts_per_tok`, renormalised where `norm_topk_prob`),
without shared experts: a MoEConfig (flexsgl/model/mla_config.py) with nothing but those set.
"""

from __future__ import annotations

from flexsgl.errors import CheckpointError, short_repr
from flexsgl.model.mla_config import MoEConfig


def qwen3_moe_fields(get, d: dict, rope: dict, source: str) -> dict:
    """ModelConfig fields of a Qwen3-MoE config beyond the common ones (get: config._Keys)."""
    if get.typed("attention_bias", bool, False):
        raise CheckpointError(f"{source} sets attention_bias, which flexsgl's Qwen3-MoE does not run.")
    layers = get.positive("num_hidden_layers")
    # transformers 5 writes `num_local_experts`; released checkpoints write `num_experts`
    key = "num_experts" if d.get("num_experts") is not None else "num_local_experts"
    experts = d.get(key, 0)
    if experts is None:
        experts = 0
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise CheckpointError(f"{source}: {key!r} must be a non-negative integer, got {short_repr(experts)}.")
    step = get.positive("decoder_sparse_step", 1)
    mlp_only = get.typed("mlp_only_layers", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise CheckpointError(f"{source}: 'mlp_only_layers' must be a list of layer indices, got "
                              f"{short_repr(mlp_only)}.")
    # As HF's Qwen3MoeDecoderLayer: a MoE layer unless listed in mlp_only_layers or skipped by the step
    dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step)
    if experts == 0 or len(dense) == layers:
        return {"moe": None}
    top_k = get.positive("num_experts_per_tok")
    if top_k > experts:
        raise CheckpointError(f"{source}: 'num_experts_per_tok' ({top_k}) is more than {key!r} ({experts}).")
    moe = MoEConfig(n_routed_experts=experts, n_shared_experts=0, top_k=top_k,
                    intermediate_size=get.positive("moe_intermediate_size"), first_k_dense_replace=0,
                    routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1,
                    norm_topk_prob=get.typed("norm_topk_prob", bool, False), dense_layers=dense)
    return {"moe": moe}
