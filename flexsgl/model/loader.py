"""Find a model (preset, local HF directory or hub id), build it, load its weights and tokenizer."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from flexsgl.distributed.layers import slice_index, split_of, take
from flexsgl.errors import CheckpointError, describe, short_repr
from flexsgl.log import progress
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
    if fmt == "safetensors" and not _weight_files(path):
        raise CheckpointError(f"No safetensors weights in {str(path)!r}; use --load-format dummy for random "
                              "weights.")
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


def build_model(src: ModelSource, device: torch.device, dtype: torch.dtype, seed: int = 0, rank: int = 0,
                size: int = 1) -> nn.Module:
    """Build the model on `device` in `dtype`, with weights from `src` (or seeded random ones): all
    of it, or with `size` > 1 rank `rank`'s part of it (flexsgl/distributed/layers.py), which is
    all that is ever allocated on this rank."""
    cfg = src.config.shard(rank, size)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
        full = model if size == 1 else model_class(cfg.architecture)(src.config)  # shapes only
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary.__init__(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
    model.model.rotary.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    split = None if size == 1 else (lambda name: split_of(name, src.config, rank, size))
    if src.load_format == "dummy":
        init_dummy_weights(model, seed, None if size == 1 else full, split)
    else:
        load_safetensors(model, _weight_files(src.path), None if size == 1 else full, split)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, full: nn.Module | None = None, split=None) -> None:
    """Random weights of the right shapes, generated on the model's device (for benchmarks and tests;
    the generators differ by device, so the same model's dummy weights on a CPU and a GPU do too).
    A rank's part of a model (`full`: the whole model on the meta device, `split`: how a parameter
    is split) gets its slice of the very tensors the whole model gets: each parameter is generated
    whole, one at a time, and sliced."""
    shapes = None if full is None else [p.shape for p in full.parameters()]
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator(device=p.device).manual_seed(seed * 1000003 + i)
        how = None if split is None else split(name)
        dst = p if how is None else torch.empty(shapes[i], dtype=p.dtype, device=p.device)
        if name.endswith("norm.weight"):
            dst.copy_(1.0 + 0.1 * torch.randn(dst.shape, generator=g, device=p.device, dtype=torch.float32))
        else:
            dst.normal_(0.0, 0.02, generator=g)
        if how is not None:
            take(how, dst, p)


@torch.no_grad()
def load_safetensors(model: nn.Module, files: list[Path], full: nn.Module | None = None, split=None) -> None:
    """Copy the checkpoint's tensors into `model`, once every tensor's name, shape and dtype has
    been checked against it (and nothing is missing): a bad checkpoint raises CheckpointError and
    loads nothing. A rank's part of a model (`full`: the whole model on the meta device, which the
    checkpoint is checked against; `split`: how a parameter is split) reads only its slices."""
    plan = check_checkpoint(model if full is None else full, files)
    params = dict(model.named_parameters())
    for f in progress(files, desc="loading weights", unit="file", disable=len(files) < 2):
        with _open_safetensors(f) as st:
            for hf_name, dst, target, shard in plan[f]:
                try:
                    how = None if split is None else split(target)
                    if how is None:
                        (dst if full is None else params[target]).copy_(st.get_tensor(hf_name))
                        continue
                    index, piece = slice_index(how, shard, len(dst.shape))
                    local = params[target]
                    if target.endswith(("embed_tokens.weight", "lm_head.weight")):
                        local.narrow(how.dim, piece.length, local.shape[how.dim] - piece.length).zero_()
                    local.narrow(how.dim, piece.at, piece.length).copy_(st.get_slice(hf_name)[index])
                except SafetensorError as e:
                    raise CheckpointError(f"Weights file {str(f)!r} is corrupt: {describe(e)}.") from None


# Floating-point safetensors dtypes, which load into any model dtype; anything else (integers,
# float8) is a quantized or foreign checkpoint.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_checkpoint(model: nn.Module, files: list[Path]) -> dict[Path, list[tuple[str, torch.Tensor, str, object]]]:
    """Read the headers of `files` and match every tensor to the part of `model` it fills; returns,
    per file, (tensor name, destination, parameter name, fused shard or None) rows. Raises CheckpointError, naming the file and the
    tensor, for an unreadable file, a tensor the model has no place for, a wrong shape or dtype, a
    tensor given twice, or a weight the checkpoint lacks."""
    params = dict(model.named_parameters())
    plan: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    loaded: dict[str, tuple[str, Path]] = {}  # filled parameter (or fused shard) -> the tensor filling it
    tied = model.cfg.tie_word_embeddings
    for f in files:
        plan[f] = []
        with _open_safetensors(f) as st:
            for hf_name in st.keys():
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the config
                target, shard = _map_name(model, hf_name)
                if target == "lm_head.weight" and tied:
                    target = "model.embed_tokens.weight"  # the same tensor; checked, and loaded once
                if target not in params:
                    raise CheckpointError(f"Weights file {str(f)!r} has tensor {hf_name!r}, which the model "
                                          f"({model.cfg.architecture}) has no place for.")
                view = st.get_slice(hf_name)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                dst = params[target] if shard is None else _shard(model, params[target], target, shard)
                if shape != tuple(dst.shape):
                    raise CheckpointError(f"Weight {hf_name!r} in {str(f)!r} has shape {shape}, the model expects "
                                          f"{tuple(dst.shape)}.")
                if dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"Weight {hf_name!r} in {str(f)!r} has dtype {dtype}; flexsgl loads "
                                          f"unquantized weights ({', '.join(FLOAT_DTYPES)}).")
                if hf_name == "lm_head.weight" and tied:
                    continue
                key = target if shard is None else f"{target}#{shard}"
                if key in loaded:
                    other, other_file = loaded[key]
                    raise CheckpointError(f"Weight {hf_name!r} in {str(f)!r} fills the same part of the model as "
                                          f"{other!r} in {str(other_file)!r}.")
                loaded[key] = hf_name, f
                plan[f].append((hf_name, dst, target, shard))
    missing = [n for n in params if not _is_loaded(model, n, loaded)]
    if missing:
        where = f"{str(files[0].parent)!r}" if files else "the model directory"
        raise CheckpointError(f"The checkpoint in {where} lacks {len(missing)} weights the model needs, "
                              f"e.g. {missing[0]!r}.")
    return plan


def _shard(model, param: torch.Tensor, target: str, shard) -> torch.Tensor:
    if hasattr(model, "checkpoint_shard"):  # a model with its own fused or stacked parameters
        return model.checkpoint_shard(param, target, shard)
    sizes = model.shard_sizes(target.split(".")[-2])
    return param.narrow(0, sum(sizes[:shard]), sizes[shard])


@contextmanager
def _open_safetensors(f: Path):
    try:
        st = safe_open(str(f), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"Weights file {str(f)!r} is not a readable safetensors file, it may be truncated "
                              f"or corrupt ({describe(e)}).") from None
    with st:
        yield st


def _map_name(model, hf_name: str) -> tuple[str, object]:
    if hasattr(model, "checkpoint_name"):
        return model.checkpoint_name(hf_name)
    for frag, (fused, shard) in model.packed_weights.items():
        if f".{frag}." in hf_name:
            return hf_name.replace(f".{frag}.", f".{fused}."), shard
    return hf_name, None


def _is_loaded(model, name: str, loaded) -> bool:
    if name in loaded:
        return True
    shards = model.checkpoint_shards(name) if hasattr(model, "checkpoint_shards") else None
    if shards is not None:
        return all(f"{name}#{s}" in loaded for s in shards)
    fused = name.split(".")[-2]
    if fused in ("qkv_proj", "gate_up_proj"):
        return all(f"{name}#{i}" in loaded for i in range(len(model.shard_sizes(fused))))
    return name in ("lm_head.weight",) and model.cfg.tie_word_embeddings

