"""GPT-OSS's settings beyond the common ones, read from its `config.json` as transformers'
GptOssConfig reads them (ModelConfig.from_hf calls `gpt_oss_fields` for GptOssForCausalLM), each
layer's attention variant, and its parameter count."""

from __future__ import annotations

from flexsgl.errors import CheckpointError
from flexsgl.model.config import LAYER_TYPES, pretraining_length
from flexsgl.model.mla_config import MoEConfig, check_yarn

# GptOssConfig's defaults where config.json leaves a key out
DEFAULT_WINDOW = 128
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def gpt_oss_fields(get, d: dict, rope: dict, source: str) -> dict:
    """ModelConfig fields of a GPT-OSS config beyond the common ones (get: config._Keys): the MoE
    (router top-k over `num_local_experts`), the experts' SwiGLU settings, the head size, RoPE,
    and the sliding window with the layers it applies to."""
    # Keys whose GptOssConfig defaults differ from those ModelConfig takes for the other families
    if not any(isinstance(x, dict) and x.get("rope_theta") is not None
               for x in (d, d.get("rope_parameters"), d.get("rope_scaling"))):
        raise CheckpointError(f"{source} lacks 'rope_theta', which the model needs.")
    get.number(d, "rms_norm_eps")
    given_rope = d.get("rope_parameters") is not None or d.get("rope_scaling") is not None
    rope = rope if given_rope else pretraining_length(DEFAULT_ROPE, d)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn":
        check_yarn(get, rope)
        if not isinstance(rope.get("truncate", True), bool):
            raise CheckpointError(f"{source}: the RoPE 'truncate' must be true or false, got {rope['truncate']!r}.")
    layers = get.positive("num_hidden_layers")
    window = get.positive("sliding_window", None) if "sliding_window" in d else DEFAULT_WINDOW
    types = get.typed("layer_types", list, None)
    if types is None:  # as GptOssConfig: sliding layers first, then every other layer
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers or not all(t in LAYER_TYPES for t in types):
        raise CheckpointError(f"{source}: 'layer_types' must name {' or '.join(LAYER_TYPES)} for each of the "
                              f"{layers} layers.")
    experts = get.positive("num_local_experts", 128)
    top_k = get.positive("num_experts_per_tok", 4)
    if top_k > experts:
        raise CheckpointError(f"{source}: 'num_experts_per_tok' ({top_k}) is more than 'num_local_experts' "
                              f"({experts}).")
    # Softmax over the top-k router logits is the softmax over all of them, top-k, renormalised.
    moe = MoEConfig(n_routed_experts=experts, n_shared_experts=0, top_k=top_k,
                    intermediate_size=get.positive("intermediate_size"), first_k_dense_replace=0,
                    routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=True)
    return {"moe": moe, "head_dim": get.positive("head_dim", 64), "sliding_window": window,
            "layer_types": tuple(types), "rope_scaling": None if rope_type == "default" else rope,
            "swiglu_alpha": get.number(d, "swiglu_alpha", 1.702), "swiglu_limit": get.number(d, "swiglu_limit", 7.0),
            "attention_bias": get.typed("attention_bias", bool, True)}  # GptOssConfig's default: biased


def gpt_oss_variants(cfg) -> list:
    """Sinks on every layer, and a sliding window too on the layers `layer_types` marks sliding: one
    variant object per kind of layer."""
    from flexsgl.attention.variants import attention_sinks, sliding_window

    sinks = attention_sinks("sinks")
    local = sinks if cfg.sliding_window is None else sliding_window(cfg.sliding_window) & sinks
    return [local if t == "sliding_attention" else sinks for t in cfg.layer_types]


def gpt_oss_params(cfg) -> int:
    """Parameter count of a GPT-OSS ModelConfig."""
    h, d, hq, hkv, moe = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.moe
    bias = int(cfg.attention_bias)
    attn = h * d * (2 * hq + 2 * hkv) + bias * ((hq + 2 * hkv) * d + h) + hq  # q, k, v, o; their biases; sinks
    e, i = moe.n_routed_experts, moe.intermediate_size
    mlp = e * (h + 1) + e * (3 * h * i + 2 * i + h)  # router, experts with biases
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.num_layers * (attn + mlp + 2 * h) + cfg.vocab_size * h + head + h
