"""The all-reduces over NVLink peers on one host that flexsgl/distributed/allreduce.py chooses
between (it holds the choice and the custom ops the model calls):

- `SymmetricAllReduce`: torch's symmetric memory, one buffer per rank mapped into every other
  rank's address space; one-shot (each rank reads and adds every peer's buffer) up to
  ONE_SHOT_MAX_BYTES, two-shot (a reduce-scatter and an all-gather over the same buffers) up to
  TWO_SHOT_MAX_BYTES, NCCL above.
- `TrtllmAllReduce`: FlashInfer's TensorRT-LLM all-reduce on one IPC workspace, plain
  (kAllReduce) or adding the residual and RMSNorm-ing the sum (kARResidualRMSNorm, `add_norm`).
  It launches with PDL where flexsgl's own kernels do (kernels/launch.py): it starts while the
  projection before it drains and waits for it in-kernel, and the next projection starts loading
  its weights as soon as the reduction has written its sum.

Neither uses NVLink multicast. Each checks one sum against a known answer when made.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from flexsgl.kernels.launch import pdl

ONE_SHOT_MAX_BYTES = 256 << 10  # messages up to this go through the one-shot kernel
TWO_SHOT_MAX_BYTES = 8 << 20  # up to this the two-shot one (the buffer's size); above, NCCL
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TRT_MAX_BYTES = 8 << 20  # FlashInfer's workspace: rows of the hidden size up to this many bytes


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
        """Each kind once on a known input (check_sum)."""
        for kind, n in (("one-shot", 4096), ("two-shot", ONE_SHOT_MAX_BYTES // 2 + 4096)):
            check_sum(lambda x: self(x, kind), (n,), self.rank, self.size, torch.bfloat16, f"the {kind} all-reduce",
                      self.buffer.device)
        torch.cuda.synchronize(self.buffer.device)


class TrtllmAllReduce:
    """FlashInfer's TensorRT-LLM all-reduce (kAllReduce, and kARResidualRMSNorm for `add_norm`) on
    one workspace for rows of `hidden` values, up to TRT_MAX_BYTES a message. Making it builds
    FlashInfer's kernels where its cache lacks them (flashinfer_comm_built), then checks one sum."""

    def __init__(self, group, hidden: int, dtype: torch.dtype):
        import flashinfer.comm as comm

        self.comm, self.hidden, self.dtype = comm, hidden, dtype
        self.max_rows = max(1, TRT_MAX_BYTES // (hidden * dtype.itemsize))
        self.pdl = pdl(group.device)
        # backend "trtllm": IPC memory without multicast (its "mnnvl" backend needs NVLink multicast)
        self.workspace = comm.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=group.size, rank=group.rank, max_token_num=self.max_rows,
            hidden_dim=hidden, dtype=dtype, group=group.group)
        check_sum(self, (2, hidden), group.rank, group.size, dtype, "FlashInfer's all-reduce", group.device)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[1] == self.hidden and x.shape[0] <= self.max_rows and x.dtype == self.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.comm.allreduce_fusion(input=x.contiguous(), workspace=self.workspace,
                                   pattern=self.comm.AllReduceFusionPattern.kAllReduce, output=out,
                                   launch_with_pdl=self.pdl)
        return out

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed, normed = torch.empty_like(x), torch.empty_like(x)
        self.comm.allreduce_fusion(input=x.contiguous(), workspace=self.workspace,
                                   pattern=self.comm.AllReduceFusionPattern.kARResidualRMSNorm,
                                   residual_in=residual.contiguous(), residual_out=summed, norm_out=normed,
                                   rms_gamma=weight, rms_eps=eps, launch_with_pdl=self.pdl)
        return summed, normed


def check_sum(reduce, shape: tuple[int, ...], rank: int, size: int, dtype: torch.dtype, what: str,
              device: torch.device) -> None:
    """Raise if `reduce` (one all-reduce, collective) gets a known sum wrong: rank r gives r + 1 plus
    each element's index mod 16, so every sum is a small integer, exact in bf16."""
    idx = torch.arange(math.prod(shape), device=device, dtype=torch.float32).view(shape) % 16
    got = reduce(((rank + 1) + idx).to(dtype)).float()
    want = size * (size + 1) / 2 + size * idx
    if not torch.equal(got, want):
        raise RuntimeError(f"{what} gave a wrong sum (off by up to {(got - want).abs().max().item():g})")


def flashinfer_comm_built() -> bool:
    """Whether FlashInfer's all-reduce kernels are built (ahead of time or in its JIT cache)."""
    try:
        from flashinfer.jit.comm import gen_trtllm_comm_module

        spec = gen_trtllm_comm_module()
        return bool(spec.is_aot or spec.is_compiled)
    except Exception:  # another FlashInfer version: nothing to say
        return True


def build_flashinfer_comm() -> None:
    """Build FlashInfer's all-reduce kernels now (or load them from its cache), before any collective
    waits on them: a first build takes minutes."""
    from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

    get_trtllm_comm_module()
