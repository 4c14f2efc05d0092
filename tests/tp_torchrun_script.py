"""A script torchrun starts on every rank, for tests/test_tensor_parallel.py's torchrun tests:
`torchrun ... tests/tp_torchrun_script.py PROMPTS_JSON`. Every rank makes the LLM; rank 0's
returns and prints `tokens <json>` of greedy outputs, and every other rank serves rank 0 inside
the constructor and ends there, so the line after it prints on rank 0 only."""

import json
import sys

from flexsgl import LLM, SamplingParams

if __name__ == "__main__":
    prompts = json.loads(sys.argv[1])
    llm = LLM("tiny", load_format="dummy", tensor_parallel_size=2, device="cpu", compile=False, page_size=16,
              max_total_tokens=2048, max_running_requests=8)
    out = llm.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    print("tokens", json.dumps([o.token_ids for o in out]), flush=True)
    llm.shutdown()
