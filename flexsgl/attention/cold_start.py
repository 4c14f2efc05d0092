"""`auto` without a cold compile: a small model does not wait for FlashInfer to compile a kernel.

FlashInfer compiles each kernel variant with nvcc the first time a process runs it (about 25 s for
fi-decode's on an H100), unless a compiled one is installed (flashinfer-jit-cache) or left in its
JIT cache by an earlier run; overrides/flashinfer_kernels.py looks for one by file lookups. For a
model under SMALL_MODEL_PARAMS parameters a decode step costs its launches more than its attention,
so no kernel's speed repays that wait: where `auto` picked fi or fi-decode and a kernel they need is
not compiled, decode goes to triton-decode (Triton compiles its kernel in about a second; flex where
triton-decode cannot run) and what fi would have prefilled to flex, and the choice says why; where
flex cannot run either (a page size it does not take), FlashInfer stays and compiles.
Larger models keep auto's choice: they pay the compile once per machine, and their figures
(docs/BENCHMARKS.md) are FlashInfer's. An override that names fi or fi-decode compiles as asked.
"""

from __future__ import annotations

import dataclasses

import torch

from flexsgl.attention import registry
from flexsgl.attention.registry import SPECS, Choice, why_not

SMALL_MODEL_PARAMS = 100_000_000  # the embedded model and the test presets; real checkpoints start at ~0.5B
FLASHINFER = ("fi", "fi-decode")  # the GQA backends whose kernels FlashInfer compiles on first use


def cold_flashinfer_modules(choice: Choice, model, device: torch.device, dtype: str) -> list[str]:
    """The FlashInfer modules `choice` would run for `model` that are neither installed nor cached."""
    from flexsgl.overrides import flashinfer_kernels

    names = sorted({s.name for s in (choice.prefill, choice.decode, choice.small_decode)
                    if s is not None and s.name in FLASHINFER})
    sm = registry.sm_version(device)
    grouped = model.num_heads != model.num_kv_heads
    needed = [m for name in names for m in flashinfer_kernels.modules(name, dtype, model.head_dim, grouped, sm)]
    return [m for m in dict.fromkeys(needed) if flashinfer_kernels.compiled(m, sm) is None]


def without_cold_compile(choice: Choice, model, device: torch.device, dtype: str, page_size: int) -> Choice:
    """`auto`'s `choice`, with its FlashInfer backends replaced where `model` is small and their
    kernels would compile first (module docstring); `note` says what changed and why."""
    uses = [s.name for s in (choice.prefill, choice.decode) if s.name in FLASHINFER]
    if not uses or model.attention != "gqa" or dtype not in ("bfloat16", "float16"):
        return choice
    params = model.num_params()
    if params >= SMALL_MODEL_PARAMS:
        return choice
    cold = cold_flashinfer_modules(choice, model, device, dtype)
    if not cold:
        return choice
    def fits(spec) -> bool:
        return why_not(spec, device, model.attention, model.head_dim, dtype, page_size) is None

    flex, triton = SPECS["flex"], SPECS["triton-decode"]
    prefill = flex if choice.prefill.name in FLASHINFER else choice.prefill
    decode = (triton if fits(triton) else flex) if choice.decode.name in FLASHINFER else choice.decode
    if flex in (prefill, decode) and not fits(flex):
        return choice  # flex cannot take FlashInfer's place here (a page size it does not take): FlashInfer compiles
    small = choice.small_decode if choice.small_decode not in (None, decode) else None
    picked = Choice(prefill, decode, small, choice.small_decode_max if small else 0)
    note = (f"auto took {picked.label} over {choice.label}: FlashInfer has no compiled kernel for this model's "
            f"shapes ({cold[0]}{f' and {len(cold) - 1} more' if len(cold) > 1 else ''}: no flashinfer-jit-cache "
            f"of its version holds it, nor its JIT cache), and compiling it (~25 s) is longer than this "
            f"{params / 1e6:.1f}M-parameter model needs to start; --override {choice.label} compiles it once")
    return dataclasses.replace(picked, note=note)
