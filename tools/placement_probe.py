"""Is a throughput run's speed a function of where its buffers land? Reserve PAD_GB of device memory
first (so every later allocation lands elsewhere), then run the throughput workload's first engine
in this fresh process with a fixed KV pool. Usage: python tools/placement_probe.py PAD_GB [bench args]"""
import sys

import torch

pad_gb = float(sys.argv[1])
pad = torch.empty(int(pad_gb * 2**30), dtype=torch.uint8, device="cuda") if pad_gb > 0 else None
sys.argv = ["flexsgl", "bench", *sys.argv[2:]]
from flexsgl.cli import app  # noqa: E402

app()
