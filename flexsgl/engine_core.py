"""What every tensor-parallel rank builds, and all a worker rank has: the model (this rank's part),
the KV pool, the attention backends and the runner, with the decode graphs captured. `LLM`
(engine.py) builds one on rank 0 and adds the scheduler, tokenizer and requests around it; a
worker rank (flexsgl/distributed/worker.py) builds the same and executes rank 0's step plans.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import torch

from flexsgl.attention.bound_variant import VariantSet, describe_variants
from flexsgl.attention.router import PhaseRouter
from flexsgl.cache.pool import build_kv_pool
from flexsgl.cache.sizing import kv_pool_size
from flexsgl.config import EngineConfig, ResolvedConfig
from flexsgl.cpu_threads import size_cpu_threads
from flexsgl.distributed import allreduce
from flexsgl.distributed.worker import agree
from flexsgl.log import logger
from flexsgl.model.loader import build_model
from flexsgl.model.presets import DEFAULT_MODEL
from flexsgl.model.source import ModelSource, resolve
from flexsgl.runner import ModelRunner


def prepare(cfg: EngineConfig, device: torch.device | None = None) -> tuple[ModelSource, ResolvedConfig]:
    """The model `cfg` names and `cfg` resolved for it on `device` (EngineConfig.resolve): every
    refusal that needs no weights, before anything loads."""
    src = resolve(cfg.model or DEFAULT_MODEL, cfg.load_format, cfg.context_length)
    return src, cfg.resolve(src.config, device)


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
    kv_pool_s: float  # sizing and allocating the KV pool
    build_s: float  # the whole build


def build_core(cfg: EngineConfig, group=None, prepared: tuple[ModelSource, ResolvedConfig] | None = None) -> EngineCore:
    """Model (this rank's part of it), KV pool, attention backends and runner, with the decode
    graphs captured, from `cfg` resolved (`prepared`, else prepare(cfg) here). With a
    tensor-parallel `group` every rank runs this, in step: after each phase the ranks agree that
    none failed (worker.agree), and the KV pool takes the fewest pages any rank can hold, so that
    rank 0's page numbers are valid on all."""
    t0 = time.perf_counter()
    device = cfg.torch_device if group is None else group.device
    rank, size = (0, 1) if group is None else (group.rank, group.size)
    src, rc = prepared or prepare(cfg, device)
    rc = dataclasses.replace(rc, device=device)
    if device.type == "cpu":
        size_cpu_threads(size)
    error = None
    try:
        model = build_model(src, device, rc.dtype, cfg.random_seed, rank, size, cfg.quantization)
    except Exception as e:
        error = e
    agree(group, error)
    load_s = time.perf_counter() - t0
    mcfg = model.cfg  # this rank's heads and MLP slice
    if device.type == "cuda":  # blocks freed while loading go back to the driver: sizing reads what is free
        torch.cuda.empty_cache()
    try:
        if group is not None:  # before sizing the pool: FlashInfer's all-reduce workspace, if asked for, takes memory
            choice = allreduce.prepare(group, mcfg.hidden_size, rc.dtype)
            if choice is not None and rank == 0:
                logger.info(f"all-reduce: {choice}")
        kv = kv_pool_size(rc, mcfg, functools.partial(rc.attention.prefill_scratch_bytes, mcfg),
                          rc.attention.max_pool_slots(mcfg) if device.type == "cuda" else None)
        num_pages = kv.pages
    except Exception as e:
        error = e
    agree(group, error)
    if group is not None:
        num_pages = group.min(num_pages)
    runner = None
    try:
        pool = build_kv_pool(mcfg, num_pages, cfg.page_size, rc.cache_dtype, device, rc.dtype)
        model.bind_kv_pool(pool)
        kv_pool_s = time.perf_counter() - t0 - load_s
        if rank == 0:
            why = kv.reason if num_pages == kv.pages else "the fewest any rank's memory holds"
            logger.info(f"KV cache: {num_pages - 1} pages of {cfg.page_size} tokens"
                        + (" per rank" if size > 1 else "")
                        + (f" in {str(rc.kv_dtype).removeprefix('torch.')}" if rc.kv_dtype != rc.dtype else "")
                        + f" ({why})")
        if rc.compile and rank == 0:
            logger.info("torch.compile on: the first step of each new batch shape compiles kernels first "
                        "(tens of seconds for a large model)")
        elif device.type == "cuda" and cfg.compile is None and rank == 0:
            params = src.config.num_params() / 1e6
            logger.info(f"torch.compile off: one request at a time of a {params:.1f}M-parameter model starts "
                        "sooner uncompiled, its steps replayed from CUDA graphs (--compile compiles)")
        variants = VariantSet(list(rc.variants) or [None] * mcfg.num_layers, mcfg.num_heads,
                              mcfg.tp_rank * mcfg.num_heads, mcfg.num_heads * mcfg.tp_size,
                              cfg.max_running_requests + 1, device)
        if variants.bound:
            model.bind_variants(variants)
        backends = PhaseRouter(rc.attention, pool, mcfg.num_heads, rc.compile, variants)
        if rank == 0:
            logger.info(f"attention: {rc.attention.label}" + describe_variants(rc.variants))
            if rc.attention.note:
                logger.info(rc.attention.note)
        runner = ModelRunner(model, pool, backends, device, cfg.max_running_requests, mcfg.max_position, rc.compile,
                             variants if variants.request_params else None)
        if rc.cuda_graph_bs:
            runner.capture_graphs(rc.cuda_graph_bs)
    except Exception as e:
        error = e
    try:
        agree(group, error)
    except BaseException:
        if runner is not None:  # graphs holding NCCL work would keep the process group from closing
            runner.release_graphs(sync=False)
        raise
    return EngineCore(model, pool, backends, runner, num_pages, rc.compile, load_s, kv_pool_s,
                      time.perf_counter() - t0)
