"""The tensor-parallel group: this process's rank, the world size, its device, and the collectives.

Two process groups join the ranks: the device group (NCCL on CUDA, gloo on the CPU), which the
model's all-reduce and all-gather run on, and a gloo control group, which carries host objects
(rank 0's step plans, errors, the KV pool size) on the CPU whatever the device.

The collectives are torch's functional collectives (`torch.ops._c10d_functional`): torch.compile
traces them as graph nodes, and inductor lowers them to the in-place NCCL calls, which CUDA graphs
capture. With one rank there is no group at all, and the model never calls them (its layers check
the config's tp_size when they are built).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

# How long a collective of the device group may wait for the other ranks before it fails. The
# control group waits without limit: between requests rank 0 sends nothing, for as long as it is
# idle; a rank that dies closes its sockets, which fails the others' waits at once.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup  # the device group
    control: dist.ProcessGroup  # gloo, for host objects

    @property
    def name(self) -> str:
        return self.group.group_name

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (over the control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (over the control group)."""
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def min(self, value: int) -> int:
        """The smallest of the ranks' `value`s."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t[0])


_current: TPGroup | None = None
# The device group's name and size as plain values, which the compiled model reads (torch.compile
# takes them as constants and guards on them).
_name: str | None = None
_size: int = 1


def current() -> TPGroup | None:
    """This process's group, once init_group has run (None with one rank)."""
    return _current


def init_group(rank: int, size: int, device: torch.device, store: dist.Store | None = None) -> TPGroup:
    """Join the ranks: the default process group (the device group) from `store` (None: torchrun's
    environment), then the gloo control group. Sets the CUDA device to cuda:rank first on a GPU."""
    global _current, _name, _size
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                            **({"device_id": device} if device.type == "cuda" else {}), **kw)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _current = TPGroup(rank, size, device, dist.group.WORLD, control)
    _name, _size = _current.name, size
    return _current


def destroy_group() -> None:
    """Leave the group (every rank calls it at the end); safe to call twice."""
    global _current, _name, _size
    _current, _name, _size = None, None, 1
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (a new tensor)."""
    return funcol.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", _name))


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """`x` `[T, N]` of every rank side by side, `[T, size * N]`, rank 0's first."""
    size = _size
    out = funcol.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), size, _name))
    t, n = x.shape
    return out.view(size, t, n).permute(1, 0, 2).reshape(t, size * n)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device rank `rank` runs on when the engine asks for `device`: cuda:rank, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")
