"""Microseconds per all-reduce across the GPUs of this host: NCCL against flexsgl's all-reduces over
symmetric memory (flexsgl/distributed/nvlink_allreduce.py: one-shot, two-shot), the one the engine
picks for the size ("flexsgl", "picks": flexsgl/distributed/allreduce.py, FLEXSGL_ALLREDUCE as
the engine reads it), and, where FlashInfer is installed, its TensorRT-LLM all-reduce
(`flashinfer.comm`, one-shot and two-shot, over IPC memory without multicast) alone and fused with
the residual add and RMSNorm that follow it in a layer ("trt1+norm", "trt2+norm"); bfloat16 messages
from 8 KB to 4 MB, as rows of HIDDEN values (a Qwen3-8B hidden state per row).

Each figure is one all-reduce's share of a CUDA graph of 50 in a row on the same buffer, replayed
20 times (the way decode steps run them: captured, so launch costs are the graph's), the median of
5 timings on rank 0's GPU. Every result is checked against NCCL's first (bf16 rounding).

    python tools/allreduce_bench.py            # every GPU of the host (at most 8)
    python tools/allreduce_bench.py --tp 2

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless set;
FlashInfer's workspace is made without multicast).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import statistics

import torch

from flexsgl.tool_args import need_gpus, parser, positive_int

SIZES_KB = (8, 16, 32, 64, 256, 1024, 2048, 4096)
CALLS, REPLAYS, TIMINGS = 50, 20, 5
HIDDEN = 4096


def time_graph(fn, device) -> float:
    """Microseconds per call of `fn` (no arguments), captured CALLS times in one CUDA graph."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(TIMINGS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS))
    graph.reset()
    return statistics.median(times)


def rank_main(rank: int, size: int, port: int) -> None:
    import torch.distributed as dist

    from flexsgl.distributed import allreduce, nvlink_allreduce
    from flexsgl.distributed.group import destroy_group, init_group

    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0)
    group = init_group(rank, size, device, store)
    allreduce.prepare(group, HIDDEN, torch.bfloat16)  # the engine's choice ("flexsgl"): FlashInfer's where auto takes it
    symm = allreduce._symm
    fi = FlashInferAllReduce.make(group)
    rows = []
    for kb in SIZES_KB:
        x = torch.randn(kb * 512, device=device, dtype=torch.bfloat16, generator=torch.Generator(device).manual_seed(rank))
        want = x.clone()
        dist.all_reduce(want)
        row = {"KB": kb, "nccl": time_graph(lambda: dist.all_reduce(x), device)}
        x.copy_(torch.randn(x.shape, device=device, dtype=x.dtype, generator=torch.Generator(device).manual_seed(rank)))
        if symm is not None:
            for kind in ("one-shot", "two-shot"):
                if kind == "one-shot" and kb * 1024 > 4 * nvlink_allreduce.ONE_SHOT_MAX_BYTES:
                    row[kind] = None
                    continue
                got = symm(x, kind)
                torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.06)
                row[kind] = time_graph(lambda: symm(x, kind), device)
        rows2d, trt = x.view(-1, HIDDEN), allreduce._trt
        torch.testing.assert_close(allreduce.all_reduce(rows2d).float().view(-1), want.float(), rtol=0.02, atol=0.06)
        row["flexsgl"] = time_graph(lambda: allreduce.all_reduce(rows2d), device)
        row["picks"] = ("trt" if trt is not None and trt.takes(rows2d) else
                        symm.kind(x) if symm is not None else "nccl")
        if fi is not None:
            row.update(fi.time_all(x, want))
        rows.append(row)
    if rank == 0:
        print(f"all-reduce of bfloat16 across {size} GPUs ({torch.cuda.get_device_name(device)}), us per call "
              f"in CUDA graphs of {CALLS}; symmetric memory: {'yes' if symm is not None else 'no (see the log)'}")
        cols = ["KB", "nccl", "one-shot", "two-shot", "flexsgl", "picks"]
        if fi is not None:
            cols += list(FlashInferAllReduce.COLUMNS)
        print("  ".join(f"{c:>9}" for c in cols))
        for r in rows:
            cells = [r.get(c) for c in cols]
            print("  ".join(f"{c:>9.1f}" if isinstance(c, float) else f"{'-' if c is None else c!s:>9}"
                            for c in cells))
    if rank == 0 and fi is not None and fi.errors:
        print("FlashInfer's all-reduce refused: " + "; ".join(sorted(fi.errors)))
    torch.cuda.synchronize(device)
    if fi is not None:
        fi.workspace.destroy()
    destroy_group()


class FlashInferAllReduce:
    """FlashInfer's TensorRT-LLM all-reduce on the engine's workspace (nvlink_allreduce.TrtllmAllReduce, for
    rows of HIDDEN); each size timed one-shot and two-shot, alone and fused with a residual add and
    RMSNorm, and checked against NCCL's sum (a column is None where FlashInfer refuses the case;
    why goes to `errors`)."""

    COLUMNS = ("trt-1shot", "trt-2shot", "trt1+norm", "trt2+norm")

    def __init__(self, trt):
        self.comm, self.workspace, self.errors = trt.comm, trt.workspace, set()

    @classmethod
    def make(cls, group):
        from flexsgl.distributed import nvlink_allreduce

        if importlib.util.find_spec("flashinfer") is None:
            return None
        try:
            return cls(nvlink_allreduce.TrtllmAllReduce(group, HIDDEN, torch.bfloat16))
        except Exception as e:
            print(f"rank {group.rank}: FlashInfer's all-reduce workspace failed: {type(e).__name__}: {e}")
            return None

    def time_all(self, x: torch.Tensor, want: torch.Tensor) -> dict:
        x2 = x.view(-1, HIDDEN)
        out = torch.empty_like(x2)
        residual = torch.randn_like(x2)
        gamma = torch.rand(HIDDEN, device=x.device, dtype=x.dtype) + 0.5
        residual_out, norm_out = torch.empty_like(x2), torch.empty_like(x2)
        kinds = {"trt-1shot": (True, False), "trt-2shot": (False, False), "trt1+norm": (True, True),
                 "trt2+norm": (False, True)}
        row = {}
        for col, (oneshot, norm) in kinds.items():
            pattern = self.comm.AllReduceFusionPattern.kARResidualRMSNorm if norm else \
                self.comm.AllReduceFusionPattern.kAllReduce
            extra = (dict(residual_in=residual, rms_gamma=gamma, residual_out=residual_out, norm_out=norm_out)
                     if norm else dict(output=out))

            def call():
                self.comm.allreduce_fusion(input=x2, workspace=self.workspace, pattern=pattern,
                                           use_oneshot=oneshot, **extra)
            try:
                call()
                got = (residual_out - residual) if norm else out
                torch.testing.assert_close(got.float().view(-1), want.float(), rtol=0.02, atol=0.06)
                row[col] = time_graph(call, x.device)
            except Exception as e:  # a size or strategy FlashInfer does not take, or a wrong sum
                self.errors.add(f"{col} at {x.numel() * 2 // 1024} KB: {type(e).__name__}: {str(e)[:120]}")
                row[col] = None
        return row


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tp", type=positive_int, default=None, help="GPUs (default: every GPU of the host, at most 8)")
    args = ap.parse_args()
    args.tp = args.tp or max(2, min(torch.cuda.device_count(), 8))
    need_gpus("allreduce_bench", args.tp)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(args.tp, port), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
