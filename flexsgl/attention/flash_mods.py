"""Which attention variants FlexAttention's FLASH backend compiles correctly.

The FLASH backend turns a variant's mods into CuTe DSL code (Inductor's cutedsl op overrides), and
that code generator gets one construct wrong: a `torch.where` whose two values are both constants
(Python numbers, or 0-dim tensors the mod captured) builds them with `cute.full_like` of the
*condition*, so they take its boolean type. `torch.where(kv_pos == 0, 1.5, 0.0)` then adds 1 where
it should add 1.5 (torch 2.11, flash-attn-4 4.0.0b19: 0.49 from float64 attention, where the
Triton kernel is 0.008 from it), or fails to compile where one value is a captured tensor.
`(kv_pos == 0).to(torch.float32) * 1.5` comes out right, and so, by the same code, does a mask's
`torch.where(c, True, False)`, which is boolean anyway.

`flash_miscompiles` finds the construct by tracing a variant's mods once on the CPU (make_fx, on
one-element coordinates, as FlexAttention's vmap sees them) where a variant's prefill could run on
FLASH; such a variant's prefill runs on the Triton kernel instead (`flash_refusal`,
flex_options.variant_prefill_options), and the log says why.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from flexsgl.attention.bound_variant import VariantMods
from flexsgl.attention.flex_options import FLASH_KV_TILE, flash_prefill_runs, flash_variants_wanted
from flexsgl.attention.variant import AttentionVariant, Params, trial_params
from flexsgl.log import logger

_CONSTANT_TARGETS = (torch.ops.aten.scalar_tensor.default, torch.ops.aten.full.default,
                     torch.ops.aten.lift_fresh_copy.default)


def flash_refusal(variant: AttentionVariant, head_dim: int, page_size: int, dtype: torch.dtype) -> str | None:
    """Why this variant's prefill may not run on FLASH where it could (logged), or None; None too,
    without tracing anything, where it could not: FLEXSGL_FLASH_VARIANTS=0, or FLASH runs neither over
    these pages nor over packed rows (flex_options.flash_prefill_runs)."""
    if not flash_variants_wanted() or not any(flash_prefill_runs(head_dim, kv_block, dtype)
                                              for kv_block in (page_size, FLASH_KV_TILE)):
        return None
    why = flash_miscompiles(variant)
    if why is not None:
        logger.warning("Attention variant %r prefills on the Triton kernel, not FLASH: %s.", variant.name, why)
    return why


def flash_miscompiles(variant: AttentionVariant, num_heads: int = 4) -> str | None:
    """Why FLASH would compute this variant's mods wrongly (one clause), or None."""
    mods = VariantMods(variant)
    p = Params(trial_params(variant, num_heads, requests=2, device=torch.device("cpu")))
    coord = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    traced = []
    if mods.mask_mod is not None:
        traced.append(("mask_mod", make_fx(lambda b, h, q, kv: mods.visible(q >= 0, b, h, q, kv, p))))
    if mods.score_mod is not None:
        traced.append(("score_mod", make_fx(lambda s, b, h, q, kv: mods.score(s, b, h, q, kv, p))))
    for name, trace in traced:
        args = (coord(0), coord(0), coord(3), coord(1))
        try:
            graph = trace(*args).graph if name == "mask_mod" else trace(torch.tensor([0.5]), *args).graph
        except Exception as e:  # a mod vmap runs but make_fx cannot trace: unchecked, so not on FLASH
            return f"its {name} could not be traced to check it ({type(e).__name__})"
        for node in graph.nodes:
            if node.target is torch.ops.aten.where.self and node.meta["val"].dtype != torch.bool \
                    and all(_is_constant(a) for a in node.args[1:3]):
                return (f"its {name} chooses between two constants with torch.where, which the FLASH "
                        f"backend's code generator computes in the condition's boolean type "
                        f"(write `cond.to(torch.float32) * value` instead)")
    return None


def _is_constant(arg) -> bool:
    if not isinstance(arg, torch.fx.Node):
        return True
    return arg.op == "get_attr" or arg.target in _CONSTANT_TARGETS
