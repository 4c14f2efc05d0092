"""Find a model (preset, local HF directory or hub id), build it, load its weights and tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flexsgl.model.config import ModelConfig, model_class
from flexsgl.model.presets import EMBEDDED, PRESETS

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ModelSource:
    name: str
    config: ModelConfig
    path: Path | None  # a directory holding config.json, weights and maybe a tokenizer
    load_format: str  # "safetensors" or "dummy"


def resolve(model: str, load_format: str = "auto") -> ModelSource:
    """Turn what the user typed into a config and a place to load from, or say in one sentence why not."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}.")
    if model in PRESETS:
        preset = PRESETS[model]
        cfg = ModelConfig.from_hf(preset["config"])
        if load_format == "dummy" or (load_format == "auto" and preset["hub"] is None):
            return ModelSource(model, cfg, None, "dummy")
        if preset["hub"] is None:
            raise ValueError(f"Preset {model!r} has no published weights; use --load-format dummy.")
        path = _fetch_from_hub(preset["hub"], hint="run the preset with --load-format dummy for random weights")
        return ModelSource(model, ModelConfig.from_dir(path), path, "safetensors")
    path = EMBEDDED.get(model) or Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"Model directory {str(path)!r} has no config.json.")
    elif model.count("/") == 1 and not path.exists() and not model.startswith((".", "/", "~")):
        path = _fetch_from_hub(model, hint="pass a local model directory instead")
    else:
        raise ValueError(
            f"Unknown model {model!r}: not a preset ({', '.join([*EMBEDDED, *PRESETS])}), "
            "not a local model directory, and not a hub id (org/name)."
        )
    cfg = ModelConfig.from_dir(path)
    fmt = "dummy" if load_format == "dummy" else "safetensors"
    if fmt == "safetensors" and not _weight_files(path):
        raise ValueError(f"No safetensors weights in {str(path)!r}; use --load-format dummy for random weights.")
    return ModelSource(model, cfg, path, fmt)


def _fetch_from_hub(repo_id: str, hint: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        try:
            return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        except Exception:
            return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # no network, no such repo, gated repo: all end the same way for the user
        raise ValueError(f"Could not fetch {repo_id!r} from the hub (no network, or no such repository: "
                         f"{type(e).__name__}); {hint}.") from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    return [single] if single.is_file() else sorted(path.glob("*.safetensors"))


def build_model(src: ModelSource, device: torch.device, dtype: torch.dtype, seed: int = 0,
                progress=None) -> nn.Module:
    """Build the model on `device` in `dtype`, with weights from `src` (or seeded random ones)."""
    cfg = src.config
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary.__init__(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
    model.model.rotary.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if src.load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors(model, _weight_files(src.path), progress)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes, generated on the model's device (for benchmarks and tests)."""
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator(device=p.device).manual_seed(seed * 1000003 + i)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32))
        else:
            p.normal_(0.0, 0.02, generator=g)


@torch.no_grad()
def load_safetensors(model: nn.Module, files: list[Path], progress=None) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for hf_name in st.keys():
                target, shard = _map_name(model, hf_name)
                if target not in params:
                    continue  # e.g. rotary inv_freq buffers, or lm_head when embeddings are tied
                p = params[target]
                t = st.get_tensor(hf_name)
                if shard is None:
                    dst = p
                else:
                    sizes = model.shard_sizes(target.split(".")[-2])
                    dst = p.narrow(0, sum(sizes[:shard]), sizes[shard])
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"Weight {hf_name!r} has shape {tuple(t.shape)}, the model expects {tuple(dst.shape)}.")
                dst.copy_(t)
                loaded.add(target if shard is None else f"{target}#{shard}")
        if progress is not None:
            progress(f.name)
    missing = [n for n in params if not _is_loaded(model, n, loaded)]
    if missing:
        raise ValueError(f"The checkpoint lacks {len(missing)} weights the model needs, e.g. {missing[0]!r}.")


def _map_name(model, hf_name: str) -> tuple[str, int | None]:
    for frag, (fused, shard) in model.packed_weights.items():
        if f".{frag}." in hf_name:
            return hf_name.replace(f".{frag}.", f".{fused}."), shard
    return hf_name, None


def _is_loaded(model, name: str, loaded: set[str]) -> bool:
    if name in loaded:
        return True
    fused = name.split(".")[-2]
    if fused in ("qkv_proj", "gate_up_proj"):
        return all(f"{name}#{i}" in loaded for i in range(len(model.shard_sizes(fused))))
    return name in ("lm_head.weight",) and model.cfg.tie_word_embeddings

