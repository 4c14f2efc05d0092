"""Where a model comes from: a preset, a local HF directory or a hub id, turned into its config
and the place its weights are (the weight files of a directory, sharded or not)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from flexsgl.errors import CheckpointError, describe, short_repr
from flexsgl.model.config import ModelConfig
from flexsgl.model.presets import EMBEDDED, PRESETS

LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class ModelSource:
    name: str
    config: ModelConfig
    path: Path | None  # a directory holding config.json, weights and maybe a tokenizer
    load_format: str  # "safetensors" or "dummy"


def resolve(model: str, load_format: str = "auto", context_length: int | None = None) -> ModelSource:
    """Turn what the user typed into a config and a place to load from, or say in one sentence why
    not; `context_length` (the option; None: the model's own) cuts the config's context."""
    return with_context_length(_located(model, load_format), context_length)


def with_context_length(src: ModelSource, tokens: int | None) -> ModelSource:
    """`src` with its context cut to `tokens` (None: the model's own): every limit the engine
    derives from the context (requests, the KV cache's default size, the server's max_model_len)
    follows it; RoPE's frequencies do not depend on it. A context longer than the model's is
    refused: its positions were never trained."""
    ctx = src.config.max_position
    if tokens is None or tokens == ctx:
        return src
    if tokens > ctx:
        raise ValueError(f"context_length {tokens} exceeds the model's context of {ctx} tokens "
                         "(max_position_embeddings); flexsgl does not extend a model's context.")
    return replace(src, config=replace(src.config, max_position=tokens))


def _located(model: str, load_format: str) -> ModelSource:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}.")
    if model in PRESETS:
        preset = PRESETS[model]
        cfg = ModelConfig.from_hf(preset["config"], f"The config of preset {model!r}")
        if load_format == "dummy" or (load_format == "auto" and preset["hub"] is None):
            return ModelSource(model, cfg, None, "dummy")
        if preset["hub"] is None:
            raise ValueError(f"Preset {model!r} has no published weights; use --load-format dummy.")
        path = _fetch_from_hub(preset["hub"], hint="run the preset with --load-format dummy for random weights")
        return ModelSource(model, ModelConfig.from_dir(path), path, "safetensors")
    path = EMBEDDED.get(model) or Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"Model directory {str(path)!r} has no config.json.")
    elif model.count("/") == 1 and not path.exists() and not model.startswith((".", "/", "~")):
        path = _fetch_from_hub(model, hint="pass a local model directory instead")
    else:
        raise ValueError(
            f"Unknown model {model!r}: not a preset ({', '.join([*EMBEDDED, *PRESETS])}), "
            "not a local model directory, and not a hub id (org/name)."
        )
    cfg = ModelConfig.from_dir(path)
    fmt = "dummy" if load_format == "dummy" else "safetensors"
    if fmt == "safetensors" and not weight_files(path):
        raise CheckpointError(f"No safetensors weights in {str(path)!r}; use --load-format dummy for random "
                              "weights.")
    return ModelSource(model, cfg, path, fmt)


def _fetch_from_hub(repo_id: str, hint: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        try:
            local = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
            if _whole(local):  # else only part of it is cached (a config fetched alone): fetch the rest
                return local
        except Exception:
            pass
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # no network, no such repo, gated repo: all end the same way for the user
        raise ValueError(f"Could not fetch {repo_id!r} from the hub (no network, or no such repository: "
                         f"{type(e).__name__}); {hint}.") from None


def _whole(path: Path) -> bool:
    """Whether a cached hub snapshot holds a config and its weights."""
    try:
        return (path / "config.json").is_file() and bool(weight_files(path))
    except CheckpointError:
        return False


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of model directory `path`: those its index lists, else model.safetensors,
    else every *.safetensors; CheckpointError for an index that cannot be read or lists absent files."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"Index file {str(index)!r} is not a safetensors index with a weight_map "
                                  f"({describe(e)}).") from None
        files = [path / n for n in names if isinstance(n, str)]
        missing = [f.name for f in files if not f.is_file()]
        if len(files) != len(names) or missing:
            raise CheckpointError(f"Index file {str(index)!r} lists weight files that are not in the directory, "
                                  f"e.g. {short_repr(missing[0] if missing else names[0])}.")
        return files
    single = path / "model.safetensors"
    return [single] if single.is_file() else sorted(path.glob("*.safetensors"))
