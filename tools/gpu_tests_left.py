"""The GPU tests a cut run left: those that pytest's arguments select and no log shows passed.

A device call's deadline stops `tools/gpu.sh tests` part-way. Its log (gpu_each.sh's gpuN/log.txt)
names every test that passed (pytest -v); this lists the rest, one pytest id a line, for the next call:

    python tools/gpu_tests_left.py --log .device/8/gpu0/log.txt -- tests/test_gpu_overrides.py > .gpu/lists/a.txt
    # on the device, directly:
    mapfile -t ids < .gpu/lists/a.txt; bash tools/gpu.sh tests -- "${ids[@]}"
    # or through gpu_each.sh, which reads each run's words as the shell does: each id quoted
    bash tools/gpu_each.sh "tests -- $(sed "s/.*/'&'/" .gpu/lists/a.txt | tr '\\n' ' ')"

The selection is collected here, on the CPU (`pytest --collect-only -m gpu`), so both machines must
hold the same tests.
"""
import argparse
import os
import re
import subprocess
import sys

PASSED = re.compile(r"^(tests/\S+::\S+) PASSED")


def passed_in(logs: list[str]) -> set[str]:
    done = set()
    for log in logs:
        with open(log, errors="replace") as f:
            done.update(m.group(1) for line in f if (m := PASSED.match(line)))
    return done


def selected(pytest_args: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "gpu", *pytest_args], capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if out.returncode not in (0, 5) or not ids:
        sys.exit(f"pytest selected no GPU test with {' '.join(pytest_args)!r}: {out.stdout[-300:]}{out.stderr[-300:]}")
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", action="append", default=[], help="a log of an earlier run (repeatable)")
    parser.add_argument("pytest_args", nargs="+", help="after --: the run's pytest arguments")
    args = parser.parse_args()
    missing = [log for log in args.log if not os.path.isfile(log)]
    if missing:
        parser.error(f"--log {missing[0]!r} is not a file")
    done = passed_in(args.log)
    left = [t for t in selected(args.pytest_args) if t not in done]
    print("\n".join(left))
    print(f"{len(left)} left, {len(done)} passed in the logs", file=sys.stderr)


if __name__ == "__main__":
    main()
