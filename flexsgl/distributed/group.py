"""The tensor-parallel group: this process's rank, the world size, its device, and the collectives.

Two process groups join the ranks: the device group (NCCL on CUDA, gloo on the CPU), which the
model's all-reduce and all-gather run on, and a gloo control group, which carries host objects
(rank 0's step plans, errors, the KV pool size) on the CPU whatever the device.

The all-gather is torch's functional collective (`torch.ops._c10d_functional`): torch.compile
traces it as a graph node, and inductor lowers it to the in-place NCCL call, which CUDA graphs
capture. The all-reduce is allreduce.py's, which chooses between symmetric memory and NCCL (set
up here once the group forms). With one rank there is no group at all, and the model never calls
them (its layers check the config's tp_size when they are built).

Leaving (`destroy_group`) is bounded. NCCL's communicator cannot be destroyed while a
CUDA graph that captured its work lives (pytorch/pytorch#115388), so every rank destroys its graphs
first (ModelRunner.release_graphs); the destroy itself runs in a thread given LEAVE_TIMEOUT_S, and
if it does not return by then the process goes on without it, and ends at exit (exit code 1)
without waiting for it.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from flexsgl.distributed import allreduce
from flexsgl.log import logger

# How long a collective of the device group may wait for the other ranks before it fails. The
# control group waits without limit: between requests rank 0 sends nothing, for as long as it is
# idle; a rank that dies closes its sockets, which fails the others' waits at once.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
CONTROL_TIMEOUT = datetime.timedelta(days=365)
WATCH_S = 0.1  # how often a watched broadcast calls its watch
LEAVE_TIMEOUT_S = 10.0  # how long leaving the group may take on a GPU before the process goes on without it


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup | None  # the device group (None once left: destroy_group)
    control: dist.ProcessGroup | None  # gloo, for host objects
    one_host: bool = True  # every rank on this host (spawned ranks; torchrun's when it ran them all here)

    @property
    def name(self) -> str:
        return self.group.group_name

    def broadcast(self, obj=None, watch: Callable[[], None] | None = None):
        """Rank 0's `obj` on every rank (over the control group): its pickled size, then its bytes.
        `watch`, called every WATCH_S while the broadcast is in flight, may raise to stop waiting
        for it (rank 0 checking that its workers still run: a rank that died may leave its side
        of the broadcast unfinished for as long as its process takes to end)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.empty(1, dtype=torch.int64)
        _finish(dist.broadcast(size, src=0, group=self.control, async_op=True), watch)
        if self.rank != 0:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        _finish(dist.broadcast(data, src=0, group=self.control, async_op=True), watch)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

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


def _finish(work, watch: Callable[[], None] | None) -> None:
    """Wait for a collective of the control group; with `watch`, polling, and calling it every WATCH_S."""
    if watch is not None:
        last = time.monotonic()
        while not work.is_completed():
            time.sleep(0)  # yields the GIL; the collective itself runs on gloo's threads
            if time.monotonic() - last > WATCH_S:
                watch()
                last = time.monotonic()
    work.wait()  # raises the collective's error, if it failed


_current: TPGroup | None = None
# The device group's name, size and this process's rank as plain values, which the compiled model
# reads (torch.compile takes them as constants and guards on them).
_name: str | None = None
_size: int = 1
_rank: int = 0


def current() -> TPGroup | None:
    """This process's group, once init_group has run (None with one rank)."""
    return _current


def init_group(rank: int, size: int, device: torch.device, store: dist.Store | None = None,
               one_host: bool = True) -> TPGroup:
    """Join the ranks: the default process group (the device group) from `store` (None: torchrun's
    environment), then the gloo control group, then choose the all-reduce (allreduce.setup). Sets
    the CUDA device to `device` first on a GPU."""
    global _current, _name, _size, _rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                            **({"device_id": device} if device.type == "cuda" else {}), **kw)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _current = TPGroup(rank, size, device, dist.group.WORLD, control, one_host)
    _name, _size, _rank = _current.name, size, rank
    choice = allreduce.setup(_current)
    if rank == 0:
        logger.info(f"all-reduce: {choice}")
    return _current


def destroy_group(abort: bool = False) -> bool:
    """Leave the group (every rank calls it at the end, after releasing its CUDA graphs); safe to
    call twice. The process groups are destroyed (on a GPU with `abort`, when a rank died and its
    peers cannot finish anything, the NCCL communicators are aborted), then the TPGroup's handles
    to them are dropped, the last ones: their destructors end gloo's threads, which would otherwise
    still run when the interpreter exits, and free the tensors of their last collective there,
    which aborts the process (pytorch/pytorch#179291). That runs in a thread given
    LEAVE_TIMEOUT_S; False if it did not return in time (the process then ends at exit without
    waiting for it)."""
    global _current, _name, _size, _rank
    tp = _current
    _current, _name, _size, _rank = None, None, 1, 0
    allreduce.teardown()
    if not dist.is_initialized():
        return True
    destroy = _abort_all if abort and tp is not None and tp.device.type == "cuda" else dist.destroy_process_group

    def leave():
        destroy()
        if tp is not None:
            tp.group = tp.control = None

    if _bounded(leave, LEAVE_TIMEOUT_S):
        return True
    logger.warning(f"the tensor-parallel process group did not close within {LEAVE_TIMEOUT_S:.0f} s; "
                   "the process ends without it at exit")
    if threading.main_thread().is_alive():
        atexit.register(_end_now)
    else:  # already exiting (atexit hooks run once the main thread has stopped): end here
        _end_now()
    return False


def _abort_all() -> None:
    """Abort every NCCL communicator of the process (no peer is waited for)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    (abort or dist.destroy_process_group)()


def _bounded(fn, timeout: float) -> bool:
    """Run `fn` in a daemon thread; whether it returned (or raised) within `timeout` seconds."""
    done = threading.Event()

    def run():
        try:
            fn()
        except Exception as e:  # a group already half torn down: nothing more to leave
            logger.debug("leaving the process group: %s", e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="flexsgl-leave-group").start()
    return done.wait(timeout)


def _end_now() -> None:
    """End the process without the interpreter's own ending, which a thread still inside NCCL
    could hold up (the process group's destructors)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(1)


def first_rank() -> bool:
    """Whether this process is rank 0 (or the only one): the rank that adds a row-parallel layer's
    residual to its partial sum before the all-reduce (flexsgl/distributed/layers.py)."""
    return _rank == 0


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """`x` `[T, N]` of every rank side by side, `[T, size * N]`, rank 0's first."""
    size = _size
    out = funcol.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), size, _name))
    t, n = x.shape
    return out.view(size, t, n).permute(1, 0, 2).reshape(t, size * n)


def all_reduce_max_(x: torch.Tensor) -> None:
    """`x`, in place, the elementwise maximum over the ranks (over the device group; while loading,
    where every rank calls it in the same order)."""
    dist.all_reduce(x, op=dist.ReduceOp.MAX)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device rank `rank` runs on when the engine asks for `device`: cuda:rank, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")
