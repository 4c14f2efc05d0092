"""Named models: presets with embedded configs (so `--load-format dummy` works offline) and models
shipped inside the package."""

from __future__ import annotations

from pathlib import Path


def _qwen3(hidden, layers, heads, kv, inter, tie, vocab=151936, max_pos=40960, head_dim=128):
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    }


def _llama3(hidden, layers, heads, inter, kv=8, vocab=128256, max_pos=131072):
    """Llama 3.1's configuration (its RoPE scaling, its three end-of-turn tokens) at a given size."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": max_pos, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    }


def _qwen3_moe(hidden, layers, heads, kv, inter, experts, top_k, moe_inter, vocab=151936, max_pos=40960,
               head_dim=128):
    return {
        **_qwen3(hidden, layers, heads, kv, inter, False, vocab, max_pos, head_dim),
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": moe_inter, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "bos_token_id": 151643,
    }


def _mistral(hidden, layers, heads, kv, inter, window, vocab=32000, max_pos=32768, head_dim=128):
    return {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": max_pos, "sliding_window": window,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }


def _deepseek_v2(hidden, layers, heads, inter, kv_rank, nope, rope, v, experts, shared, top_k, moe_inter,
                 vocab=102400, max_pos=163840, yarn_factor=40.0, original_max_pos=4096, mscale=0.707):
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": None,
        "kv_lora_rank": kv_rank, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
        "n_routed_experts": experts, "n_shared_experts": shared, "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_inter, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "scoring_func": "softmax", "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": yarn_factor, "original_max_position_embeddings": original_max_pos,
                         "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale},
        "max_position_embeddings": max_pos, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
    }


def _gemma2(hidden, layers, heads, kv, inter, window=4096, scalar=256, vocab=256000, max_pos=8192, head_dim=256):
    return {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": scalar, "sliding_window": window, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": max_pos, "attention_bias": False, "bos_token_id": 2, "eos_token_id": 1,
        "pad_token_id": 0, "torch_dtype": "float32",
    }


def _gemma3(hidden, layers, heads, kv, inter, window, rope_scaling=None, vocab=262144, max_pos=32768, head_dim=256):
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "query_pre_attn_scalar": 256,
        "sliding_window": window, "sliding_window_pattern": 6, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "rope_local_base_freq": 10000, "rope_scaling": rope_scaling, "max_position_embeddings": max_pos,
        "attention_bias": False, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def _gpt_oss(layers, experts, hidden=2880, heads=64, kv=8, head_dim=64, inter=2880, top_k=4, window=128,
             vocab=201088, max_pos=131072):
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "attention_bias": True,
        "num_local_experts": experts, "num_experts_per_tok": top_k, "swiglu_limit": 7.0, "hidden_act": "silu",
        "sliding_window": window, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "rms_norm_eps": 1e-5, "rope_theta": 150000, "max_position_embeddings": max_pos,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "pad_token_id": 199999, "eos_token_id": 200002, "torch_dtype": "bfloat16",
    }


# Named presets: embedded configs so `--load-format dummy` works offline. `hub` is where real weights live.
PRESETS: dict[str, dict] = {
    "qwen3-0.6b": {"hub": "Qwen/Qwen3-0.6B", "config": _qwen3(1024, 28, 16, 8, 3072, True)},
    "qwen3-8b": {"hub": "Qwen/Qwen3-8B", "config": _qwen3(4096, 36, 32, 8, 12288, False)},
    "llama3-8b": {"hub": "meta-llama/Meta-Llama-3.1-8B", "config": _llama3(4096, 32, 32, 14336)},
    # Llama-3-70B's shape (3.1's RoPE scaling), random weights only: for tensor-parallel benchmarks.
    "llama3-70b": {"hub": None, "config": _llama3(8192, 80, 64, 28672)},
    # Qwen3-30B-A3B's own config: 128 experts of 768 per MoE layer, 8 per token, on every layer.
    "qwen3-30b-a3b": {"hub": "Qwen/Qwen3-30B-A3B",
                      "config": _qwen3_moe(2048, 48, 32, 4, 6144, experts=128, top_k=8, moe_inter=768)},
    # DeepSeek-V2-Lite's own config: MLA (512 + 64 latent dims per token), 64 routed experts, 6 per token.
    "deepseek-v2-lite": {"hub": "deepseek-ai/DeepSeek-V2-Lite",
                         "config": _deepseek_v2(2048, 27, 16, 10944, 512, 128, 64, 128, 64, 2, 6, 1408)},
    # Mistral-7B-v0.1's shape: a sliding window of 4,096 keys on every layer.
    "mistral-7b": {"hub": "mistralai/Mistral-7B-v0.1", "config": _mistral(4096, 32, 32, 8, 14336, window=4096)},
    # Gemma 2 9B: softcaps, sliding and global layers alternating; Gemma 3 1B (it) and 4B's text model:
    # five local layers to one global, with their own RoPE bases (the 4B is multimodal on the hub: dummy only).
    "gemma-2-9b": {"hub": "google/gemma-2-9b", "config": _gemma2(3584, 42, 16, 8, 14336)},
    "gemma-3-1b": {"hub": "google/gemma-3-1b-it", "config": _gemma3(1152, 26, 4, 1, 6912, window=512)},
    "gemma-3-4b": {"hub": None, "config": _gemma3(2560, 34, 8, 4, 10240, window=1024, vocab=262208, max_pos=131072,
                                                  rope_scaling={"rope_type": "linear", "factor": 8.0})},
    # GPT-OSS-20B's and -120B's own configs in bfloat16 (random weights only: the published checkpoints
    # are MXFP4, which flexsgl refuses): sinks, a window of 128 on every other layer, 32 or 128 experts.
    "gpt-oss-20b": {"hub": None, "config": _gpt_oss(24, 32)},
    "gpt-oss-120b": {"hub": None, "config": _gpt_oss(36, 128)},
    # A few hundred thousand parameters: seeded random weights, runs anywhere in a blink.
    "tiny": {"hub": None, "config": {**_qwen3(128, 2, 4, 2, 256, True, vocab=512, max_pos=4096, head_dim=32),
                                     "eos_token_id": None, "torch_dtype": "float32"}},
    # Mistral's shape in miniature: a window of 48 keys on every layer.
    "tiny-mistral": {"hub": None, "config": {**_mistral(128, 2, 4, 2, 256, window=48, vocab=512, max_pos=4096,
                                                        head_dim=32), "eos_token_id": None, "torch_dtype": "float32"}},
    # Qwen3-MoE's shape in miniature: 8 experts of 64, 2 per token.
    "tiny-qwen3-moe": {"hub": None, "config": {**_qwen3_moe(128, 2, 4, 2, 256, experts=8, top_k=2, moe_inter=64,
                                                            vocab=512, max_pos=4096, head_dim=32),
                                               "eos_token_id": None, "bos_token_id": None, "torch_dtype": "float32"}},
    # Gemma's shapes in miniature: windows of 48 keys, a softmax scale other than head_dim**-0.5; Gemma 3's
    # global layer with linear RoPE scaling.
    "tiny-gemma2": {"hub": None, "config": {**_gemma2(128, 2, 4, 2, 256, window=48, scalar=32, vocab=512,
                                                      max_pos=4096, head_dim=64), "eos_token_id": None}},
    "tiny-gemma3": {"hub": None, "config": {**_gemma3(128, 6, 4, 2, 256, window=48, vocab=512, max_pos=4096,
                                                      head_dim=64, rope_scaling={"rope_type": "linear", "factor": 4.0}),
                                            "eos_token_id": None, "torch_dtype": "float32"}},
    # DeepSeek-V2's shape in miniature: MLA, YaRN, a dense layer then a MoE layer with a shared expert.
    "tiny-mla": {"hub": None, "config": {**_deepseek_v2(128, 2, 4, 256, 64, 32, 16, 32, 8, 1, 2, 64, vocab=512,
                                                         max_pos=4096, yarn_factor=4.0, original_max_pos=1024,
                                                         mscale=1.0),
                                         "eos_token_id": None, "bos_token_id": None, "torch_dtype": "float32"}},
    # GPT-OSS's shape in miniature: sinks, a window of 48 on the first of two layers, 4 experts, top-2.
    "tiny-gpt-oss": {"hub": None, "config": {**_gpt_oss(2, 4, hidden=128, heads=4, kv=2, head_dim=32, inter=128,
                                                         top_k=2, window=48, vocab=512, max_pos=4096),
                                             "pad_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}},
}
# Models shipped inside the package, by name. tiny-docs: a 3.4M-parameter Qwen3 trained by
# tools/train_tiny.py on the standard library's docstrings (see its training.json).
EMBEDDED = {"tiny-docs": Path(__file__).parent.parent / "data" / "tiny-docs"}
DEFAULT_MODEL = "tiny-docs"
