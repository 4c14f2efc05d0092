"""Is a throughput run's speed a function of where its buffers land? Reserves PAD_GB of device
memory first, so that every later allocation lands elsewhere, then runs `flexsgl bench` with the
arguments given in this fresh process. Pass --kv-cache-tokens, or the pool shrinks by the pad.
(docs/BENCHMARKS.md, seventh session: it is not; 6 GB moved the figure by at most 0.15%.)

    python tools/placement_probe.py PAD_GB --workload throughput --model qwen3-0.6b --kv-cache-tokens 600000
"""

import sys

import torch

from flexsgl.cli import app

pad_gb = float(sys.argv[1])
pad = torch.empty(int(pad_gb * 2**30), dtype=torch.uint8, device="cuda") if pad_gb > 0 else None
sys.argv = ["flexsgl", "bench", *sys.argv[2:]]
app()
