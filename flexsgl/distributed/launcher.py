"""Starting the ranks of a tensor-parallel engine, and refusing what cannot run, before anything loads.

Two ways to start N ranks:

- One process (`LLM(..., tensor_parallel_size=N)`, `flexsgl generate/bench/serve --tp N`): rank 0
  is the caller. It opens a TCPStore on a free local port and spawns N-1 daemon worker processes
  (torch.multiprocessing, spawn context: safe from a thread, or from a spawned process such as
  the server's engine process), each of which joins through the store, loads its part of the
  model and runs the worker loop (worker.py). A worker that fails before joining writes why to
  the store and exits; rank 0, which polls the store and the processes, raises that reason. As
  with any spawn-based program, a script that makes an LLM with N > 1 must guard its top level
  with `if __name__ == "__main__":`: a spawned process first imports the main script (as
  `__mp_main__`), and without the guard it would make the LLM again there. That LLM sees it is
  inside a spawned process's start (`refuse_spawn_reimport`), says so and exits with
  SPAWN_REIMPORT_EXIT, and rank 0 raises that cause.
- torchrun (`torchrun --nproc-per-node N script.py`, where the script makes
  `LLM(..., tensor_parallel_size=N)`, or `--nnodes H --node-rank h --rdzv-endpoint HOST:PORT` on
  each of H hosts): every process runs the script; RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE and MASTER_ADDR/PORT come from torchrun, and nothing else is assumed about
  where the ranks run. Rank 0's constructor returns the engine as usual. The constructor of every
  other rank serves rank 0's steps instead of returning, and when rank 0 shuts down (or dies) it
  ends the process (SystemExit, code 0 after a normal shutdown): the script's code after
  `LLM(...)` runs on rank 0 only. If a rank fails, torchrun stops the others.

Rank r runs on cuda:r (cuda:LOCAL_RANK under torchrun), or on the CPU over gloo.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from flexsgl.config import EngineConfig
from flexsgl.distributed.group import COLLECTIVE_TIMEOUT, TPGroup, init_group, rank_device
from flexsgl.distributed.worker import exit_reason, stop_processes, worker_main
from flexsgl.errors import RankFailedError, TensorParallelError
from flexsgl.log import logger

JOIN_TIMEOUT_S = 600.0  # the longest rank 0 waits for spawned workers to join (they import torch first)
# The exit code of a spawned process that re-ran an unguarded main script's LLM(...) while it started.
SPAWN_REIMPORT_EXIT = 86
SPAWN_REIMPORT = ("Each spawned tensor-parallel rank re-ran the main script, which makes the LLM at its top level; "
                  "guard that code with `if __name__ == \"__main__\":`.")


def refuse_spawn_reimport() -> None:
    """In a process that multiprocessing is still starting (spawn: it imports the parent's main
    script as `__mp_main__` before it runs its target), an LLM with N > 1 ranks comes from a main
    script without the guard: say so and end this process with SPAWN_REIMPORT_EXIT, which the
    parent reads as that cause."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.write(f"flexsgl: {SPAWN_REIMPORT}\n")
        sys.stderr.flush()
        os._exit(SPAWN_REIMPORT_EXIT)


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun (or another launcher) started this process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def one_host() -> bool:
    """Whether every rank runs on this host: spawned ranks always do; under torchrun, when this
    host runs all of them (LOCAL_WORLD_SIZE equals WORLD_SIZE)."""
    env = torchrun_env()
    return env is None or int(os.environ.get("LOCAL_WORLD_SIZE", env[1])) == env[1]


def refuse(cfg: EngineConfig, mcfg, device: torch.device) -> None:
    """Raise TensorParallelError, in one sentence, for a tensor-parallel setting that cannot run."""
    n = cfg.tensor_parallel_size
    env = torchrun_env()
    if dist.is_initialized():
        raise TensorParallelError("This process already has a process group (another tensor-parallel engine, "
                                  "or one of its own); shut that engine down before starting another.")
    if env is not None and env[1] != n:
        raise TensorParallelError(f"tensor_parallel_size is {n}, but this process was started as one of "
                                  f"{env[1]} ranks (WORLD_SIZE); start as many processes as tensor-parallel ranks.")
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if env is None and n > gpus:
            raise TensorParallelError(f"tensor_parallel_size {n} needs {n} GPUs, and this machine has {gpus}.")
        if env is not None and env[2] >= gpus:
            raise TensorParallelError(f"This process is local rank {env[2]} (LOCAL_RANK) and runs on cuda:{env[2]}, "
                                      f"but this host has {gpus} GPUs; start at most {gpus} processes per host.")
        if device.index not in (None, 0) and env is None:
            raise TensorParallelError(f"Tensor parallelism runs on cuda:0 to cuda:{n - 1}; device "
                                      f"{str(device)!r} cannot be given with tensor_parallel_size {n}.")
    if mcfg.num_heads % n:
        raise TensorParallelError(f"The model's {mcfg.num_heads} attention heads do not split across "
                                  f"tensor_parallel_size {n} ranks; use a divisor of {mcfg.num_heads}.")
    hkv = mcfg.num_kv_heads
    if mcfg.mla is None and hkv % n and n % hkv:  # (MLA's one latent per token is replicated)
        raise TensorParallelError(f"The model's {hkv} KV heads neither split across nor divide "
                                  f"tensor_parallel_size {n}; use a divisor or a multiple of {hkv}.")
    if mcfg.intermediate_size % n:
        raise TensorParallelError(f"The model's MLP width {mcfg.intermediate_size} does not split across "
                                  f"tensor_parallel_size {n} ranks.")
    if mcfg.moe is not None and mcfg.moe.intermediate_size % n:
        raise TensorParallelError(f"The model's expert width {mcfg.moe.intermediate_size} does not split across "
                                  f"tensor_parallel_size {n} ranks.")


def spawn(cfg: EngineConfig, device: torch.device, build):
    """Rank 0 of a one-process start: spawn the workers, wait for them to join, join the group.
    Each worker builds its rank with `build(cfg, group)` (engine_core.build_core, a module-level
    function: the spawn context pickles it by name). Returns (group, worker processes, store)."""
    n = cfg.tensor_parallel_size
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(main_file, str) and main_file.startswith("<"):  # `python - < script.py`: "<stdin>"
        raise TensorParallelError(f"The other tensor-parallel ranks start by re-running the main script, and one "
                                  f"read from {main_file} cannot be re-run; save it to a file and run that.")
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(r, n, cfg, device.type, store.port, build), daemon=True,
                         name=f"flexsgl-tp{r}") for r in range(1, n)]
    # Started with Ctrl-C ignored, which they inherit: ignored from their first instruction, they
    # print no KeyboardInterrupt of their own when the terminal's Ctrl-C reaches the whole group
    # while they start (worker_main ignores it too; rank 0 decides).
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        for p in procs:
            p.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not store.check([f"joined/{r}" for r in range(1, n)]):
            for r, p in enumerate(procs, 1):
                if not p.is_alive() and p.exitcode == SPAWN_REIMPORT_EXIT:
                    raise TensorParallelError(SPAWN_REIMPORT)
                if not p.is_alive():
                    raise RankFailedError(f"Tensor-parallel rank {r} exited before joining: "
                                          f"{exit_reason(store, r, p.exitcode)}.")
            if time.monotonic() > deadline:
                raise RankFailedError(f"The tensor-parallel ranks did not all join within {JOIN_TIMEOUT_S:.0f} s.")
            time.sleep(0.05)
        group = init_group(0, n, rank_device(device, 0), store)
    except BaseException:  # a rank failed, or Ctrl-C: the others only wait to join, nothing to finish
        stop_processes(procs, timeout=0.0)
        raise
    return group, procs, store


def join_torchrun(device: torch.device) -> TPGroup:
    """This process's rank of a torchrun start (its environment gives the rank and the rendezvous)."""
    rank, world, local = torchrun_env()
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    logger.info(f"rank {rank} of {world} (RANK, WORLD_SIZE): waiting for the other ranks to join at {where}, "
                f"up to {COLLECTIVE_TIMEOUT.total_seconds() / 60:.0f} minutes")
    return init_group(rank, world, torch.device("cuda", local) if device.type == "cuda" else device,
                      one_host=one_host())
