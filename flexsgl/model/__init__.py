"""Plain-PyTorch models, keyed by HF architecture name."""

from flexsgl.model.llama import LlamaForCausalLM
from flexsgl.model.qwen3 import Qwen3ForCausalLM

MODELS = {"Qwen3ForCausalLM": Qwen3ForCausalLM, "LlamaForCausalLM": LlamaForCausalLM}
