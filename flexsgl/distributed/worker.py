"""Rank 0's channel to the other ranks, the loop those ranks run, and their processes' ends.

Rank 0 owns the scheduler and the tokenizer. Each step it turns the scheduled batch into a
StepPlan (step/plan.py: host lists only) and broadcasts it over the gloo control group, then executes
it itself; every other rank executes the same plan with its own runner, model shard, attention
backends and CUDA graphs, so each samples the same tokens (the same logits, gathered whole, or a
greedy step's same exchanged argmaxes; counter-based noise; the same token mask) and keeps the same
token buffer and penalty counts. Only rank 0 reads tokens back.

Messages: ("step", plan); for a step sampled under structured outputs' token mask, ("forward",
plan) and then ("sample", mask), once rank 0 has filled the mask; ("stop",). Building the engine (loading, KV pool sizing, graph capture)
runs the same code on every rank, so its collectives line up without messages; after each phase
the ranks `agree`: a rank that failed sends its reason and every rank raises.
A worker builds its rank with the function the engine hands it (`build`: engine_core.build_core),
so nothing here imports the engine.

Failures: a worker that raises in a step writes why to the store and exits; rank 0 checks that
its workers are alive (not ended, nor ending: `exiting`) before each step, while it broadcasts a
step's plan, when a step fails, and while it waits for a step's tokens, and raises EngineDeadError
naming the rank. A worker whose rank 0 goes away (its sockets close)
fails its next receive and exits; a spawned worker also ends as soon as its parent process does
(a thread waits on the parent's sentinel), even inside a collective that can no longer finish,
and ignores Ctrl-C, which the terminal sends to every process of its group: rank 0 decides.

Ends: every rank destroys its CUDA graphs before it leaves the process group (group.destroy_group,
bounded), and rank 0 leaves it while the workers do, then waits for them a bounded time and kills
what remains.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from flexsgl.distributed.group import COLLECTIVE_TIMEOUT, TPGroup, destroy_group, init_group, rank_device
from flexsgl.errors import EngineDeadError, RankFailedError, TensorParallelError, describe

LIVENESS_CHECK_S = 0.1  # how often rank 0 looks at its workers while it waits for a step
DEATH_WAIT_S = 3.0  # how long a failed collective waits to see whether a worker is exiting
# How long rank 0 waits for its workers to end after telling them to stop (they leave the group,
# itself bounded by group.LEAVE_TIMEOUT_S), before killing them.
STOP_WAIT_S = 20.0


def agree(group: TPGroup | None, error: BaseException | None) -> None:
    """After a phase every rank runs: share whether each failed. A rank that failed re-raises its
    own error; the others raise the first failed rank's reason, naming it."""
    if group is None:
        if error is not None:
            raise error
        return
    mine = None if error is None else (isinstance(error, ValueError), describe(error))
    reports = group.gather(mine)
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            bad_input, reason = report
            kind = TensorParallelError if bad_input else RankFailedError
            raise kind(f"Tensor-parallel rank {rank} failed: {reason}.")


class Channel:
    """Rank 0's side: broadcasts plans, watches the workers (the processes it spawned; under
    torchrun, torchrun watches them)."""

    def __init__(self, group: TPGroup, procs: list | None, store):
        self.group, self.procs, self.store = group, procs, store
        self.closed = False
        # Destroys rank 0's CUDA graphs (ModelRunner.release_graphs; the engine sets it once built),
        # given whether to wait for the device first.
        self.release: Callable[[bool], None] | None = None

    def dead(self, ending: bool = True) -> str | None:
        """Why a worker is gone (with `ending`, also one that is ending: `exiting`), or None while all
        run. The check before each step leaves out `ending` (a read of /proc per worker); the waits
        that poll include it."""
        for rank, p in enumerate(self.procs or (), 1):
            if not p.is_alive() or (ending and exiting(p.pid)):
                return f"tensor-parallel rank {rank} stopped ({exit_reason(self.store, rank, p.exitcode)})"
        return None

    def check(self, ending: bool = True) -> None:
        reason = self.dead(ending)
        if reason is not None:
            raise self.abandon(reason)

    def abandon(self, reason: str) -> EngineDeadError:
        """A rank died: end the other workers now (they could only wait on it), destroy rank 0's
        graphs without waiting for the device (a collective of the dead rank's may never finish),
        abort the group, and return the error. (On the CPU the group is left, and another engine
        can start.)"""
        if not self.closed:
            self.closed = True
            stop_processes(self.procs or [], timeout=0.0)
            self._leave(clean=False)
        return EngineDeadError(reason)

    def _leave(self, clean: bool) -> None:
        try:
            if self.release is not None:
                self.release(clean)
        finally:
            destroy_group(abort=not clean)

    def dead_soon(self, wait: float = DEATH_WAIT_S) -> str | None:
        """dead(), given a worker whose failure broke a collective the time to finish exiting."""
        deadline = time.monotonic() + (wait if self.procs else 0.0)
        while True:
            reason = self.dead()
            if reason is not None or time.monotonic() >= deadline:
                return reason
            time.sleep(0.02)

    def send(self, msg: tuple) -> None:
        self.check(ending=False)
        try:
            self.group.broadcast(msg, watch=self.check)
        except EngineDeadError:
            raise
        except Exception as e:
            reason = self.dead_soon()
            raise self.abandon(reason or f"the tensor-parallel ranks lost contact ({describe(e)})") from e

    def send_step(self, plan) -> None:
        self.send(("step", plan))

    def failed(self, e: BaseException) -> EngineDeadError:
        """The error for a step that failed on rank 0 after its plan went out: the ranks may have
        parted ways, so the engine cannot go on (a dead worker is named as the cause)."""
        reason = self.dead_soon()
        return self.abandon(reason or f"a step failed on rank 0 after the other ranks started it ({describe(e)})")

    def wait(self, event: torch.cuda.Event) -> None:
        """Wait for a step's tokens (CUDA), checking now and then that the workers still run: a
        collective whose peer died would never finish."""
        last = time.monotonic()
        while not event.query():
            # Yield the GIL while polling: other threads of the process run meanwhile (an application
            # that steps the LLM from a thread of its own, beside its other work).
            time.sleep(0)
            now = time.monotonic()
            if now - last > LIVENESS_CHECK_S:
                self.check()
                last = now

    def close(self) -> None:
        """Stop the workers and leave the group (safe to call twice): the workers are told to stop,
        every rank destroys its graphs and leaves the group at once (leaving may wait for the
        peers), then rank 0 waits for its workers to end, and kills those that do not."""
        if self.closed:
            return
        self.closed = True
        clean = self.dead() is None
        if clean:
            try:
                self.group.broadcast(("stop",))
            except Exception:
                clean = False
        if not clean:  # after a rank died the others cannot finish a collective: end them now
            stop_processes(self.procs or [], timeout=0.0)
        self._leave(clean)
        stop_processes(self.procs or [], timeout=STOP_WAIT_S)


def worker_main(rank: int, size: int, cfg, device_type: str, port: int, build) -> None:
    """A spawned worker process: join through rank 0's store, then serve (never returns normally)."""
    from tqdm import tqdm

    from flexsgl.log import set_level

    # Ctrl-C, and a service manager's SIGTERM, reach the whole process group: rank 0 decides, and a
    # worker ends with it (_end_with_parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_with_parent()
    # tqdm's default lock is a multiprocessing semaphore, which a worker ending with os._exit would
    # leave behind (the resource tracker warns of it at exit); a thread lock does here.
    tqdm.set_lock(threading.RLock())
    store = None
    try:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        set_level(os.environ.get("FLEXSGL_WORKER_LOG_LEVEL", "warning"))  # rank 0 speaks for the engine
        store.set(f"joined/{rank}", "1")
        group = init_group(rank, size, rank_device(torch.device(device_type), rank), store)
    except BaseException as e:
        _report(store, rank, e)
        os._exit(1)
    os._exit(serve(cfg, group, build, store))


def _end_with_parent() -> None:
    """End this process as soon as its parent (rank 0's process) ends, however it ends: a worker
    blocked in a collective whose peer is gone would otherwise wait for the collective's timeout."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="flexsgl-parent-watch").start()


def serve(cfg, group: TPGroup, build, store=None) -> int:
    """A worker rank: build the same engine core as rank 0 (`build(cfg, group)`, which the engine
    passes: engine_core.build_core), then execute rank 0's plans until it says stop (returns 0) or
    fails (returns 1, the reason in the store). On stop it destroys its graphs, then leaves the group."""
    try:
        core = build(cfg, group)
    except BaseException:  # agreed with rank 0, which raises the reason
        core = None
    if core is None:  # (outside the handler: its traceback no longer holds what the build made)
        destroy_group(abort=True)
        return 1
    runner = core.runner
    try:
        while True:
            msg: Any = group.broadcast()
            if msg[0] == "step":
                runner.execute(msg[1])
            elif msg[0] == "forward":  # a step sampled under a token mask: its forward half,
                runner.execute_forward(msg[1])
            elif msg[0] == "sample":  # then its sampling under the mask rank 0 filled
                runner.execute_sample(msg[1])
            elif msg[0] == "stop":
                break
    except BaseException as e:
        _report(store, group.rank, e)
        return 1
    runner.release_graphs()
    destroy_group()
    return 0


def _report(store, rank: int, e: BaseException) -> None:
    if store is None:
        return
    try:
        store.set(f"error/{rank}", describe(e))
    except Exception:
        pass


PF_EXITING = 0x4  # Linux's task flag of a process that is ending


def exiting(pid: int) -> bool:
    """Whether process `pid` is ending though not yet reaped (Linux: PF_EXITING in its flags, or a
    zombie). A killed process that held a GPU can take a long time to end, and its sockets stay
    open meanwhile; False where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return False
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)


def exit_reason(store, rank: int, exitcode) -> str:
    """Why worker `rank` stopped: what it wrote to the store, else its exit code."""
    key = f"error/{rank}"
    try:
        if store is not None and store.check([key]):
            return store.get(key).decode()
    except Exception:  # the store itself may be gone with rank 0's side of it
        pass
    return f"its process exited with code {exitcode}" if exitcode is not None else "its process stopped"


def stop_processes(procs, timeout: float = 10.0) -> None:
    """Wait for the worker processes to end, then end those that do not."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
