"""flexsgl: LLM inference on torch.compile + FlexAttention over a paged KV cache."""

from flexsgl.engine import LLM
from flexsgl.request import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
