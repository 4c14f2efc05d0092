"""How the next token is picked.

- params.py: SamplingParams, what a request asks for, every field checked for type and range.
- sampler.py: sampling on the device with no host sync (penalties, min_tokens, greedy, temperature,
  top-k, top-p, min-p, log-probabilities; counter-based noise).
- batch.py: a step's sampling parameters, host lists for the runner's packed uploads, then tensors.
- token_counts.py: per-slot output-token counts and prompt marks on the device (penalties).
"""

from flexsgl.sampling.params import SamplingParams
from flexsgl.sampling.sampler import row_argmax, sample, token_logprobs

__all__ = ["SamplingParams", "row_argmax", "sample", "token_logprobs"]
