"""A model's default sampling parameters, from its generation_config.json (as vLLM reads it)."""

from __future__ import annotations

import json

from flexsgl.errors import CheckpointError
from flexsgl.model.source import ModelSource
from flexsgl.sampling.params import SamplingParams

# generation_config.json key -> SamplingParams field; the keys vLLM takes as a model's defaults.
KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_new_tokens"}


def generation_defaults(src: ModelSource) -> dict:
    """The SamplingParams fields that the model directory's generation_config.json sets ({} without one)."""
    path = None if src.path is None else src.path / "generation_config.json"
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is not readable JSON ({e}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(path)!r} should hold a JSON object.")
    found = {field: data[key] for key, field in KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**found)
    except ValueError as e:
        raise CheckpointError(f"{str(path)!r} sets a default the engine cannot use: {e}") from None
    return found


def default_sampling(src: ModelSource) -> SamplingParams:
    """SamplingParams() with the model's defaults applied."""
    return SamplingParams(**generation_defaults(src))
