"""The machine, the software and the commit that a `flexsgl bench` report's figures came from."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch


def environment(device: torch.device) -> dict:
    """The machine, the software and the commit the figures came from."""
    cuda = device.type == "cuda"
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "hostname": socket.gethostname(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": tf_version,
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "gpu_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else None,
        "commit": commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    """FLEXSGL_COMMIT if set (trees copied without .git), else git's HEAD (+ "-dirty"), else "unknown"."""
    if os.environ.get("FLEXSGL_COMMIT"):
        return os.environ["FLEXSGL_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "") if head else "unknown"
