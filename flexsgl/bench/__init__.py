"""`flexsgl bench`: the throughput, latency and prefill workloads, run on one or more attention backends.

What the command, `benchmarks/` and `tools/` use:

- a run: `BenchArgs` (the command line) -> `plan()` (checked, defaults applied: a `Plan`) -> `run()`
  (the report, a dict) -> `format_table()` / `write_json()`; `build_llm()` is the engine a plan
  describes for one override;
- a pass: `timed_pass()` runs requests to completion through the step API and times every token;
  `random_prompts()` and `throughput_requests()` make its inputs; `freeze_heap()` before a timed
  pass and `free_memory()` between engines;
- the machine: `copy_bandwidth()` and `decode_floor()` (the roofline of a decode step), `sync()`,
  `environment()` and `commit()`; `cuda_timing.graph_median_s()` times device work from a CUDA graph.

args.py, passes.py, workloads.py, roofline.py, machine.py, report.py and cuda_timing.py hold one each;
critical_path.py splits a profiled span of kernels into each one's share (tools/profile_step.py).
"""

from flexsgl.bench.args import WORKLOADS, BenchArgs, Plan, plan
from flexsgl.bench.machine import commit, environment
from flexsgl.bench.passes import free_memory, freeze_heap, random_prompts, throughput_requests, timed_pass
from flexsgl.bench.report import format_table, write_json
from flexsgl.bench.roofline import copy_bandwidth, decode_floor, sync
from flexsgl.bench.workloads import build_llm, run

__all__ = [
    "WORKLOADS", "BenchArgs", "Plan", "build_llm", "commit", "copy_bandwidth", "decode_floor", "environment",
    "format_table", "free_memory", "freeze_heap", "plan", "random_prompts", "run", "sync", "throughput_requests",
    "timed_pass", "write_json",
]
