"""Build a model and give it its weights: a checkpoint's safetensors, checked whole before anything
is copied, or seeded random ones. Where the model comes from is flexsgl/model/source.py; how each
checkpoint tensor lands in its parameter is that parameter's weight loader
(flexsgl/model/weight_loaders.py)."""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from flexsgl.errors import CheckpointError, describe
from flexsgl.log import logger, progress
from flexsgl.model.architectures import model_class
from flexsgl.model.dummy_weights import init_dummy_weights
from flexsgl.model.empty_init import no_init
from flexsgl.model.source import ModelSource, weight_files
from flexsgl.model.weight_loaders import StackedExperts, block_loader, row_loader, weight_loader
from flexsgl.quant.apply import keep_fp8, keeps_fp8, keeps_fp8_experts, quantize_online
from flexsgl.quant.fp8 import FP8, expand_scale
from flexsgl.quant.scheme import QuantScheme

# Floating-point safetensors dtypes, which load into any model dtype; FP8 tensors load with their
# scales (flexsgl/quant); anything else (integers, other float8) is a quantized or foreign checkpoint.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
FP8_DTYPE = "F8_E4M3"
# A layer's FP8 KV cache scales, one value each (llm-compressor's and vLLM's names, and the older
# `k_proj.output_scale` / `v_proj.output_scale`): read into the model's kv_cache_scales, which an
# FP8 cache uses (flexsgl/model/causal_lm.py).
KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])(?:_scale|_proj\.output_scale)$")


def build_model(src: ModelSource, device: torch.device, dtype: torch.dtype, seed: int = 0, rank: int = 0,
                size: int = 1, quantization: str | None = None) -> nn.Module:
    """Build the model on `device` in `dtype`, with weights from `src` (or seeded random ones): all
    of it, or with `size` > 1 rank `rank`'s part of it (flexsgl/distributed/layers.py), which is
    all that is ever allocated on this rank: the parameters are allocated in `dtype` at the rank's
    shapes, and the weights are read (or generated) into them a slice at a time.

    An FP8 checkpoint's projections and experts stay FP8 where FP8 products run (flexsgl/quant/apply.py);
    its other FP8 tensors, and all of them elsewhere, are dequantized to `dtype` as they load.
    `quantization` "fp8" quantizes an unquantized checkpoint's projections and experts once loaded."""
    cfg = src.config.shard(rank, size)
    cls = model_class(cfg.architecture)
    files = weight_files(src.path) if src.load_format != "dummy" else []
    with torch.device("meta"), no_init():  # values come from loading alone (empty_init.py)
        model = cls(cfg)
        full = model if size == 1 else cls(src.config)  # the whole model's shapes and weight loaders
        if cfg.quant is not None and files:
            block = cfg.quant.block
            keep = keeps_fp8(device, dtype, block), keeps_fp8_experts(device, dtype, block)
            if any(keep):
                kept = keep_fp8(model, fp8_parameters(model, read_headers(files)), *keep, block,
                                lambda linear: block_loader(weight_loader(linear.weight), block) is not None)
                logger.info(f"FP8: {len(kept)} projections and experts keep FP8 weights")
    model.materialize(device, dtype)
    if src.load_format == "dummy":
        init_dummy_weights(model, seed, full)
    else:
        load_safetensors(model, files, full)
    if quantization == "fp8" and cfg.quant is None:
        quantize_online(model, device, dtype)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def load_safetensors(model: nn.Module, files: list[Path], full: nn.Module | None = None) -> None:
    """Copy the checkpoint's tensors into `model`, once every tensor's name, shape and dtype (and an
    FP8 tensor's scale) has been checked against the whole model (`full`, on the meta device, for a
    rank's part of it) and nothing is missing: a bad checkpoint raises CheckpointError and loads
    nothing. Each tensor goes through its parameter's weight loader, which reads only this rank's
    slices of it; an FP8 tensor is read whole with its scale, then goes into an FP8 parameter as it
    is (its scales into the parameter's `<name>_scale`: one per row, row for row with the weight, or
    a block-wise checkpoint's per block, block row for block row) or into any other dequantized."""
    plan = check_checkpoint(model if full is None else full, files)
    params = dict(model.named_parameters())
    scheme = model.cfg.quant
    for f in progress(files, desc="loading weights", unit="file", disable=len(files) < 2):
        with _open_safetensors(f) as st:
            for hf_name, target, part, scale in plan[f]:
                p = params[target]
                try:
                    if scale is None:
                        weight_loader(p).load(p, _reader(st, hf_name), part)
                        continue
                    weight = _read(st.get_tensor(hf_name), hf_name)
                    with _open_safetensors(scale[1]) as scale_file:
                        s = _read(scale_file.get_tensor(scale[0]), scale[0], scale[1])
                    if p.dtype == FP8:  # the FP8 values as they are, and their scales by block or by row
                        weight_loader(p).load(p, _held(weight), part)
                        scales = params[target + "_scale"]
                        if scheme.block is not None:
                            block_loader(weight_loader(p), scheme.block).load(scales, _held(s.float()), part)
                        else:
                            rows = expand_scale(s, scheme.strategy, None, tuple(weight.shape))
                            row_loader(weight_loader(p)).load(scales, _held(rows.expand(*weight.shape[:-1], 1)), part)
                    else:
                        expanded = expand_scale(s, scheme.strategy, scheme.block, tuple(weight.shape))
                        weight_loader(p).load(p, _held(weight.float() * expanded), part)
                except SafetensorError as e:
                    raise CheckpointError(f"Weights file {str(f)!r} is corrupt: {describe(e)}.") from None
                except NonFinite as e:
                    raise CheckpointError(f"Weight {e.name!r} in {str(e.file or f)!r} holds NaN or infinite "
                                          "values.") from None
    model.kv_cache_scales = kv_cache_scales(files)


def kv_cache_scales(files: list[Path]) -> dict[int, list[float]]:
    """Per layer, [k_scale, v_scale] from the checkpoint's KV_SCALE tensors (1.0 for one it lacks);
    a scale that is not a positive finite number raises CheckpointError."""
    out: dict[int, list[float]] = {}
    for f in files:
        with _open_safetensors(f) as st:
            for name in st.keys():
                m = KV_SCALE.match(name)
                if m is None:
                    continue
                value = float(st.get_tensor(name).float().reshape(()))
                if not (math.isfinite(value) and value > 0):
                    raise CheckpointError(f"KV cache scale {name!r} in {str(f)!r} is {value}; a scale is a positive "
                                          "finite number.")
                out.setdefault(int(m.group(1)), [1.0, 1.0])["kv".index(m.group(2))] = value
    return out


class NonFinite(Exception):
    """A tensor read holds NaN or infinity (load_safetensors names it, and its file)."""

    def __init__(self, name: str, file: Path | None = None):
        super().__init__(name)
        self.name, self.file = name, file


def _check_tied_head(model, head_file: Path, by_name: dict) -> None:
    """A checkpoint whose config ties the LM head to the embeddings may still hold an lm_head.weight:
    the same values are the tie written out; other values are refused (transformers would untie and
    use them, flexsgl's model is built tied)."""
    embed = next((n for n in by_name if n != "lm_head.weight"
                  and model.checkpoint_name(n)[0] == "model.embed_tokens.weight"), None)
    if embed is None:
        return  # the embeddings' absence is reported as missing
    with safe_open(str(head_file), framework="pt", device="cpu") as h, \
            safe_open(str(by_name[embed][0]), framework="pt", device="cpu") as e:
        same = torch.equal(h.get_tensor("lm_head.weight"), e.get_tensor(embed))
    if not same:
        raise CheckpointError(f"config.json ties the LM head to the embeddings (tie_word_embeddings), but "
                              f"{str(head_file)!r} holds an lm_head.weight other than {embed!r}; set "
                              f"tie_word_embeddings to false in config.json to use it.")


def _read(t: torch.Tensor, name: str, file: Path | None = None) -> torch.Tensor:
    if not all_finite(t):
        raise NonFinite(name, file)
    return t


def _reader(st, name: str):
    """read(index, out) of a weight loader: the whole tensor, or only its slice `index`, into `out`
    (through the host: what is read is the rank's part alone), refusing NaN or infinite values."""
    return lambda index, out: out.copy_(_read(st.get_tensor(name) if index is None else st.get_slice(name)[index],
                                              name))


def _held(t: torch.Tensor):
    """read(index, out) of a tensor already in memory."""
    return lambda index, out: out.copy_(t if index is None else t[index])


def all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN or infinity: one float32 sum, which NaN and infinities carry into (a
    tensor whose sum overflows float32, far beyond any weight's, counts as infinite)."""
    if t.dtype.itemsize == 1:  # float8: no sum kernel
        t = t.float()
    return bool(torch.isfinite(t.sum(dtype=torch.float32)))


# (name, file, shape, safetensors dtype) of every tensor of a checkpoint, file by file
Headers = list[tuple[str, Path, tuple[int, ...], str]]


def read_headers(files: list[Path]) -> Headers:
    """The name, file, shape and dtype of every tensor in `files` (their headers alone); a name in
    two files raises CheckpointError."""
    headers, seen = [], {}
    for f in files:
        with _open_safetensors(f) as st:
            for name in st.keys():
                if name in seen:
                    raise CheckpointError(f"Tensor {name!r} is given twice, in {str(seen[name])!r} and in {str(f)!r}.")
                seen[name] = f
                view = st.get_slice(name)
                headers.append((name, f, tuple(view.get_shape()), view.get_dtype()))
    return headers


def fp8_parameters(model: nn.Module, headers: Headers) -> set[str]:
    """The parameters that only FP8 checkpoint tensors fill."""
    fp8, other = set(), set()
    for name, _, _, dtype in headers:
        (fp8 if dtype == FP8_DTYPE else other).add(model.checkpoint_name(name)[0])
    return fp8 - other


def check_checkpoint(model: nn.Module, files: list[Path]) -> dict[Path, list[tuple[str, str, object, object]]]:
    """Read the headers of `files` and match every tensor to the part of `model` it fills (the
    model's `checkpoint_name`, the parameter's weight loader); returns, per file, (tensor name,
    parameter name, part, scale) rows, scale (name, file) for an FP8 tensor, else None. Raises
    CheckpointError, naming the file and the tensor, for an unreadable file, a tensor the model has
    no place for, a wrong shape or dtype, an FP8 tensor that is not a matrix (or stacked experts')
    or without its scale or with one of the wrong shape, a tensor given twice (or whole as well as
    in parts; a KV cache scale under two names), or a weight the checkpoint lacks."""
    params = dict(model.named_parameters())
    plan: dict[Path, list[tuple[str, str, object, object]]] = {f: [] for f in files}
    filled: dict[str, dict[object, tuple[str, Path]]] = {}  # parameter (or KV scale) -> part -> the tensor filling it
    tied = model.cfg.tie_word_embeddings
    headers = read_headers(files)
    scales = _scales(model.cfg.quant, headers)
    by_name = {name: (f, shape, dtype) for name, f, shape, dtype in headers}
    for hf_name, f, shape, dtype in headers:
        if hf_name.endswith("rotary_emb.inv_freq") or scales.get(hf_name, "") is None:
            continue  # recomputed from the config; an activation scale (activations are scaled per token)
        if hf_name in scales:
            continue  # an FP8 weight's scale, checked and read with it
        kv = KV_SCALE.match(hf_name)
        if kv is not None:
            if math.prod(shape) != 1:
                raise CheckpointError(f"KV cache scale {hf_name!r} in {str(f)!r} has shape {shape}; flexsgl reads "
                                      "one scale per layer for K and one for V.")
            _claim(filled, "model.layers.{}.self_attn.{}_scale".format(*kv.groups()), None, hf_name, f)
            continue  # read by kv_cache_scales
        target, part = model.checkpoint_name(hf_name)
        if target == "lm_head.weight" and tied:
            target = "model.embed_tokens.weight"  # the same tensor; checked, and loaded once
        loader = weight_loader(params[target]) if target in params else None
        if loader is None or (part is not None and part not in loader.parts):
            raise CheckpointError(f"Weights file {str(f)!r} has tensor {hf_name!r}, which the model "
                                  f"({model.cfg.architecture}) has no place for.")
        expected = tuple(loader.part_of(params[target], part).shape)
        if shape != expected:
            raise CheckpointError(f"Weight {hf_name!r} in {str(f)!r} has shape {shape}, the model expects "
                                  f"{expected}.")
        scale = None
        if dtype == FP8_DTYPE:
            if len(shape) != 2 and not (len(shape) == 3 and isinstance(loader, StackedExperts)):
                raise CheckpointError(f"FP8 tensor {hf_name!r} in {str(f)!r} has shape {shape}; flexsgl reads FP8 "
                                      "weight matrices [N, K] and stacked experts [E, N, K] alone.")
            scale = _check_scale(model.cfg.quant, hf_name, f, shape, by_name)
        elif dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"Weight {hf_name!r} in {str(f)!r} has dtype {dtype}; flexsgl loads "
                                  f"unquantized weights ({', '.join(FLOAT_DTYPES)}) and FP8 ones ({FP8_DTYPE}).")
        if hf_name == "lm_head.weight" and tied:
            _check_tied_head(model, f, by_name)
            continue
        _claim(filled, target, part, hf_name, f)
        plan[f].append((hf_name, target, part, scale))
    row_scales = {n + "_scale" for n, p in params.items() if p.dtype == FP8}  # FP8 weights': read with them
    needed = {n: p for n, p in params.items() if n not in row_scales}
    missing = [n for n, p in needed.items() if not _filled(filled.get(n, {}), weight_loader(p).parts)]
    if missing:
        where = f"{str(files[0].parent)!r}" if files else "the model directory"
        raise CheckpointError(f"The checkpoint in {where} lacks {len(missing)} weights the model needs, "
                              f"e.g. {missing[0]!r}.")
    return plan


def _claim(filled: dict[str, dict[object, tuple[str, Path]]], target: str, part, name: str, f: Path) -> None:
    """Note that tensor `name` in `f` fills `part` of `target` (None: the whole) in `filled`; a part
    (or the whole) another tensor fills already raises CheckpointError."""
    parts = filled.setdefault(target, {})
    clash = parts.get(part) or (next(iter(parts.values()), None) if part is None else parts.get(None))
    if clash is not None:
        other, other_file = clash
        raise CheckpointError(f"Tensor {name!r} in {str(f)!r} fills the same part of the model as {other!r} in "
                              f"{str(other_file)!r}.")
    parts[part] = name, f


def _scales(scheme: QuantScheme | None, headers: Headers) -> dict[str, str | None]:
    """The scale tensors of an FP8 checkpoint: each FP8 weight's scale -> the weight, and each
    activation scale -> None."""
    if scheme is None:
        return {}
    names = {name for name, *_ in headers}
    scales: dict[str, str | None] = {n: None for n in names if n.endswith(".input_scale")}
    for name, _, _, dtype in headers:
        if dtype == FP8_DTYPE and scheme.scale_name(name) in names:
            scales[scheme.scale_name(name)] = name
    return scales


def _check_scale(scheme: QuantScheme | None, name: str, f: Path, shape: tuple[int, ...],
                 headers: dict[str, tuple[Path, tuple[int, ...], str]]) -> tuple[str, Path]:
    """The (name, file) of FP8 weight `name`'s scale, once its presence, shape and dtype are checked."""
    if scheme is None:
        raise CheckpointError(f"Weight {name!r} in {str(f)!r} has dtype {FP8_DTYPE}, but the model's config has "
                              "no quantization_config saying how it is scaled.")
    scale = scheme.scale_name(name)
    if scale not in headers:
        raise CheckpointError(f"FP8 weight {name!r} in {str(f)!r} has no scale: the checkpoint lacks {scale!r}.")
    scale_file, scale_shape, scale_dtype = headers[scale]
    expected = scheme.scale_shape(shape)
    if scale_shape != expected and not (scheme.strategy == "tensor" and scale_shape == ()):
        raise CheckpointError(f"Scale {scale!r} in {str(scale_file)!r} has shape {scale_shape}; the {scheme.strategy} "
                              f"scale of FP8 weight {name!r} {shape} must have shape {expected}.")
    if scale_dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"Scale {scale!r} in {str(scale_file)!r} has dtype {scale_dtype}; scales are "
                              f"floating-point ({', '.join(FLOAT_DTYPES)}).")
    return scale, scale_file


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
