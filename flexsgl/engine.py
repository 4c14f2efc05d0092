"""LLM: the Python API. Owns the model, the KV pool, the scheduler and the runner."""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from flexsgl.attention.registry import create_backend
from flexsgl.cache.pool import KVPool, PageAllocator
from flexsgl.config import DEFAULT_MODEL
from flexsgl.model.loader import DTYPES, build_model, resolve
from flexsgl.request import Request, RequestOutput, SamplingParams
from flexsgl.runner import ModelRunner
from flexsgl.scheduler import Scheduler
from flexsgl.tokenizer import load_tokenizer

CPU_DEFAULT_KV_TOKENS = 16384
GPU_MEMORY_FRACTION = 0.85


class LLM:
    def __init__(self, model: str | None = None, device: str | None = None, dtype: str | None = None,
                 override: str = "auto", load_format: str = "auto", page_size: int = 64,
                 kv_cache_tokens: int | None = None, max_batch_tokens: int = 8192, *,
                 max_running: int = 256, compile: bool | None = None, seed: int = 0,
                 shuffle_pages: int | None = None, progress: Callable[[str], None] | None = None):
        """Load `model` (a preset, a local HF directory or a hub id; None for the embedded default).

        compile: torch.compile the model (default: on CUDA, not on CPU).
        shuffle_pages: hand out KV pages in an order shuffled with this seed (tests).
        progress: called with a short message at each loading stage.
        """
        say = progress or (lambda msg: None)
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}.")
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be at least 1.")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("Device 'cuda' was asked for, but this machine has no CUDA GPU.")
        self.src = resolve(model or DEFAULT_MODEL, load_format)
        self.config = cfg = self.src.config
        self.dtype = self._pick_dtype(dtype)
        backend_factory = create_backend(override, cfg, self.device, page_size)  # refuses before the model loads
        say(f"loading {self.src.name} ({self.src.load_format}, {cfg.num_params() / 1e6:.1f}M params, "
            f"{str(self.dtype).removeprefix('torch.')}, {self.device})")
        self.model = build_model(self.src, self.device, self.dtype, seed, progress=lambda f: say(f"loaded {f}"))
        self.tokenizer = load_tokenizer(self.src)
        num_pages = self._num_pages(kv_cache_tokens, page_size, max_batch_tokens, max_running)
        self.pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                           self.dtype, self.device)
        self.allocator = PageAllocator(num_pages, shuffle_seed=shuffle_pages)
        say(f"KV cache: {num_pages - 1} pages of {page_size} tokens")
        self.compile = self.device.type == "cuda" if compile is None else compile
        self.backend = backend_factory(self.pool, self.compile)
        self.scheduler = Scheduler(self.pool, self.allocator, max_batch_tokens, max_running)
        self.runner = ModelRunner(self.model, self.pool, self.backend, self.device, max_running,
                                  cfg.max_position, self.compile)
        self._ids = itertools.count()

    def _pick_dtype(self, dtype: str | None) -> torch.dtype:
        if dtype in (None, "auto"):
            if self.device.type == "cpu":
                return torch.float32
            return torch.float16 if self.config.torch_dtype == "float16" else torch.bfloat16
        if dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}.")
        return DTYPES[dtype]

    def _num_pages(self, kv_tokens: int | None, page_size: int, max_batch_tokens: int, max_running: int) -> int:
        cfg = self.config
        if kv_tokens is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                itemsize = torch.tensor([], dtype=self.dtype).element_size()
                # Room for one step's activations: the widest layer over the token budget, and logits.
                act = max_batch_tokens * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * itemsize * 2
                act += max_running * cfg.vocab_size * 4 * 4 + (1 << 30)
                kv_tokens = int((free * GPU_MEMORY_FRACTION - act) // cfg.kv_bytes_per_token(itemsize))
            else:
                kv_tokens = CPU_DEFAULT_KV_TOKENS
        pages = KVPool.num_pages_for(kv_tokens, page_size) + 1  # + the dummy page
        if kv_tokens < page_size:
            raise ValueError(f"The KV cache must hold at least one page ({page_size} tokens); it would hold {kv_tokens}.")
        return pages

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
        req = Request(next(self._ids), ids, sampling, eos, ctx)
        need, have = self.scheduler.pages_needed(req), self.allocator.capacity
        if need > have:
            raise ValueError(f"Prompt {index} needs {need * self.pool.page_size} KV slots (prompt plus "
                             f"max_new_tokens), more than the whole cache holds ({have * self.pool.page_size}); "
                             "raise kv_cache_tokens or lower max_new_tokens.")
        return req

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
        for r in reqs:
            r.on_token = on_token
            self.scheduler.add(r)
        self._run_until_done()
        return [self._output(r) for r in reqs]

    def _run_until_done(self) -> None:
        pending = None
        while self.scheduler.has_unfinished or pending is not None:
            batch = self.scheduler.schedule()
            launched = self.runner.run(batch) if batch is not None else None
            if pending is not None:  # read the previous step while this one runs
                self.scheduler.process(pending.batch, pending.tokens())
            elif launched is None:
                raise RuntimeError("The scheduler has unfinished requests but nothing it can run.")
            pending = launched

    def _output(self, req: Request) -> RequestOutput:
        out = req.output()
        if self.tokenizer is not None:
            out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return out

    def decode_text(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)
