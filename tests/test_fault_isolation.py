"""A fault ends only the requests it concerns, and the engine goes on serving.

Faults are injected into the real step (building the batch, the forward pass, sampling, reading
tokens back, detokenizing) or come from on_token callbacks. Every test compares the requests the
fault did not concern, and whatever the others produced before it, with the same requests run
alone on a separate engine, and checks that no page leaked.
"""

import os
import random
import signal

import pytest
import torch

import flexsgl.runner
from flexsgl import LLM, SamplingParams
from flexsgl.errors import EngineDeadError
from tests.test_engine import assert_no_page_leak


def small_engine() -> LLM:
    """A small KV cache and few slots, so requests wait, share pages and get preempted."""
    return LLM("tiny", device="cpu", page_size=4, max_total_tokens=96, max_running_requests=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def solo():
    """Runs each request alone, on its own engine; results are kept by (prompt, params)."""
    engine, seen = LLM("tiny", device="cpu", page_size=4, max_running_requests=1), {}

    def run(prompt, sp):
        key = (tuple(prompt), sp)
        if key not in seen:
            seen[key] = engine.generate([prompt], sp)[0].token_ids
        return seen[key]
    return run


@pytest.fixture
def llm():
    return small_engine()


def workload(rng: random.Random, n: int = 5):
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(3, 17))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randrange(3, 7), temperature=rng.choice([0.0, 0.8]),
                             seed=rng.randrange(1 << 30)) for _ in range(n)]
    return prompts, params


def assert_engine_serves(llm, solo, rng, note):
    """At rest: no page leaked, nothing live; and a fresh request still matches its solo run."""
    assert not llm.has_unfinished and not llm._live, note
    assert_no_page_leak(llm)
    prompt = [rng.randrange(512) for _ in range(rng.randrange(3, 17))]
    sp = SamplingParams(max_new_tokens=4, temperature=0.8, seed=rng.randrange(1 << 30))
    assert llm.generate([prompt], sp)[0].token_ids == solo(prompt, sp), note


class Injector:
    """Raises `error` inside the `phase` step number `at` (counted from 1) at `where`; records which
    requests that step held."""

    def __init__(self, llm, monkeypatch, where: str, phase: str, at: int, error: Exception):
        self.where, self.phase, self.at, self.error = where, phase, at, error
        self.count, self.armed, self.failed = 0, False, None
        real_plan, real_run = llm.runner.plan, llm.runner.run

        def plan(batch):  # every step is planned once, first (the step loop hands the plan to run)
            if batch.mode == self.phase:
                self.count += 1
                if self.count == self.at:
                    self.armed, self.failed = True, [r.request_id for r in batch.requests]
            if self.armed and where == "build":  # building a step starts with its plan
                self.fire()
            return real_plan(batch)

        def run(batch, plan=None):
            out = real_run(batch, plan)
            if self.armed and where == "readback":
                real_tokens, self.armed = out.tokens, False
                out.tokens = lambda: (real_tokens(), self.fire())[1]
            return out

        monkeypatch.setattr(llm.runner, "plan", plan)
        monkeypatch.setattr(llm.runner, "run", run)
        if where == "forward":
            monkeypatch.setattr(llm.runner, "_prefill", self.wrap(llm.runner._prefill))
            monkeypatch.setattr(llm.runner, "_decode", self.wrap(llm.runner._decode))
        elif where == "sample":
            monkeypatch.setattr(flexsgl.runner, "sample", self.wrap(flexsgl.runner.sample))

    def fire(self):
        self.armed = False
        raise self.error

    def wrap(self, fn):
        def wrapped(*args, **kwargs):
            if self.armed:
                self.fire()
            return fn(*args, **kwargs)
        return wrapped


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("where", ["build", "forward", "sample", "readback"])
def test_failed_step_ends_its_requests_only(llm, solo, monkeypatch, where, phase):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts, params = workload(rng)
    inject = Injector(llm, monkeypatch, where, phase, at=rng.randrange(1, 3), error=OverflowError("injected fault"))
    outs = llm.generate(prompts, params)
    note = f"seed={seed}, failed={inject.failed}"
    assert inject.failed, note
    for p, sp, out in zip(prompts, params, outs):
        ref = solo(p, sp)
        if out.request_id in inject.failed:
            assert out.finish_reason == "error" and "OverflowError: injected fault" in out.error, note
            assert out.error.endswith(".") and "\n" not in out.error, note
            # What it produced before the fault is right; the failed step would have added to it.
            assert out.token_ids == ref[:len(out.token_ids)] and len(out.token_ids) < len(ref), note
        else:
            assert out.finish_reason == "length" and out.token_ids == ref, note
    stats = llm.stats()
    assert stats["finished_error"] == len(inject.failed), (note, stats)
    assert stats["finished_error"] + stats["finished_length"] == len(prompts), (note, stats)
    monkeypatch.undo()
    # The failed requests again: pages their failed step did not fill must not have reached the cache.
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == [solo(p, sp) for p, sp in zip(prompts, params)], note
    assert_engine_serves(llm, solo, rng, note)


def test_parameters_that_overflow_at_upload_fail_their_step_not_the_engine(llm, solo):
    """The hardening issue's top_k=2**64, which validation now refuses, forced past it: the step
    that uploads it raises OverflowError, and only that step's request ends."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    bad = SamplingParams(max_new_tokens=4)
    object.__setattr__(bad, "top_k", 2**64)
    out = llm.generate("Return the", bad)[0]
    assert out.finish_reason == "error" and "OverflowError" in out.error and not out.token_ids, f"seed={seed}"
    assert_engine_serves(llm, solo, rng, f"seed={seed}")


@pytest.mark.parametrize("kind", ["first", "any"])
def test_callback_that_raises_ends_its_own_request(llm, solo, kind):
    """The issue's case: the callback of the first request of a decode step raises; and any request's."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts, params = workload(rng)
    victim = 0 if kind == "first" else rng.randrange(len(prompts))
    at = rng.randrange(2 if kind == "first" else 1, params[victim].max_new_tokens + 1)  # 2+: a decode step
    calls = []

    def on_token(req):
        calls.append(req.request_id)
        if req.sampling is params[victim] and len(req.output_ids) == at:
            raise ZeroDivisionError("callback fault")

    outs = llm.generate(prompts, params, on_token=on_token)
    note = f"seed={seed}, victim={victim}, at={at}"
    for i, (p, sp, out) in enumerate(zip(prompts, params, outs)):
        ref = solo(p, sp)
        if i == victim:
            assert out.finish_reason == "error" and "ZeroDivisionError: callback fault" in out.error, note
            assert out.token_ids == ref[:at], note
        else:
            assert out.finish_reason == "length" and out.token_ids == ref, note
        assert calls.count(out.request_id) == len(out.token_ids), note  # one call per token, none after
    assert_engine_serves(llm, solo, rng, note)


def test_keyboard_interrupt_from_callback_aborts_the_call_and_spares_other_requests(llm, solo):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts, params = workload(rng)
    other_prompt, other_sp = prompts.pop(), params.pop()
    other = llm.add_request(other_prompt, other_sp)  # another client's request, not part of the call
    at = rng.randrange(1, 3)

    def on_token(req):
        if len(req.output_ids) == at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, on_token=on_token)
    note = f"seed={seed}, at={at}"
    assert set(llm._live) <= {other}, note  # the call's requests are gone
    outs = {}
    while llm.has_unfinished:
        outs.update((o.request_id, o) for o in llm.step())
    assert list(outs) == [other] and outs[other].token_ids == solo(other_prompt, other_sp), note
    assert llm.stats()["finished_abort"] == len(prompts), note
    assert_engine_serves(llm, solo, rng, note)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_ctrl_c_during_a_step_is_held_until_the_step_is_complete(llm, solo, monkeypatch, phase):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts, params = workload(rng)
    name = "_prefill" if phase == "prefill" else "_decode"
    real, completed = getattr(llm.runner, name), []

    def forward(fb):
        if not completed:
            os.kill(os.getpid(), signal.SIGINT)  # arrives at the next bytecode: inside the step
            out = real(fb)
            completed.append(True)
            return out
        return real(fb)

    monkeypatch.setattr(llm.runner, name, forward)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    note = f"seed={seed}"
    assert completed and not llm._live, note
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, note
    while llm.has_unfinished:
        assert not llm.step(), note  # only the step in flight is left, and its requests were aborted
    monkeypatch.undo()
    assert_engine_serves(llm, solo, rng, note)


def test_second_ctrl_c_breaks_the_step_off_and_the_engine_says_it_is_dead(llm, monkeypatch):
    real = llm.runner._decode

    def forward(fb):
        os.kill(os.getpid(), signal.SIGINT)  # held back
        os.kill(os.getpid(), signal.SIGINT)  # not held back: raised here, half-way through the step
        return real(fb)

    monkeypatch.setattr(llm.runner, "_decode", forward)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(EngineDeadError, match="half-way"):
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))


def test_ctrl_c_during_step_keeps_the_steps_outputs_for_the_next(llm, solo, monkeypatch):
    """With add_request and step: the interrupted step raises, and what finished in it comes back
    from the next step, each request exactly once."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts, params = workload(rng)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    real, steps = llm.runner.run, []

    def run(batch, plan=None):
        steps.append(batch.mode)
        if len(steps) % 3 == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return real(batch, plan)

    monkeypatch.setattr(llm.runner, "run", run)
    outs, interrupts = [], 0
    while llm.has_unfinished:
        try:
            outs += llm.step()
        except KeyboardInterrupt:
            interrupts += 1
    note = f"seed={seed}, steps={steps}"
    assert interrupts == len(steps) // 3 > 0, note
    assert sorted(o.request_id for o in outs) == ids, note
    for p, sp, out in zip(prompts, params, sorted(outs, key=lambda o: o.request_id)):
        assert out.finish_reason == "length" and out.token_ids == solo(p, sp), note
    monkeypatch.undo()
    assert_engine_serves(llm, solo, rng, note)


def test_failed_detokenization_reports_error_with_the_tokens(llm, solo, monkeypatch):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts, params = workload(rng, n=3)

    def decode(ids, skip_special_tokens=True):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(llm.tokenizer, "decode", decode)
    outs = llm.generate(prompts, params)
    for p, sp, out in zip(prompts, params, outs):
        assert out.finish_reason == "error" and "Detokenizing" in out.error and out.text is None, f"seed={seed}"
        assert out.token_ids == solo(p, sp), f"seed={seed}"
    monkeypatch.undo()
    assert_engine_serves(llm, solo, rng, f"seed={seed}")


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be reported later"),
    torch.AcceleratorError("CUDA error: unspecified launch failure"),
], ids=["cuda-error", "accelerator-error"])
def test_device_fault_kills_the_engine_and_every_later_call_fails_fast(llm, monkeypatch, error):
    inject = Injector(llm, monkeypatch, "forward", "decode", at=1, error=error)
    with pytest.raises(EngineDeadError) as e:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4))
    reason = str(e.value)
    assert inject.failed and error.args[0].splitlines()[0].rstrip(".") in reason and "\n" not in reason
    monkeypatch.setattr(llm.runner, "run", lambda batch, plan=None: pytest.fail("a dead engine ran a step"))
    for call in (lambda: llm.generate([[1, 2]]), lambda: llm.add_request([1, 2]), llm.step, lambda: llm.abort(0)):
        with pytest.raises(EngineDeadError) as again:
            call()
        assert str(again.value) == reason


def test_out_of_memory_fails_the_step_not_the_engine(llm, solo, monkeypatch):
    """A CUDA out-of-memory error leaves the device usable: it is a per-request fault."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    inject = Injector(llm, monkeypatch, "forward", "prefill", at=1, error=oom)
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert inject.failed and outs[0].finish_reason == "error" and "OutOfMemoryError" in outs[0].error
    monkeypatch.undo()
    assert_engine_serves(llm, solo, rng, f"seed={seed}")
