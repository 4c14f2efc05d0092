"""A tensor-parallel engine's life in a process of its own, for the exit tests of
tests/test_tensor_parallel.py: `python tests/tp_exit_script.py MODE DEVICE [TP]`.

It starts `tiny` at TP ranks (2 by default; compiled steps and CUDA graphs on a GPU), prints
`workers PID...`, generates, prints `generated`, then, by MODE:

    exit         returns: the engine is left to the interpreter's exit
    shutdown     LLM.shutdown(), then returns
    rank-killed  kills rank 1 (SIGKILL), generates again, prints `dead` on EngineDeadError, returns
    step-interrupted  a KeyboardInterrupt on rank 0 half-way through a step whose plan went out (a
                 second Ctrl-C there; rank 1 then waits inside the step's collectives): prints
                 `interrupted` when it comes out of generate, returns
    load-interrupted  a KeyboardInterrupt on rank 0 while the model loads (rank 1 goes on loading and
                 then waits for rank 0 in a collective): prints the workers, `interrupted` once the
                 engine's construction raised it, and `generated` (where the test's reader stops), returns
    load-rank-killed  rank 1 killed (SIGKILL) while rank 0 loads the model: prints the workers, `failed`
                 and the reason once the engine's construction raised RankFailedError, then
                 `generated`, returns
    signal       generates until the test signals the process: SIGTERM to rank 0 alone ends it;
                 after Ctrl-C (SIGINT to its process group) it prints `interrupted`, generates once
                 more (the engine must still run: the workers ignore Ctrl-C), prints `continued`
                 and returns
"""

import os
import signal
import sys

from flexsgl import LLM, SamplingParams
from flexsgl.errors import EngineDeadError, RankFailedError

if __name__ == "__main__":
    mode, device = sys.argv[1], sys.argv[2]
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    options = dict(device=device, load_format="dummy", tensor_parallel_size=tp, max_total_tokens=4096,
                   max_running_requests=4, page_size=16)
    options.update(compile=False) if device == "cpu" else options.update(cuda_graph_bs=(1, 2, 4))
    if mode in ("load-interrupted", "load-rank-killed"):
        import flexsgl.distributed.launcher as launcher
        import flexsgl.engine_core as engine_core

        started, spawn, build_model = [], launcher.spawn, engine_core.build_model

        def recording_spawn(*args, **kwargs):
            group, procs, store = spawn(*args, **kwargs)
            started.extend(procs)
            return group, procs, store

        def interrupted(*args, **kwargs):
            if mode == "load-interrupted":
                raise KeyboardInterrupt
            os.kill(started[0].pid, signal.SIGKILL)
            started[0].join()
            return build_model(*args, **kwargs)

        launcher.spawn, engine_core.build_model = recording_spawn, interrupted  # this process's (rank 0's) alone
        try:
            LLM("tiny", **options)
        except KeyboardInterrupt:
            print("workers", *[p.pid for p in started], flush=True)
            print("interrupted", flush=True)
        except RankFailedError as e:
            print("workers", *[p.pid for p in started], flush=True)
            print("failed", e, flush=True)
        print("generated", flush=True)
        sys.exit(0)
    llm = LLM("tiny", **options)
    print("workers", *[p.pid for p in llm._channel.procs], flush=True)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], greedy)  # a prefill, then decode steps (graphs on a GPU)
    print("generated", flush=True)
    if mode == "shutdown":
        llm.shutdown()
    elif mode == "rank-killed":
        os.kill(llm._channel.procs[0].pid, signal.SIGKILL)
        try:
            llm.generate([[1, 2, 3]], greedy)
        except EngineDeadError:
            print("dead", flush=True)
    elif mode == "step-interrupted":
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        llm.runner._launch = interrupted
        try:
            llm.generate([[1, 2, 3]], greedy)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    elif mode == "signal":
        try:
            while True:
                llm.generate([[1, 2, 3], [4, 5]], greedy)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        llm.generate([[1, 2, 3]], greedy)
        print("continued", flush=True)
