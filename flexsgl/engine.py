"""LLM: the Python API. Owns the model, the KV pool, the scheduler and the runner."""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from flexsgl.attention.registry import resolve_override
from flexsgl.attention.router import PhaseRouter
from flexsgl.cache.pool import KVPool, PageAllocator
from flexsgl.config import EngineConfig
from flexsgl.log import logger
from flexsgl.model.loader import DTYPES, build_model, resolve
from flexsgl.model.presets import DEFAULT_MODEL
from flexsgl.request import FinishReason, Request, RequestOutput, SamplingParams
from flexsgl.runner import ModelRunner
from flexsgl.scheduler import Scheduler
from flexsgl.tokenizer import load_tokenizer

CPU_DEFAULT_KV_TOKENS = 16384


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory the device can still give: free GPU memory, or the host's available memory (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class LLM:
    def __init__(self, model: str | EngineConfig | None = None, **options):
        """Load `model` (a preset, a local HF directory or a hub id; None for the embedded default)
        with engine `options`: the fields of EngineConfig (flexsgl/config.py), e.g.
        `LLM("qwen3-0.6b", load_format="dummy", max_total_tokens=65536, override="fa3")`, or an
        EngineConfig itself. Bad options raise ValueError before anything loads."""
        if isinstance(model, EngineConfig):
            if options:
                raise ValueError("Pass an EngineConfig or keyword options, not both.")
            self.engine_config = cfg = model
        else:
            self.engine_config = cfg = EngineConfig.from_options(model, **options)
        self.device = cfg.torch_device
        self.src = resolve(cfg.model or DEFAULT_MODEL, cfg.load_format)
        self.config = mcfg = self.src.config
        self.dtype = self._pick_dtype(cfg.dtype)
        dtype_name = str(self.dtype).removeprefix("torch.")
        # Refuses before the model loads, with the reason.
        choice = resolve_override(cfg.override, self.device, "gqa", cfg.page_size, mcfg.head_dim, dtype_name)
        if cfg.cuda_graph_bs is not None and not cfg.cuda_graphs:
            raise ValueError("cuda_graph_bs was given, but CUDA graphs are off: they need a CUDA device "
                             f"(this engine runs on {self.device.type}) and disable_cuda_graph unset.")
        logger.info(f"loading {self.src.name} ({self.src.load_format}, {mcfg.num_params() / 1e6:.1f}M params, "
                    f"{dtype_name}, {self.device})")
        self.model = build_model(self.src, self.device, self.dtype, cfg.random_seed)
        self.tokenizer = load_tokenizer(self.src)
        num_pages = self._num_pages(cfg, choice.max_pool_elements(self.device))
        self.pool = KVPool(mcfg.num_layers, num_pages, cfg.page_size, mcfg.num_kv_heads, mcfg.head_dim,
                           self.dtype, self.device)
        self.model.bind_kv_pool(self.pool)
        self.allocator = PageAllocator(num_pages)
        logger.info(f"KV cache: {num_pages - 1} pages of {cfg.page_size} tokens")
        self.compile = self.device.type == "cuda" if cfg.compile is None else cfg.compile
        if self.compile:
            logger.info("torch.compile on: the first step of each new batch shape compiles kernels first "
                        "(tens of seconds for a large model)")
        self.backends = PhaseRouter(choice, self.pool, mcfg.num_heads, self.compile)
        logger.info(f"attention: {choice.label}")
        self.scheduler = Scheduler(cfg.page_size, self.allocator, cfg.max_num_batched_tokens,
                                   cfg.max_running_requests)
        self.runner = ModelRunner(self.model, self.pool, self.backends, self.device, cfg.max_running_requests,
                                  mcfg.max_position, self.compile)
        if cfg.cuda_graphs:
            self.runner.capture_graphs(cfg.cuda_graph_bs)
        self._ids = itertools.count()
        self._live: dict[int, Request] = {}  # added and not yet returned by step()
        self._done: list[Request] = []  # finished, to be returned by the next step()
        self._pending = None  # the launched step not yet read back

    def _pick_dtype(self, dtype: str) -> torch.dtype:
        if dtype == "auto":
            if self.device.type == "cpu":
                return torch.float32
            return torch.float16 if self.config.torch_dtype == "float16" else torch.bfloat16
        return DTYPES[dtype]

    def _num_pages(self, cfg: EngineConfig, max_elements: int | None) -> int:
        mcfg, ps = self.config, cfg.page_size
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        per_token = mcfg.kv_bytes_per_token(itemsize)
        kv_tokens = cfg.max_total_tokens
        if kv_tokens is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                # Room for one step's activations: the widest layer over the token budget, and logits.
                act = cfg.max_num_batched_tokens * (2 * mcfg.intermediate_size + 4 * mcfg.hidden_size) * itemsize * 2
                act += cfg.max_running_requests * mcfg.vocab_size * 4 * 4 + (1 << 30)
                kv_tokens = int((free * cfg.mem_fraction_static - act) // per_token)
            else:
                kv_tokens = CPU_DEFAULT_KV_TOKENS
        if max_elements is not None:  # the attention backends' own limit (e.g. flex's 32-bit indexing)
            most = (max_elements // (mcfg.num_kv_heads * mcfg.head_dim) // ps - 1) * ps
            if cfg.max_total_tokens is not None and kv_tokens > most:
                raise ValueError(f"max_total_tokens {kv_tokens} is more than these attention backends can index "
                                 f"({most} tokens of this model per pool); lower it.")
            kv_tokens = min(kv_tokens, most)
        if kv_tokens < ps:
            raise ValueError(f"The KV cache must hold at least one page ({ps} tokens); it would hold "
                             f"{max(kv_tokens, 0)}.")
        num_pages = KVPool.num_pages_for(kv_tokens, ps) + 1  # + the dummy page
        need, free = num_pages * ps * per_token, free_memory_bytes(self.device)
        if free is not None and need > free:
            raise ValueError(f"A KV cache of {kv_tokens} tokens needs {need / 2**30:.1f} GiB, and the "
                             f"{self.device.type} has {free / 2**30:.1f} GiB free; lower max_total_tokens.")
        return num_pages

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
