"""The tools' command lines (tools/*.py, flexsgl/tool_args.py): --help describes each; a bad value is
one `error:` sentence and exit status 2, not a traceback; a GPU tool on a machine without the GPUs
it needs says so in one sentence (exit status 1). Each tool's main() runs in this process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parent.parent / "tools"
PY_TOOLS = sorted(p.stem for p in TOOLS.glob("*.py"))


def run_main(tool: str, argv: list[str], monkeypatch) -> int:
    """tools/<tool>.py's main() with `argv`; its exit status (0 when it returns)."""
    spec = importlib.util.spec_from_file_location(f"tool_{tool}", TOOLS / f"{tool}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [f"{tool}.py", *argv])
    try:
        main = module.main
        code = main() if tool != "import_cycles" else _import_cycles_main(module)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return e.code or 0
    return code or 0


def _import_cycles_main(module):
    """import_cycles parses its arguments under `if __name__ == "__main__"`: run that block."""
    source = (TOOLS / "import_cycles.py").read_text().split('if __name__ == "__main__":\n')[1]
    exec(compile("\n".join(line[4:] for line in source.splitlines()), "import_cycles", "exec"), vars(module))


@pytest.mark.parametrize("tool", PY_TOOLS)
def test_help_describes_the_tool(tool, monkeypatch, capsys):
    assert run_main(tool, ["--help"], monkeypatch) == 0
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    assert usage.startswith("usage:") and rest.split("\n\n")[0].strip(), f"{tool}: no description in {out[:300]!r}"


BAD = [
    ("allreduce_bench", ["--tp", "0"]), ("decode_sweep", ["--batches", "x"]), ("fp8_gemm_bench", ["--rows", "1,-4"]),
    ("fp8_gemm_bench", ["--model", "nosuch"]), ("gemv_bench", ["--model", "nosuch"]), ("tp_memory", ["--tp", "two"]),
    ("gemv_sass", ["--tiles", "1,2"]), ("gemv_sass", ["--tiles", "24,512,4,3"]), ("gemv_sass", ["--block-scales"]),
    ("fa3_fp8_rounding", ["--checkpoints", "0"]), ("load_test", ["--max-new", "0"]), ("load_test", ["--model", "x"]),
    ("profile_step", ["--profile-steps", "-1"]), ("train_tiny", ["--out", "unused", "--steps", "0"]),
    ("train_tiny", ["--out", "unused", "--hidden", "96"]), ("train_tiny", ["--out", "unused", "--held-out", "1"]),
    ("gpu_tests_left", ["--log", "no-such-log.txt", "--", "tests"]), ("import_cycles", ["/no/such/checkout"]),
    ("tp_bench_table", ["/no/such/folder"]), ("fp8_agreement", ["--prompts", "0"]),
]


@pytest.mark.parametrize("tool, argv", BAD, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_a_bad_argument_is_one_sentence_and_status_2(tool, argv, monkeypatch, capsys):
    assert run_main(tool, argv, monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"{tool}.py: error: ") and "Traceback" not in "\n".join(err), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPUs are here")
@pytest.mark.parametrize("tool, gpus", [("allreduce_bench", 2), ("decode_sweep", 1), ("fp8_gemm_bench", 1),
                                        ("gemv_bench", 1), ("tp_memory", 2)])
def test_a_gpu_tool_without_its_gpus_says_so(tool, gpus, monkeypatch, capsys):
    assert run_main(tool, [], monkeypatch) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"{tool} needs {gpus} CUDA GPU{'s' if gpus > 1 else ''}; this machine has 0.", err
