"""tools/gemv_sass.py on the batch-1 matrix-vector kernel compiled for SM90 (no GPU needed): the loop
over K reads each thread's weight bytes in 16-byte loads and does one multiply-add per weight
element, the counts the kernel's design gives (BLOCK_N x BLOCK_K elements over the program's
threads an iteration); and every FP8 form fits the register cap its launches take
(gemv.FP8_MAX_REGISTERS) with no spill stored in that loop."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexsgl.kernels import gemv

ROOT = Path(__file__).resolve().parent.parent


def loop_mix(*args: str) -> dict:
    """tools/gemv_sass.py's --json answer for these arguments."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tool compiles the kernel
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gemv_sass.py"), "--json", *args],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fp8,tiles", [(True, gemv.FP8_TILES), (False, (4, 512, 4, 3))], ids=["fp8", "bf16"])
def test_loop_reads_16_byte_vectors_and_multiplies_each_element_once(fp8, tiles):
    mix = loop_mix("--tiles", ",".join(map(str, tiles)), *(["--fp8"] if fp8 else []))
    ops = mix["ops"]
    block_n, block_k, warps, _ = tiles
    elements = block_n * block_k // (warps * 32)  # weight elements a thread an iteration
    assert mix["bytes_per_thread"] == elements * (1 if fp8 else 2)
    loads = {op.split(".")[-1]: n for op, n in ops.items() if op.startswith("LDG")}
    assert loads.get("128") == mix["bytes_per_thread"] // 16, ops  # x is read from shared memory
    assert "U8" not in loads and "U16" not in loads, ops
    assert sum(n for op, n in ops.items() if op.split(".")[0] in ("FFMA", "FMUL")) == elements, ops
    if fp8:  # e4m3 pairs widened to half precision in one instruction each
        assert ops.get("F2FP.F16.E4M3.UNPACK_B") == elements // 2, ops


@pytest.mark.parametrize("prologue", ["plain", "rms_norm", "silu_gate"])
@pytest.mark.parametrize("scales", ["row", "block"])
def test_fp8_forms_fit_the_register_cap(prologue, scales):
    """Capped, no form stores a spilled register inside the loop over K, and none spills more than a
    few values outside it (the GPU image's Triton 3.6 spills none; 3.9 spills 16-24 bytes after
    RMSNorm, reloaded in the loop from L1)."""
    mix = loop_mix("--fp8", "--prologue", prologue, *(["--block-scales"] if scales == "block" else []))
    assert mix["registers"] <= gemv.FP8_MAX_REGISTERS, mix
    assert not any(op.startswith("STL") for op in mix["ops"]), mix["ops"]
    assert mix["spilled"] <= 32, mix
