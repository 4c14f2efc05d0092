"""Compile policy: what the engine compiles, with which torch settings, and at which shapes.

- What compiles is the model's *regions* (`model.compiled_regions()`): each decoder layer, not the
  whole step. Every layer runs the same code on its own weights and its own KV cache tensors (the
  backends take a layer's cache, not its index), so the first layer's compile serves all of them:
  tracing and code generation cost one layer, not 36, and a warm cache reloads one layer's code.
  The embedding, the final norm, the LM head and sampling run eagerly around the layers; CUDA
  graphs capture the whole step all the same. A model whose layers differ (the dense and MoE layers
  of DeepSeek-V2 and Qwen3-MoE) compiles once per kind.
- The step functions (prefill, decode) run the regions inside `settings()` and log the calls in
  which something compiled (CompiledStep).
- Prefill shapes are dynamic on CUDA. On the CPU, Inductor's flex kernel miscompiles some dynamic
  shapes (duplicate size symbols) and cannot take fused epilogues (batch 1), so there each shape
  compiles on its own and nothing is fused after attention.
- Decode steps pad to a batch bucket and CUDA graphs are captured per bucket (the buckets, and
  every other shape a step takes, are step_shape.py's). On CUDA decode compiles once with a
  symbolic batch (and once at batch 1, where the projections are flexsgl's gemv kernels): attention
  is one opaque op for every backend (flex's is flex_decode, which compiles one small kernel per
  batch size, so flex gets the few buckets; a kernel override gets SGLang's finer spacing). On the
  CPU each decode bucket compiles.
- No varying dimension of a compiled prefill step is 0 or 1 (MIN_COMPILED_SIZE, step_shape.py):
  torch.compile specialises such a dimension, so a batch-1 or one-block prefill after
  multi-request ones would recompile. The step's plan pads requests and sampled rows, flex pads
  query blocks.
- Torch settings hold only while a compiled step runs (dynamo traces and recompiles inside the
  call), not process-wide: a recompile limit for the buckets, no duck sizing, and Inductor's
  kernels launched with PDL on SM90+ GPUs (kernels/launch.py: a layer's elementwise kernels,
  attention's split-combining ones and the MoE's sum launch while the kernel before them drains
  instead of after it; figures in docs/BENCHMARKS.md). Duck sizing gives dimensions of equal size
  one symbol at the first compile, so one that happens to equal a static size is specialised with
  it and the next step recompiles (prefill's 8 query blocks would take 8 KV heads' symbol, a decode
  batch equal to its token buffer's size that buffer's).

Compiled artifacts persist across processes: compile_cache.py says where.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from flexsgl.compile_cache import prepare as prepare_cache
from flexsgl.kernels import launch
from flexsgl.log import logger

RECOMPILE_LIMIT = 128  # one compile per decode bucket and per prefill shape on the CPU, in one code object


@contextlib.contextmanager
def settings():
    """The torch settings compiled steps trace and run under. Set and restored by hand: the configs'
    own patch() costs ~0.6 ms a call on the development CPU, on every prefill step.

    Python floats are specialized (constants of the graph): a float an attention variant's
    score_mod closes over would otherwise reach FlexAttention's lowering as a 0-d CPU tensor read
    with .item(), which Inductor cannot lower inside flex's kernel (torch 2.11, dynamic shapes)."""
    import torch._inductor.config  # here, not at import: importing it sets TORCHINDUCTOR_CACHE_DIR (compile_cache)

    dynamo, inductor = torch._dynamo.config, torch._inductor.config.triton
    saved = dynamo.recompile_limit, fx_config.use_duck_shape, inductor.enable_pdl, dynamo.specialize_float
    dynamo.recompile_limit, fx_config.use_duck_shape = max(saved[0], RECOMPILE_LIMIT), False
    dynamo.specialize_float = True
    inductor.enable_pdl = launch.allowed()  # Inductor itself keeps it to CUDA SM90+
    try:
        yield
    finally:
        dynamo.recompile_limit, fx_config.use_duck_shape, inductor.enable_pdl, dynamo.specialize_float = saved


class CompiledStep:
    """A step function whose model runs its compiled regions, run inside `settings()`; logs each
    call that compiled something and how long it took."""

    def __init__(self, fn: Callable, name: str):
        self.name, self.fn = name, fn
        self.compile_s = 0.0  # seconds spent in calls that compiled

    def __call__(self, *args):
        counts = torch._dynamo.utils.counters["stats"]
        before = counts["unique_graphs"]
        t0 = time.perf_counter()
        with settings():
            out = self.fn(*args)
        if counts["unique_graphs"] != before:
            took = time.perf_counter() - t0
            self.compile_s += took
            logger.info(f"compiled the {self.name} step in {took:.1f}s")
        return out


def compile_model(model: nn.Module, device: torch.device) -> None:
    """torch.compile each of the model's regions, in place (module docstring)."""
    cpu = device.type == "cpu"
    prepare_cache()  # before the first compile reads it
    for region in model.compiled_regions():
        region.compile(dynamic=not cpu, options={"epilogue_fusion": False} if cpu else None)


def compile_steps(model: nn.Module, prefill: Callable, decode: Callable, device: torch.device):
    """Compile `model`'s regions; returns the (prefill, decode) step functions that run them."""
    compile_model(model, device)
    return CompiledStep(prefill, "prefill"), CompiledStep(decode, "decode")
