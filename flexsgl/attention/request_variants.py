"""What an engine's attention variants take from each request, and what they mean for reusing its K/V.

A request may give the variants' per-request parameters (`PerRequest`) through
`SamplingParams.attention_params`; an integer parameter takes whole numbers, a floating one finite
numbers, within the parameter's bounds and what its dtype holds (`refusal`).

The prefix cache hands a request the K/V another computed for the same tokens. That is right only
where both computed them alike, and a token's K/V after the first layer depend on every earlier
layer's attention:
- plain causal attention, and causal variants that read no request's values: on the tokens up to
  it alone, so every request shares with every other;
- a per-request parameter: on its value too, so a request shares only with requests that give the
  same values (those that give none, or the defaults, share with each other);
- a variant that is not causal or reads the prompt's length (prefix-LM: the prompt sees itself both
  ways): on the whole prompt, so a request shares only with requests of the same prompt. Its prompt
  must also be prefilled in one step, as a chunk of it would attend without the chunks after it.

`salt` is the prefix cache's partition for a request's K/V (flexsgl/cache/radix.py): None where it
shares with every request.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from flexsgl.attention.variant import AttentionVariant, PerRequest, PromptLength, VariantError


class RequestVariants:
    def __init__(self, per_layer: Sequence[AttentionVariant | None]):
        variants = [v for v in per_layer if v is not None]
        self.params: dict[str, PerRequest] = {}
        for v in variants:
            for n, p in v.params.items():
                if isinstance(p, PerRequest):
                    if self.params.setdefault(n, p) != p:  # one value per request: one definition
                        raise VariantError(f"Two layers' attention variants declare the per-request parameter {n!r} "
                                           f"differently ({self.params[n]} and {p}); a request gives one value for "
                                           "a name: give them different names.")
        # whether a prompt token's K/V depend on the prompt after it
        self.whole_prompt = any(not v.causal or any(isinstance(p, PromptLength) for p in v.params.values())
                                for v in variants)

    def refusal(self, name: str, value: float | int) -> str | None:
        """What parameter `name` takes, where `value` is not that (else None): an integer one whole
        numbers, a floating one finite numbers, within its bounds and what its dtype holds."""
        param = self.params[name]
        floating = param.dtype.is_floating_point
        info = torch.finfo(param.dtype) if floating else torch.iinfo(param.dtype)
        low = info.min if param.low is None else max(param.low, info.min)
        top = info.max if param.high is None else min(param.high, info.max)
        if (floating or float(value).is_integer()) and low <= value <= top:
            return None
        if floating:
            return f"finite numbers of {param.dtype} from {low:.4g} to {top:.4g}"
        return f"whole numbers from {low} to {top}"

    def salt(self, prompt_ids: Sequence[int], given: dict | None) -> Hashable | None:
        """The prefix cache partition of a request with this prompt and these attention_params
        (module docstring)."""
        values = tuple(sorted((k, v) for k, v in (given or {}).items() if v != self.params[k].default))
        if self.whole_prompt:
            return "prompt", tuple(prompt_ids), values
        return ("params", values) if values else None
