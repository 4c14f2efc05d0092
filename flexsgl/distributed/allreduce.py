"""The all-reduce the model runs under tensor parallelism, and the one place that chooses how.

- On GPUs of one host where FlashInfer is installed, messages of the model's hidden rows up to
  TRT_MAX_BYTES go through FlashInfer's TensorRT-LLM all-reduce (`flashinfer.comm.allreduce_fusion`,
  one-shot or two-shot by its own choice, over IPC buffers made without multicast), on a workspace
  made once the model's hidden size is known (`prepare`, after loading). It measured fastest
  (`tools/allreduce_bench.py`, docs/BENCHMARKS.md). Its kernel can also add the residual and
  RMSNorm the sum (kARResidualRMSNorm): `all_reduce_add_norm` returns both, and the dense decoder
  (flexsgl/model/decoder.py) takes that path wherever `fuses_norm` says so (steps of 2 rows or more:
  at one row the gemv kernels fold the norm in), so no add or norm kernel follows the all-reduce.
  FlashInfer compiles these kernels on first use (minutes, once; its cache keeps them): `auto`
  takes them once they are built (ahead of time, or by one run with FLEXSGL_ALLREDUCE=trtllm) and
  meanwhile goes without rather than wait.
- Otherwise on GPUs of one host, and for what FlashInfer's workspace does not hold, torch's
  symmetric memory (`torch.distributed._symmetric_memory`): each rank's buffer is mapped into
  every other rank's address space over NVLink, and one kernel copies the rank's input into its
  buffer, waits at a barrier of signal pads, and reads and adds every peer's buffer
  (`symm_mem::one_shot_all_reduce`, with the copy folded in where torch has
  `one_shot_all_reduce_copy_out`); larger messages take `two_shot_all_reduce_` (a reduce-scatter
  and an all-gather over the same buffers). Torch registers a group's name for symmetric memory
  once per process, so a second engine in the same process (whose group has the same name) does
  without it.
- Neither uses NVLink multicast, so both run with NCCL_NVLS_ENABLE=0 and
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1. Messages above TWO_SHOT_MAX_BYTES, or of a dtype or size the
  kernels do not take, go to NCCL. A message's size is a shape, known on the host, so the choice
  costs no sync, and a CUDA graph captured at one batch size records one path.
- Everywhere else (the CPU's gloo ranks, ranks on several hosts, or a setup that did not work on
  every rank), torch's functional collective: torch.compile traces it into the layer's graph and
  inductor lowers it to the in-place NCCL (or gloo) call.

FLEXSGL_ALLREDUCE picks one for comparisons: "trtllm" (FlashInfer's; an error where it cannot
run), "symm" (symmetric memory, no FlashInfer), "nccl" (neither); "auto" (the default) as above.

The symmetric-memory and FlashInfer paths are one custom op, `flexsgl::all_reduce` (a fake
implementation for torch.compile), which the compiled layers call like any op and CUDA graphs
capture with its kernels; `flexsgl::all_reduce_add_norm` is the fused one. Without the fused
path, the residual add rides in rank 0's partial sum before the all-reduce
(flexsgl/distributed/layers.py), so the sum needs nothing after it.

`setup` (right after the group forms) and `prepare` (after loading) are collective: every rank
tries to make and check its part, and a path is used only where all ranks succeeded.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch.distributed import _functional_collectives as funcol

from flexsgl.distributed.nvlink_allreduce import (ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES, SymmetricAllReduce,
                                                  TrtllmAllReduce, build_flashinfer_comm, flashinfer_comm_built)
from flexsgl.log import logger

ENV = "FLEXSGL_ALLREDUCE"  # "auto" (default), "trtllm", "symm" or "nccl" (module docstring)
MODES = ("auto", "trtllm", "symm", "nccl")

_name: str | None = None  # the device group's name (a constant to torch.compile)
_symm: SymmetricAllReduce | None = None  # set on every rank, or on none
_trt: TrtllmAllReduce | None = None  # set on every rank, or on none (prepare)
_symm_names: set[str] = set()  # groups this process set symmetric memory up for (torch allows it once a name)


def setup(group) -> str:
    """Choose the all-reduce for `group` (a TPGroup; collective: every rank calls it, in step).
    Returns what was chosen, in words (`prepare` may add FlashInfer's once the model is loaded)."""
    global _name, _symm, _trt
    _name, _symm, _trt = group.name, None, None
    reason = _symm_unusable(group)
    votes = group.gather(reason)
    reason = next((r for r in votes if r is not None), None)
    if reason is not None:
        return f"NCCL ({reason})" if group.device.type == "cuda" else "gloo"
    symm, error = None, None
    try:
        _symm_names.add(group.name)
        symm = SymmetricAllReduce(group)
        symm.check()
    except Exception as e:  # mapping the buffers, or a wrong sum
        error = f"symmetric memory failed on rank {group.rank}: {type(e).__name__}: {e}"
    errors = [e for e in group.gather(error) if e is not None]
    if errors:
        return f"NCCL ({errors[0]})"
    _symm = symm
    return (f"symmetric memory (one-shot up to {ONE_SHOT_MAX_BYTES >> 10} KB, two-shot up to "
            f"{TWO_SHOT_MAX_BYTES >> 20} MB), NCCL above")


def prepare(group, hidden: int, dtype: torch.dtype) -> str | None:
    """Once the model's hidden size is known (collective: every rank calls it, in step): FlashInfer's
    workspace on every rank where the mode allows it (module docstring). Returns what was chosen, in
    words, or None where nothing changed; raises where FLEXSGL_ALLREDUCE=trtllm cannot be met."""
    global _trt
    mode = _mode()
    wanted = group.device.type == "cuda" and mode in ("auto", "trtllm")
    if not any(group.gather(wanted)):
        return None
    behind = "symmetric memory" if _symm is not None else "NCCL"
    # Every rank imports (and with trtllm builds) the kernels, then says whether it can, before any
    # makes the workspace, itself a collective (over the control group, which waits out a build).
    if mode == "trtllm" and group.rank == 0 and not flashinfer_comm_built():
        logger.info("building FlashInfer's all-reduce kernels (first use: a few minutes, once; FlashInfer "
                    "caches them)")
    reason = next((r for r in group.gather(_trtllm_unusable(group, build=mode == "trtllm")) if r is not None),
                  None)
    trt, error = None, None
    if reason is None:
        try:
            trt = TrtllmAllReduce(group, hidden, dtype)
        except Exception as e:
            error = f"rank {group.rank}: {type(e).__name__}: {e}"
        reason = next((e for e in group.gather(error) if e is not None), None)
    if reason is not None:
        if mode == "trtllm":
            raise RuntimeError(f"{ENV}=trtllm: FlashInfer's all-reduce cannot run ({reason})")
        if trt is not None:
            trt.workspace.destroy()
        return f"{behind} (FlashInfer's all-reduce: {reason})"
    _trt = trt
    return (f"FlashInfer's TensorRT-LLM all-reduce for up to {trt.max_rows} rows, with the residual "
            f"add and RMSNorm fused where a dense layer has them; {behind} above")


def teardown() -> None:
    """Forget the group (before it is left; the graphs that captured the kernels are gone by then)."""
    global _name, _symm, _trt
    if _trt is not None:
        _trt.workspace.destroy()
    _name, _symm, _trt = None, None, None


def _mode() -> str:
    mode = os.environ.get(ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def _trtllm_unusable(group, build: bool) -> str | None:
    """Why this rank cannot use FlashInfer's all-reduce (None: it can). Its kernels are built first
    where `build` (FLEXSGL_ALLREDUCE=trtllm); `auto` does not wait minutes for a first build."""
    if not group.one_host:
        return "ranks on several hosts"
    try:
        importlib.import_module("flashinfer.comm")
    except Exception as e:  # not installed, or it failed to import
        return f"flashinfer.comm does not import ({type(e).__name__}: {e})"
    if not build and not flashinfer_comm_built():
        return (f"its kernels are not built yet; one run with {ENV}=trtllm builds them, in a few minutes, "
                "and later runs pick it")
    try:
        build_flashinfer_comm()
    except Exception as e:  # no compiler, or a build that failed
        return f"its kernels did not build ({type(e).__name__}: {str(e)[:200]})"
    return None


def _symm_unusable(group) -> str | None:
    """Why this rank cannot use symmetric memory (None: it can)."""
    if group.device.type != "cuda":
        return "not a GPU"
    mode = _mode()
    if mode in ("nccl", "trtllm"):
        return f"{ENV}={mode}"
    if not group.one_host:
        return "ranks on several hosts"
    if group.name in _symm_names:
        return (f"this process set symmetric memory up for an earlier group named {group.name!r}, and "
                "torch sets a name up once")
    ops = torch.ops.symm_mem
    if not all(hasattr(ops, op) for op in ("one_shot_all_reduce_out", "two_shot_all_reduce_out")):
        return f"torch {torch.__version__} lacks symm_mem's one-shot and two-shot all-reduce"
    return None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (a new tensor)."""
    if _symm is not None or (_trt is not None and _trt.takes(x)):
        return torch.ops.flexsgl.all_reduce(x, _name)
    return funcol.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", _name))


def fusing() -> bool:
    """Whether all-reduces can carry the residual add and RMSNorm (FlashInfer's all-reduce is in use)."""
    return _trt is not None


def fuses_norm(x: torch.Tensor) -> bool:
    """Whether to all-reduce `x` with `all_reduce_add_norm`: rows FlashInfer's workspace holds, at
    least two of them. One row's norm and residual add ride free in the batch-1 gemv kernels
    (flexsgl/kernels/gemv.py), and on two H200s the fused kernel takes 4.9 us at 8 KB against 2.8
    for the plain one (tools/allreduce_bench.py)."""
    return _trt is not None and _trt.takes(x) and x.shape[0] > 1


def all_reduce_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s) * weight) for s = residual + the sum of `x` over the ranks, in one kernel
    (only where fuses_norm(x))."""
    return torch.ops.flexsgl.all_reduce_add_norm(x, residual, weight, eps, _name)


@torch.library.custom_op("flexsgl::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _trt(x) if _trt is not None and _trt.takes(x) else _symm(x)


@_all_reduce_op.register_fake
def _(x, group_name):
    return torch.empty_like(x)


@torch.library.custom_op("flexsgl::all_reduce_add_norm", mutates_args=())
def _all_reduce_add_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _trt.add_norm(x, residual, weight, eps)


@_all_reduce_add_norm_op.register_fake
def _(x, residual, weight, eps, group_name):
    return torch.empty_like(x), torch.empty_like(x)
