"""Tokenizers: the model directory's own, or raw bytes for presets that ship none.

A directory's tokenizer is transformers' (AutoTokenizer), except where transformers would give the
`tokenizers` library's tokenizer.json unchanged (`plain_tokenizer`): its generic class, no option
or file that changes or adds to it. There the `tokenizers` library reads it alone (FastTokenizer),
which encodes and decodes as transformers' tokenizer does, byte for byte, and spares a start-up
the import of transformers and the building of its tokenizer (together about 2.5 s on the
development CPU). The embedded model's tokenizer is one of these.
"""

from __future__ import annotations

import json
from pathlib import Path

from flexsgl.errors import CheckpointError, PromptError, describe
from flexsgl.model.source import ModelSource

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# transformers' generic tokenizer classes: the backend tokenizer as tokenizer.json describes it
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# tokenizer_config.json keys that change nothing of it (named special tokens are checked apart)
PLAIN_KEYS = frozenset({"tokenizer_class", "backend", "model_max_length", "clean_up_tokenization_spaces",
                        "bos_token", "eos_token", "unk_token", "pad_token"})
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Files beside tokenizer.json that transformers would read into its tokenizer (added and special
# tokens, chat templates) or build it from
OTHER_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "tokenizer.model", "vocab.json", "merges.txt")
# transformers rewrites the pre-tokenizer of some tokenizers with a vocabulary this large (Mistral's)
MAX_PLAIN_VOCAB = 100_000


class ByteTokenizer:
    """Token id = byte value (0..255). Used by random-weight presets so text prompts work offline."""

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class FastTokenizer:
    """A directory's tokenizer.json through the `tokenizers` library alone, where transformers'
    tokenizer would be that very tokenizer (module docstring). It has what flexsgl asks of a
    transformers tokenizer, with the same defaults (encode adds special tokens, decode keeps them);
    what only transformers has (a chat template given to the server, xgrammar's view of the
    vocabulary) goes to transformers' tokenizer of the directory, loaded on first use (`hf`)."""

    is_fast = True
    clean_up_tokenization_spaces = False
    chat_template = None  # none in the directory (plain_tokenizer)

    def __init__(self, path: Path, backend, eos_token: str | None):
        self.path, self.backend_tokenizer, self.eos_token = path, backend, eos_token
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        self._hf = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def apply_chat_template(self, *args, **kwargs):
        return self.hf().apply_chat_template(*args, **kwargs)

    def hf(self):
        """transformers' tokenizer of the same directory."""
        if self._hf is None:
            self._hf = _transformers_tokenizer(self.path)
        return self._hf


def hf_tokenizer(tokenizer):
    """transformers' tokenizer behind `tokenizer` (for libraries that take one: xgrammar)."""
    return tokenizer.hf() if isinstance(tokenizer, FastTokenizer) else tokenizer


def load_tokenizer(src: ModelSource):
    """The model directory's tokenizer, or a byte tokenizer for a dummy preset, or None."""
    if src.path is not None and any((src.path / f).is_file() for f in TOKENIZER_FILES):
        try:
            return plain_tokenizer(src.path) or _transformers_tokenizer(src.path)
        except Exception as e:
            raise CheckpointError(f"The tokenizer in {str(src.path)!r} could not be loaded ({describe(e)}).") from None
    if src.path is None and src.config.vocab_size >= 256:
        return ByteTokenizer()
    return None


def plain_tokenizer(path: Path) -> FastTokenizer | None:
    """`path`'s tokenizer read by the `tokenizers` library, where transformers would load its
    tokenizer.json as it is: tokenizer_config.json names a generic class and no key beyond
    PLAIN_KEYS (no space clean-up), every special token it names is one of tokenizer.json's special
    tokens, tokenizer.json sets no truncation or padding, its vocabulary is at most MAX_PLAIN_VOCAB
    tokens, and no file of OTHER_FILES lies beside it. Else None."""
    config_file, json_file = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (config_file.is_file() and json_file.is_file()) or any((path / f).exists() for f in OTHER_FILES):
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # transformers says what is wrong with it
    if (not isinstance(config, dict) or config.get("tokenizer_class") not in PLAIN_CLASSES
            or not set(config) <= PLAIN_KEYS or config.get("clean_up_tokenization_spaces", False) is not False):
        return None
    named = [config.get(k) for k in SPECIAL_KEYS if config.get(k) is not None]
    if not all(isinstance(t, str) for t in named):
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(json_file))
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    if (backend.truncation is not None or backend.padding is not None or not set(named) <= special
            or backend.get_vocab_size(with_added_tokens=True) > MAX_PLAIN_VOCAB):
        return None
    return FastTokenizer(path, backend, config.get("eos_token"))


def _transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer, text: str, index: int) -> list[int]:
    """The token ids of prompt `index`; a prompt the tokenizer refuses raises PromptError."""
    try:
        ids = list(tokenizer.encode(text))
    except Exception as e:
        raise PromptError(f"Prompt {index} could not be tokenized ({describe(e)}).") from None
    if not ids:
        raise PromptError(f"Prompt {index} has no tokens once tokenized.")
    return ids
