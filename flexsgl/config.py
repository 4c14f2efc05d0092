"""Model configuration read from an HF `config.json`, and named presets with embedded configs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# HF architectures this engine implements, mapped to whether the attention has q/k RMSNorm.
ARCHITECTURES = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False}
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


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
        return ARCHITECTURES[self.architecture]

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        arch = (d.get("architectures") or [MODEL_TYPES.get(d.get("model_type"), "?")])[0]
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


def _qwen3(hidden, layers, heads, kv, inter, tie, vocab=151936, max_pos=40960, head_dim=128):
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    }


# Named presets: embedded configs so `--load-format dummy` works offline. `hub` is where real weights live.
PRESETS: dict[str, dict] = {
    "qwen3-0.6b": {"hub": "Qwen/Qwen3-0.6B", "config": _qwen3(1024, 28, 16, 8, 3072, True)},
    "qwen3-8b": {"hub": "Qwen/Qwen3-8B", "config": _qwen3(4096, 36, 32, 8, 12288, False)},
    "llama3-8b": {
        "hub": "meta-llama/Meta-Llama-3.1-8B",
        "config": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
        },
    },
    # A few hundred thousand parameters: seeded random weights, runs anywhere in a blink.
    "tiny": {"hub": None, "config": {**_qwen3(128, 2, 4, 2, 256, True, vocab=512, max_pos=4096, head_dim=32),
                                     "eos_token_id": None, "torch_dtype": "float32"}},
}
# Models shipped inside the package, by name. tiny-docs: a 3.4M-parameter Qwen3 trained by
# tools/train_tiny.py on the standard library's docstrings (see its training.json).
EMBEDDED = {"tiny-docs": Path(__file__).parent / "data" / "tiny-docs"}
DEFAULT_MODEL = "tiny-docs"
