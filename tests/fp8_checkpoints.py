"""FP8 checkpoints made from tiny HF ones, quantized here independently of flexsgl.quant: block-wise
(`quant_method: fp8`, `<name>_scale_inv` per block) and compressed-tensors (per channel or per
tensor, `<name>_scale`), with a float32 copy of the same weights dequantized (the reference).
Stacked experts `[E, N, K]` are quantized expert by expert, their scales stacked `[E, ...]`."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn


def quantize(w: torch.Tensor, fmt: str, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, its scale as the checkpoint stores it, the float32 weight they stand for), each
    scale the absmax of what it scales over 448, computed block by block, row by row or whole."""
    w = w.double()
    n, k = w.shape
    if fmt == "block":
        bn, bk = block
        scale = torch.empty(math.ceil(n / bn), math.ceil(k / bk), dtype=torch.float64)
        full = torch.empty_like(w)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                part = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                scale[i, j] = part.abs().max() / 448
                full[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = scale[i, j]
    elif fmt == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        full = scale.expand(n, k)
    else:
        scale = w.abs().max().reshape(1) / 448
        full = scale.expand(n, k)
    scale, full = scale.float(), full.float()  # the checkpoint's float32 scales
    q = (w / full.double()).to(FP8)
    return q, scale, (q.double() * full.double()).float()


def quantization_config(fmt: str, block, ignore: list[str]) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "modules_to_not_convert": ignore}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": fmt,
                                                      "symmetric": True, "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "dynamic": True}}}}


def quantizable(name: str, t: torch.Tensor, ignore: list[str]) -> bool:
    """The layers' projections and experts, one tensor per expert or stacked (not norms, not MoE
    routers, not the modules in `ignore`)."""
    module = name.removesuffix(".weight")
    stacked = t.dim() == 3 and ".mlp.experts." in name
    return ((t.dim() == 2 and name.endswith(".weight") or stacked) and name.startswith("model.layers.")
            and "norm" not in name and not name.endswith("mlp.gate.weight")
            and not any(module.endswith(i) for i in ignore))


def make_fp8_checkpoint(src: Path, dst: Path, ref: Path, fmt: str, block=(128, 128), ignore=(),
                        input_scales: bool = False) -> list[str]:
    """Write `src` (an HF checkpoint) to `dst` with its projections in FP8 as `fmt` says ("block",
    "channel" or "tensor"), and to `ref` in float32 with the weights `dst` stands for; returns the
    names of the FP8 tensors."""
    tensors, quantized, reference = load_file(src / "model.safetensors"), {}, {}
    config = json.loads((src / "config.json").read_text())
    for name, t in tensors.items():
        if quantizable(name, t, list(ignore)):
            q, scale, deq = (quantize(t, fmt, block) if t.dim() == 2 else
                             map(torch.stack, zip(*(quantize(e, fmt, block) for e in t))))
            quantized[name] = q
            quantized[name + ("_scale_inv" if fmt == "block" else "_scale")] = scale
            if input_scales:
                quantized[name.removesuffix("weight") + "input_scale"] = torch.rand(1) + 0.5
            reference[name] = deq
        else:
            quantized[name] = reference[name] = t
    for d in (dst, ref):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, d / f.name)
    save_file(quantized, dst / "model.safetensors")
    save_file(reference, ref / "model.safetensors")
    (ref / "config.json").write_text(json.dumps(config))
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config":
                                                 quantization_config(fmt, block, list(ignore))}))
    return [n for n, t in quantized.items() if t.dtype == FP8]
