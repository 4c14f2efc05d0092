"""The all-reduce the model runs under tensor parallelism, and the one place that chooses how.

- On GPUs of one host where FlashInfer is installed, messages of the model's hidden rows up to
  TRT_MAX_BYTES go through FlashInfer's TensorRT-LLM all-reduce (`flashinfer.comm.allreduce_fusion`,
  one-shot or two-shot by its own choice, over IPC buffers made without multicast), on a workspace
  made once the model's hidden size is known (`prepare`, after loading). It measured fastest
  (`tools/allreduce_bench.py`, docs/BENCHMARKS.md). Its kernel can also add the residual and
  RMSNorm the sum (kARResidualRMSNorm): `all_reduce_add_norm` returns both, and the dense decoder
  (flexsgl/model/decoder.py) takes that path wherever `fuses_norm` says so (steps of 2 rows or more:
  at one row the gemv kernels fold the norm in), so no add or norm kernel follows the all-reduce. FlashInfer compiles these kernels on first use
  (minutes, once; its cache keeps them).
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
import warnings

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from flexsgl.log import logger

ONE_SHOT_MAX_BYTES = 256 << 10  # messages up to this go through the one-shot kernel
TWO_SHOT_MAX_BYTES = 8 << 20  # up to this the two-shot one (the buffer's size); above, NCCL
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TRT_MAX_BYTES = 8 << 20  # FlashInfer's workspace: rows of the hidden size up to this many bytes
ENV = "FLEXSGL_ALLREDUCE"  # "auto" (default), "trtllm", "symm" or "nccl" (module docstring)
MODES = ("auto", "trtllm", "symm", "nccl")

_name: str | None = None  # the device group's name (a constant to torch.compile)
_symm: "SymmetricAllReduce | None" = None  # set on every rank, or on none
_trt: "TrtllmAllReduce | None" = None  # set on every rank, or on none (prepare)
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
    # Every rank says whether it can before any makes the workspace, itself a collective.
    reason = next((r for r in group.gather(_trtllm_unusable(group)) if r is not None), None)
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


def _trtllm_unusable(group) -> str | None:
    """Why this rank cannot use FlashInfer's all-reduce (None: it can)."""
    if not group.one_host:
        return "ranks on several hosts"
    try:
        importlib.import_module("flashinfer.comm")
    except Exception as e:  # not installed, or it failed to import
        return f"flashinfer.comm does not import ({type(e).__name__}: {e})"
    return None


def _flashinfer_comm_built() -> bool:
    """Whether FlashInfer's all-reduce kernels are built (ahead of time or in its JIT cache)."""
    try:
        from flashinfer.jit.comm import gen_trtllm_comm_module

        spec = gen_trtllm_comm_module()
        return bool(spec.is_aot or spec.is_compiled)
    except Exception:  # another FlashInfer version: nothing to say
        return True


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
    """Whether all-reduces can carry the residual add and RMSNorm (FlashInfer's, FLEXSGL_ALLREDUCE=trtllm)."""
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


class SymmetricAllReduce:
    """One symmetric buffer of TWO_SHOT_MAX_BYTES per rank, mapped on every rank, and the kernels over it."""

    def __init__(self, group):
        from torch.distributed import _symmetric_memory as symm

        self.name, self.size, self.rank = group.name, group.size, group.rank
        self.pg = group.group
        with warnings.catch_warnings():  # older torch needs it; newer ones call it deprecated
            warnings.simplefilter("ignore")
            if hasattr(symm, "enable_symm_mem_for_group"):
                symm.enable_symm_mem_for_group(self.name)
        self.buffer = symm.empty(TWO_SHOT_MAX_BYTES, dtype=torch.uint8, device=group.device)
        self.handle = symm.rendezvous(self.buffer, self.name)
        self.copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)

    def kind(self, x: torch.Tensor) -> str:
        """Which all-reduce takes `x`: "one-shot", "two-shot" or "nccl"."""
        nbytes = x.numel() * x.element_size()
        if x.dtype not in DTYPES or nbytes % 16 or nbytes > TWO_SHOT_MAX_BYTES:
            return "nccl"
        return "one-shot" if nbytes <= ONE_SHOT_MAX_BYTES else "two-shot"

    def __call__(self, x: torch.Tensor, kind: str | None = None) -> torch.Tensor:
        kind = kind or self.kind(x)
        x = x.contiguous()
        out = torch.empty_like(x)
        if kind == "nccl":
            out.copy_(x)
            dist.all_reduce(out, group=self.pg)
            return out
        flat, n = out.view(-1), x.numel()
        buf = self.buffer.view(x.dtype)[:n]
        ops = torch.ops.symm_mem
        if kind == "one-shot" and self.copy_out is not None:
            self.copy_out(buf, x.view(-1), "sum", self.name, flat)
        else:
            buf.copy_(x.view(-1))
            if kind == "one-shot":
                ops.one_shot_all_reduce_out(buf, "sum", self.name, flat)
            else:
                ops.two_shot_all_reduce_out(buf, "sum", self.name, flat)
        return out

    def check(self) -> None:
        """Each kind once on a known input: rank r gives r + 1 (+ the element's index), so the sum
        is known; raises if a result is off."""
        for kind, n in (("one-shot", 4096), ("two-shot", ONE_SHOT_MAX_BYTES // 2 + 4096)):
            idx = torch.arange(n, device=self.buffer.device, dtype=torch.float32) % 16  # sums exact in bf16
            got = self(((self.rank + 1) + idx).to(torch.bfloat16), kind).float()
            want = self.size * (self.size + 1) / 2 + self.size * idx
            if not torch.equal(got, want):
                raise RuntimeError(f"the {kind} all-reduce gave a wrong sum (off by up to "
                                   f"{(got - want).abs().max().item():g})")
        torch.cuda.synchronize(self.buffer.device)


class TrtllmAllReduce:
    """FlashInfer's TensorRT-LLM all-reduce (kAllReduce, and kARResidualRMSNorm for `add_norm`) on
    one workspace for rows of `hidden` values, up to TRT_MAX_BYTES a message. Making it builds
    FlashInfer's kernels where its cache lacks them (said on the terminal), then checks one sum."""

    def __init__(self, group, hidden: int, dtype: torch.dtype):
        import flashinfer.comm as comm

        self.comm, self.hidden, self.dtype = comm, hidden, dtype
        self.max_rows = max(1, TRT_MAX_BYTES // (hidden * dtype.itemsize))
        if group.rank == 0 and not _flashinfer_comm_built():
            logger.info("building FlashInfer's all-reduce kernels (first use: a few minutes, once; FlashInfer "
                        f"caches them; {ENV}=symm skips them)")
        # backend "trtllm": IPC memory without multicast (its "mnnvl" backend needs NVLink multicast)
        self.workspace = comm.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=group.size, rank=group.rank, max_token_num=self.max_rows,
            hidden_dim=hidden, dtype=dtype, group=group.group)
        idx = torch.arange(2 * hidden, device=group.device, dtype=torch.float32).view(2, hidden) % 16
        got = self(((group.rank + 1) + idx).to(dtype)).float()  # sums exact in bf16
        want = group.size * (group.size + 1) / 2 + group.size * idx
        if not torch.equal(got, want):
            raise RuntimeError(f"FlashInfer's all-reduce gave a wrong sum (off by up to {(got - want).abs().max().item():g})")

    def takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[1] == self.hidden and x.shape[0] <= self.max_rows and x.dtype == self.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.comm.allreduce_fusion(input=x.contiguous(), workspace=self.workspace,
                                   pattern=self.comm.AllReduceFusionPattern.kAllReduce, output=out)
        return out

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed, normed = torch.empty_like(x), torch.empty_like(x)
        self.comm.allreduce_fusion(input=x.contiguous(), workspace=self.workspace,
                                   pattern=self.comm.AllReduceFusionPattern.kARResidualRMSNorm,
                                   residual_in=residual.contiguous(), residual_out=summed, norm_out=normed,
                                   rms_gamma=weight, rms_eps=eps)
        return summed, normed


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
