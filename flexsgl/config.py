"""EngineConfig: every engine option, once, with its default, its check and its help text.

`LLM(model, **options)`, `flexsgl generate` and `flexsgl bench` are all built from it; the command
line makes one flag per field (`--max-total-tokens`, ...) from the field's name, type and help, so a
new option is one field here. Names follow SGLang's server arguments where one exists. The names
flexsgl used before are still taken, with a FutureWarning, for one release (DEPRECATED).

Each field's own check (type, range) runs when the config is made. `resolve` then turns the
defaults that depend on the device and the model ("auto", None) into values and checks the rules
between fields, all before anything loads (resolved_config.py); the engine builds from what it
returns.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from flexsgl.model.source import LOAD_FORMATS
from flexsgl.quant.apply import QUANTIZATIONS
from flexsgl.resolved_config import DTYPE_NAMES, KV_CACHE_DTYPES, ResolvedConfig, resolve_config

if TYPE_CHECKING:
    from flexsgl.model.config import ModelConfig


def option(default, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(None, "Preset, local HF model directory or hub id (default: the embedded model).")
    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda when there is one).")
    dtype: str = option("auto", "auto, float32, bfloat16 or float16 (auto: float32 on the CPU, the "
                                "checkpoint's half type on a GPU).")
    load_format: str = option("auto", "auto, safetensors or dummy (seeded random weights).")
    override: str = option("auto", "Attention backend(s): a name, auto, PREFILL,DECODE or "
                                   "PREFILL,DECODE,SMALL<=N (see `flexsgl backends`).")
    page_size: int = option(64, "Tokens per KV page (on a GPU a multiple of 16 for flex).")
    max_total_tokens: int | None = option(None, "KV cache size in tokens (default: what max_running_requests "
                                                "requests at the model's context fill, and as much again for "
                                                "the prefix cache, within free GPU memory; at most 16384 on "
                                                "the CPU).")
    mem_fraction_static: float = option(0.85, "Fraction of the GPU memory free once the weights are "
                                              "loaded that the KV cache and one step's activations may take.")
    context_length: int | None = option(None, "The most tokens, prompt and output, a request may hold (vLLM's "
                                              "max_model_len; default: the model's context, "
                                              "max_position_embeddings, which it may not exceed).")
    max_running_requests: int = option(256, "Most requests decoding at once.")
    max_num_batched_tokens: int = option(8192, "Most tokens in one prefill step (longer prompts are "
                                               "prefilled in chunks).")
    prefill_first: bool = option(False, "Prefill every waiting prompt before the next decode step (the whole "
                                        "batch's first tokens soonest), rather than alternating prefill and "
                                        "decode steps while requests decode (steady inter-token latency).")
    compile: bool | None = option(None, "torch.compile the model (default: on CUDA, off on the CPU "
                                   "and for one request at a time of a model under 100M parameters).")
    disable_cuda_graph: bool = option(False, "Run decode steps without CUDA graphs.")
    cuda_graph_bs: tuple[int, ...] | None = option(None, "Decode batch sizes to capture as CUDA graphs, "
                                                         "e.g. 1,2,4,8 (default: the decode buckets up to "
                                                         "max_running_requests).")
    cuda_graph_max_bs: int | None = option(None, "Largest decode batch captured as a CUDA graph where "
                                                 "cuda_graph_bs is not given (default: max_running_requests); "
                                                 "larger batches run without graphs. Lower it to start sooner.")
    quantization: str | None = option(None, "fp8: quantize an unquantized checkpoint's projections and routed "
                                            "experts to FP8 as it loads (weights per output channel; on GPUs with "
                                            "FP8 products, activations per token). FP8 checkpoints need no flag.")
    kv_cache_dtype: str = option("auto", "auto (the engine's dtype) or fp8_e4m3 (also fp8): the KV cache in "
                                         "FP8 E4M3, half the bytes of 16-bit K/V, with a scale per layer for K and "
                                         "one for V (the checkpoint's k_scale and v_scale, else 1.0). flex, FA3, "
                                         "FlashInfer and triton-decode read it; models with K/V heads only.")
    random_seed: int = option(0, "Seed of dummy weights, and of the sampling of requests without a seed of "
                                 "their own (vLLM's seed).")
    tensor_parallel_size: int = option(1, "GPUs (ranks) to split the model across, one process each "
                                          "(--tp, --tp-size; flexsgl starts them, or torchrun does).")
    attention: object = option(None, "Attention variant(s), composed with the model's own: a name with "
                                     "arguments, e.g. sliding_window:window=4096, NAME@LAYERS (layers: all, i,j or "
                                     "a slice like 0::2), several separated by ';', or module:attribute; from "
                                     "Python also an AttentionVariant or a dict of layers to variants "
                                     "(docs/ATTENTION.md).")

    def __post_init__(self):
        if self.cuda_graph_bs is not None and not isinstance(self.cuda_graph_bs, (str, bytes)):
            try:
                object.__setattr__(self, "cuda_graph_bs", tuple(self.cuda_graph_bs))
            except TypeError:
                pass
        for f in fields(self):  # every field has its check: a new option without one fails here
            CHECKS[f.name](f.name, getattr(self, f.name))
        if self.device is not None:
            kind = torch.device(self.device).type
            if kind == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"Device {str(self.device)!r} was asked for, but this machine has no CUDA GPU.")

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> "EngineConfig":
        """`LLM(model, **options)`'s arguments as a config; old option names warn and still work."""
        defaults = {f.name: f.default for f in fields(cls)}
        for other, name in SYNONYMS.items():
            if other in options:
                if name in options:
                    raise ValueError(f"Give {name!r} or {other!r}, not both.")
                options[name] = options.pop(other)
        for old, (new, convert) in DEPRECATED.items():
            if old in options:
                warnings.warn(f"The engine option {old!r} is deprecated; use {new!r}.", FutureWarning, stacklevel=3)
                value = options.pop(old)
                if options.get(new, defaults[new]) != defaults[new]:
                    raise ValueError(f"Give {new!r} or its old name {old!r}, not both.")
                if value is not None:
                    options[new] = convert(value)
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            raise ValueError(f"Unknown engine option {unknown[0]!r}; the options are {', '.join(sorted(defaults))}.")
        return cls(model=model, **options)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def torch_device(self) -> torch.device:
        """The device the engine runs on: the one asked for, else CUDA when there is one."""
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def resolve(self, model: ModelConfig, device: torch.device | str | None = None) -> ResolvedConfig:
        """Every default made concrete for `model` on `device` (default: torch_device), and every
        rule between options checked, before anything loads; ValueError in one sentence if they
        cannot run together (resolved_config.py; ResolvedConfig says what each value becomes)."""
        return resolve_config(self, model, device)


# ---- checks: one sentence each, types as well as ranges


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _positive_int(name, value):
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer of at least 1, got {value!r}.")


def _optional(check):
    return lambda name, value: None if value is None else check(name, value)


def _one_of(choices):
    def check(name, value):
        if value not in choices:
            raise ValueError(f"Unknown {name.replace('_', ' ')} {value!r}; choose one of {', '.join(choices)}.")
    return check


def _of_type(kind, what):
    def check(name, value):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be {what}, got {value!r}.")
    return check


def _device(name, value):
    if value is None:
        return
    ok = isinstance(value, str) and (value in ("cpu", "cuda") or
                                     (value.startswith("cuda:") and value[5:].isdigit()))
    if not ok:
        raise ValueError(f"Unknown device {value!r}; use cpu, cuda or cuda:N.")


def _fraction(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}.")


def _batch_sizes(name, value):
    if value is None:
        return
    if not isinstance(value, tuple) or not value or not all(_is_int(b) and b >= 1 for b in value):
        raise ValueError(f"{name} must be one or more batch sizes of at least 1, got {value!r}.")


def _attention(value):
    from flexsgl.attention.variant import AttentionVariant

    if not (value is None or isinstance(value, (str, dict, AttentionVariant))):
        raise ValueError(f"attention must be a variant's name, an AttentionVariant or a dict of layers to "
                         f"variants, got {type(value).__name__}.")


def _seed(name, value):
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")


CHECKS = {
    "model": _optional(_of_type(str, "a model name or path")),
    "device": _device,
    "dtype": _one_of(DTYPE_NAMES),
    "load_format": _one_of(LOAD_FORMATS),
    "override": _of_type(str, "a backend name, auto, or PREFILL,DECODE"),
    "attention": lambda name, value: _attention(value),
    "page_size": _positive_int,
    "max_total_tokens": _optional(_positive_int),
    "context_length": _optional(_positive_int),
    "mem_fraction_static": _fraction,
    "max_running_requests": _positive_int,
    "max_num_batched_tokens": _positive_int,
    "prefill_first": _of_type(bool, "True or False"),
    "compile": _optional(_of_type(bool, "True, False or None (the device's default)")),
    "disable_cuda_graph": _of_type(bool, "True or False"),
    "cuda_graph_bs": _batch_sizes,
    "cuda_graph_max_bs": _optional(_positive_int),
    "quantization": _optional(_one_of(QUANTIZATIONS)),
    "kv_cache_dtype": _one_of(tuple(KV_CACHE_DTYPES)),
    "random_seed": _seed,
    "tensor_parallel_size": _positive_int,
}

# vLLM's name of an option -> flexsgl's (SGLang's); both are taken.
SYNONYMS = {"max_model_len": "context_length"}

# Old option name -> (new name, how its value converts). Kept for one release.
_same = lambda v: v  # noqa: E731
DEPRECATED = {
    "kv_cache_tokens": ("max_total_tokens", _same),
    "max_running": ("max_running_requests", _same),
    "max_batch_tokens": ("max_num_batched_tokens", _same),
    "gpu_memory_fraction": ("mem_fraction_static", _same),
    "graph_batch_sizes": ("cuda_graph_bs", _same),
    "cuda_graphs": ("disable_cuda_graph", lambda on: not on),
    "seed": ("random_seed", _same),
}
