"""Engine options made concrete for one model on one device: ResolvedConfig, and resolve_config,
which turns the defaults that depend on the device and the model ("auto", None) into values and
checks the rules between options, all before anything loads (EngineConfig.resolve); the engine
builds from what it returns. Also the dtype names the options take and the dtypes they resolve to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flexsgl.quant.fp8 import FP8

if TYPE_CHECKING:
    from flexsgl.attention.registry import Choice
    from flexsgl.config import EngineConfig
    from flexsgl.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float": torch.float32, "half": torch.float16}  # vLLM's names too
DTYPE_NAMES = ("auto", *DTYPES)
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": FP8, "fp8": FP8}


@dataclass(frozen=True)
class ResolvedConfig:
    """An EngineConfig made concrete for one model on one device (EngineConfig.resolve): what the
    engine builds. `options` holds the options as given; the rest are the values they resolve to."""

    options: EngineConfig
    device: torch.device
    dtype: torch.dtype  # dtype "auto": float32 on the CPU; on a GPU float16 for a float16 checkpoint, else bfloat16
    # The backends of `override` ("auto": the fastest that run here, attention/registry.py, but none
    # that would compile a FlashInfer kernel first for a small model, attention/cold_start.py).
    attention: Choice
    # compile None: on CUDA, off on the CPU and for one request at a time of a small model (lone_small_run)
    compile: bool
    # Decode batch sizes captured as CUDA graphs: cuda_graph_bs, else the decode buckets up to
    # max_running_requests, or up to cuda_graph_max_bs where that is lower (flexsgl/step_shape.py);
    # () where graphs are off (not CUDA, or disable_cuda_graph).
    cuda_graph_bs: tuple[int, ...]
    # KV cache tokens (flexsgl/cache/sizing.py has the rule): max_total_tokens; else on the CPU what
    # max_running_requests requests at the model's context fill and as much again, at most
    # CPU_KV_TOKENS; None on a GPU, where the device's limit, mem_fraction_static of the memory free
    # once the weights are loaded less one step's activations, is measured then.
    max_total_tokens: int | None
    max_total_tokens_reason: str = ""  # why max_total_tokens is what it is ("" where None)
    # Each layer's attention variant: the model's own composed with `attention`'s (None: plain
    # causal attention; flexsgl/attention/layer_variants.py)
    variants: tuple = ()
    kv_dtype: torch.dtype | None = None  # the KV cache's dtype: kv_cache_dtype's, or `dtype` for "auto"

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


def resolve_config(options: EngineConfig, model: ModelConfig,
                   device: torch.device | str | None = None) -> ResolvedConfig:
    """Every default of `options` made concrete for `model` on `device` (default:
    options.torch_device), and every rule between options checked, before anything loads;
    ValueError in one sentence if they cannot run together (ResolvedConfig says what each value
    becomes)."""
    from flexsgl.attention.cold_start import without_cold_compile
    from flexsgl.attention.registry import backend_class, resolve_override
    from flexsgl.cache.sizing import CPU_KV_TOKENS, check_kv_tokens, pool_tokens
    from flexsgl.step_shape import decode_buckets

    device = options.torch_device if device is None else torch.device(device)
    cpu = device.type == "cpu"
    if options.dtype != "auto":
        dtype = DTYPES[options.dtype]
    else:
        dtype = torch.float32 if cpu else torch.float16 if model.torch_dtype == "float16" else torch.bfloat16
    variants = resolve_variants(options.attention, model)
    kv_dtype = KV_CACHE_DTYPES[options.kv_cache_dtype]
    if kv_dtype is not None and model.attention == "mla":
        raise ValueError(f"kv_cache_dtype {options.kv_cache_dtype!r} serves models with K/V heads; this model "
                         "caches MLA latents (DeepSeek-V2), which stay in the engine's dtype.")
    attention = resolve_override(options.override, device, model.attention, options.page_size, model.kv_layout[2],
                                 str(dtype).removeprefix("torch."), variants,
                                 None if kv_dtype is None else str(kv_dtype).removeprefix("torch."))
    if options.override == "auto":  # no cold FlashInfer compile for a small model
        attention = without_cold_compile(attention, model, device, str(dtype).removeprefix("torch."),
                                         options.page_size)
    graphs = device.type == "cuda" and not options.disable_cuda_graph
    given = next((name for name in ("cuda_graph_bs", "cuda_graph_max_bs") if getattr(options, name) is not None), None)
    if given and not graphs:
        raise ValueError(f"{given} was given, but CUDA graphs are off: they need a CUDA device "
                         f"(this engine runs on {device.type}) and disable_cuda_graph unset.")
    sizes = ()
    if graphs:
        per_shape = any(backend_class(s, model.attention).compiles_per_shape
                        for s in (attention.decode, attention.small_decode) if s is not None)
        top = min(options.cuda_graph_max_bs or options.max_running_requests, options.max_running_requests)
        sizes = tuple(sorted(set(options.cuda_graph_bs or decode_buckets(per_shape, top))))
        for limit, name in ((options.max_running_requests, "max_running_requests"),
                            (options.cuda_graph_max_bs, "cuda_graph_max_bs")):
            if limit is not None and sizes[-1] > limit:
                raise ValueError(f"CUDA graph batch sizes go up to {name} ({limit}), got {sizes[-1]}.")
    # The KV pool's size where the device's limit is known before loading (cache/sizing.py).
    kv = pool_tokens(options, model.max_position, CPU_KV_TOKENS if cpu else None, "flexsgl's CPU default")
    if kv is not None:
        check_kv_tokens(kv.tokens, options.page_size)
    compile = options.compile
    if compile is None:
        compile = device.type == "cuda" and not lone_small_run(options, model)
    return ResolvedConfig(options, device, dtype, attention, compile, sizes, kv and kv.tokens,
                          kv.reason if kv else "", variants, kv_dtype or dtype)


def lone_small_run(options: EngineConfig, model: ModelConfig) -> bool:
    """Whether the engine runs one request at a time of a model under SMALL_MODEL_PARAMS parameters
    (`flexsgl generate` of one prompt of the embedded model): its steps cost their launches, which
    its CUDA graphs replay whether compiled or not, so compiling them (seconds) only delays the
    first token; `compile` None is off there."""
    from flexsgl.attention.cold_start import SMALL_MODEL_PARAMS

    return options.max_running_requests == 1 and model.num_params() < SMALL_MODEL_PARAMS


def resolve_variants(spec, model: ModelConfig) -> tuple:
    """Each layer's attention variant for `model` with the user's `spec` (the `attention` option),
    or ValueError (a VariantError) in one sentence where one cannot run."""
    from flexsgl.attention.layer_variants import layer_variants, user_variants
    from flexsgl.attention.variant import VariantError

    own = model.attention_variants()
    user = user_variants(spec, model.num_layers)
    if model.attention == "mla" and any(v is not None for v in (*own, *user)):
        raise VariantError("Attention variants are not served on MLA models (DeepSeek-V2) yet.")
    return tuple(layer_variants(own, user, model.num_heads))

