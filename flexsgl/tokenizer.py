"""Tokenizers: the model directory's own through transformers, or raw bytes for presets that ship none."""

from __future__ import annotations

from flexsgl.errors import CheckpointError, PromptError, describe
from flexsgl.model.source import ModelSource


class ByteTokenizer:
    """Token id = byte value (0..255). Used by random-weight presets so text prompts work offline."""

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def load_tokenizer(src: ModelSource):
    """The model directory's tokenizer, or a byte tokenizer for a dummy preset, or None."""
    if src.path is not None and any((src.path / f).is_file() for f in
                                    ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(src.path))
        except Exception as e:
            raise CheckpointError(f"The tokenizer in {str(src.path)!r} could not be loaded ({describe(e)}).") from None
    if src.path is None and src.config.vocab_size >= 256:
        return ByteTokenizer()
    return None


def encode_prompt(tokenizer, text: str, index: int) -> list[int]:
    """The token ids of prompt `index`; a prompt the tokenizer refuses raises PromptError."""
    try:
        ids = list(tokenizer.encode(text))
    except Exception as e:
        raise PromptError(f"Prompt {index} could not be tokenized ({describe(e)}).") from None
    if not ids:
        raise PromptError(f"Prompt {index} has no tokens once tokenized.")
    return ids
