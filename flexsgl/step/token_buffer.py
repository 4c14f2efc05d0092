"""The token each running request sampled last, kept on the device: decode feeds it back as the
request's next input without the host reading it.

A slot per running request (Request.slot), and one more that no request holds: padding rows read
and write it, so padding never touches a request's token.
"""

from __future__ import annotations

import torch


class TokenBuffer:
    def __init__(self, max_running: int, device: torch.device):
        self.ids = torch.zeros(max_running + 1, dtype=torch.long, device=device)
        self.pad_slot = max_running  # the padding rows' slot

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The last tokens of `slots` (a step's input ids)."""
        return self.ids[slots]

    def write(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keep `tokens`, sampled by the rows of `slots`, as those slots' last tokens."""
        self.ids.index_copy_(0, slots, tokens)
