"""docs/ATTENTION.md's Python examples run as they stand: each in a namespace of its own, in one
fresh interpreter on the CPU, must finish and print what it generates."""

import json
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "ATTENTION.md"
RUNNER = """
import contextlib, io, json, sys
results = []
for code in json.loads(sys.stdin.read()):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<ATTENTION.md example>", "exec"), {"__name__": "__main__"})
        results.append({"ok": True, "out": out.getvalue()})
    except BaseException as e:
        results.append({"ok": False, "out": f"{type(e).__name__}: {e}"})
print(json.dumps(results))
"""


def test_attention_doc_examples_run():
    examples = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(examples) >= 3
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(examples), capture_output=True,
                          text=True, timeout=900, env={"FLEXSGL_LOG_LEVEL": "warning", "CUDA_VISIBLE_DEVICES": "",
                                                       "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    for i, result in enumerate(json.loads(done.stdout.strip().splitlines()[-1])):
        assert result["ok"], f"example {i} failed: {result['out']}"
        assert result["out"].strip(), f"example {i} printed nothing"
