"""A model's configuration, read from an HF `config.json`, and the architectures flexsgl serves."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path



@dataclass(frozen=True)
class Architecture:
    """An HF architecture flexsgl serves: its `model_type`, the module:class that builds it (imported
    when a model is built) and how it configures that class."""

    model_type: str
    target: str
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE


DECODER = "flexsgl.model.decoder:DecoderForCausalLM"
# The one architecture registry: HF architecture name -> what flexsgl builds for it. Llama 3 is the
# Qwen3 decoder without q/k norm.
ARCHITECTURES = {
    "Qwen3ForCausalLM": Architecture("qwen3", DECODER, qk_norm=True),
    "LlamaForCausalLM": Architecture("llama", DECODER, qk_norm=False),
}


def model_class(architecture: str) -> type:
    """The class that builds models of `architecture` (a key of ARCHITECTURES)."""
    module, cls = ARCHITECTURES[architecture].target.split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    hf: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_norm(self) -> bool:
        return ARCHITECTURES[self.architecture].qk_norm

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        by_type = {a.model_type: name for name, a in ARCHITECTURES.items()}
        arch = (d.get("architectures") or [by_type.get(d.get("model_type"), "?")])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"Model architecture {arch!r} is not supported; flexsgl runs {', '.join(ARCHITECTURES)}."
            )
        # transformers 5 writes `rope_parameters`; older checkpoints write rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"RoPE type {rope_type!r} is not supported; flexsgl runs 'default' and 'llama3'.")
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        heads = d["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            rope_scaling=rope if rope_type == "llama3" else None,
            eos_token_ids=eos,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            hf=d,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * i + 2 * h + (2 * d if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * layer + self.vocab_size * h + head + h
