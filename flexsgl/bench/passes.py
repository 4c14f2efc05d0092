"""One timed pass of requests through the engine, and what passes share: prompts, the heap, memory.

How requests are timed: through the engine's step API. `LLM.step()` launches a step and then reads
back the *previous* step's tokens (asynchronously copied), so a token's `on_token` callback fires
when the host reads it: after its step finished on the device and the host launched the next
one. A request's TTFT is that moment for its first token, from just before `add_request`; its
TPOT is (last token - first token) / (tokens - 1). Both therefore include the host's work, as a
caller of the engine sees it. Every pass starts and ends with a device synchronize, and its wall
time is taken after the final synchronize. Repeated passes use fresh prompts, so no pass reuses
another's KV pages through the prefix cache (the JSON reports `cached_tokens` to show it).
"""

from __future__ import annotations

import gc
import random
import time

import torch

from flexsgl.bench.roofline import sync
from flexsgl.log import progress as log_progress

BAR_INTERVAL = 0.1  # seconds between progress updates (bars show on a terminal only: flexsgl/log.py)


def freeze_heap() -> None:
    """Collect, then move every object alive now (the model, compiled code, captured graphs, some
    800k objects) out of the garbage collector's reach, as vLLM's engine does after start-up. A full
    collection inside a timed pass then skips them (on the development CPU ~130 ms with them in
    reach, 2 ms without). free_memory unfreezes."""
    gc.collect()
    gc.freeze()


def free_memory(device: torch.device) -> None:
    """Let the next LLM start clean: drop the last one's memory and compiled graphs."""
    torch._dynamo.reset()  # compiled frames hold the last runner (and its model) alive
    gc.unfreeze()  # what freeze_heap froze can be collected again
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_prompts(rng: random.Random, lens: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def throughput_requests(seed: int, n: int, input_range: tuple[int, int], output_range: tuple[int, int],
                        vocab: int):
    """The throughput workload from `seed`: (input lengths, output lengths, prompts, warm-up prompts).
    The warm-up prompts have the same lengths (so the same shapes compile) and other tokens, drawn
    from seed + 1 (so nothing they leave in the prefix cache is hit)."""
    rng = random.Random(seed)
    in_lens = [rng.randint(*input_range) for _ in range(n)]
    out_lens = [rng.randint(*output_range) for _ in range(n)]
    prompts = random_prompts(rng, in_lens, vocab)
    return in_lens, out_lens, prompts, random_prompts(random.Random(seed + 1), in_lens, vocab)


def timed_pass(llm, prompts: list[list[int]], out_lens: list[int], desc: str, progress: bool) -> dict:
    """Run requests to completion through the step API; wall time and per-request token times: TTFT
    from just before the requests are added, TPOT over the decode steps from each request's second
    token to its last (the gap to the second token may hold other requests' prefill steps)."""
    from flexsgl import SamplingParams

    first: dict[int, float] = {}
    second: dict[int, float] = {}
    last: dict[int, float] = {}
    count = [0]

    def on_token(req) -> None:
        now = time.perf_counter()
        if req.request_id not in first:
            first[req.request_id] = now
        elif req.request_id not in second:
            second[req.request_id] = now
        last[req.request_id] = now
        count[0] += 1

    bar = log_progress(total=sum(out_lens), desc=desc, unit="tok", disable=not progress, mininterval=BAR_INTERVAL)
    freeze_heap()
    sync(llm.device)
    t0 = time.perf_counter()
    ids = [llm.add_request(pr, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), on_token)
           for pr, n in zip(prompts, out_lens)]
    before = llm.stats()
    outs = {}
    while llm.has_unfinished:
        outs.update((o.request_id, o) for o in llm.step())
        bar.update(count[0] - bar.n)
    sync(llm.device)
    wall = time.perf_counter() - t0
    bar.close()
    after = llm.stats()
    steps = {k: after.get(k, 0) - before.get(k, 0) for k in ("prefill_steps", "decode_steps", "preemptions")}
    outs = [outs[i] for i in ids]
    for o, n in zip(outs, out_lens):
        if o.error:
            raise ValueError(o.error)
        if len(o.token_ids) != n:  # EOS is ignored, so every request runs to its length
            raise RuntimeError(f"request {o.request_id} produced {len(o.token_ids)} tokens, expected {n}")
    return {"wall_s": wall, "outputs": outs, "steps": steps, "ttft_s": [first[i] - t0 for i in ids],
            "tpot_s": [(last[i] - second[i]) / (n - 2) if n > 2 else None for i, n in zip(ids, out_lens)]}
