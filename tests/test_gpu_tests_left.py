"""tools/gpu_tests_left.py: a cut run's log against its selection, checked on hand-written cases."""
import random
import subprocess
import sys

from tools.gpu_tests_left import passed_in, selected


def test_the_tests_left_are_those_no_log_passed(tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    ids = [f"tests/test_x.py::test_case[{rng.randrange(1000)}-{i}-fa3-prefill,fi-decode]" for i in range(12)]
    passed = set(rng.sample(ids, 5))
    failed = rng.choice([t for t in ids if t not in passed])
    part_of = {t: rng.randrange(2) for t in passed}
    logs = []
    for part in (0, 1):
        lines = ["collecting ... collected 12 items", "!!!!! KeyboardInterrupt !!!!!"]
        lines += [f"{t} PASSED [ {rng.randrange(100)}%]" for t in sorted(passed) if part_of[t] == part]
        lines += [f"{failed} FAILED [ 50%]", f"FAILED {failed} - AssertionError"] if part else []
        logs.append(tmp_path / f"log{part}.txt")
        logs[-1].write_text("\n".join(lines) + "\n")
    assert passed_in([str(p) for p in logs]) == passed, f"seed={seed}"


def test_the_selection_is_what_pytest_collects_with_the_gpu_mark():
    ids = selected(["tests/test_gpu_overrides.py", "-k", "qwen3_8b_greedy"])
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "tests/test_gpu_overrides.py"], capture_output=True, text=True).stdout
    expected = [line for line in collected.splitlines() if "::test_qwen3_8b_greedy_agrees_with_flex[" in line]
    assert ids == expected and len(ids) >= 3, ids
