"""Runs one scheduled batch: plan -> upload -> forward -> sample -> read-back, nothing waiting for
the device.

- plan (step/plan.py): the step's host lists, shaped by the StepShape (step_shape.py);
- upload (step/inputs.py): a few packed host -> device copies, into a CUDA graph's buffers for a
  decode step that replays one;
- forward: the graph's replay, or the backend's metadata and the (compiled) model; under tensor
  parallelism each rank's logits cover its vocabulary slice, and a step whose rows are greedy or
  sampled by temperature alone races each slice (sampler.race) and exchanges three numbers a row
  (CausalLM.argmax) instead of gathering the logits;
- sample: on the device; the tokens go into the token buffer (step/token_buffer.py), which decode
  feeds back as each request's next input;
- read-back: the tokens copied to the host asynchronously, NONFINITE for a row whose logits are
  not all finite (a flag computed on the device beside the tokens). The host reads a step's tokens
  only after it has launched the next one (see scheduler.py).

A step with structured outputs is launched in two halves: `run_forward(batch)` plans, uploads
and runs the forward pass, and `sample(launched, mask)` samples under the token mask
the host filled meanwhile (it needs the previous step's tokens), then starts the read-back. Under
tensor parallelism rank 0 sends the plan, then the mask, and every rank runs each half
(`execute_forward`, `execute_sample`); such a step keeps its whole logits.
"""

from __future__ import annotations

import time

import torch

from flexsgl.attention.base import ForwardBatch
from flexsgl.attention.router import PhaseRouter
from flexsgl.cache.pool import KVPool
from flexsgl.compile import compile_steps
from flexsgl.step.graphs import GraphManager
from flexsgl.log import logger, progress
from flexsgl.sampling.sampler import TokenMask, race, sample, token_logprobs
from flexsgl.scheduler import ScheduledBatch
from flexsgl.step.inputs import StepInputs, upload
from flexsgl.step.output import NONFINITE, DeferredStep, StepOutput
from flexsgl.step.plan import StepPlan, padding_plan, plan_step
from flexsgl.step_shape import StepShape
from flexsgl.step.token_buffer import TokenBuffer
from flexsgl.sampling.token_counts import TokenCounts


class ModelRunner:
    def __init__(self, model, pool: KVPool, backends: PhaseRouter, device: torch.device, max_running: int,
                 max_len: int, compile: bool, variants=None):
        self.model, self.pool, self.backends, self.device = model, pool, backends, device
        self.variants = variants  # the attention variants' VariantSet (bound_variant.py), or None
        self.tp = None  # the tensor-parallel group's channel on rank 0 (flexsgl/distributed/worker.py)
        self.vocab_parallel = model.cfg.tp_size > 1  # each rank's logits cover its vocabulary slice
        self._pages_to_clear: list[int] = []  # zeroed on every rank before the next step (clear_pages)
        self._deferred: tuple | None = None  # a worker's step launched up to its logits (execute_forward)
        self.wait = None  # how rank 0 waits for a step's tokens (under tensor parallelism: watching the ranks)
        self.tokens = TokenBuffer(max_running, device)  # last token per slot
        self.token_counts = TokenCounts(max_running, model.cfg.vocab_size, device)  # for penalties
        self.shape = StepShape(compile, max_running, KVPool.num_pages_for(max_len, pool.page_size), pool.num_pages,
                               {"prefill": backends.prefill.compiles_per_shape,
                                "decode": backends.decode.compiles_per_shape}, device.type == "cuda")
        self.graphs: GraphManager | None = None
        self.capture_s = 0.0
        self._prefill, self._decode = self._prefill_forward, self._decode_forward
        if compile:
            self._prefill, self._decode = compile_steps(model, self._prefill_forward, self._decode_forward, device)

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling so far."""
        return sum(getattr(step, "compile_s", 0.0) for step in (self._prefill, self._decode))

    def capture_graphs(self, sizes=None, emulate: bool = False) -> None:
        """Capture decode steps as CUDA graphs for `sizes` (default: the decode buckets).
        emulate: run the static-buffer path without recording (CPU tests)."""
        backend = self.backends.decode
        if not backend.graphable:
            logger.info(f"CUDA graphs off: the {backend.name} decode backend cannot be captured; "
                        "decode runs without them")
            return
        sizes = sorted(set(sizes or self.shape.buckets))
        if sizes[-1] > self.shape.buckets[-1]:
            raise ValueError(f"CUDA graph batch sizes go up to max_running_requests ({self.shape.buckets[-1]}), "
                             f"got {sizes[-1]}.")
        self.graphs = GraphManager(self._decode, self.model.argmax, backend, self.device, sizes, self.shape.max_pages,
                                   self.pool.num_pages, self.tokens, emulate=emulate)
        self.shape.use_graphs(sizes)
        compiled_before, t0 = self.compile_s, time.perf_counter()
        with torch.inference_mode():
            for bs in progress(self.graphs.sizes, desc="capturing decode graphs", unit="graph"):
                # A step of padding rows: what bind_graph reads and the graph is recorded on.
                self.upload(padding_plan(bs, self.shape, self.pool.page_size, self.tokens.pad_slot))
                self.graphs.capture(bs)
        took, compiling = time.perf_counter() - t0, self.compile_s - compiled_before
        self.capture_s += took
        logger.info(f"captured {len(sizes)} decode graphs in {took:.1f}s"
                    + (f" ({compiling:.1f}s of it compiling)" if compiling else ""))

    def release_graphs(self, sync: bool = True) -> None:
        """Destroy the decode graphs (GraphManager.release); the runner cannot step afterwards. Every
        tensor-parallel rank calls it before it leaves its process group."""
        if self.graphs is not None:
            self.graphs.release(sync)

    def _prefill_forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb.input_ids, fb.positions, fb)

    def _decode_forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, plan: StepPlan | None = None) -> StepOutput:
        """Launch `batch`: plan it on the host (unless `plan`, made for it, is given), upload, run the
        model and sample (nothing waits for the device). Under tensor parallelism the plan goes to
        every other rank first, which executes it."""
        plan = self._with_clears(self.plan(batch) if plan is None else plan)
        if self.tp is None:
            return self._launch(batch, self.upload(plan), plan)
        self.tp.send_step(plan)
        try:
            return self._launch(batch, self.upload(plan), plan)
        except Exception as e:  # the other ranks run this step: they may now wait on rank 0 forever
            raise self.tp.failed(e) from e

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> None:
        """A tensor-parallel worker's step: the plan rank 0 made, run as rank 0 runs it (the same
        sampled tokens land in the token buffer and the token counts); nothing is read back."""
        self._launch(None, self.upload(plan))

    def clear_pages(self, pages: list[int]) -> None:
        """Have every rank zero `pages` in its KV pool before the next step (their K/V may hold NaN).
        The next step is the first that can reuse them, and under tensor parallelism each rank's
        pool holds its own heads, so the pages travel in that step's plan."""
        self._pages_to_clear += pages

    def _with_clears(self, plan: StepPlan) -> StepPlan:
        if self._pages_to_clear:
            plan.clear_pages, self._pages_to_clear = list(plan.clear_pages) + self._pages_to_clear, []
        return plan

    def build(self, batch: ScheduledBatch) -> StepInputs:
        """`batch` planned and uploaded: its inputs on the device."""
        plan = self.plan(batch)
        return self.upload(plan)

    def plan(self, batch: ScheduledBatch) -> StepPlan:
        """The host side of a step: every list the device needs, shaped by the step shape policy."""
        return plan_step(batch, self.shape, self.pool.page_size, self.tokens.pad_slot, variants=self.variants)

    def upload(self, plan: StepPlan) -> StepInputs:
        """The device side of a plan: into a CUDA graph's buffers where the step replays one (the
        plan's pages to clear zeroed first)."""
        if plan.clear_pages:
            self.pool.clear_pages(list(plan.clear_pages))
        return upload(plan, self.device, self.tokens, self.token_counts, self.graphs, self.variants)

    @torch.inference_mode()
    def run_forward(self, batch: ScheduledBatch, plan: StepPlan | None = None) -> DeferredStep:
        """Launch `batch` up to its logits (`plan` as in run); `sample` finishes it. Under tensor
        parallelism the plan goes to every other rank first, which runs the same half."""
        plan = self._with_clears(self.plan(batch) if plan is None else plan)
        plan.keep_logits = True  # the mask, which decides what the step reads, comes later
        if self.tp is None:
            return DeferredStep(batch, plan, *self._launch_forward(plan))
        self.tp.send(("forward", plan))
        try:
            return DeferredStep(batch, plan, *self._launch_forward(plan))
        except Exception as e:  # the other ranks run this step: they may now wait on rank 0 forever
            raise self.tp.failed(e) from e

    def _launch_forward(self, plan: StepPlan) -> tuple[StepInputs, torch.Tensor, torch.Tensor | None]:
        step = self.upload(plan)
        logits, greedy, _ = self._forward(step)
        return step, logits, greedy

    @torch.inference_mode()
    def execute_forward(self, plan: StepPlan) -> None:
        """A tensor-parallel worker's run_forward: the step waits for rank 0's mask (execute_sample).
        A step rank 0 never samples (its mask failed) is dropped by the next one."""
        self._deferred = self._launch_forward(plan)

    @torch.inference_mode()
    def execute_sample(self, mask: TokenMask) -> None:
        """A tensor-parallel worker's sample: the waiting step sampled under rank 0's mask, as rank 0 does."""
        step, logits, greedy = self._deferred
        self._deferred = None
        step.sampling.token_mask = mask.to(self.device)
        self._sample(logits, step, greedy)

    def _launch(self, batch: ScheduledBatch | None, step: StepInputs, plan: StepPlan | None = None) -> StepOutput | None:
        """Forward, sample and (on rank 0) start the read-back of an uploaded step."""
        logits, greedy, finite = self._forward(step)
        tokens = self._sample(logits, step, greedy)
        if batch is None:  # a tensor-parallel worker: rank 0 alone reads tokens back
            return None
        return self._read_back(batch, step, logits, tokens, plan, finite)

    @torch.inference_mode()
    def sample(self, launched: DeferredStep, mask: TokenMask) -> StepOutput:
        """Sample a step launched with sample=False under `mask` (on the host, sampling/grammar.py),
        and start its read-back."""
        step = launched.step
        if self.tp is not None:
            self.tp.send(("sample", mask))
        step.sampling.token_mask = mask.to(self.device)
        tokens = self._sample(launched.logits, step, launched.greedy)
        return self._read_back(launched.batch, step, launched.logits, tokens, launched.plan)

    def _forward(self, step: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(the logits over the whole vocabulary, None under tensor parallelism where the step reads
        no more than the ranks exchange; each sampled row's argmax where a CUDA graph took it, and
        wrote it into the token buffer, or the row's token where the ranks raced their slices; each
        sampled row's finiteness where the ranks took it)."""
        fb = step.fb
        if step.graphed:
            logits, greedy, finite = self.graphs.replay(fb)
            greedy, finite = greedy[:step.rows], None if finite is None else finite[:step.rows]
        else:
            fb.backend = self.backends.for_batch(fb)
            fb.backend.prepare(fb)
            logits, greedy, finite = (self._decode if fb.mode == "decode" else self._prefill)(fb), None, None
        if not self.vocab_parallel:
            return logits, greedy, None
        if step.whole_logits:  # every rank decides this alike from the same plan, and gathers
            return self.model.whole_logits(logits), greedy, None
        if greedy is None or not step.sampling.all_greedy:  # (a graph took the greedy rows' argmax)
            local = logits[:step.rows]
            greedy, finite = self.model.argmax(race(local, step.sampling, self.model.cfg.tp_rank * local.shape[1]))
        return None, greedy, finite

    def _sample(self, logits: torch.Tensor | None, step: StepInputs, greedy: torch.Tensor | None) -> torch.Tensor:
        """The sampled rows' tokens (`greedy` itself where `logits` is None: the ranks' race), kept
        in the token buffer and the penalties' counts."""
        tokens = greedy if logits is None else sample(logits[:step.rows], step.sampling, argmax=greedy)
        if not (step.graphed and step.sampling.all_greedy and tokens is greedy):  # else the graph wrote them
            self.tokens.write(step.write_slots, tokens)
        self.token_counts.record(step.write_slots, tokens)
        return tokens

    def _read_back(self, batch: ScheduledBatch, step: StepInputs, logits: torch.Tensor | None,
                   tokens: torch.Tensor, plan: StepPlan | None, finite: torch.Tensor | None = None) -> StepOutput:
        """The step's tokens, with their log-probabilities where asked (and the prompt tokens'), on
        their way to the host (asynchronously on CUDA). A row whose logits are not all finite
        (`finite`, else checked on `logits`) reads back token NONFINITE."""
        if finite is None:
            finite = torch.isfinite(logits[:step.rows].sum(-1, dtype=torch.float32))  # NaN and infinities carry into it
        if step.sampling.logprobs >= 0:
            tokens = token_logprobs(logits[:step.rows], tokens, step.sampling.logprobs)
            tokens[:, 0] = torch.where(finite, tokens[:, 0], NONFINITE)
        else:
            tokens = torch.where(finite, tokens, NONFINITE)
        prompt = None
        if step.prompt_targets is not None:
            n = step.prompt_targets.shape[0]
            prompt = token_logprobs(logits[step.rows:step.rows + n], step.prompt_targets, step.prompt_k)
        if self.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            if prompt is not None:
                prompt = torch.empty(prompt.shape, dtype=prompt.dtype, pin_memory=True).copy_(prompt, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            return StepOutput(batch, host, ready, wait=self.wait, host_prompt=prompt, plan=plan)
        return StepOutput(batch, tokens, None, host_prompt=prompt, plan=plan)
