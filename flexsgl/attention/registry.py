"""Attention backends by name, what each needs, and how an `--override` string picks them.

A backend is named once here with its phases, the SM architectures and packages it needs and the
attention kinds (GQA or MLA) it serves; its class is imported only when it is built, so a missing
package costs nothing until it is asked for. An override is a name, `auto`, or `PREFILL,DECODE`; a name that serves one phase
only (`fi-decode`, `fa3-prefill`) leaves the other to flex.
Everything is checked before any weights load, and a backend that cannot run says why in one
sentence.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BackendSpec:
    name: str
    target: str  # "module:Class", imported lazily
    phases: tuple[str, ...]  # subset of ("prefill", "decode")
    sm: tuple[int, ...] | None  # SM versions (major*10+minor) it runs on; None: any, CPU included
    package: str | None  # importable module it needs
    attention: tuple[str, ...] = ("gqa",)  # model attention kinds it serves: "gqa" (MHA/GQA), "mla"
    head_dims: tuple[int, ...] | None = None  # head sizes its kernels are built for; None: any
    dtypes: tuple[str, ...] | None = None  # KV/activation dtypes it runs; None: any
    doc: str = ""
    mla_target: str | None = None  # the class serving MLA models, where it is another one
    # The attention-variant kernel features it runs (variant.py: window, softcap, sinks, chunk,
    # scale); ANY: every variant, its mods included (flex).
    features: tuple[str, ...] = ()
    kv_dtypes: tuple[str, ...] = ()  # quantized KV cache dtypes it reads, beside the engine's dtype


ANY = ("any",)
FA3_FEATURES = ("window", "softcap", "sinks", "chunk", "scale")


HALF = ("bfloat16", "float16")
FP8_KV = ("float8_e4m3fn",)  # an FP8 KV cache (kv_cache_dtype fp8_e4m3)


SPECS = {s.name: s for s in (
    BackendSpec("flex", "flexsgl.attention.flex:FlexAttentionBackend", ("prefill", "decode"), None, None,
                attention=("gqa", "mla"), mla_target="flexsgl.attention.flex_mla:FlexMLABackend", features=ANY,
                kv_dtypes=FP8_KV,
                doc="torch.compile + FlexAttention block masks over the paged KV (default path)"),
    BackendSpec("fa3", "flexsgl.overrides.fa3:FA3Backend", ("prefill", "decode"), (90,), "sgl_kernel",
                head_dims=(64, 96, 128, 192, 256), dtypes=HALF, features=FA3_FEATURES, kv_dtypes=FP8_KV,
                doc="sgl_kernel FlashAttention-3 flash_attn_with_kvcache"),
    BackendSpec("fa3-prefill", "flexsgl.overrides.fa3:FA3Backend", ("prefill",), (90,), "sgl_kernel",
                head_dims=(64, 96, 128, 192, 256), dtypes=HALF, features=FA3_FEATURES, kv_dtypes=FP8_KV,
                doc="FA3 for prefill only (decode: flex or another)"),
    BackendSpec("fi-decode", "flexsgl.overrides.flashinfer:FlashInferDecodeBackend", ("decode",), (80, 86, 89, 90, 100, 120),
                "flashinfer", head_dims=(64, 128, 256), dtypes=HALF, kv_dtypes=FP8_KV,
                doc="FlashInfer BatchDecodeWithPagedKVCacheWrapper, tensor cores for GQA (prefill: flex or another)"),
    BackendSpec("fi", "flexsgl.overrides.flashinfer:FlashInferBackend", ("prefill", "decode"), (80, 86, 89, 90, 100, 120),
                "flashinfer", head_dims=(64, 128, 256), dtypes=HALF, kv_dtypes=FP8_KV,
                doc="FlashInfer paged prefill and decode"),
    BackendSpec("triton-decode", "flexsgl.overrides.triton_decode:TritonDecodeBackend", ("decode",),
                (80, 86, 89, 90, 100, 120), "triton", head_dims=(64, 128, 256), dtypes=HALF, kv_dtypes=FP8_KV,
                doc="flexsgl's split-KV decode kernel (Triton), one launch per layer (prefill: flex or another)"),
    BackendSpec("fi-mla", "flexsgl.overrides.flashinfer_mla:FlashInferMLABackend", ("prefill", "decode"),
                (80, 86, 89, 90, 100, 120), "flashinfer", attention=("mla",), head_dims=(576,), dtypes=HALF,
                doc="FlashInfer BatchMLAPagedAttentionWrapper over the latent pool (MLA models)"),
    BackendSpec("triton-mla", "flexsgl.overrides.triton_mla:TritonMLADecodeBackend", ("decode",),
                (80, 86, 89, 90, 100, 120), "triton", attention=("mla",), dtypes=HALF,
                doc="flexsgl's split-KV MLA decode kernel (Triton) over the latent pool, one launch per layer "
                    "(MLA models; prefill: flex or another)"),
    BackendSpec("trtllm-mla", "flexsgl.overrides.trtllm_mla:TrtllmMLABackend", ("decode",), (100,), "flashinfer",
                attention=("mla",), head_dims=(576, 320), dtypes=HALF,
                doc="FlashInfer TRT-LLM MLA decode (Blackwell, MLA models; untested on hardware)"),
)}

# What `auto` means per (SM version, attention kind) when those backends can run; otherwise flex.
AUTO = {(90, "gqa"): "fa3-prefill,fi-decode", (100, "gqa"): "fi",
        (80, "mla"): "fi-mla", (90, "mla"): "fi-mla", (100, "mla"): "fi-mla,trtllm-mla"}
# Where a decode backend beats `auto`'s at small batches: it takes decode batches up to the size given
# (`PREFILL,DECODE,SMALL_DECODE<=N`), when it can run. Measured on an H200: docs/BENCHMARKS.md.
AUTO_SMALL_DECODE = {(90, "gqa"): "triton-decode<=64", (90, "mla"): "triton-mla<=8"}


def sm_version(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def why_not(spec: BackendSpec, device: torch.device, attention: str = "gqa", head_dim: int | None = None,
            dtype: str | None = None, page_size: int | None = None, variants=(), kv_dtype: str | None = None) -> str | None:
    """Why `spec` cannot run on `device` for a model with this attention kind, head size and dtype,
    a cache of this page size (None: not known yet), these per-layer attention variants and a KV
    cache quantized to `kv_dtype` (None: in the engine's dtype), or None."""
    if spec.sm is not None:
        sm = sm_version(device)
        if sm is None:
            return f"it needs a CUDA GPU (SM {'/'.join(map(str, spec.sm))}), and the device is {device.type}"
        if sm not in spec.sm:
            return f"it runs on SM {'/'.join(map(str, spec.sm))}, and this GPU is SM {sm}"
    if attention not in spec.attention:
        return f"it serves {'/'.join(a.upper() for a in spec.attention)} models, and this model is {attention.upper()}"
    if head_dim is not None and spec.head_dims is not None and head_dim not in spec.head_dims:
        what = "latent sizes (kv_lora_rank + rope dims)" if attention == "mla" else "head sizes"
        return f"its kernels take {what} {'/'.join(map(str, spec.head_dims))}, and this model's is {head_dim}"
    if dtype is not None and spec.dtypes is not None and dtype not in spec.dtypes:
        return f"it runs {' and '.join(spec.dtypes)}, and this engine runs {dtype}"
    if kv_dtype is not None and kv_dtype not in spec.kv_dtypes:
        return f"it does not read a {kv_dtype} KV cache (flex does)"
    reason = variant_refusal(spec, variants)
    if reason:
        return reason
    if spec.package and importlib.util.find_spec(spec.package) is None:
        return f"the package {spec.package!r} is not installed"
    if page_size is not None:  # the backend itself knows, once its package imports
        return backend_class(spec, attention).unsupported(page_size, device)
    return None


def variant_features(variant) -> dict | None:
    """What a layer's attention variant asks of a kernel override: its kernel features (with the
    scale where it sets one), {} for plain causal attention, None where only flex can run it."""
    if variant is None:
        return {}
    features = variant.features()
    if features is not None and variant.scale is not None:
        features["scale"] = variant.scale
    return features


def variant_refusal(spec: BackendSpec, variants) -> str | None:
    """Why `spec` cannot run one of the layers' attention variants, or None."""
    if spec.features == ANY:
        return None
    for v in {id(v): v for v in variants if v is not None}.values():
        features = variant_features(v)
        if features is None:
            return f"it cannot run the attention variant {v.name!r}, whose mods only flex runs"
        missing = [f for f in features if f not in spec.features]
        if missing:
            return (f"it does not take the attention variant {v.name!r}'s {', '.join(missing)} "
                    f"(it takes {', '.join(spec.features) or 'no variant features'})")
    return None


@dataclass(frozen=True)
class Choice:
    """The backend each phase runs; `small_decode`, if set, runs decode batches of up to
    `small_decode_max` requests instead of `decode`."""

    prefill: BackendSpec
    decode: BackendSpec
    small_decode: BackendSpec | None = None
    small_decode_max: int = 0
    note: str = ""  # why `auto` chose otherwise than its table (attention/cold_start.py), for the log

    @property
    def label(self) -> str:
        same = self.prefill.name == self.decode.name and self.small_decode is None
        label = self.prefill.name if same else f"{self.prefill.name},{self.decode.name}"
        return label + (f",{self.small_decode.name}<={self.small_decode_max}" if self.small_decode else "")

    def prefill_scratch_bytes(self, mcfg, tokens: int, itemsize: int) -> int:
        """What the prefill backend holds in a step of up to `tokens` new tokens beyond the model's
        activations, for this model's attention kind."""
        return backend_class(self.prefill, mcfg.attention).prefill_scratch_bytes(mcfg, tokens, itemsize)

    def max_pool_slots(self, mcfg) -> int | None:
        """The most pool slots the decode backends read in one pass (None: no limit)."""
        limits = [backend_class(spec, mcfg.attention).max_pool_slots(mcfg)
                  for spec in (self.decode, self.small_decode) if spec is not None]
        return min((n for n in limits if n is not None), default=None)


def split_small_decode(part: str, override: str) -> tuple[str, int]:
    """'NAME<=N' into (NAME, N), or ValueError in one sentence."""
    name, _, size = part.partition("<=")
    if not size.strip().isdigit() or int(size) < 1:
        raise ValueError(f"Override {override!r}: the third part names a decode backend for small batches "
                         f"and the largest batch it takes, e.g. triton-decode<=8.")
    return name.strip(), int(size)


def resolve_override(override: str, device: torch.device, attention: str = "gqa", page_size: int | None = None,
                     head_dim: int | None = None, dtype: str | None = None, variants=(),
                     kv_dtype: str | None = None) -> Choice:
    """Pick the backends `override` names, or raise ValueError saying in one sentence why not.
    variants: each layer's attention variant (None: plain causal), which every backend must serve;
    kv_dtype: the KV cache's quantized dtype (None: the engine's), which every backend must read."""
    names = (auto_choice(device, attention, head_dim, dtype, page_size, variants, kv_dtype) if override == "auto"
             else override)
    parts = [p.strip() for p in names.split(",")]
    if len(parts) > 3 or not all(parts):
        raise ValueError(f"Override {override!r} should be one backend, PREFILL,DECODE or "
                         f"PREFILL,DECODE,SMALL_DECODE<=N; available: auto, {', '.join(SPECS)}.")
    small_max = 0
    if len(parts) == 3:
        parts[2], small_max = split_small_decode(parts[2], override)
    for p in parts:
        if p not in SPECS:
            raise ValueError(f"Unknown attention override {p!r}; available: auto, {', '.join(SPECS)}.")
    if len(parts) == 1:  # a one-phase backend leaves the other phase to the default path
        spec = SPECS[parts[0]]
        prefill = spec if "prefill" in spec.phases else SPECS["flex"]
        decode = spec if "decode" in spec.phases else SPECS["flex"]
    small = SPECS[parts[2]] if len(parts) == 3 else None
    if len(parts) > 1:
        prefill, decode = SPECS[parts[0]], SPECS[parts[1]]
        for spec, phase in ((prefill, "prefill"), (decode, "decode"), (small, "decode")):
            if spec is not None and phase not in spec.phases:
                raise ValueError(f"Override {spec.name!r} does not run {phase}; it runs {', '.join(spec.phases)}.")
    for spec in {s.name: s for s in (prefill, decode, small) if s is not None}.values():
        reason = why_not(spec, device, attention, head_dim, dtype, page_size, variants, kv_dtype)
        if reason:
            raise ValueError(f"Override {spec.name!r} cannot run here: {reason}.")
    return Choice(prefill, decode, small, small_max)


def auto_choice(device: torch.device, attention: str = "gqa", head_dim: int | None = None,
                dtype: str | None = None, page_size: int | None = None, variants=(), kv_dtype: str | None = None) -> str:
    """`auto`'s backends here: AUTO's for this GPU where they run and serve every layer's variant
    and the KV cache's dtype; a phase whose backend cannot falls back to flex, and the small-batch
    decode backend is left out. An FP8 cache goes to flex, whose FP8 reads are the ones measured
    (docs/BENCHMARKS.md); an override that names another backend reads it there."""
    def runs(name: str, layers=()) -> bool:
        return why_not(SPECS[name.partition("<=")[0]], device, attention, head_dim, dtype, page_size, layers,
                       kv_dtype) is None

    key = (sm_version(device), attention)
    names = AUTO.get(key, "flex") if kv_dtype is None else "flex"
    if not all(runs(n) for n in names.split(",")):
        return "flex"
    prefill, decode = (names.split(",") * 2)[:2]
    prefill, decode = (n if runs(n, variants) else "flex" for n in (prefill, decode))  # what serves the variants
    small = AUTO_SMALL_DECODE.get(key)
    if small and decode != "flex" and runs(small, variants):
        return f"{prefill},{decode},{small}"
    return prefill if prefill == decode else f"{prefill},{decode}"


def check_override(override: str, device: torch.device | str, attention: str = "gqa") -> str:
    """Raise ValueError if `override` cannot run on `device`; return the backends it resolves to."""
    return resolve_override(override, torch.device(device), attention).label


def backend_class(spec: BackendSpec, attention: str = "gqa"):
    """The class that serves models of this attention kind for `spec`."""
    target = spec.mla_target if attention == "mla" and spec.mla_target else spec.target
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def table(device: torch.device) -> list[dict]:
    """One row per backend: its phases, the models it serves, whether it runs here for them and why not."""
    from flexsgl.attention.flex_options import flash_note

    rows = []
    for spec in SPECS.values():
        reasons = {a: why_not(spec, device, a) for a in spec.attention}
        runs = [a for a, r in reasons.items() if r is None]
        rows.append({"name": spec.name, "phases": ",".join(spec.phases), "models": ",".join(spec.attention),
                     "variants": "all" if spec.features == ANY else ",".join(spec.features) or "-",
                     "runs_here": bool(runs), "why_not": "" if runs else next(iter(reasons.values())),
                     "about": spec.doc + (flash_note(sm_version(device)) if spec.name == "flex" else "")})
    rows.append({"name": "auto", "phases": "prefill,decode", "models": "gqa,mla", "variants": "all",
                 "runs_here": True, "why_not": "",
                 "about": f"here: {auto_choice(device, 'gqa')} for GQA, {auto_choice(device, 'mla')} for MLA "
                          "(SM90: fa3-prefill,fi-decode, with triton-decode for batches up to 64 where triton is "
                          "installed, and fi-mla for MLA, with triton-mla for batches up to 8; SM100: fi, and "
                          "fi-mla,trtllm-mla for MLA; otherwise, or when those cannot run: flex)"})
    return rows
