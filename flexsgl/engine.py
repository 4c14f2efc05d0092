"""LLM: the Python API. Owns the model, the KV pool, the scheduler and the runner."""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from flexsgl.attention.registry import resolve_override
from flexsgl.attention.router import PhaseRouter
from flexsgl.cache.pool import KVPool, PageAllocator
from flexsgl.model.presets import DEFAULT_MODEL
from flexsgl.model.loader import DTYPES, build_model, resolve
from flexsgl.request import FinishReason, Request, RequestOutput, SamplingParams
from flexsgl.runner import ModelRunner
from flexsgl.scheduler import Scheduler
from flexsgl.tokenizer import load_tokenizer

CPU_DEFAULT_KV_TOKENS = 16384


class LLM:
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
        self.model.bind_kv_pool(self.pool)
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

    # ---- requests

    def make_request(self, prompt: str | Sequence[int], sampling: SamplingParams, index: int = 0) -> Request:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"Prompt {index} is empty.")
            if self.tokenizer is None:
                raise ValueError(f"Model {self.src.name!r} has no tokenizer; pass prompts as token ids.")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"Prompt {index} is empty.")
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"Prompt {index} has token ids outside the vocabulary [0, {vocab}).")
        ctx = self.config.max_position
        if len(ids) >= ctx:
            raise ValueError(f"Prompt {index} has {len(ids)} tokens; the model's context is {ctx}, "
                             "leaving no room for a new token.")
        eos = self.config.eos_token_ids
        if not eos and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos = (self.tokenizer.eos_token_id,)
        return Request(next(self._ids), ids, sampling, eos, ctx)

    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                    on_token: Callable[[Request], None] | None = None) -> int:
        """Queue one request; returns its id. Malformed input raises ValueError; a request that can
        never run here (longer than the context or the whole cache) finishes at once as "refused",
        with the reason in its output's `error`."""
        return self._add(self.make_request(prompt, sampling or SamplingParams()), on_token)

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
        req = self._live.get(request_id)
        if req is not None and not req.finished:
            self.scheduler.finish(req, FinishReason.ABORT)
            self._done.append(req)

    def step(self) -> list[RequestOutput]:
        """Launch one step and read back the previous one; returns the requests that finished."""
        batch = self.scheduler.schedule()
        launched = self.runner.run(batch) if batch is not None else None
        if self._pending is not None:  # read the previous step while this one runs
            self._done += self.scheduler.process(self._pending.batch, self._pending.tokens())
        elif launched is None and self.scheduler.has_unfinished:
            raise RuntimeError("The scheduler has unfinished requests but nothing it can run.")
        self._pending = launched
        done, self._done = self._done, []
        for r in done:
            del self._live[r.request_id]
        return [self._output(r) for r in done]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._pending is not None or bool(self._done)

    def stats(self) -> dict:
        """Counters: prefix-cache hit tokens, preemptions, evicted pages, steps, pages free/cached/running."""
        return self.scheduler.stats()

    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_token: Callable[[Request], None] | None = None) -> list[RequestOutput]:
        """Run `prompts` (strings or token-id lists) to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("No prompts given.")
        sampling = sampling or SamplingParams()
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"Got {len(sampling)} SamplingParams for {len(prompts)} prompts.")
        reqs = [self.make_request(p, s, i) for i, (p, s) in enumerate(zip(prompts, sampling))]
        ids = [self._add(r, on_token) for r in reqs]
        outs = {}
        while len(outs) < len(ids) or self.has_unfinished:
            outs.update((o.request_id, o) for o in self.step())
        return [outs[i] for i in ids]

    def _output(self, req: Request) -> RequestOutput:
        out = req.output()
        if self.tokenizer is not None:
            out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return out

    def decode_text(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)
