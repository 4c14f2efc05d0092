"""A model directory's tokenizer read by the `tokenizers` library alone (FastTokenizer) gives what
transformers' tokenizer of the directory gives, byte for byte; a directory whose transformers
tokenizer would differ from its tokenizer.json gets transformers' own."""

import json
import random
import shutil

import pytest
from transformers import AutoTokenizer

from flexsgl.model.presets import DEFAULT_MODEL, EMBEDDED
from flexsgl.model.source import resolve
from flexsgl.tokenizer import FastTokenizer, hf_tokenizer, load_tokenizer

PATH = EMBEDDED[DEFAULT_MODEL]


@pytest.fixture(scope="module")
def pair():
    ours = load_tokenizer(resolve(DEFAULT_MODEL))
    assert isinstance(ours, FastTokenizer)
    return ours, AutoTokenizer.from_pretrained(str(PATH))


def random_text(rng: random.Random) -> str:
    """Docstring-like words, punctuation, spaces, newlines, the special token's text, and characters
    from beyond ASCII (accents, CJK, emoji)."""
    pieces = ["Return", " the", " value", "(", ")", ".", ",", "  ", "\n", "\t", "<|endoftext|>", "é", "日本",
              "😀", "x" * rng.randrange(1, 30), "'s", " 123", "__init__", "\u00a0", "\u200b"]
    return "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))


def test_encode_matches_transformers(pair):
    ours, hf = pair
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(300):
        text = random_text(rng)
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), \
                f"seed={seed} text={text!r}"
    assert ours.encode("Return the") == hf.encode("Return the")


def test_decode_matches_transformers(pair):
    ours, hf = pair
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    n = len(hf)
    for _ in range(300):
        ids = [rng.choice([0, rng.randrange(n), n - 1]) for _ in range(rng.randrange(0, 30))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), \
                f"seed={seed} ids={ids}"
        assert ours.decode(ids) == hf.decode(ids), f"seed={seed} ids={ids}"  # the same default
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids), f"seed={seed} ids={ids}"


def test_vocabulary_and_special_tokens_match_transformers(pair):
    ours, hf = pair
    assert ours.eos_token_id == hf.eos_token_id is not None
    assert len(ours) == len(hf) and ours.get_vocab() == hf.get_vocab()
    assert ours.is_fast == hf.is_fast and ours.clean_up_tokenization_spaces == hf.clean_up_tokenization_spaces
    assert ours.chat_template == hf.chat_template
    assert ours.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
    assert type(hf_tokenizer(ours)) is type(hf) and hf_tokenizer(hf) is hf


def copy_tokenizer(tmp_path, config_change=None, extra_file=None):
    """The embedded model's directory, its tokenizer_config.json changed and a file added."""
    d = tmp_path / "model"
    shutil.copytree(PATH, d)
    if config_change:
        config = json.loads((d / "tokenizer_config.json").read_text())
        config.update(config_change)
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    if extra_file:
        (d / extra_file[0]).write_text(extra_file[1])
    return resolve(str(d))


@pytest.mark.parametrize("config_change, extra_file", [
    ({"tokenizer_class": "Qwen2Tokenizer"}, None),
    ({"add_bos_token": True, "bos_token": "<|endoftext|>"}, None),
    ({"chat_template": "{{ messages[0]['content'] }}"}, None),
    ({"clean_up_tokenization_spaces": True}, None),
    ({"eos_token": "<|im_end|>"}, None),  # not in tokenizer.json: transformers adds it
    (None, ("special_tokens_map.json", json.dumps({"eos_token": "<|endoftext|>"}))),
    (None, ("chat_template.jinja", "{{ messages[0]['content'] }}")),
], ids=["other-class", "add-bos", "chat-template", "clean-up", "new-special-token", "special-tokens-map",
        "chat-template-file"])
def test_a_tokenizer_transformers_changes_is_transformers(tmp_path, config_change, extra_file):
    src = copy_tokenizer(tmp_path, config_change, extra_file)
    tok = load_tokenizer(src)
    assert not isinstance(tok, FastTokenizer), type(tok)
    assert type(tok) is type(AutoTokenizer.from_pretrained(str(src.path)))


def test_an_unchanged_copy_is_read_by_tokenizers(tmp_path):
    assert isinstance(load_tokenizer(copy_tokenizer(tmp_path)), FastTokenizer)
