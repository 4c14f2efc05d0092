"""GPU memory of a tensor-parallel model, rank by rank: what loading holds at its peak, and what the
engine's ranks hold once started.

1. Loading: each rank's part of the model is built on its own GPU (flexsgl.model.loader.build_model,
   no process group needed), one after another; per rank: the part's bytes, the allocator's peak
   while loading, and what it still reserves.
2. The engine: `LLM(model, tensor_parallel_size=N, ...)` starts (KV pool sized from the memory
   left, unless --max-total-tokens), generates a few tokens, and nvidia-smi reads each GPU's memory
   in use; then it shuts down.

    python tools/tp_memory.py --model llama3-70b --tp 2
    python tools/tp_memory.py --model llama3-70b --tp 2,4 --max-total-tokens 65536

With several sizes (--tp 2,4) the loading table is printed for each and the engine runs at the
largest. Prints short tables (GiB).
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from flexsgl.tool_args import need_gpus, parser, positive_ints, preset

GIB = 1 << 30


def loading(model: str, tp: int) -> None:
    from flexsgl.model.loader import build_model
    from flexsgl.model.source import resolve

    src = resolve(model, "dummy")
    print(f"loading {model} (dummy, bfloat16) at TP={tp}, each rank on its own GPU")
    print(f"{'rank':>4} {'part':>8} {'peak':>8} {'reserved':>9} {'load s':>7}")
    for rank in range(tp):
        device = torch.device("cuda", rank)
        torch.empty(0, device=device)  # the device's context: its memory stats cannot be reset before it
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        m = build_model(src, device, torch.bfloat16, 0, rank, tp)
        torch.cuda.synchronize(device)
        took = time.perf_counter() - t0
        part = sum(p.numel() * p.element_size() for p in {id(p): p for p in m.parameters()}.values())
        peak = torch.cuda.max_memory_allocated(device) - before
        print(f"{rank:>4} {part / GIB:>8.2f} {peak / GIB:>8.2f} {torch.cuda.memory_reserved(device) / GIB:>9.2f} "
              f"{took:>7.1f}")
        del m
        torch.cuda.empty_cache()


def engine(model: str, tp: int, max_total_tokens: int | None) -> None:
    from flexsgl import LLM, SamplingParams

    options = dict(load_format="dummy", tensor_parallel_size=tp, cuda_graph_bs=(1,), max_running_requests=4)
    if max_total_tokens:
        options["max_total_tokens"] = max_total_tokens
    t0 = time.perf_counter()
    with LLM(model, **options) as llm:
        ready = time.perf_counter() - t0
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        used = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.split("\n")
        print(f"engine {model} at TP={tp}: ready in {ready:.0f} s, KV cache {llm.pool.num_pages - 1} pages of "
              f"{llm.pool.page_size} tokens per rank")
        print(f"{'gpu':>4} {'in use':>8} {'of':>8}")
        for line in used[:tp]:
            i, u, total = (x.strip() for x in line.split(","))
            print(f"{i:>4} {int(u) / 1024:>8.2f} {int(total) / 1024:>8.2f}")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", type=preset, default="llama3-70b")
    ap.add_argument("--tp", type=positive_ints, default="2", help="tensor-parallel sizes, comma-separated")
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--part", choices=("both", "loading", "engine"), default="both")
    args = ap.parse_args()
    sizes = args.tp
    need_gpus("tp_memory", max(sizes))
    if args.part == "loading":
        for tp in sizes:
            loading(args.model, tp)
        return
    if args.part == "both":  # in a process of its own: the engine's GPUs then hold nothing of it
        subprocess.run([sys.executable, __file__, "--model", args.model, "--tp", ",".join(map(str, sizes)),
                        "--part", "loading"], check=True)
    engine(args.model, max(sizes), args.max_total_tokens)


if __name__ == "__main__":
    main()
