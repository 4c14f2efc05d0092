"""The `flexsgl` command line, run as a subprocess on the tiny preset (byte tokenizer, CPU).

All runs start at once in one module fixture, so their interpreter start-ups overlap.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flexsgl import LLM, SamplingParams

BASE = ["generate", "--device", "cpu", "--model", "tiny"]
BAD = {
    "unknown-model": ["Hello", "--model", "no-such-model"],
    "empty-prompt": [""],
    "negative-temperature": ["Hello", "--temperature", "-1"],
    "top-p-0": ["Hello", "--top-p", "0"],
    "max-new-tokens-0": ["Hello", "--max-new-tokens", "0"],
    "unknown-override": ["Hello", "--override", "nope"],
    "prompt-too-long": ["x" * 5000],
    "prompt-plus-output-too-long": ["Hello", "--max-new-tokens", "5000"],
    "no-prompt": [],
    "unknown-device": ["Hello", "--device", "tpu"],
    "kv-cache-beyond-memory": ["Hello", "--max-total-tokens", "99999999999"],
    "kv-cache-below-a-page": ["Hello", "--max-total-tokens", "10"],
    "unknown-log-level": ["Hello", "--log-level", "loud"],
    "bad-graph-sizes": ["Hello", "--cuda-graph-bs", "1,x"],
    "old-and-new-flag": ["Hello", "--kv-cache-tokens", "4096", "--max-total-tokens", "8192"],
    "non-utf8-prompt": [os.fsdecode(b"\xff\xfe abc")],  # argv bytes that are not UTF-8
    "top-k-2**64": ["Hello", "--top-k", str(2**64)],
    "tp-heads-do-not-split": ["Hello", "--tp", "3"],
    "tp-size-0": ["Hello", "--tp-size", "0"],
    "n-0": ["Hello", "--n", "0"],
}
# Refused once the model has loaded: what needs its tokenizer, or the memory left after its weights.
# Every other refusal comes before the model loads.
AFTER_LOADING = ("prompt-too-long", "prompt-plus-output-too-long", "kv-cache-beyond-memory")
GOOD = {
    "json": ["Hello", "--max-new-tokens", "4", "--json"],
    "stream": ["Hello", "--max-new-tokens", "4"],
    "two-prompts": ["Hello", "Hi", "--max-new-tokens", "3"],
    "deprecated-flag": ["Hello", "--max-new-tokens", "4", "--json", "--kv-cache-tokens", "4096"],
    "tp-2": ["Hello", "--max-new-tokens", "4", "--json", "--tp", "2"],
    "n-samples": ["Hello", "Hi", "--n", "2", "--max-new-tokens", "3", "--temperature", "0.8", "--seed", "5", "--json"],
}


@pytest.fixture(scope="module")
def runs():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen([sys.executable, "-m", "flexsgl.cli", *BASE, *args], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, args in {**BAD, **GOOD}.items()}
    results = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return results


def test_json_output(runs):
    r = runs["json"]
    assert r.returncode == 0, r.stderr
    [out] = json.loads(r.stdout)
    assert len(out["token_ids"]) == 4, out
    assert out["prompt_tokens"] == 5 and out["finish_reason"] == "length", out
    # The same greedy run through the Python API gives the same tokens.
    api = LLM("tiny", device="cpu").generate(["Hello"], SamplingParams(max_new_tokens=4, temperature=0))[0]
    assert api.token_ids == out["token_ids"]
    assert api.text == out["text"]


def test_stream_prints_prompt_then_the_token_ids_of_dummy_weights(runs):
    """tiny has dummy weights and a byte tokenizer (ids of 256 and up are no byte): the stream shows
    its token ids after the prompt, and the log says why."""
    r, ids = runs["stream"], json.loads(runs["json"].stdout)[0]["token_ids"]
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hello" + "".join(f" {t}" for t in ids) + "\n", r.stdout
    note = "[flexsgl] tiny has dummy (random) weights and a byte tokenizer, which give no readable text: its token " \
           "ids are shown instead"
    assert note in r.stderr.splitlines(), r.stderr


def test_several_prompts_print_each_with_its_token_ids(runs):
    r = runs["two-prompts"]
    assert r.returncode == 0, r.stderr
    api = LLM("tiny", device="cpu").generate(["Hello", "Hi"], SamplingParams(max_new_tokens=3, temperature=0))
    want = "".join(f"{p} {' '.join(map(str, o.token_ids))}\n---\n" for p, o in zip(["Hello", "Hi"], api))
    assert r.stdout == want, r.stdout


def test_n_samples_of_each_prompt_come_in_a_row(runs):
    r = runs["n-samples"]
    assert r.returncode == 0, r.stderr
    got = [(o["prompt"], o["index"], o["token_ids"]) for o in json.loads(r.stdout)]
    api = LLM("tiny", device="cpu").generate(["Hello", "Hi"], SamplingParams(max_new_tokens=3, temperature=0.8,
                                                                             seed=5, n=2))
    assert got == [(p, o.index, o.token_ids) for p, o in zip(["Hello", "Hello", "Hi", "Hi"], api)]
    assert [i for _, i, _ in got] == [0, 1, 0, 1]


def test_deprecated_flag_warns_and_still_works(runs):
    r = runs["deprecated-flag"]
    assert r.returncode == 0, r.stderr
    assert "warning: --kv-cache-tokens is deprecated; use --max-total-tokens." in r.stderr.splitlines()
    assert json.loads(r.stdout)[0]["token_ids"] == json.loads(runs["json"].stdout)[0]["token_ids"]


def test_two_tensor_parallel_ranks_give_the_same_tokens(runs):
    r = runs["tp-2"]
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["token_ids"] == json.loads(runs["json"].stdout)[0]["token_ids"]
    assert "2 tensor-parallel ranks" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("name", BAD)
def test_bad_input_exits_2_with_one_error_line(runs, name):
    r = runs[name]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and len(errors[0]) > len("error: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    loaded = any(line.startswith("[flexsgl] loading ") for line in r.stderr.splitlines())
    assert loaded == (name in AFTER_LOADING), r.stderr


@pytest.mark.parametrize("name, error", [
    ("empty-prompt", "error: Prompt 0 is empty."),
    ("kv-cache-below-a-page", "error: The KV cache must hold at least one page (64 tokens); it would hold 10."),
])
def test_refused_before_loading_with_the_reason(runs, name, error):
    assert error in runs[name].stderr.splitlines(), runs[name].stderr


def test_stream_reports_startup_and_first_token(runs):
    err = runs["stream"].stderr
    assert any(line.startswith("[flexsgl] ready in ") and "s after start (imports " in line and ", weights " in line
               and ", tokenizer " in line and ", KV pool " in line and ", other " in line for line in err.splitlines()), err
    # One prompt: one running request, its 4,096-token context in 64 pages, and as many again.
    assert "[flexsgl] KV cache: 128 pages of 64 tokens (what 1 running request at the model's 4,096-token " \
           "context fills, and as much again for the prefix cache)" in err.splitlines(), err
    assert any(line.startswith("[flexsgl] first token ") for line in err.splitlines()), err


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc to see torch loading")
@pytest.mark.parametrize("entry", [["-m", "flexsgl"], ["-c", "import sys; sys.argv[0] = 'flexsgl'; "
                                                           "from flexsgl.cli import app; app()"]],
                         ids=["python -m flexsgl", "the flexsgl script"])
def test_ctrl_c_while_torch_imports_ends_with_130_and_no_traceback(entry):
    """A Ctrl-C in the seconds torch takes to import ended the command line with a traceback from
    inside the import; it ends it with status 130 and nothing printed. The interrupt is sent once
    torch's library is mapped into the process, so it lands in the import."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, *entry, "generate", "Return the"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        try:
            if "libtorch" in Path(f"/proc/{p.pid}/maps").read_text():
                break
        except OSError:
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGINT)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 130 and "Traceback" not in out, (p.returncode, out[-2000:])


def test_ctrl_c_while_streaming_ends_the_line_and_exits_130():
    """Ctrl-C in the middle of a streamed output: the line is ended, status 130, no traceback."""
    import signal

    p = subprocess.Popen([sys.executable, "-m", "flexsgl", "generate", "Return the", "--max-new-tokens", "1000",
                          "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        shown = b""
        while len(shown) < len("Return the") + 20:  # the prompt and some of the output
            chunk = p.stdout.read1(4096)
            assert chunk, p.stderr.read().decode()[-2000:]
            shown += chunk
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and b"Traceback" not in err, (p.returncode, err[-2000:])
    assert (shown + out).endswith(b"\n"), (shown + out)[-200:]


def test_cache_shows_and_clears_the_compile_cache(tmp_path):
    """A TORCHINDUCTOR_CACHE_DIR of the user's: what torch.compile keeps there goes, the rest stays
    (the whole directory went, another project's files with it)."""
    where = tmp_path / "inductor"
    for entry in ("fxgraph", "c4"):
        (where / entry).mkdir(parents=True)
        (where / entry / "entry").write_bytes(os.urandom(1_000_000))
    (where / "other_project").mkdir()
    (where / "other_project" / "keep.txt").write_text("mine")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(where)}
    show = subprocess.run([sys.executable, "-m", "flexsgl.cli", "cache"], env=env, text=True, capture_output=True)
    assert show.returncode == 0 and show.stdout.startswith(f"{where} (2.0 MB)"), show
    cleared = subprocess.run([sys.executable, "-m", "flexsgl.cli", "cache", "--clear"], env=env, text=True,
                             capture_output=True)
    assert cleared.returncode == 0 and "2.0 MB" in cleared.stdout, cleared
    assert sorted(p.name for p in where.iterdir()) == ["other_project"] and (where / "other_project" / "keep.txt").exists()


def test_cache_defaults_under_the_user_cache_dir(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"XDG_CACHE_HOME": str(tmp_path)}
    show = subprocess.run([sys.executable, "-m", "flexsgl.cli", "cache"], env=env, text=True, capture_output=True)
    assert show.returncode == 0 and show.stdout.startswith(f"{tmp_path}/flexsgl/inductor (0.0 MB)"), show


@pytest.mark.parametrize("preset", [False, True])
def test_flash_kernel_cache_lives_in_the_compile_cache_unless_set(tmp_path, monkeypatch, preset):
    from flexsgl import compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for name in compile_cache.FLASH_ENV:
        monkeypatch.delenv(name, raising=False)
    if preset:
        monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    compile_cache.prepare()
    got = tuple(os.environ.get(name) for name in compile_cache.FLASH_ENV)
    assert got == (("0", None) if preset else ("1", str(tmp_path / "inductor" / "flash_attn_cute")))


@pytest.mark.parametrize("preset", [False, True])
def test_compile_cache_keys_carry_the_source_hash_unless_set(tmp_path, monkeypatch, preset):
    """torch.compile's cache keys are tagged with a hash of flexsgl's source, which changes with any
    source file, so one version's compiled graphs never serve another; a tag the user set stands."""
    import torch

    from flexsgl import compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    if preset:
        monkeypatch.setenv(compile_cache.TAG_ENV, "mine")
    else:
        monkeypatch.delenv(compile_cache.TAG_ENV, raising=False)
    # the config's own patch restores it: pytest 9.2's monkeypatch, undoing a setattr, deleted the entry
    with torch.compiler.config.patch(cache_key_tag="unset"):
        compile_cache.prepare()
        tag = torch.compiler.config.cache_key_tag
    assert tag == ("unset" if preset else f"flexsgl-{compile_cache.source_hash()}")
    # the hash follows the source: the same files hash the same, a changed one differently
    before = compile_cache.source_hash()
    compile_cache.source_hash.cache_clear()
    assert compile_cache.source_hash() == before
    edited = tmp_path / "flexsgl"
    shutil.copytree(Path(compile_cache.__file__).parent, edited, ignore=shutil.ignore_patterns("__pycache__"))
    (edited / "sampling" / "sampler.py").write_text((edited / "sampling" / "sampler.py").read_text() + "\n# edited\n")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(compile_cache.importlib.util, "find_spec", lambda name: types.SimpleNamespace(
        submodule_search_locations=[str(edited)]) if name == "flexsgl" else real_find_spec(name))
    compile_cache.source_hash.cache_clear()
    assert compile_cache.source_hash() != before
    compile_cache.source_hash.cache_clear()
