"""Llama 3: the Qwen3 decoder without q/k norm (ModelConfig.qk_norm is False for it), with llama3 RoPE scaling."""

from flexsgl.model.qwen3 import Qwen3ForCausalLM


class LlamaForCausalLM(Qwen3ForCausalLM):
    pass
