"""Fuzz one engine with a small KV cache: random prompts, sampling parameters (structured outputs
among them) and callbacks (some raising, some interrupting), bad input, aborts and injected step
faults, in random order.

After every call the engine must be at rest with no page leaked and must still produce, for a
fixed pair of requests, the tokens they get alone on a fresh engine. Every output must be what
its parameters allow, and its tokens a prefix of those the same request gets alone on another
engine (all of them, unless it was aborted or failed). The seed is printed on failure; set
FLEXSGL_FUZZ_SEED to rerun one (shrinking is off: it would replay on the engine the run left).
"""

import dataclasses
import os
import random
import re

import hypothesis
import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import flexsgl.runner
from flexsgl import LLM, SamplingParams
from flexsgl.errors import InputError
from tests.test_engine import assert_no_page_leak

VOCAB = 512  # the tiny preset's (byte tokenizer)
CHOICES = ("ab", "cd", "abc")
CONSTRAINTS = ({"choice": list(CHOICES)}, {"regex": "[a-c]{1,4}"})
FIXED = ([[3, 14, 15, 92, 65, 35], [2, 71, 82]],
         [SamplingParams(max_new_tokens=3, temperature=0), SamplingParams(max_new_tokens=3, temperature=0.9, seed=7)])


def engine() -> LLM:
    # 12 pages of 4 tokens: requests wait, share pages, get preempted, and some are refused.
    return LLM("tiny", device="cpu", page_size=4, max_total_tokens=48, max_running_requests=4, max_num_batched_tokens=24)


sampling_params = st.builds(
    SamplingParams, max_new_tokens=st.integers(1, 6),
    temperature=st.sampled_from([0.0, 1e-30, 0.6, 1.0, 1.7]), top_k=st.sampled_from([0, 1, 4, 600, 2**40]),
    top_p=st.sampled_from([1.0, 0.9, 0.3, 1e-9]), min_p=st.sampled_from([0.0, 0.05, 0.5]),
    seed=st.integers(0, 2**63 - 1),  # always given, so that a hypothesis seed replays a run exactly
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3) | st.lists(st.integers(0, VOCAB - 1), min_size=40,
                                                                              max_size=120),
    ignore_eos=st.booleans(), structured_outputs=st.sampled_from([None, None, *CONSTRAINTS]))
prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=44) | st.text(min_size=1, max_size=12)
# None, or (what the callback does, at which output token): "raise" an error, or "interrupt" (KeyboardInterrupt).
callbacks = st.none() | st.tuples(st.sampled_from(["raise", "interrupt"]), st.integers(1, 6))
requests = st.lists(st.tuples(prompts, sampling_params, callbacks), min_size=1, max_size=4)
bad_sampling = st.sampled_from([
    {"top_k": 2**64}, {"temperature": "0.5"}, {"temperature": -1.0}, {"stop_token_ids": 5}, {"stop_token_ids": "abc"},
    {"stop_token_ids": (None,)}, {"stop_token_ids": (-1,)}, {"max_new_tokens": 0}, {"top_p": 0.0}, {"seed": -3},
    {"min_p": float("nan")}, {"ignore_eos": "yes"}])
bad_prompts = st.sampled_from([b"abc", "", [], [1.5, 2.0], [[1, None]], "a\udcffb", [VOCAB], [-1], [[1] * 5000],
                               {"prompt": "x"}, None])


class CallbackFault(Exception):
    pass


class EngineFuzz(RuleBasedStateMachine):
    llm: LLM
    reference: list[list[int]]
    alone: LLM  # runs each request by itself, for the tokens every output must be a prefix of
    alone_tokens: dict = {}
    fault: dict | None = None  # an armed step fault: {"where", "at" (steps left), "failed" (request ids), "batch"}

    def make_callback(self, spec):
        if spec is None:
            return None
        action, at = spec

        def on_token(req):
            if len(req.output_ids) == at:
                self.fired.append((req.request_id, action))
                raise CallbackFault("fuzz") if action == "raise" else KeyboardInterrupt
        return on_token

    def solo(self, prompt, sp) -> list[int]:
        key = (prompt if isinstance(prompt, str) else tuple(prompt), sp)
        if key not in self.alone_tokens:
            self.alone_tokens[key] = self.alone.generate([prompt], sp)[0].token_ids
        return self.alone_tokens[key]

    def check_outputs(self, outs, specs, aborted=()):
        for out, (prompt, sp, cb) in zip(outs, specs):
            note = f"request {out.request_id}: {out}"
            n = len(out.token_ids)
            # a grammar that allows no token leaves its row's logits all masked: the token sampled there, which
            # the output reports and the grammar refuses, depends on the batch, and is left out of the comparison
            same = n - ("allows no token" in (out.error or ""))
            if out.finish_reason != "refused":  # what it produced is what it produces alone, so far
                assert out.token_ids[:same] == self.solo(prompt, sp)[:same], f"{note}, alone: {self.solo(prompt, sp)}"
            stops = set(sp.stop_token_ids)
            assert n <= sp.max_new_tokens and all(0 <= t < VOCAB for t in out.token_ids), note
            assert not stops & set(out.token_ids[:-1]), note  # nothing after a stop token
            failed = EngineFuzz.fault is not None and out.request_id in EngineFuzz.fault["failed"]
            if sp.structured_outputs is not None and out.finish_reason != "refused":
                check_constrained(out, sp, stops, note)
            if out.finish_reason == "length":
                assert n == sp.max_new_tokens and not out.error, note
            elif out.finish_reason == "stop":  # a stop token, or (constrained) a grammar complete without one
                assert out.token_ids[-1] in stops or sp.structured_outputs is not None, note
                assert not out.error, note
            elif out.finish_reason == "refused":
                assert n == 0 and "refused" in out.error, note
            elif out.finish_reason == "abort":
                assert out.request_id in aborted, note
            else:
                assert out.finish_reason == "error", note
                assert out.error.endswith(".") and "\n" not in out.error, note
                if "CallbackFault" in out.error:
                    assert cb is not None and cb[0] == "raise" and n == cb[1], note
                elif "allows no token" in out.error:  # its stop tokens took every token its grammar needed
                    assert sp.structured_outputs is not None, note
                else:
                    assert failed and "injected" in out.error, note
            handed = n - ("allows no token" in (out.error or ""))  # a token its grammar refuses reaches no callback
            if (cb is not None and cb[0] == "raise" and handed >= cb[1]) != ("CallbackFault" in (out.error or "")):
                raise AssertionError(f"the callback raised at token {cb[1]}, the output disagrees: {note}")

    @rule(reqs=requests)
    def generate(self, reqs):
        self.fired = []
        reqs = [(p, dataclasses.replace(sp), cb) for p, sp, cb in reqs]  # one params object per request
        by_params = {id(sp): self.make_callback(cb) for _, sp, cb in reqs}

        def on_token(req):  # generate takes one callback: each request's own, found by its params
            if by_params[id(req.sampling)] is not None:
                by_params[id(req.sampling)](req)
        try:
            outs = self.llm.generate([p for p, _, _ in reqs], [sp for _, sp, _ in reqs], on_token=on_token)
        except KeyboardInterrupt:
            assert any(action == "interrupt" for _, action in self.fired), self.fired
            self.settle()
            return
        assert not any(action == "interrupt" for _, action in self.fired), self.fired
        self.check_outputs(outs, reqs)

    @rule(reqs=requests, steps=st.integers(0, 8), abort=st.lists(st.integers(0, 3), max_size=3))
    def stream_and_abort(self, reqs, steps, abort):
        """add_request and step, as a server would, aborting some requests part-way."""
        self.fired = []
        ids = [self.llm.add_request(p, sp, on_token=self.make_callback(cb)) for p, sp, cb in reqs]
        outs = {}

        def step():
            fired = len(self.fired)
            try:
                outs.update((o.request_id, o) for o in self.llm.step())
            except KeyboardInterrupt:  # a callback's: the step completed, its outputs come next time
                assert any(action == "interrupt" for _, action in self.fired[fired:]), self.fired
            else:
                assert not any(action == "interrupt" for _, action in self.fired[fired:]), self.fired
        for _ in range(steps):
            step()
        aborted = {ids[i] for i in abort if i < len(ids)}
        for i in aborted:
            self.llm.abort(i)
        while self.llm.has_unfinished:
            step()
        assert sorted(outs) == ids, (sorted(outs), ids)
        self.check_outputs([outs[i] for i in ids], reqs, aborted)

    @rule(where=st.sampled_from(["build", "forward", "sample", "readback"]), at=st.integers(1, 4), reqs=requests)
    def step_fault(self, where, at, reqs):
        """A step fails at `where`, `at` steps from now; then the same requests run again (the failed
        step's pages must not have reached the prefix cache)."""
        reqs = [(p, sp, None) for p, sp, _ in reqs]
        EngineFuzz.fault = {"where": where, "at": at, "failed": [], "batch": None}  # read by install_fault_injection's wrappers
        try:
            self.generate(reqs)
        finally:
            EngineFuzz.fault = None
        self.generate(reqs)

    @rule(sampling=bad_sampling)
    def bad_sampling_params(self, sampling):
        try:
            SamplingParams(**sampling)
        except InputError as e:
            assert str(e).endswith(".") and "\n" not in str(e) and next(iter(sampling)) in str(e), str(e)
        else:
            raise AssertionError(f"SamplingParams(**{sampling}) was accepted")

    @rule(prompt=bad_prompts)
    def bad_prompt(self, prompt):
        try:
            self.llm.generate(prompt, SamplingParams(max_new_tokens=2))
        except InputError as e:
            assert str(e).endswith(".") and "\n" not in str(e), str(e)
        else:
            raise AssertionError(f"prompt {prompt!r} was accepted")

    def settle(self):
        """Run what is left in flight after an interrupted call (its requests were aborted)."""
        while self.llm.has_unfinished:
            assert not self.llm.step()

    @invariant()
    def serves_like_a_fresh_engine(self):
        assert not self.llm.has_unfinished and not self.llm._live
        assert_no_page_leak(self.llm)
        got = [o.token_ids for o in self.llm.generate(*FIXED)]
        assert got == self.reference, f"fixed requests: {got} != {self.reference} (alone on a fresh engine)"


def check_constrained(out, sp, stops: set[int], note: str) -> None:
    """A constrained output's text follows its constraint: whole where the grammar ended it ("stop"
    on no stop token), a prefix of what it allows otherwise (a stop token the grammar allowed may end
    it first, or complete it: the text before that token is a prefix either way)."""
    ends_on_its_last = out.token_ids and (out.token_ids[-1] in stops or "allows no token" in (out.error or ""))
    ids = out.token_ids[:-1] if ends_on_its_last else out.token_ids
    assert all(t < 256 for t in ids), note  # the byte tokenizer's grammar vocabulary
    text = bytes(ids).decode("latin-1")
    whole = out.finish_reason == "stop" and not ends_on_its_last
    if sp.structured_outputs.choice is not None:
        assert text in CHOICES if whole else any(c.startswith(text) for c in CHOICES), note
    else:
        assert re.fullmatch("[a-c]{1,4}" if whole else "[a-c]{0,4}", text), note


def install_fault_injection(llm: LLM) -> None:
    """Wrap the step's parts so that EngineFuzz.fault, when armed, raises in the step it names: the
    step whose plan counts `at` down to 0 (every step is planned once, first; the step after a
    constrained one is planned before the constrained one samples, so the fault follows its batch)."""
    runner = llm.runner
    current = [None]  # the batch whose forward pass or sampling runs now

    def armed(where, batch=None):
        f = EngineFuzz.fault
        return (f is not None and f["where"] == where and f["at"] == 0
                and (batch is None or batch is f["batch"]))

    def fire():
        EngineFuzz.fault["at"] = -1
        raise RuntimeError("injected step fault")

    real_plan, real_run, real_run_forward, real_sample = runner.plan, runner.run, runner.run_forward, runner.sample

    def plan(batch):
        f = EngineFuzz.fault
        if f is not None and f["at"] > 0:
            f["at"] -= 1
            if f["at"] == 0:
                f["failed"], f["batch"] = [r.request_id for r in batch.requests], batch
        if armed("build", batch):  # building a step starts with its plan
            fire()
        return real_plan(batch)

    def read_back_fails(batch, out):
        if armed("readback", batch):  # this step's tokens, when the next step reads them back
            EngineFuzz.fault["at"] = -1
            real_tokens = out.tokens
            out.tokens = lambda: (real_tokens(), fire())[1]
        return out

    def run(batch, plan=None):
        current[0] = batch
        return read_back_fails(batch, real_run(batch, plan))

    def run_forward(batch, plan=None):
        current[0] = batch
        return real_run_forward(batch, plan)

    def sample(deferred, mask):
        current[0] = deferred.batch
        return read_back_fails(deferred.batch, real_sample(deferred, mask))

    def wrap(where, fn):
        def wrapped(*args, **kwargs):
            if armed(where, current[0]):
                fire()
            return fn(*args, **kwargs)
        return wrapped

    runner.plan, runner.run, runner.run_forward, runner.sample = plan, run, run_forward, sample
    runner._prefill = wrap("forward", runner._prefill)
    runner._decode = wrap("forward", runner._decode)
    flexsgl.runner.sample = wrap("sample", flexsgl.runner.sample)


def test_fuzz_one_engine(monkeypatch):
    seed = int(os.environ.get("FLEXSGL_FUZZ_SEED", random.randrange(1 << 32)))
    EngineFuzz.alone = LLM("tiny", device="cpu", page_size=4, max_running_requests=1)
    EngineFuzz.alone_tokens = {}
    fresh = engine()
    EngineFuzz.reference = [fresh.generate([p], sp)[0].token_ids for p, sp in zip(*FIXED)]  # each alone
    EngineFuzz.llm = llm = engine()
    monkeypatch.setattr(flexsgl.runner, "sample", flexsgl.runner.sample)  # restored after the test
    install_fault_injection(llm)
    try:
        run_state_machine_as_test(hypothesis.seed(seed)(EngineFuzz), settings=settings(
            max_examples=8, stateful_step_count=8, deadline=None, database=None, print_blob=True,
            phases=[Phase.explicit, Phase.generate],  # shrinking replays on the one engine: minutes
            suppress_health_check=list(HealthCheck)))
    except BaseException as e:
        e.add_note(f"fuzz seed {seed}: rerun with FLEXSGL_FUZZ_SEED={seed}")
        raise
