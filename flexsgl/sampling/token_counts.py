"""What the penalties look at, per running request's slot, kept on the device: how often each token
occurs in its output, and which tokens its prompt holds.

Allocated when the first penalized request samples ([slots, vocab] int32 and bool: ~190 MB at 256
slots and Qwen3's 152k vocabulary). A slot's rows are rebuilt from the host's token lists when its
request samples its first token after (re)admission, and every sampled token is counted on the
device right after it is sampled, so the next step sees it without the host reading anything.
"""

from __future__ import annotations

import torch


class TokenCounts:
    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.slots, self.vocab, self.device = slots, vocab, device
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None

    def reset(self, slots: torch.Tensor, prompt_slots: torch.Tensor, prompt_ids: torch.Tensor,
              output_slots: torch.Tensor, output_ids: torch.Tensor) -> None:
        """Rebuild the rows of `slots` from their prompts' and outputs' tokens (each id paired with its slot)."""
        if self.counts is None:
            self.counts = torch.zeros(self.slots, self.vocab, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(self.slots, self.vocab, dtype=torch.bool, device=self.device)
        self.counts[slots] = 0
        self.in_prompt[slots] = False
        self.in_prompt[prompt_slots, prompt_ids] = True
        self.counts.index_put_((output_slots, output_ids), torch.ones_like(output_ids, dtype=torch.int32),
                               accumulate=True)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's sampled token (rows of unpenalized requests too: their counts are never read)."""
        if self.counts is not None:
            self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.counts[slots], self.in_prompt[slots]
