"""LLM: the Python API. Owns the model, the KV pool, the scheduler and the runner.

Errors (flexsgl/errors.py has the types):

- Bad input raises a ValueError that says why in one sentence, before anything runs: malformed
  prompts (PromptError), sampling parameters of the wrong type or range (SamplingParamsError), a
  model directory that cannot be served (CheckpointError, from the constructor). The engine is
  untouched by them.
- A request that can never run here (longer than the context or the whole KV cache) is not an
  error of the call: it finishes at once with reason "refused" and the reason in `error`.
- Per-request faults are not raised either: the requests they concern finish with reason "error"
  and a one-sentence reason in `error`, their pages are released, and the engine goes on serving.
  A step that fails while it is built, run or sampled (any Python exception, a CUDA out-of-memory
  error) ends every request of that step, since it cannot tell which one caused it, after they
  receive the tokens of the step before it; the tokens it did not compute never reach the prefix
  cache. A step whose tokens cannot be read back ends its requests; an on_token callback that raises ends its own request; an
  output that cannot be detokenized is reported as "error" with its token ids intact.
- KeyboardInterrupt: Ctrl-C during a step is held back until the step is complete (a second
  Ctrl-C is not). `generate` then aborts its own requests and re-raises it; `step` raises it with
  the requests that finished in that step kept for the next `step`. A callback that raises
  KeyboardInterrupt (or SystemExit) is treated the same way.
- Fatal errors raise EngineDeadError (a RuntimeError), and every later call raises it again at
  once with the same reason: a fault of the device itself (torch's AcceleratorError, a
  "CUDA error", or a device that fails to synchronise after an error), since a CUDA context that
  saw one cannot run anything more; an error in the scheduler's own bookkeeping; a step broken
  off half-way (a second Ctrl-C). The process must make a new LLM (after a device fault, a new
  process).
"""

from __future__ import annotations

import itertools
import logging
from functools import cached_property
from typing import Callable, Sequence

import torch

from flexsgl.attention.registry import resolve_override
from flexsgl.attention.router import PhaseRouter
from flexsgl.cache.pool import KVPool, PageAllocator
from flexsgl.model.presets import DEFAULT_MODEL
from flexsgl.model.loader import DTYPES, build_model, resolve
from flexsgl.errors import EngineDeadError, Health, PromptError, SamplingParamsError, describe
from flexsgl.interrupts import deferred_interrupts
from flexsgl.request import (FinishReason, Request, RequestOutput, SamplingParams, check_callback, check_prompt,
                             prompt_list, sampling_list)
from flexsgl.runner import ModelRunner
from flexsgl.scheduler import Scheduler
from flexsgl.tokenizer import encode_prompt, load_tokenizer

CPU_DEFAULT_KV_TOKENS = 16384
log = logging.getLogger("flexsgl")


class LLM:
    _interrupt: BaseException | None = None  # raised by a callback in the step being processed

    def __init__(self, model: str | None = None, device: str | None = None, dtype: str | None = None,
                 override: str = "auto", load_format: str = "auto", page_size: int = 64,
                 kv_cache_tokens: int | None = None, max_batch_tokens: int = 8192, *,
                 max_running: int = 256, compile: bool | None = None, cuda_graphs: bool | None = None,
                 graph_batch_sizes: Sequence[int] | None = None, seed: int = 0,
                 gpu_memory_fraction: float = 0.85,
                 shuffle_pages: int | None = None, progress: Callable[[str], None] | None = None):
        """Load `model` (a preset, a local HF directory or a hub id; None for the embedded default).

        kv_cache_tokens: KV cache size; None sizes it from free memory after the weights load
            (gpu_memory_fraction of it on CUDA, less room for one step's activations; 16k on CPU).
        override: attention backend(s): a name, `auto`, or `PREFILL,DECODE` (see `flexsgl backends`).
        compile: torch.compile the model (default: on CUDA, not on CPU).
        cuda_graphs: capture decode steps as CUDA graphs (default: on CUDA); graph_batch_sizes: the
            batch sizes to capture (default: the decode buckets up to max_running).
        shuffle_pages: hand out KV pages in an order shuffled with this seed (tests).
        progress: called with a short message at each loading stage.
        """
        say = progress or (lambda msg: None)
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}.")
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be at least 1.")
        if not 0.0 < gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}.")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("Device 'cuda' was asked for, but this machine has no CUDA GPU.")
        self.src = resolve(model or DEFAULT_MODEL, load_format)
        self.config = cfg = self.src.config
        self.dtype = self._pick_dtype(dtype)
        # Refuses before the model loads, with the reason.
        dtype_name = str(self.dtype).removeprefix("torch.")
        choice = resolve_override(override, self.device, "gqa", page_size, cfg.head_dim, dtype_name)
        graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, and this engine runs on {self.device.type}.")
        say(f"loading {self.src.name} ({self.src.load_format}, {cfg.num_params() / 1e6:.1f}M params, "
            f"{dtype_name}, {self.device})")
        self.model = build_model(self.src, self.device, self.dtype, seed, progress=lambda f: say(f"loaded {f}"))
        self.tokenizer = load_tokenizer(self.src)
        num_pages = self._num_pages(kv_cache_tokens, page_size, max_batch_tokens, max_running, gpu_memory_fraction)
        self.pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                           self.dtype, self.device)
        self.allocator = PageAllocator(num_pages, shuffle_seed=shuffle_pages)
        say(f"KV cache: {num_pages - 1} pages of {page_size} tokens")
        self.compile = self.device.type == "cuda" if compile is None else compile
        if self.compile:
            say("torch.compile on: the first step of each new batch shape compiles kernels first "
                "(tens of seconds for a large model)")
        self.backends = PhaseRouter(choice, self.pool, cfg.num_heads, self.compile)
        say(f"attention: {choice.label}")
        self.scheduler = Scheduler(self.pool, self.allocator, max_batch_tokens, max_running)
        self.runner = ModelRunner(self.model, self.pool, self.backends, self.device, max_running,
                                  cfg.max_position, self.compile)
        if graphs:
            self.runner.capture_graphs(graph_batch_sizes, say)
        self._ids = itertools.count()
        self._live: dict[int, Request] = {}  # added and not yet returned by step()
        self._done: list[Request] = []  # finished, to be returned by the next step()
        self._pending = None  # the launched step not yet read back

    def _pick_dtype(self, dtype: str | None) -> torch.dtype:
        if dtype in (None, "auto"):
            if self.device.type == "cpu":
                return torch.float32
            return torch.float16 if self.config.torch_dtype == "float16" else torch.bfloat16
        if dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}.")
        return DTYPES[dtype]

    def _num_pages(self, kv_tokens: int | None, page_size: int, max_batch_tokens: int, max_running: int,
                   fraction: float) -> int:
        cfg = self.config
        if kv_tokens is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                itemsize = torch.tensor([], dtype=self.dtype).element_size()
                # Room for one step's activations: the widest layer over the token budget, and logits.
                act = max_batch_tokens * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * itemsize * 2
                act += max_running * cfg.vocab_size * 4 * 4 + (1 << 30)
                kv_tokens = int((free * fraction - act) // cfg.kv_bytes_per_token(itemsize))
            else:
                kv_tokens = CPU_DEFAULT_KV_TOKENS
        if kv_tokens < page_size:
            raise ValueError(f"The KV cache must hold at least one page ({page_size} tokens); it would hold "
                             f"{max(kv_tokens, 0)}.")
        return KVPool.num_pages_for(kv_tokens, page_size) + 1  # + the dummy page

    @cached_property
    def health(self) -> Health:
        """Whether the engine can still run, and if not, why (see the module docstring)."""
        return Health()

    # ---- requests

    def make_request(self, prompt: str | Sequence[int], sampling: SamplingParams, index: int = 0) -> Request:
        """Check one prompt and its sampling parameters and turn them into a Request (not queued);
        bad input raises a ValueError (PromptError, SamplingParamsError) that says why."""
        if not isinstance(sampling, SamplingParams):
            raise SamplingParamsError(f"Sampling parameters must be a SamplingParams, got {type(sampling).__name__}.")
        prompt = check_prompt(prompt, index)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError(f"Model {self.src.name!r} has no tokenizer; pass prompts as token ids.")
            ids = encode_prompt(self.tokenizer, prompt, index)
        else:
            ids = prompt
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise PromptError(f"Prompt {index} has token ids outside the vocabulary [0, {vocab}).")
        ctx = self.config.max_position
        if len(ids) >= ctx:
            raise PromptError(f"Prompt {index} has {len(ids)} tokens; the model's context is {ctx}, "
                              "leaving no room for a new token.")
        if any(t >= vocab for t in sampling.stop_token_ids):
            raise SamplingParamsError(f"stop_token_ids of prompt {index} hold ids outside the vocabulary [0, {vocab}).")
        eos = self.config.eos_token_ids
        if not eos and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos = (self.tokenizer.eos_token_id,)
        return Request(next(self._ids), ids, sampling, eos, ctx)

    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                    on_token: Callable[[Request], None] | None = None) -> int:
        """Queue one request; returns its id. Malformed input raises ValueError; a request that can
        never run here (longer than the context or the whole cache) finishes at once as "refused",
        with the reason in its output's `error`."""
        self.health.check()
        check_callback(on_token)
        return self._add(self.make_request(prompt, SamplingParams() if sampling is None else sampling), on_token)

    def _add(self, req: Request, on_token) -> int:
        req.on_token = on_token
        self._live[req.request_id] = req
        reason = self.scheduler.refusal(req)
        if reason is None:
            self.scheduler.add(req)
        else:
            self.scheduler.finish(req, FinishReason.REFUSED, f"Request refused: {reason}.")
            self._done.append(req)
        return req.request_id

    def abort(self, request_id: int) -> None:
        """Stop a request; it finishes with reason "abort" and keeps the tokens it has."""
        self.health.check()
        req = self._live.get(request_id)
        if req is not None and not req.finished:
            self.scheduler.finish(req, FinishReason.ABORT)
            self._done.append(req)

    # ---- steps

    def step(self) -> list[RequestOutput]:
        """Launch one step and read back the previous one; returns the requests that finished.

        A fault that concerns some requests finishes them with reason "error"; a KeyboardInterrupt
        (Ctrl-C, or raised by an on_token callback) is raised once the step is complete, and the
        requests that finished in it come back from the next step(). See the module docstring."""
        self.health.check()
        try:
            with deferred_interrupts() as deferred:
                interrupt = self._advance()
        except EngineDeadError:
            raise
        except BaseException as e:  # a bug, or a second Ctrl-C half-way through the step
            self.health.kill(f"a step stopped half-way ({describe(e)})")
            raise
        if interrupt is not None:
            raise interrupt
        deferred.redeliver()
        done, self._done = self._done, []
        for r in done:
            del self._live[r.request_id]
        return [self._output(r) for r in done]

    def _advance(self) -> BaseException | None:
        """Schedule and launch the next step, then read back and hand out the previous one. Every
        fault a request can be blamed for ends that request here; what escapes kills the engine.
        Returns an interrupt raised by a callback, to be raised once the step is complete."""
        batch = self.scheduler.schedule()
        launched = failure = None
        if batch is not None:
            try:
                launched = self.runner.run(batch)
            except Exception as e:  # building the batch, the forward pass, sampling
                self.health.check_device(e, self.device)
                self.scheduler.unschedule(batch)
                failure = f"The step that ran this request failed: {describe(e)}."
                log.debug("step failed for requests %s", [r.request_id for r in batch.requests], exc_info=True)
        pending, self._pending = self._pending, launched
        self._interrupt = None
        if pending is not None:  # read the previous step while this one runs
            self._read_back(pending)
        elif batch is None and self.scheduler.has_unfinished:
            raise self.health.kill("the scheduler has unfinished requests but nothing it can run")
        if failure is not None:  # after the previous step's tokens, which these requests may have
            self._finish_all(batch.requests, failure)
        return self._interrupt

    def _read_back(self, pending) -> None:
        try:
            tokens = pending.tokens()
        except Exception as e:
            self.health.check_device(e, self.device)
            self._finish_all(pending.batch.requests, f"Reading back the step that ran this request failed: "
                                                     f"{describe(e)}.")
            return
        self._done += self.scheduler.process(pending.batch, tokens, self._notify)

    def _notify(self, req: Request) -> str | None:
        """Run req's on_token callback; returns why req must end with an error, if it raised."""
        if req.on_token is None:
            return None
        try:
            req.on_token(req)
        except Exception as e:
            log.debug("on_token callback of request %d raised", req.request_id, exc_info=True)
            return f"The on_token callback raised {describe(e)}."
        except BaseException as e:  # KeyboardInterrupt, SystemExit: raised once the step is complete
            if self._interrupt is None:
                self._interrupt = e
        return None

    def _finish_all(self, reqs: list[Request], error: str) -> None:
        for r in reqs:
            if not r.finished:
                self.scheduler.finish(r, FinishReason.ERROR, error)
                self._done.append(r)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._pending is not None or bool(self._done)

    def stats(self) -> dict:
        """Counters: prefix-cache hit tokens, preemptions, evicted pages, steps, pages free/cached/running."""
        return self.scheduler.stats()

    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_token: Callable[[Request], None] | None = None) -> list[RequestOutput]:
        """Run `prompts` (strings or token-id lists) to completion; outputs come back in prompt order.

        Bad input raises a ValueError before any request starts. On KeyboardInterrupt (Ctrl-C, or
        from on_token) this call's requests are aborted, and it is raised with the engine ready for
        the next call."""
        self.health.check()
        prompts = prompt_list(prompts)
        sampling = sampling_list(sampling, len(prompts))
        check_callback(on_token)
        reqs = [self.make_request(p, s, i) for i, (p, s) in enumerate(zip(prompts, sampling))]
        ids = [self._add(r, on_token) for r in reqs]
        outs = {}
        try:
            with deferred_interrupts() as deferred:
                while len(outs) < len(ids) or self.has_unfinished:
                    outs.update((o.request_id, o) for o in self.step())
                    deferred.redeliver()
        except BaseException:
            self._abandon(ids)
            raise
        return [outs[i] for i in ids]

    def _abandon(self, ids: list[int]) -> None:
        """Abort the requests of an interrupted generate() and forget them: nobody will ask for them."""
        if not self.health.alive:
            return
        for i in ids:
            self.abort(i)
            req = self._live.pop(i, None)
            if req is not None and req in self._done:
                self._done.remove(req)

    def _output(self, req: Request) -> RequestOutput:
        out = req.output()
        if self.tokenizer is not None:
            try:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            except Exception as e:
                log.debug("detokenizing request %d failed", req.request_id, exc_info=True)
                out.finish_reason, out.error = FinishReason.ERROR.value, f"Detokenizing the output failed: {describe(e)}."
        return out

    def decode_text(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

