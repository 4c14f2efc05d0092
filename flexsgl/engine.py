"""LLM: the Python API. Owns the model, the KV pool, the scheduler and the runner.

Errors (flexsgl/errors.py has the types):

- Bad input raises a ValueError that says why in one sentence, before anything runs: malformed
  prompts (PromptError), sampling parameters of the wrong type or range (SamplingParamsError), a
  model directory that cannot be served (CheckpointError, from the constructor), an id that names
  no request (UnknownRequestError, from abort). The engine is untouched by them.
- A request that can never run here (longer than the context or the whole KV cache) is not an
  error of the call: it finishes at once with reason "refused" and the reason in `error`.
- Per-request faults are not raised either: the requests they concern finish with reason "error"
  and a one-sentence reason in `error`, their pages are released, and the engine goes on serving.
  A step that fails while it is built, run or sampled (any Python exception, a CUDA out-of-memory
  error) ends every request of that step, since it cannot tell which one caused it, after they
  receive the tokens of the step before it; the tokens it did not compute never reach the prefix
  cache. A step whose tokens cannot be read back ends its requests; a request whose logits are not
  finite (NaN or infinity: the step reads a flag per row back with the tokens) ends, its pages kept
  out of the prefix cache; an on_token callback that raises ends its own request; an
  output that cannot be detokenized is reported as "error" with its token ids intact.
- KeyboardInterrupt: Ctrl-C during a step is held back until the step is complete (a second
  Ctrl-C is not). `generate` then aborts its own requests and re-raises it; `step` raises it with
  the requests that finished in that step kept for the next `step`. A callback that raises
  KeyboardInterrupt (or SystemExit) is treated the same way.
- Fatal errors raise EngineDeadError (a RuntimeError), and every later call raises it again at
  once with the same reason: a fault of the device itself (torch's AcceleratorError, a
  "CUDA error", or a device that fails to synchronise after an error), since a CUDA context that
  saw one cannot run anything more; an error in the scheduler's own bookkeeping; a step broken
  off half-way (a second Ctrl-C; under tensor parallelism the other ranks are ended with it). The
  process must make a new LLM (after a device fault, a new process).
"""

from __future__ import annotations

import numbers
import time
import weakref
from functools import cached_property
from typing import Callable, Sequence

from flexsgl.cache.pool import PageAllocator
from flexsgl.attention.layer_variants import kv_window
from flexsgl.attention.request_variants import RequestVariants
from flexsgl import chat_template as chat_prompt
from flexsgl.config import EngineConfig
from flexsgl.engine_core import build_core, prepare
from flexsgl.generation_config import default_sampling, eos_token_ids
from flexsgl.log import logger, progress
from flexsgl.errors import (EngineDeadError, Health, PromptError, RankFailedError, SamplingParamsError,
                            UnknownRequestError, describe, short_repr)
from flexsgl.interrupts import deferred_interrupts
from flexsgl.output import OutputProcessor
from flexsgl.request import FinishReason, Request, RequestOutput
from flexsgl.request_factory import RequestFactory, check_callback, prompt_list, sampling_list
from flexsgl.sampling import grammar
from flexsgl.sampling.params import SamplingParams
from flexsgl.scheduler import Scheduler
from flexsgl.step_loop import StepLoop
from flexsgl.tokenizer import load_tokenizer

# generate() shows a progress bar (stderr, at log level info) for calls of this many prompts or tokens.
PROGRESS_PROMPTS, PROGRESS_TOKENS = 8, 1024


class LLM:
    def __init__(self, model: str | EngineConfig | None = None, **options):
        """Load `model` (a preset, a local HF directory or a hub id; None for the embedded default)
        with engine `options`: the fields of EngineConfig (flexsgl/config.py), e.g.
        `LLM("qwen3-0.6b", load_format="dummy", max_total_tokens=65536, override="fa3")`, or an
        EngineConfig itself. Bad options raise ValueError before anything loads."""
        started = time.perf_counter()
        if isinstance(model, EngineConfig):
            if options:
                raise ValueError("Pass an EngineConfig or keyword options, not both.")
            self.engine_config = cfg = model
        else:
            self.engine_config = cfg = EngineConfig.from_options(model, **options)
        self.device = cfg.torch_device
        # Refuses before the model loads, with the reason.
        self.src, self.resolved = prepare(cfg, self.device)
        variants = RequestVariants(self.resolved.variants)  # what requests give them (refuses clashes)
        resolve_s = time.perf_counter() - started
        self.dtype = self.resolved.dtype
        self.config = mcfg = self.src.config
        self._channel = None  # to the other tensor-parallel ranks
        if cfg.tensor_parallel_size > 1:
            self._channel = self._start_ranks(cfg, mcfg)
            self.device = self._channel.group.device
        logger.info(f"loading {self.src.name} ({self.src.load_format}, {mcfg.num_params() / 1e6:.1f}M params, "
                    f"{str(self.dtype).removeprefix('torch.')}, {self.device}"
                    + (f", {cfg.tensor_parallel_size} tensor-parallel ranks" if self._channel else "") + ")")
        try:
            core = build_core(cfg, None if self._channel is None else self._channel.group,
                              (self.src, self.resolved))
        except BaseException as e:
            if self._channel is not None and not isinstance(e, Exception):  # Ctrl-C half-way: the other ranks
                self._channel.abandon(f"its start was interrupted ({describe(e)})")  # may wait in a collective
            # A worker that died (killed, out of memory) breaks the collective rank 0 waits in: name it.
            died = (self._channel.dead_soon() if self._channel is not None and isinstance(e, Exception)
                    and not isinstance(e, (ValueError, RankFailedError)) else None)
            self.shutdown()
            if died is not None:
                raise RankFailedError(f"The engine could not start: {died}.") from None
            raise
        self.model, self.pool, self.runner, self.backends = core.model, core.pool, core.runner, core.backends
        self.compile = core.compile
        t0 = time.perf_counter()
        self.tokenizer = load_tokenizer(self.src)
        tokenizer_s = time.perf_counter() - t0
        self.outputs = OutputProcessor(self.tokenizer)  # text, stop decisions, callbacks
        self.default_sampling = default_sampling(self.src)
        self.allocator = PageAllocator(core.num_pages)
        self.scheduler = Scheduler(cfg.page_size, self.allocator, cfg.max_num_batched_tokens,
                                   cfg.max_running_requests, kv_window(self.resolved.variants), cfg.prefill_first,
                                   variants.whole_prompt)
        if self._channel is not None:
            self.runner.tp = self._channel
            self.runner.wait = self._channel.wait
            self._channel.release = self.runner.release_graphs  # before leaving the process group
            self._finalizer = weakref.finalize(self, self._channel.close)
        structured = None
        if self.tokenizer is None:
            structured = f"model {self.src.name!r} has no tokenizer"
        self.requests = RequestFactory(self.src.name, mcfg, self.tokenizer, cfg.page_size, self.allocator.capacity,
                                       variants, self.scheduler.held_tokens, structured,
                                       self.scheduler.whole_prompt_tokens, cfg.random_seed, eos_token_ids(self.src))
        self.grammars = grammar.GrammarQueue(self.tokenizer, mcfg.vocab_size)  # requests waiting for their grammar
        self._live: dict[int, Request] = {}  # added and not yet returned by step()
        self._unclaimed: list[RequestOutput] = []  # add_request's outputs that a generate() call read back
        self._next_id = 0  # above every id added (abort tells a finished request from an unknown one)
        self.loop = StepLoop(self.scheduler, self.runner, self.outputs, self.grammars, self.health, self.device)
        self._startup = {"startup_s": time.perf_counter() - started, "resolve_s": resolve_s, "load_s": core.load_s,
                         "tokenizer_s": tokenizer_s, "kv_pool_s": core.kv_pool_s, "capture_s": self.runner.capture_s}

    @staticmethod
    def _start_ranks(cfg: EngineConfig, mcfg):
        """Start the other tensor-parallel ranks (or join torchrun's); see flexsgl/distributed/launcher.py.
        Under torchrun a rank other than 0 serves rank 0 here and then ends the process."""
        from flexsgl.distributed import launcher
        from flexsgl.distributed.worker import Channel, serve

        device = cfg.torch_device
        launcher.refuse_spawn_reimport()
        launcher.refuse(cfg, mcfg, device)
        if launcher.torchrun_env() is None:
            return Channel(*launcher.spawn(cfg, device, build_core))
        group = launcher.join_torchrun(device)
        if group.rank > 0:
            raise SystemExit(serve(cfg, group, build_core))
        return Channel(group, None, None)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing with one rank); the engine cannot run
        afterwards. Also done at exit, and by `with LLM(...) as llm:`."""
        if self._channel is not None:
            self._channel.close()
            self.health.kill("it was shut down")
        if hasattr(self, "grammars"):
            self.grammars.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def startup_times(self) -> dict[str, float]:
        """Seconds of this engine's construction (`startup_s`), and of it: resolving the options
        for the model (`resolve_s`: finding it, picking the attention backends), building the model
        and loading its weights (`load_s`), loading the tokenizer (`tokenizer_s`), sizing and
        allocating the KV pool (`kv_pool_s`), capturing CUDA graphs, compiling included
        (`capture_s`), and the rest (`other_s`: starting tensor-parallel ranks, the backends, the
        runner, the scheduler); the phases add up to `startup_s`. Also the seconds spent compiling
        so far (`compile_s`: in graph capture and in the first steps of each new shape)."""
        times = dict(self._startup)
        times["other_s"] = max(0.0, times["startup_s"] - sum(v for k, v in times.items() if k != "startup_s"))
        times["compile_s"] = self.runner.compile_s
        return times

    @cached_property
    def health(self) -> Health:
        """Whether the engine can still run, and if not, why (see the module docstring)."""
        return Health()

    # ---- requests

    def make_request(self, prompt: str | Sequence[int], sampling: SamplingParams, index: int = 0) -> Request:
        """Check one prompt and its sampling parameters and turn them into a Request (not queued);
        bad input raises a ValueError (PromptError, SamplingParamsError) that says why."""
        return self.requests.make_request(prompt, sampling, index)

    def make_requests(self, prompt: str | Sequence[int], sampling: SamplingParams, index: int = 0) -> list[Request]:
        """make_request for each of sampling.n samples (request_factory.py)."""
        return self.requests.make_requests(prompt, sampling, index)

    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                    on_token: Callable[[Request], None] | None = None) -> int:
        """Queue one request; returns its id. Malformed input raises ValueError, a prompt that leaves no
        room in the context among it (PromptError); a request that can never run here (its prompt and
        max_new_tokens past the context, or more than the whole cache) finishes at once as "refused",
        with the reason in its output's `error`. For n > 1 samples, add_requests."""
        sampling = self.default_sampling if sampling is None else sampling
        if isinstance(sampling, SamplingParams) and sampling.n > 1:
            raise SamplingParamsError(f"add_request queues one sample; for n={sampling.n} call add_requests.")
        return self.add_requests(prompt, sampling, on_token)[0]

    def add_requests(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                     on_token: Callable[[Request], None] | None = None) -> list[int]:
        """Queue sampling.n samples of one prompt, sharing its KV pages; returns their ids in
        sample order (RequestOutput.index). Errors as add_request."""
        self.health.check()
        check_callback(on_token)
        reqs = self.make_requests(prompt, self.default_sampling if sampling is None else sampling)
        return [self._add(r, on_token) for r in reqs]

    def submit(self, reqs: list[Request], on_token: Callable[[Request], None] | None = None) -> list[int]:
        """Queue requests made by make_requests or a copy of this LLM's RequestFactory (the server
        makes them in its HTTP process, so that bad input is answered there, and hands them to its
        engine process, which steps); returns their ids."""
        self.health.check()
        check_callback(on_token)
        return [self._add(r, on_token) for r in reqs]

    def _add(self, req: Request, on_token) -> int:
        req.added_at = time.monotonic()
        self.outputs.start(req, on_token)
        self._live[req.request_id] = req
        self._next_id = max(self._next_id, req.request_id + 1)
        reason = self.scheduler.refusal(req)
        if reason is None and req.sampling.structured_outputs is not None:  # it waits for its grammar
            self.grammars.add(req)
        elif reason is None:
            self.scheduler.add(req)
        else:
            self.loop.finish(req, FinishReason.REFUSED, f"Request refused: {reason}.")
        return req.request_id

    def abort(self, request_id: int) -> None:
        """Stop a request; it finishes with reason "abort" and keeps the tokens it has, and its
        output comes back from the next step(). A request that has finished already is left as it
        is: ids are handed out in increasing order, so an id up to the highest one added that is no
        longer running or waiting is taken as finished. Any other id (one never handed out, or not
        an integer) raises UnknownRequestError."""
        self.health.check()
        rid = int(request_id) if isinstance(request_id, numbers.Integral) and not isinstance(request_id, bool) else None
        req = None if rid is None else self._live.get(rid)
        if req is None:
            if rid is not None and 0 <= rid < self._next_id:
                return
            raise UnknownRequestError(f"abort takes an id that add_request, add_requests or submit returned; "
                                      f"no request has id {short_repr(request_id)}.")
        if not req.finished and req.finish_reason is None:  # not ended, nor ending in this step (a callback's abort)
            self.loop.finish(req, FinishReason.ABORT)
            self.grammars.discard(req)

    # ---- steps

    def step(self) -> list[RequestOutput]:
        """Launch one step and read back the previous one; returns the requests that finished.

        A fault that concerns some requests finishes them with reason "error"; a KeyboardInterrupt
        (Ctrl-C, or raised by an on_token callback) is raised once the step is complete, and the
        requests that finished in it come back from the next step(). See the module docstring."""
        self.health.check()
        try:
            with deferred_interrupts() as deferred:
                interrupt = self.loop.advance()
        except EngineDeadError:
            raise
        except BaseException as e:  # a bug, or a second Ctrl-C half-way through the step
            reason = f"a step stopped half-way ({describe(e)})"
            self.health.kill(reason)
            if self._channel is not None:  # the other ranks may be inside the step's collectives,
                self._channel.abandon(reason)  # where no message reaches them: end them now
            raise
        if interrupt is not None:
            raise interrupt
        deferred.redeliver()
        done, self.loop.done = self.loop.done, []
        for r in done:
            del self._live[r.request_id]
        unclaimed, self._unclaimed = self._unclaimed, []
        return unclaimed + [self.outputs.request_output(r) for r in done]

    @property
    def has_unfinished(self) -> bool:
        return self.loop.has_unfinished

    def stats(self) -> dict:
        """Counters: prefix-cache hit tokens, preemptions, evicted pages, steps, pages free/cached/running;
        requests running and waiting (those waiting for their grammar included)."""
        stats = self.scheduler.stats()
        stats["waiting"] += len(self.grammars)
        return stats

    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_token: Callable[[Request], None] | None = None) -> list[RequestOutput]:
        """Run `prompts` (strings or token-id lists) to completion; outputs come back in prompt order,
        a prompt sampled n times giving n outputs in a row (RequestOutput.index 0..n-1). Without
        `sampling`, default_sampling (the model's generation_config.json) applies. Requests added
        earlier with add_request run too; their outputs come back from the next step().

        Bad input raises a ValueError before any request starts. On KeyboardInterrupt (Ctrl-C, or
        from on_token) this call's requests are aborted, and it is raised with the engine ready for
        the next call."""
        self.health.check()
        prompts = prompt_list(prompts)
        sampling = sampling_list(self.default_sampling if sampling is None else sampling, len(prompts))
        check_callback(on_token)
        reqs = [r for i, (p, s) in enumerate(zip(prompts, sampling)) for r in self.make_requests(p, s, i)]
        ids = [self._add(r, on_token) for r in reqs]
        mine, outs = set(ids), {}
        long_call = len(ids) >= PROGRESS_PROMPTS or sum(r.sampling.max_new_tokens for r in reqs) >= PROGRESS_TOKENS
        bar = progress(total=len(ids), desc="generate", unit="req", disable=not long_call)
        try:
            with deferred_interrupts() as deferred:
                while len(outs) < len(ids) or self.has_unfinished:
                    for o in self.step():
                        if o.request_id in mine:
                            outs[o.request_id] = o
                        else:  # an add_request's: step() returns it next
                            self._unclaimed.append(o)
                    bar.update(len(outs) - bar.n)
                    deferred.redeliver()
        except BaseException:
            self._abandon(ids)
            raise
        finally:
            bar.close()
        return [outs[i] for i in ids]

    def chat(self, messages, sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None,
             on_token: Callable[[Request], None] | None = None) -> list[RequestOutput]:
        """generate() on chat messages, as vLLM's LLM.chat: `messages` is one conversation (a list of
        {"role", "content"} dicts, OpenAI's; content a string or text parts) or a list of them, each
        rendered by the model's chat template (or `chat_template`, a Jinja template) with
        `chat_template_kwargs` and `tools` (flexsgl/chat_template.py), or opened at its last message
        (`continue_final_message`). A PromptError for messages or a template that cannot render."""
        if self.tokenizer is None:
            raise PromptError("This model has no tokenizer, so it cannot chat.")
        many = isinstance(messages, (list, tuple)) and bool(messages) and all(isinstance(c, (list, tuple))
                                                                            for c in messages)
        conversations = list(messages) if many else [messages]
        prompts = [chat_prompt.encode(self.tokenizer, chat_prompt.render(
            self.tokenizer, chat_prompt.conversation(c), add_generation_prompt, chat_template_kwargs, tools,
            chat_template, continue_final_message)) for c in conversations]
        return self.generate(prompts, sampling, on_token)

    def _abandon(self, ids: list[int]) -> None:
        """Abort the requests of an interrupted generate() and forget them: nobody will ask for them."""
        if not self.health.alive:
            return
        for i in ids:
            self.abort(i)
            req = self._live.pop(i, None)
            if req is not None and req in self.loop.done:
                self.loop.done.remove(req)

    def decode_text(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

