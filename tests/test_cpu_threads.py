"""torch's CPU threads are lowered to the cores the process may use, once, where an engine starts on
the CPU, unless the user chose the count."""

import pytest
import torch

from flexsgl import LLM, cpu_threads


@pytest.mark.parametrize("affinity, cpu_max, cores", [
    (8, None, 8),  # no cgroup quota file
    (8, "max 100000", 8),  # no quota
    (8, "250000 100000", 3),  # 2.5 CPUs of quota: 3 cores run its threads
    (2, "400000 100000", 2),  # the affinity is the smaller
    (8, "garbage", 8),
])
def test_usable_cores_are_the_affinity_capped_by_the_cgroup_quota(tmp_path, monkeypatch, affinity, cpu_max, cores):
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max + "\n")
    assert cpu_threads.usable_cores(str(path)) == cores


@pytest.fixture
def threads(monkeypatch):
    """torch's thread count as a plain value (the test process's own is left alone), 8 at import,
    on a machine of 3 usable cores, no thread variables set."""
    state = {"now": 8, "set": []}
    monkeypatch.setattr(cpu_threads, "_sized", False)
    monkeypatch.setattr(cpu_threads, "_threads_at_import", 8)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 3)
    monkeypatch.setattr(torch, "get_num_threads", lambda: state["now"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: state["set"].append(n))
    for name in cpu_threads.ENV:
        monkeypatch.delenv(name, raising=False)
    return state


@pytest.mark.parametrize("ranks, want", [(1, 3), (2, 1), (4, 1)])
def test_threads_are_lowered_to_the_usable_cores_once(threads, ranks, want):
    assert cpu_threads.size_cpu_threads(ranks) == want and threads["set"] == [want]
    assert cpu_threads.size_cpu_threads(ranks) is None and threads["set"] == [want]  # once per process


def test_fewer_threads_than_cores_are_kept(threads):
    threads["now"] = cpu_threads._threads_at_import = 2
    assert cpu_threads.size_cpu_threads() is None and threads["set"] == []


@pytest.mark.parametrize("variable", cpu_threads.ENV)
def test_a_thread_variable_the_user_set_is_kept(threads, monkeypatch, variable):
    monkeypatch.setenv(variable, "8")
    assert cpu_threads.size_cpu_threads() is None and threads["set"] == []


def test_a_count_the_user_set_after_import_is_kept(threads):
    threads["now"] = 6  # torch.set_num_threads(6) since flexsgl was imported
    assert cpu_threads.size_cpu_threads() is None and threads["set"] == []


def test_an_engine_on_the_cpu_sizes_the_threads(monkeypatch):
    import flexsgl.engine_core

    calls = []
    monkeypatch.setattr(flexsgl.engine_core, "size_cpu_threads", lambda ranks=1: calls.append(ranks))
    LLM("tiny", device="cpu", max_total_tokens=128)
    assert calls == [1]
