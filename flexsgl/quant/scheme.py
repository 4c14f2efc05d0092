"""A checkpoint's `quantization_config`, read into a QuantScheme: the FP8 formats flexsgl serves, and
one sentence for every other.

Served:

- block-wise FP8 (`quant_method: "fp8"` with `weight_block_size`, as DeepSeek-V3 and Qwen3-FP8 ship):
  each FP8 weight `<name>` comes with `<name>_scale_inv`, float32 `[ceil(N / bn), ceil(K / bk)]`,
  one scale per weight block; `modules_to_not_convert` / `ignored_layers` name modules left unquantized.
- per-tensor FP8 (`quant_method: "fp8"` without `weight_block_size`): `<name>_scale`, one number.
- compressed-tensors (`quant_method: "compressed-tensors"`, `format: "float-quantized"` or
  `"naive-quantized"`): 8-bit float weights by tensor or by output channel, `<name>.weight_scale`
  `[1]` or `[N, 1]`; an `input_scale` may be present (activations are quantized dynamically, per
  token, so it is not read); `ignore` names modules left unquantized (a name, or `re:` and a
  regular expression). A `kv_cache_scheme` (8-bit float, one scale per tensor) says the checkpoint
  holds per-layer K/V scales, read by the loader; with no config group quantizing weights the
  config quantizes none (no QuantScheme).

Stacked experts' weights `[E, N, K]` take a scale of each expert's shape stacked, `[E, ...]`.
Which tensors are FP8 is what the checkpoint's files say (their dtype); the scheme says which scale
each one has and what shape it takes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from flexsgl.errors import CheckpointError, short_repr

FP8_MAX = 448.0  # the largest float8_e4m3fn

SERVED = "fp8 (block-wise or per-tensor) and compressed-tensors FP8"


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's FP8 weights are scaled: `strategy` "block" (`block` = (rows, cols) per scale),
    "channel" (one scale per output row) or "tensor" (one scale); `scale_suffix` is appended to a
    weight's name to name its scale; `ignore` lists module names (or `re:` patterns) kept unquantized."""

    method: str  # "fp8" or "compressed-tensors"
    strategy: str
    scale_suffix: str
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()

    def scale_name(self, weight_name: str) -> str:
        return weight_name + self.scale_suffix

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the scale of an FP8 weight of `weight_shape` must have: of `[N, K]` per block
        `[ceil(N / bn), ceil(K / bk)]`, per channel `[N, 1]`, per tensor `[1]`; of stacked experts
        `[E, N, K]` the same led by E."""
        *lead, n, k = weight_shape
        if self.strategy == "block":
            return *lead, math.ceil(n / self.block[0]), math.ceil(k / self.block[1])
        return (*lead, n, 1) if self.strategy == "channel" else (*lead, 1)

    def ignores(self, module: str) -> bool:
        """Whether the config keeps module `module` (an HF module name) unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False


def quant_scheme(q, source: str) -> QuantScheme | None:
    """The QuantScheme of a config's `quantization_config` `q` (None where it quantizes no weights: a
    compressed-tensors `kv_cache_scheme` alone), or CheckpointError in one sentence naming the format
    where flexsgl does not serve it."""
    if not isinstance(q, dict):
        raise CheckpointError(f"{source}: 'quantization_config' must be a JSON object, got {short_repr(q)}.")
    method = q.get("quant_method")
    if method is None and (q.get("load_in_4bit") or q.get("load_in_8bit")):
        method = "bitsandbytes"  # as transformers reads a bitsandbytes config written without its method
    if method == "fp8":
        return _fp8(q, source)
    if method == "compressed-tensors":
        return _compressed_tensors(q, source)
    if str(method).lower() == "mxfp4":
        raise CheckpointError(f"{source} is an MXFP4-quantized checkpoint ('mxfp4'), which flexsgl does not "
                              f"dequantize; a bfloat16 checkpoint of the model loads (it serves {SERVED} ones too).")
    raise CheckpointError(f"{source} has a quantization_config of method {short_repr(method)}, which flexsgl does "
                          f"not serve; it serves {SERVED} checkpoints.")


def _names(q: dict, key: str, source: str) -> tuple[str, ...]:
    names = q.get(key) or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{source}: quantization_config {key!r} must be a list of module names, "
                              f"got {short_repr(names)}.")
    return tuple(names)


def _fp8(q: dict, source: str) -> QuantScheme:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{source}: FP8 quantization_config fmt {short_repr(fmt)} is not served; flexsgl "
                              "loads float8_e4m3fn weights.")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise CheckpointError(f"{source}: FP8 quantization_config activation_scheme {short_repr(scheme)} is not "
                              "'dynamic' or 'static'.")
    ignore = _names(q, "modules_to_not_convert", source) + _names(q, "ignored_layers", source)
    block = q.get("weight_block_size")
    if block is None:
        return QuantScheme("fp8", "tensor", "_scale", None, ignore)
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{source}: FP8 quantization_config 'weight_block_size' must be two positive "
                              f"integers, got {short_repr(block)}.")
    return QuantScheme("fp8", "block", "_scale_inv", (block[0], block[1]), ignore)


def _compressed_tensors(q: dict, source: str) -> QuantScheme | None:
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise CheckpointError(f"{source} is a compressed-tensors checkpoint of format {short_repr(fmt)}, which "
                              "flexsgl does not serve; it serves float-quantized and naive-quantized FP8 ones.")
    kv = q.get("kv_cache_scheme")
    if kv is not None:
        bits, kind, strategy = (kv.get(k) if isinstance(kv, dict) else None for k in ("num_bits", "type", "strategy"))
        if (bits, kind, strategy) != (8, "float", "tensor"):
            raise CheckpointError(f"{source}: the compressed-tensors kv_cache_scheme quantizes K/V to "
                                  f"{short_repr(bits)}-bit {short_repr(kind)} by {short_repr(strategy)}, which flexsgl "
                                  "does not serve; it serves 8-bit float K/V by tensor (a scale per layer).")
    groups = q.get("config_groups")
    if not isinstance(groups, dict):
        raise CheckpointError(f"{source}: the compressed-tensors quantization_config has no 'config_groups'.")
    strategies = set()
    for name, group in groups.items():
        if isinstance(group, dict) and (group.get("targets") == [] or not (group.get("weights")
                                                                           or group.get("input_activations"))):
            continue  # a group that quantizes nothing (llm-compressor writes one beside a kv_cache_scheme)
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise CheckpointError(f"{source}: compressed-tensors config group {name!r} has no 'weights' scheme.")
        bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
        if bits != 8 or kind != "float" or strategy not in ("tensor", "channel"):
            raise CheckpointError(f"{source}: compressed-tensors config group {name!r} quantizes weights to "
                                  f"{short_repr(bits)}-bit {short_repr(kind)} by {short_repr(strategy)}, which "
                                  "flexsgl does not serve; it serves 8-bit float weights by tensor or by channel.")
        if weights.get("symmetric") is False:
            raise CheckpointError(f"{source}: compressed-tensors config group {name!r} quantizes weights "
                                  "asymmetrically (with zero points), which flexsgl does not serve; it serves "
                                  "symmetric FP8 weights.")
        strategies.add(strategy)
    if len(strategies) > 1:
        raise CheckpointError(f"{source}: the compressed-tensors config groups mix per-tensor and per-channel "
                              "weights, which flexsgl does not serve.")
    if not strategies and kv is None:
        raise CheckpointError(f"{source}: the compressed-tensors quantization_config quantizes no weights and has "
                              "no 'kv_cache_scheme'.")
    if not strategies:
        return None  # the KV cache's scales alone; the weights are unquantized
    return QuantScheme("compressed-tensors", strategies.pop(), "_scale", None, _names(q, "ignore", source))
