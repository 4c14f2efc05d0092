"""flexsgl: LLM inference on torch.compile + FlexAttention over a paged KV cache."""

from flexsgl import startup  # noqa: F401  (first, before torch: start-up's clock)


def _map_source_overrides() -> None:
    """An installed flexsgl has `overrides/` as flexsgl.overrides (pyproject maps it). Run from a
    source checkout without installing, map it the same way, so the kernel overrides still load."""
    import importlib.util
    import sys
    from pathlib import Path

    init = Path(__file__).resolve().parent.parent / "overrides" / "__init__.py"
    found = importlib.util.find_spec("flexsgl.overrides")
    if found is not None and (not init.exists() or Path(found.origin).resolve() == init):
        return  # installed, or this checkout's own folder: nothing to map
    if init.exists():  # a checkout beside another's editable install maps its own overrides
        spec = importlib.util.spec_from_file_location("flexsgl.overrides", init,
                                                      submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["flexsgl.overrides"] = module
        setattr(sys.modules[__name__], "overrides", module)
        spec.loader.exec_module(module)


_map_source_overrides()

from flexsgl.attention.variant import AttentionVariant, PerHead, PerRequest, PromptLength, VariantError
from flexsgl.config import EngineConfig
from flexsgl.engine import LLM
from flexsgl.errors import (CheckpointError, EngineDeadError, InputError, PromptError, RankFailedError,
                            SamplingParamsError, TensorParallelError, UnknownRequestError)
from flexsgl.request import RequestOutput
from flexsgl.sampling.params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "AttentionVariant", "PerHead", "PerRequest",
           "PromptLength", "VariantError", "InputError", "PromptError",
           "SamplingParamsError", "CheckpointError", "UnknownRequestError", "EngineDeadError", "TensorParallelError",
           "RankFailedError"]
__version__ = "0.1.0"
