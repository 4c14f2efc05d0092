"""Build a model and give it its weights: a checkpoint's safetensors, checked whole before anything
is copied, or seeded random ones. Where the model comes from is flexsgl/model/source.py; how each
checkpoint tensor lands in its parameter is that parameter's weight loader
(flexsgl/model/weight_loaders.py)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from flexsgl.errors import CheckpointError, describe
from flexsgl.log import progress
from flexsgl.model.config import model_class
from flexsgl.model.dummy_weights import init_dummy_weights
from flexsgl.model.source import ModelSource, weight_files
from flexsgl.model.weight_loaders import weight_loader

# Floating-point safetensors dtypes, which load into any model dtype; anything else (integers,
# float8) is a quantized or foreign checkpoint.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def build_model(src: ModelSource, device: torch.device, dtype: torch.dtype, seed: int = 0, rank: int = 0,
                size: int = 1) -> nn.Module:
    """Build the model on `device` in `dtype`, with weights from `src` (or seeded random ones): all
    of it, or with `size` > 1 rank `rank`'s part of it (flexsgl/distributed/layers.py), which is
    all that is ever allocated on this rank: the parameters are allocated in `dtype` at the rank's
    shapes, and the weights are read (or generated) into them a slice at a time."""
    cfg = src.config.shard(rank, size)
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg)
        full = model if size == 1 else cls(src.config)  # the whole model's shapes and weight loaders
    model.materialize(device, dtype)
    if src.load_format == "dummy":
        init_dummy_weights(model, seed, full)
    else:
        load_safetensors(model, weight_files(src.path), full)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def load_safetensors(model: nn.Module, files: list[Path], full: nn.Module | None = None) -> None:
    """Copy the checkpoint's tensors into `model`, once every tensor's name, shape and dtype has
    been checked against the whole model (`full`, on the meta device, for a rank's part of it) and
    nothing is missing: a bad checkpoint raises CheckpointError and loads nothing. Each tensor goes
    through its parameter's weight loader, which reads only this rank's slices of it."""
    plan = check_checkpoint(model if full is None else full, files)
    params = dict(model.named_parameters())
    for f in progress(files, desc="loading weights", unit="file", disable=len(files) < 2):
        with _open_safetensors(f) as st:
            for hf_name, target, part in plan[f]:
                p = params[target]
                try:
                    weight_loader(p).load(p, _reader(st, hf_name, f), part)
                except SafetensorError as e:
                    raise CheckpointError(f"Weights file {str(f)!r} is corrupt: {describe(e)}.") from None


def _reader(st, name: str, f: Path):
    """read(index, out) of a weight loader: the whole tensor, or only its slice `index`, into `out`
    (through the host: what is read is the rank's part alone), refusing NaN or infinite values."""

    def read(index, out):
        t = st.get_tensor(name) if index is None else st.get_slice(name)[index]
        if not all_finite(t):
            raise CheckpointError(f"Weight {name!r} in {str(f)!r} holds NaN or infinite values.")
        out.copy_(t)

    return read


def all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN or infinity: one float32 sum, which NaN and infinities carry into (a
    tensor whose sum overflows float32, far beyond any weight's, counts as infinite)."""
    if t.dtype.itemsize == 1:  # float8: no sum kernel
        t = t.float()
    return bool(torch.isfinite(t.sum(dtype=torch.float32)))


def check_checkpoint(model: nn.Module, files: list[Path]) -> dict[Path, list[tuple[str, str, object]]]:
    """Read the headers of `files` and match every tensor to the part of `model` it fills (the
    model's `checkpoint_name`, the parameter's weight loader); returns, per file, (tensor name,
    parameter name, part) rows. Raises CheckpointError, naming the file and the tensor, for an
    unreadable file, a tensor the model has no place for, a wrong shape or dtype, a tensor given
    twice (or whole as well as in parts), or a weight the checkpoint lacks."""
    params = dict(model.named_parameters())
    plan: dict[Path, list[tuple[str, str, object]]] = {}
    filled: dict[str, dict[object, tuple[str, Path]]] = {}  # parameter -> part -> the tensor filling it
    tied = model.cfg.tie_word_embeddings
    for f in files:
        plan[f] = []
        with _open_safetensors(f) as st:
            for hf_name in st.keys():
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the config
                target, part = model.checkpoint_name(hf_name)
                if target == "lm_head.weight" and tied:
                    target = "model.embed_tokens.weight"  # the same tensor; checked, and loaded once
                loader = weight_loader(params[target]) if target in params else None
                if loader is None or (part is not None and part not in loader.parts):
                    raise CheckpointError(f"Weights file {str(f)!r} has tensor {hf_name!r}, which the model "
                                          f"({model.cfg.architecture}) has no place for.")
                view = st.get_slice(hf_name)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                expected = tuple(loader.part_of(params[target], part).shape)
                if shape != expected:
                    raise CheckpointError(f"Weight {hf_name!r} in {str(f)!r} has shape {shape}, the model expects "
                                          f"{expected}.")
                if dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"Weight {hf_name!r} in {str(f)!r} has dtype {dtype}; flexsgl loads "
                                          f"unquantized weights ({', '.join(FLOAT_DTYPES)}).")
                if hf_name == "lm_head.weight" and tied:
                    continue
                parts = filled.setdefault(target, {})
                clash = parts.get(part) or (next(iter(parts.values()), None) if part is None else parts.get(None))
                if clash is not None:
                    other, other_file = clash
                    raise CheckpointError(f"Weight {hf_name!r} in {str(f)!r} fills the same part of the model as "
                                          f"{other!r} in {str(other_file)!r}.")
                parts[part] = hf_name, f
                plan[f].append((hf_name, target, part))
    missing = [n for n, p in params.items() if not _filled(filled.get(n, {}), weight_loader(p).parts)]
    if missing:
        where = f"{str(files[0].parent)!r}" if files else "the model directory"
        raise CheckpointError(f"The checkpoint in {where} lacks {len(missing)} weights the model needs, "
                              f"e.g. {missing[0]!r}.")
    return plan


def _filled(given: dict, parts: tuple) -> bool:
    """Whether a parameter whose checkpoint tensors fill `parts` (or the whole: part None) is filled."""
    return None in given or (bool(parts) and all(p in given for p in parts))


@contextmanager
def _open_safetensors(f: Path):
    try:
        st = safe_open(str(f), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"Weights file {str(f)!r} is not a readable safetensors file, it may be truncated "
                              f"or corrupt ({describe(e)}).") from None
    with st:
        yield st
