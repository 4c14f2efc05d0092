"""TRT-LLM MLA decode through FlashInfer (SM100, MLA models): registered, not yet buildable.

The registry lists `trtllm-mla` with what it needs (an SM100 GPU, the flashinfer package, a model
with multi-head latent attention) so that asking for it anywhere else is refused, before any weights
load, with the reason. Building it also needs two things flexsgl does not have yet: an MLA model
(DeepSeek-V2) and a latent KV pool (`[pages, page_size, kv_lora_rank + rope_dim]`). Until they
land, construction says so rather than pretending to run.
"""

from __future__ import annotations

import torch

from flexsgl.attention.base import KernelBackend


class TrtllmMLABackend(KernelBackend):
    name = "trtllm-mla"

    def __init__(self, pool, num_heads: int | None = None, compiled: bool = False):
        raise NotImplementedError(self.unsupported(0, pool.device))

    @staticmethod
    def unsupported(page_size: int, device: torch.device) -> str | None:
        return ("flexsgl has no MLA model or latent KV pool yet, which TRT-LLM MLA decode needs "
                "(DeepSeek-V2 support is not built)")
