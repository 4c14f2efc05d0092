"""A model's default sampling parameters and the end tokens it adds, from its generation_config.json
(as vLLM reads it)."""

from __future__ import annotations

import json

from flexsgl.errors import CheckpointError
from flexsgl.model.source import ModelSource
from flexsgl.sampling.params import SamplingParams

# generation_config.json key -> SamplingParams field; the keys vLLM takes as a model's defaults.
KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_new_tokens"}


def _read(src: ModelSource) -> dict:
    """The model directory's generation_config.json ({} without one)."""
    path = None if src.path is None else src.path / "generation_config.json"
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is not readable JSON ({e}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(path)!r} should hold a JSON object.")
    return data


def eos_token_ids(src: ModelSource) -> tuple[int, ...]:
    """The end tokens generation_config.json names (`eos_token_id`, one or a list: a chat model's
    end of turn often stands only there), which end outputs beside config.json's and the tokenizer's."""
    eos = _read(src).get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"generation_config.json of {src.name!r}: 'eos_token_id' must be a token id or a "
                              f"list of them, got {eos!r}.")
    return tuple(ids)


def generation_defaults(src: ModelSource) -> dict:
    """The SamplingParams fields that the model directory's generation_config.json sets ({} without one)."""
    data = _read(src)
    path = None if src.path is None else src.path / "generation_config.json"
    found = {field: data[key] for key, field in KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**found)
    except ValueError as e:
        raise CheckpointError(f"{str(path)!r} sets a default the engine cannot use: {e}") from None
    return found


def default_sampling(src: ModelSource) -> SamplingParams:
    """SamplingParams() with the model's defaults applied."""
    return SamplingParams(**generation_defaults(src))
