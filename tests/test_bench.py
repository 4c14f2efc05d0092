"""`flexsgl bench` on the tiny preset (CPU) through typer's CliRunner, and the benchmarks/ folder run once.

Checks that every figure is in the JSON, positive, and consistent with the others (EOS is ignored,
so the output tokens are exactly the requested ones); never how fast anything is.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flexsgl.bench import commit
from flexsgl.bench.report import STARTUP_ROWS
from flexsgl.cli import app
from flexsgl.model.config import ModelConfig
from flexsgl.model.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
BASE = ["bench", "--device", "cpu", "--model", "tiny"]
TOP = {"workload", "model", "load_format", "device", "tensor_parallel_size", "copy_bandwidth_bytes_per_s", "command", "args", "resolved",
       "environment", "results"}
ENV = {"hostname", "cpu", "cpu_count", "platform", "python", "torch", "cuda", "transformers", "gpu",
       "gpu_memory_bytes", "gpu_capability", "commit", "date"}
PHASES = {"resolve_s", "load_s", "tokenizer_s", "kv_pool_s", "capture_s", "other_s"}  # add up to startup_s
COMMON = {"override", "backends", "startup_s", *PHASES, "compile_s", "kv_cache_tokens", "compile", "dtype",
          "cached_tokens"}
FIELDS = {
    "throughput": {"requests", "input_tokens", "output_tokens", "requested_output_tokens", "wall_s", "warmup_s",
                   "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "prefill_steps",
                   "decode_steps", "preemptions"},
    "latency": {"batch_size", "input_len", "output_len", "repeats", "output_tokens", "ttft_s", "tpot_s", "wall_s",
                "tokens_per_s", "decode_tokens_per_s", "weight_bytes", "embedding_bytes", "weight_bytes_read",
                "tied_embeddings", "kv_bytes_read", "mean_context", "bytes_per_step", "floor_tpot_s",
                "pct_of_floor", "ttft_s_per_pass", "tpot_s_per_pass", "preemptions"},
    "prefill": {"repeats", "prefill"},
    "serve": {"startup_s", "kv_cache_pages", "requests", "request_rate", "max_concurrency", "input_tokens",
              "output_tokens", "requested_output_tokens", "wall_s", "warmup_s", "requests_per_s",
              "output_tokens_per_s", "total_tokens_per_s", "cached_tokens"}
    | {f"{m}_{q}_s" for m in ("ttft", "tpot", "itl") for q in ("p50", "p90", "p99", "mean")},
}
COMMON_SERVE = {"override", "backends"}  # the engine runs in the server (its engine process)
TINY = ModelConfig.from_hf(PRESETS["tiny"]["config"])


def run_bench(tmp_path, *args):
    path = tmp_path / "bench.json"
    r = CliRunner().invoke(app, [*BASE, *args, "--json", str(path)])
    assert r.exit_code == 0, (r.output, r.exception)
    report = json.loads(path.read_text())
    assert set(report) == TOP and set(report["environment"]) == ENV, report.keys()
    w = report["workload"]
    for res in report["results"]:
        common = COMMON_SERVE if w == "serve" else COMMON
        assert set(res) == common | FIELDS[w], set(res) ^ (common | FIELDS[w])
        assert res["backends"] == "flex" and res["cached_tokens"] == 0  # fresh prompts: no prefix-cache hits
        if w == "serve":
            assert res["startup_s"] > 0 and res["kv_cache_pages"] > 0
        else:
            assert res["startup_s"] >= res["load_s"] > 0 and res["kv_cache_tokens"] > 0
            assert all(res[k] >= 0 for k in PHASES)
            assert math.isclose(sum(res[k] for k in PHASES), res["startup_s"], rel_tol=1e-9), res
            assert res["capture_s"] == 0 and res["compile_s"] == 0  # the CPU runs eager, without CUDA graphs
    assert report["copy_bandwidth_bytes_per_s"] > 0  # measured: its size is the machine's, not a check
    assert report["environment"]["cpu_count"] >= 1 and report["environment"]["commit"]
    assert report["command"].startswith("flexsgl bench") and "--json" not in report["command"]
    return r.stdout, report


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9)


def test_throughput(tmp_path):
    out, report = run_bench(tmp_path, "--num-prompts", "4", "--input-len", "8:16", "--output-len", "4:8")
    assert report["load_format"] == "dummy" and report["args"]["num_prompts"] == 4
    assert report["resolved"] == {"num_prompts": 4, "input_len": [8, 16], "output_len": [4, 8]}
    [res] = report["results"]
    assert res["requests"] == 4 and 4 * 8 <= res["input_tokens"] <= 4 * 16
    assert res["output_tokens"] == res["requested_output_tokens"] and 4 * 4 <= res["output_tokens"] <= 4 * 8
    wall = res["wall_s"]
    assert wall > 0 and res["warmup_s"] > 0 and res["preemptions"] == 0
    assert close(res["requests_per_s"] * wall, 4)
    assert close(res["output_tokens_per_s"] * wall, res["output_tokens"])
    assert close(res["total_tokens_per_s"] * wall, res["output_tokens"] + res["input_tokens"])
    assert res["prefill_steps"] >= 1 and res["decode_steps"] >= 3  # at least max(output) - 1 decode steps
    assert out.splitlines()[0].startswith("throughput: tiny (dummy) on cpu")
    assert out.splitlines()[1].split() == ["flex"]
    assert f"{res['output_tokens']}" in out


def test_latency_on_two_overrides_gives_two_columns(tmp_path):
    b, n_in, n_out = 2, 16, 6
    out, report = run_bench(tmp_path, "--workload", "latency", "--batch-size", str(b), "--input-len", str(n_in),
                            "--output-len", str(n_out), "--repeats", "1", "--override", "flex", "--override", "flex")
    assert [r["override"] for r in report["results"]] == ["flex", "flex"]
    lines = out.splitlines()
    assert lines[1].split() == ["flex", "flex", "#2"]
    rows = lines[2:]
    assert len(rows) == 6 + len(STARTUP_ROWS) and all(row.rstrip().endswith("x)") for row in rows[:6]), out
    assert [row.split("  ")[0].strip() for row in rows[6:]] == [label for label, _ in STARTUP_ROWS], out
    bw = report["copy_bandwidth_bytes_per_s"]
    for res in report["results"]:
        assert res["output_tokens"] == b * n_out
        assert 0 < res["ttft_s"] < res["wall_s"] and 0 < res["tpot_s"] < res["wall_s"]
        assert close(res["tokens_per_s"] * res["wall_s"], b * n_out)
        assert close(res["decode_tokens_per_s"] * res["tpot_s"], b)
        assert res["tied_embeddings"] and res["embedding_bytes"] == 0
        assert res["weight_bytes"] == res["weight_bytes_read"] == TINY.num_params() * 4  # float32 on the CPU
        assert res["mean_context"] == n_in + (n_out + 1) / 2
        assert close(res["kv_bytes_read"], b * res["mean_context"] * TINY.kv_bytes_per_token(4))
        assert close(res["bytes_per_step"], res["weight_bytes_read"] + res["kv_bytes_read"])
        assert close(res["floor_tpot_s"], res["bytes_per_step"] / bw)
        assert close(res["pct_of_floor"], 100 * res["floor_tpot_s"] / res["tpot_s"])
        assert len(res["ttft_s_per_pass"]) == len(res["tpot_s_per_pass"]) == 1


def test_prefill(tmp_path):
    out, report = run_bench(tmp_path, "--workload", "prefill", "--input-len", "32,64", "--repeats", "1")
    [res] = report["results"]
    assert [r["input_len"] for r in res["prefill"]] == [32, 64]
    for r in res["prefill"]:
        assert r["ttft_s"] > 0 and close(r["tokens_per_s"] * r["ttft_s"], r["input_len"])
        assert r["ttft_s_per_pass"] == [r["ttft_s"]]
    assert "TTFT ms @ 64" in out and "prefill tok/s @ 32" in out


def test_serve_starts_a_server_and_measures_its_streams(tmp_path):
    out, report = run_bench(tmp_path, "--workload", "serve", "--num-prompts", "6", "--input-len", "8:16",
                            "--output-len", "3:6", "--request-rate", "50,inf", "--max-concurrency", "4",
                            "--max-total-tokens", "1024")
    assert report["resolved"] == {"num_prompts": 6, "input_len": [8, 16], "output_len": [3, 6],
                                  "request_rate": "50.0,inf", "max_concurrency": 4, "dataset_path": None,
                                  "structured": None}
    # One server, warmed up once, then one timed pass per rate, in the order given.
    assert [r["request_rate"] for r in report["results"]] == ["50.0", "inf"]
    assert len({(r["startup_s"], r["warmup_s"]) for r in report["results"]}) == 1
    for res in report["results"]:
        assert res["output_tokens"] == res["requested_output_tokens"] and 6 * 3 <= res["output_tokens"] <= 6 * 6
        assert res["kv_cache_pages"] == 1024 // 64
        assert close(res["requests_per_s"] * res["wall_s"], 6)
        assert close(res["output_tokens_per_s"] * res["wall_s"], res["output_tokens"])
        for m in ("ttft", "tpot", "itl"):
            assert 0 <= res[f"{m}_p50_s"] <= res[f"{m}_p90_s"] <= res[f"{m}_p99_s"] < res["wall_s"], m
        assert res["ttft_p50_s"] > 0 and res["tpot_p50_s"] > 0
    assert out.splitlines()[0].startswith("serve: tiny (dummy) on cpu") and "ITL ms p99" in out
    assert "@ 50.0/s" in out and "@ inf/s" in out


def test_serve_takes_a_sharegpt_file_and_json_schema_constrained_requests(tmp_path):
    """Each prompt a conversation's first turn, its output as long as the reply (the tiny preset's
    byte tokenizer: one token per byte), every output constrained to the bench's JSON schema."""
    import random

    seed = random.randrange(2**31)
    rng = random.Random(seed)  # the seed rebuilds the conversations
    words = ["alpha", "beta", "gamma", "delta", "omega"]
    convs = [{"conversations": [{"from": "human", "value": " ".join(rng.choices(words, k=rng.randrange(2, 6)))},
                                {"from": "gpt", "value": " ".join(rng.choices(words, k=rng.randrange(1, 4)))}]}
             for _ in range(12)]
    convs.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    out, report = run_bench(tmp_path, "--workload", "serve", "--num-prompts", "5", "--dataset-path", str(path),
                            "--structured", "json-schema", "--max-total-tokens", "1024", "--seed", str(seed))
    res = report["results"][0]
    usable = [c["conversations"] for c in convs if len(c["conversations"][0]["value"]) >= 4]
    lengths = {(len(h["value"]), len(g["value"])) for h, g in usable}
    assert res["requests"] == 5 and res["output_tokens"] == res["requested_output_tokens"], f"seed={seed}"
    assert res["input_tokens"] <= 5 * max(i for i, _ in lengths) and res["output_tokens"] >= 5 * 4, f"seed={seed}"
    assert report["resolved"]["structured"] == "json-schema" and report["resolved"]["dataset_path"] == str(path)


BAD = {
    "unknown-workload": ["--workload", "nope"],
    "reversed-range": ["--input-len", "5:2"],
    "not-a-number": ["--output-len", "abc"],
    "empty-range": ["--input-len", ""],
    "zero-length": ["--input-len", "0:4"],
    "range-for-latency": ["--workload", "latency", "--input-len", "4:8"],
    "one-output-token-latency": ["--workload", "latency", "--output-len", "1"],
    "output-len-for-prefill": ["--workload", "prefill", "--output-len", "4"],
    "bad-prefill-lengths": ["--workload", "prefill", "--input-len", "64,x"],
    "batch-size-for-throughput": ["--batch-size", "4"],
    "zero-prompts": ["--num-prompts", "0"],
    "override-not-here": ["--override", "flex", "--override", "fa3"],
    "unknown-override": ["--override", "nope"],
    "longer-than-context": ["--workload", "prefill", "--input-len", "5000"],
    "batch-above-max-running": ["--workload", "latency", "--batch-size", "8", "--max-running", "4"],
    "json-folder-missing": ["--json", "/no/such/folder/bench.json"],
    "rate-for-throughput": ["--request-rate", "4"],
    "zero-rate": ["--workload", "serve", "--request-rate", "0"],
    "word-rate": ["--workload", "serve", "--request-rate", "fast"],
    "zero-in-rates": ["--workload", "serve", "--request-rate", "8,0"],
    "zero-concurrency": ["--workload", "serve", "--max-concurrency", "0"],
    "base-url-and-override": ["--workload", "serve", "--base-url", "http://127.0.0.1:1", "--override", "flex"],
    "base-url-not-http": ["--workload", "serve", "--base-url", "localhost:8000"],
    "base-url-nobody-answers": ["--workload", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "2"],
    "base-url-and-engine-flag": ["--workload", "serve", "--base-url", "http://127.0.0.1:1", "--max-total-tokens", "64"],
    "unknown-structured": ["--workload", "serve", "--structured", "xml"],
    "structured-for-throughput": ["--structured", "json-schema"],
    "dataset-not-a-file": ["--workload", "serve", "--dataset-path", "/no/such/sharegpt.json"],
    "dataset-and-input-len": ["--workload", "serve", "--dataset-path", __file__, "--input-len", "4:8"],
    "dataset-not-json": ["--workload", "serve", "--dataset-path", __file__],
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_exits_2_with_one_error_line(name):
    r = CliRunner().invoke(app, [*BASE, *BAD[name]])
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and len(errors[0]) > len("error: "), r.stderr
    assert "Traceback" not in r.output and r.stdout == "", r.output


@pytest.mark.parametrize("flag", [["--max-total-tokens", "4096"], ["--tp", "2"], ["--dtype", "float16"]])
def test_with_base_url_an_engine_flag_is_refused_naming_it(flag):
    """The server is already running: a flag that would configure the one the bench starts is refused
    (it was taken and meant nothing); --model, which the requests are made for, is not."""
    r = CliRunner().invoke(app, [*BASE, "--workload", "serve", "--base-url", "http://127.0.0.1:1", *flag])
    assert r.exit_code == 2 and "with --base-url the server is already running" in r.stderr, r.output
    name = {"--tp": "--tensor-parallel-size"}.get(flag[0], flag[0])
    assert f"error: {name} configures a server" in r.stderr, r.stderr


def test_each_engine_is_freed_before_the_next(monkeypatch):
    """A run over several overrides sizes each engine's KV cache from free memory, so nothing may
    keep the previous engine's pool alive (a module-level handle table once did, on the GPU)."""
    import gc
    import weakref

    import flexsgl.bench.workloads as workloads
    from flexsgl import bench

    pools = []
    build = bench.build_llm

    def tracked(p, override):
        llm = build(p, override)
        assert all(ref() is None for ref in pools), "the previous engine's KV pool is still alive"
        pools.append(weakref.ref(llm.pool))
        return llm

    monkeypatch.setattr(workloads, "build_llm", tracked)  # what run() calls
    args = bench.BenchArgs(workload="throughput", num_prompts=3, input_len="8:16", output_len="2:4",
                           overrides=["flex", "flex"])
    bench.run(bench.plan(args), progress=False)
    gc.collect()
    assert len(pools) == 2 and pools[-1]() is None


def git(cwd, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_commit_from_environment(monkeypatch):
    monkeypatch.setenv("FLEXSGL_COMMIT", "abc123")
    assert commit() == "abc123"


def test_commit_of_this_checkout_is_git_head(monkeypatch):
    monkeypatch.delenv("FLEXSGL_COMMIT", raising=False)
    import flexsgl

    root = Path(flexsgl.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip(f"flexsgl is imported from {root}, which is no git checkout")
    dirty = git(root, "status", "--porcelain", "--untracked-files=no")
    assert commit() == git(root, "rev-parse", "HEAD") + ("-dirty" if dirty else "")


def commit_in(folder: Path, monkeypatch) -> str:
    """commit() of a copy of flexsgl/bench/machine.py placed in `folder`, git looking no higher."""
    import importlib.util

    import flexsgl.bench.machine as machine

    copy = folder / "machine_copy.py"
    copy.write_text(Path(machine.__file__).read_text())
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(folder.parent))
    spec = importlib.util.spec_from_file_location("machine_copy", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.commit()


def test_commit_follows_head_and_tracked_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEXSGL_COMMIT", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    assert commit_in(repo, monkeypatch) == "unknown"  # no .git here or above
    git(repo, "init", "-q")
    (repo / "tracked.txt").write_text("one\n")
    git(repo, "add", "tracked.txt")
    git(repo, "commit", "-q", "-m", "first")
    head = git(repo, "rev-parse", "HEAD")
    (repo / "untracked.txt").write_text("not counted\n")
    assert commit_in(repo, monkeypatch) == head  # the copy itself is untracked too
    (repo / "tracked.txt").write_text("two\n")
    assert commit_in(repo, monkeypatch) == head + "-dirty"


def test_benchmarks_folder_runs():
    """benchmarks/ once, timings off: each benchmark runs once and its output checks run (about 10 s)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "benchmarks", "--benchmark-disable", "-x",
                        "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]


def test_cpu_warns_before_a_long_default_run_and_names_a_quick_one(caplog):
    """The default workloads are sized for a GPU: on the CPU the plan says so, with a command whose
    own plan is quick (no warning)."""
    from flexsgl import bench
    from flexsgl.config import EngineConfig
    from flexsgl.log import logger

    logger.addHandler(caplog.handler)
    try:
        for workload in bench.WORKLOADS:
            caplog.clear()
            bench.plan(bench.BenchArgs(workload=workload, engine=EngineConfig(device="cpu", model="qwen3-0.6b")))
            [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            assert "minutes on the CPU" in warning, warning
            quick = warning.split("for a quick one: flexsgl bench ")[1].split()
            flags = {k[2:].replace("-", "_"): v for k, v in zip(quick[::2], quick[1::2])}
            args = {k: int(v) if k in ("num_prompts", "repeats") else v for k, v in flags.items() if k != "workload"}
            assert flags["workload"] == workload
            caplog.clear()
            p = bench.plan(bench.BenchArgs(workload=workload, engine=EngineConfig(device="cpu", model="qwen3-0.6b"),
                                           **args))
            assert p.args.workload == workload and caplog.records == [], caplog.records
        caplog.clear()  # one request on the embedded model: seconds (a step of a few ms), no warning
        p = bench.plan(bench.BenchArgs(num_prompts=1, engine=EngineConfig(device="cpu")))
        warned = [r for r in caplog.records if r.levelname == "WARNING"]
        assert warned == [] and bench.args.cpu_seconds(p, 3_400_000) < 30, warned
    finally:
        logger.removeHandler(caplog.handler)


def test_plan_checks_overrides_against_the_models_attention(monkeypatch):
    """bench checks each override for the model's attention kind (an MLA model's, here), before loading."""
    from flexsgl import EngineConfig, bench
    from flexsgl.attention import registry

    seen = []
    real = registry.resolve_override
    monkeypatch.setattr(registry, "resolve_override", lambda o, dev, kind, *a: seen.append(kind) or real(o, dev, kind, *a))
    p = bench.plan(bench.BenchArgs(workload="latency", overrides=["flex"], engine=EngineConfig(device="cpu", model="tiny-mla")))
    assert p.backends == ["flex"] and seen == ["mla"]


def test_a_default_length_beside_a_given_one_is_cut_to_fit_the_context():
    """The embedded model's context is 1,024 tokens: a length given on the command line stands, and
    the default beside it gives way (the both-default case halves the context between them)."""
    from flexsgl import bench
    from flexsgl.config import EngineConfig

    cpu = EngineConfig(device="cpu")
    ctx = 1024
    cases = [("throughput", dict(output_len="4:8"), None, (4, 8)),
             ("throughput", dict(input_len="8:16"), (8, 16), None),
             ("throughput", dict(input_len="900:1000"), (900, 1000), None),
             ("latency", dict(output_len="4"), None, (4, 4)),
             ("latency", dict(input_len="1000"), (1000, 1000), None), ("throughput", {}, None, None)]
    for workload, given, want_in, want_out in cases:
        prompts = dict(num_prompts=2) if workload == "throughput" else {}
        p = bench.plan(bench.BenchArgs(workload=workload, engine=cpu, **prompts, **given))
        assert p.input_range[1] + p.output_range[1] <= ctx, (workload, given, p.input_range, p.output_range)
        assert want_in is None or p.input_range == want_in, (given, p.input_range)
        assert want_out is None or p.output_range == want_out, (given, p.output_range)
        assert min(p.input_range + p.output_range) >= 1
    with pytest.raises(ValueError, match="leaves 2 output tokens"):
        bench.plan(bench.BenchArgs(workload="latency", engine=cpu, input_len="1022"))
    with pytest.raises(ValueError, match="exceeds the context"):
        bench.plan(bench.BenchArgs(workload="throughput", engine=cpu, input_len="900:1000", output_len="100:200"))


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (from /proc)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parents[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    below, todo = [], [pid]
    while todo:
        top = todo.pop()
        kids = [p for p, parent in parents.items() if parent == top]
        below += kids
        todo += kids
    return below


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc for the server's processes")
@pytest.mark.parametrize("when, sig", [("starting", "SIGTERM"), ("started", "SIGTERM"), ("started", "SIGHUP"),
                                       ("started", "SIGKILL")])
def test_sigterm_to_the_bench_stops_the_server_it_started(when, sig):
    """SIGTERM to the bench alone (`kill PID`), or SIGHUP (its terminal closed), while its server
    starts (the server process alone), or once the server's engine process runs too: the bench
    exits 128 + the signal and every process under it ends. SIGKILL, which the bench cannot see:
    the server and its engine end all the same."""
    import signal
    import time

    sig = getattr(signal, sig)

    proc = subprocess.Popen([sys.executable, "-m", "flexsgl", *BASE, "--workload", "serve", "--num-prompts", "50"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(below := _descendants(proc.pid)) < (1 if when == "starting" else 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.02)
        proc.send_signal(sig)
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), err[-2000:]
        deadline = time.monotonic() + 30
        while (left := [p for p in below if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"processes {left} outlived the bench"
    finally:
        for p in _descendants(proc.pid) + [proc.pid]:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
