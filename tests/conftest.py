import importlib.util
import os
import signal

import pytest
import torch

CUDA = torch.cuda.is_available()

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A suite started in the background by a non-interactive shell inherits SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler (nor do the processes the tests start). The
    # Ctrl-C tests check the engine's handling of KeyboardInterrupt as a terminal delivers it.
    signal.signal(signal.SIGINT, signal.default_int_handler)

if not CUDA:
    # Without a GPU, flexsgl's Triton kernels run on CPU tensors through Triton's interpreter
    # (the `triton_interpreter` tests). Triton takes the switch as it is imported, and Inductor
    # imports it with torch._inductor, so it is set here, before any test module loads. Inductor's
    # CPU code generation does not read it: it only changes how Triton kernels launch.
    # The interpreter runs float32 and float16 as the GPU does; bfloat16 it does not support
    # (Triton's debugging guide): it rounds float32 to bfloat16 toward zero, and its tl.dot
    # multiplies bfloat16 bit patterns. So the CPU tests run float32 and float16, the GPU ones bfloat16.
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run with -m gpu on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def triton_interpreter():
    """For tests that run a Triton kernel on CPU tensors, through Triton's interpreter."""
    if CUDA:
        pytest.skip("runs on machines without a GPU; here the GPU variant runs the kernel compiled")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install -e '.[dev]' brings it)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test reports the seeds it drew: every integer local named `seed` or `..._seed` in the
    frames of its traceback (the test, its fixtures' and helpers' frames), so that any failure can be
    replayed, not only those whose assertion message names the seed."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.excinfo is None:
        return
    seeds = {}
    for entry in call.excinfo.traceback:
        for name, value in entry.frame.f_locals.items():
            if (name == "seed" or name.endswith("_seed")) and isinstance(value, int) and not isinstance(value, bool):
                seeds.setdefault(f"{entry.name}: {name}={value}", None)
    if seeds:
        report.sections.append(("seeds drawn", "\n".join(seeds)))


def pytest_runtest_logreport(report):
    """With FLEXSGL_FAILURES_FILE set (tools/gpu.sh sets it per step), each failure is appended to that
    file as it happens, its message and seeds: a run cut at a time limit keeps what failed and why,
    where pytest would have printed it only at the end."""
    path = os.environ.get("FLEXSGL_FAILURES_FILE")
    if not path or not report.failed:
        return
    lines = report.longreprtext.splitlines()[-60:]
    seeds = [text for title, text in report.sections if title == "seeds drawn"]
    with open(path, "a") as f:
        f.write("\n".join([f"==== {report.nodeid} ({report.when})", *lines, *seeds, ""]))
