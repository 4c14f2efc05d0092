"""Building a model without running its modules' initialisers.

A model is built on the meta device (flexsgl/model/loader.py) and its parameters get their values
from loading: a checkpoint, or seeded dummy weights. The initialisers its torch modules run as they
are made (nn.Linear's kaiming_uniform_, nn.Embedding's normal_) give a meta tensor no values, yet
they are not free: torch's meta `normal_` is a Python reference whose first call imports
torch._dynamo, over a second of start-up where nothing else needs it (the CPU runs eager by
default). Inside `no_init()` they leave a meta tensor as it is.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# The in-place fills torch.nn.init's initialisers end in (those that dispatch no torch function of
# their own call these on the tensor).
RANDOM_FILLS = frozenset({"normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_",
                          "geometric_", "log_normal_", "cauchy_"})


class no_init(TorchFunctionMode):
    """Within it, torch.nn.init's initialisers and the in-place fills they run return a meta tensor
    untouched (module docstring). Tensors on other devices are initialised as ever. Torch function
    modes are per thread: another thread building a module meanwhile is not affected."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")  # nn.init's dispatch passes it by keyword
        if isinstance(first, torch.Tensor) and first.is_meta and _initialiser(func):
            return first
        return func(*args, **kwargs)


def _initialiser(func) -> bool:
    if getattr(func, "__module__", None) == "torch.nn.init":
        return True
    return getattr(func, "__name__", None) in RANDOM_FILLS and getattr(func, "__objclass__", None) is not None
