"""The architectures flexsgl serves: ARCHITECTURES, the one model registry, from an HF architecture
name to what flexsgl builds for it and how it reads and counts that architecture's config."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """An HF architecture flexsgl serves: its `model_type`, the module:class that builds it (imported
    when a model is built) and how it configures that class."""

    model_type: str
    target: str
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    rope_types: tuple[str, ...] = ("default", "llama3")
    # "module:function" reading the architecture's own config keys into ModelConfig fields
    extra_fields: str | None = None
    sliding: bool = False  # reads `sliding_window` (and `layer_types`): windowed attention layers
    # "module:function" giving each layer's attention variant from the ModelConfig (default:
    # window_variants, the sliding windows the config names)
    variants: str | None = None
    ignores: tuple[str, ...] = ()  # UNSUPPORTED_SETTINGS keys HF's modeling code of it never reads
    # "module:function" counting the parameters of a ModelConfig (default: the dense decoder's count)
    params: str | None = None


DECODER = "flexsgl.model.decoder:DecoderForCausalLM"
GEMMA, GEMMA_VARIANTS = "flexsgl.model.gemma:GemmaForCausalLM", "flexsgl.model.gemma_config:gemma_variants"
# The one architecture registry: HF architecture name -> what flexsgl builds for it. Llama 3 is the
# Qwen3 decoder without q/k norm; Mistral is Llama with a sliding window on every layer; Qwen3-MoE is
# Qwen3 with a mixture of experts for the MLP.
ARCHITECTURES = {
    "Qwen3ForCausalLM": Architecture("qwen3", DECODER, qk_norm=True),
    "LlamaForCausalLM": Architecture("llama", DECODER, qk_norm=False),
    "MistralForCausalLM": Architecture("mistral", DECODER, qk_norm=False, sliding=True),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", DECODER, qk_norm=True,
                                        extra_fields="flexsgl.model.qwen3_moe_config:qwen3_moe_fields"),
    "DeepseekV2ForCausalLM": Architecture("deepseek_v2", "flexsgl.model.deepseek_v2:DeepseekV2ForCausalLM",
                                          qk_norm=False, rope_types=("default", "yarn"),
                                          extra_fields="flexsgl.model.mla_config:deepseek_v2_fields"),
    "Gemma2ForCausalLM": Architecture("gemma2", GEMMA, qk_norm=False, rope_types=("default",), ignores=("hidden_act",),
                                      extra_fields="flexsgl.model.gemma_config:gemma2_fields", variants=GEMMA_VARIANTS),
    "Gemma3ForCausalLM": Architecture("gemma3_text", GEMMA, qk_norm=True, rope_types=("default", "linear"),
                                      ignores=("hidden_act",), extra_fields="flexsgl.model.gemma_config:gemma3_fields",
                                      variants=GEMMA_VARIANTS),
    "GptOssForCausalLM": Architecture("gpt_oss", "flexsgl.model.gpt_oss:GptOssForCausalLM", qk_norm=False,
                                      rope_types=("default", "yarn"),
                                      extra_fields="flexsgl.model.gpt_oss_config:gpt_oss_fields",
                                      variants="flexsgl.model.gpt_oss_config:gpt_oss_variants",
                                      params="flexsgl.model.gpt_oss_config:gpt_oss_params"),
}


def model_class(architecture: str) -> type:
    """The class that builds models of `architecture` (a key of ARCHITECTURES)."""
    return import_target(ARCHITECTURES[architecture].target)


def import_target(target: str):
    """The object a "module:name" target names, its module imported now."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
