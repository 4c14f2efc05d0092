"""What every tensor-parallel rank builds, and all a worker rank has: the model (this rank's part),
the KV pool, the attention backends and the runner, with the decode graphs captured. `LLM`
(engine.py) builds one on rank 0 and adds the scheduler, tokenizer and requests around it; a
worker rank (flexsgl/distributed/worker.py) builds the same and executes rank 0's step plans.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from flexsgl.attention.registry import resolve_override
from flexsgl.attention.router import PhaseRouter
from flexsgl.cache.pool import build_kv_pool
from flexsgl.cache.sizing import kv_cache_pages
from flexsgl.config import EngineConfig
from flexsgl.distributed.worker import agree
from flexsgl.log import logger
from flexsgl.model.loader import DTYPES, build_model, resolve
from flexsgl.model.presets import DEFAULT_MODEL
from flexsgl.runner import ModelRunner


def pick_dtype(dtype: str, device: torch.device, mcfg) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if mcfg.torch_dtype == "float16" else torch.bfloat16
    return DTYPES[dtype]


def prepare(cfg: EngineConfig, device: torch.device):
    """(model source, dtype, attention backend choice) of `cfg`, or ValueError saying why it cannot run."""
    src = resolve(cfg.model or DEFAULT_MODEL, cfg.load_format)
    mcfg = src.config
    dtype = pick_dtype(cfg.dtype, device, mcfg)
    choice = resolve_override(cfg.override, device, mcfg.attention, cfg.page_size, mcfg.kv_layout[2],
                              str(dtype).removeprefix("torch."))
    if cfg.cuda_graph_bs is not None and not cfg.cuda_graphs:
        raise ValueError("cuda_graph_bs was given, but CUDA graphs are off: they need a CUDA device "
                         f"(this engine runs on {device.type}) and disable_cuda_graph unset.")
    return src, dtype, choice


@dataclass
class EngineCore:
    """What every tensor-parallel rank builds (and the only thing a worker rank has)."""

    model: torch.nn.Module
    pool: object
    backends: PhaseRouter
    runner: ModelRunner
    num_pages: int
    compile: bool
    load_s: float  # loading the weights
    build_s: float  # the whole build


def build_core(cfg: EngineConfig, group=None, prepared=None) -> EngineCore:
    """Model (this rank's part of it), KV pool, attention backends and runner, with the decode
    graphs captured. With a tensor-parallel `group` every rank runs this, in step: after each
    phase the ranks agree that none failed (worker.agree), and the KV pool takes the fewest pages
    any rank can hold, so that rank 0's page numbers are valid on all."""
    t0 = time.perf_counter()
    device = cfg.torch_device if group is None else group.device
    rank, size = (0, 1) if group is None else (group.rank, group.size)
    src, dtype, choice = prepared or prepare(cfg, device)
    error = None
    try:
        model = build_model(src, device, dtype, cfg.random_seed, rank, size)
    except Exception as e:
        error = e
    agree(group, error)
    load_s = time.perf_counter() - t0
    mcfg = model.cfg  # this rank's heads and MLP slice
    try:
        num_pages = kv_cache_pages(cfg, mcfg, dtype, device, functools.partial(choice.prefill_scratch_bytes, mcfg))
    except Exception as e:
        error = e
    agree(group, error)
    if group is not None:
        num_pages = group.min(num_pages)
    try:
        pool = build_kv_pool(mcfg, num_pages, cfg.page_size, dtype, device)
        model.bind_kv_pool(pool)
        if rank == 0:
            logger.info(f"KV cache: {num_pages - 1} pages of {cfg.page_size} tokens"
                        + (" per rank" if size > 1 else ""))
        compile = device.type == "cuda" if cfg.compile is None else cfg.compile
        if compile and rank == 0:
            logger.info("torch.compile on: the first step of each new batch shape compiles kernels first "
                        "(tens of seconds for a large model)")
        backends = PhaseRouter(choice, pool, mcfg.num_heads, compile)
        if rank == 0:
            logger.info(f"attention: {choice.label}")
        runner = ModelRunner(model, pool, backends, device, cfg.max_running_requests, mcfg.max_position, compile)
        if cfg.cuda_graphs:
            runner.capture_graphs(cfg.cuda_graph_bs)
    except Exception as e:
        error = e
    agree(group, error)
    return EngineCore(model, pool, backends, runner, num_pages, compile, load_s, time.perf_counter() - t0)

