"""LLM.chat: conversations rendered as documented (the fallback template written out by hand, a
given template against transformers' own apply_chat_template) and generated as generate() does."""

from __future__ import annotations

import random

import pytest

from flexsgl import LLM, SamplingParams
from flexsgl.errors import PromptError
from flexsgl.model.presets import EMBEDDED

TEMPLATE = ("{% if tools %}[tools] {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] or '' }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking %}<think>\n{% endif %}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
WORDS = "return the value of a list object when called with an argument string".split()


@pytest.fixture(scope="module")
def llm():
    return LLM(max_total_tokens=2048, page_size=16)


@pytest.fixture(scope="module")
def hf_tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(EMBEDDED["tiny-docs"]))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_conversations_run_as_their_fallback_prompts_do(llm):
    """Two conversations (one with text parts) against generate() on the fallback template's text,
    written out here: one `role: content` line per message, then `assistant:`."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    first = [{"role": "system", "content": "Docs."}, {"role": "user", "content": words(rng, 6)}]
    second = [{"role": "user", "content": [{"type": "text", "text": words(rng, 3)}, {"type": "text", "text": " x"}]}]
    texts = [f"system: Docs.\nuser: {first[1]['content']}\nassistant:",
             f"user: {second[0]['content'][0]['text']} x\nassistant:"]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    want = llm.generate([llm.tokenizer.encode(t, add_special_tokens=False) for t in texts], sp)
    got = llm.chat([first, second], sp)
    assert [(o.prompt_token_ids, o.token_ids, o.text) for o in got] == \
        [(o.prompt_token_ids, o.token_ids, o.text) for o in want], f"seed={seed}"
    assert llm.chat(first, sp)[0].token_ids == want[0].token_ids, f"seed={seed}: one conversation alone"


def test_the_fallback_goes_on_with_the_final_message(llm):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    question, partial = words(rng, 4), words(rng, 2)
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": partial}]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    want = llm.generate([llm.tokenizer.encode(f"user: {question}\nassistant: {partial}", add_special_tokens=False)], sp)
    got = llm.chat(messages, sp, add_generation_prompt=False, continue_final_message=True)
    assert (got[0].prompt_token_ids, got[0].token_ids) == (want[0].prompt_token_ids, want[0].token_ids), f"seed={seed}"


@pytest.mark.parametrize("continue_final", [False, True])
def test_a_given_template_renders_as_transformers_renders_it(llm, hf_tokenizer, continue_final):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    messages = [{"role": "user", "content": words(rng, 5)}]
    if continue_final:
        messages.append({"role": "assistant", "content": words(rng, 2) + " "})
    kwargs = {"enable_thinking": True}
    want = hf_tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tools=TOOLS, tokenize=False,
                                            add_generation_prompt=not continue_final,
                                            continue_final_message=continue_final, **kwargs)
    out = llm.chat(messages, SamplingParams(max_new_tokens=2, temperature=0.0), chat_template=TEMPLATE,
                   chat_template_kwargs=kwargs, tools=TOOLS, add_generation_prompt=not continue_final,
                   continue_final_message=continue_final)[0]
    assert out.prompt_token_ids == hf_tokenizer.encode(want, add_special_tokens=False), f"seed={seed}: {want!r}"
    assert want.endswith(messages[-1]["content"] if continue_final else "<think>\n"), want  # the space kept


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list of messages"),
    ("hello", "non-empty list of messages"),
    ([{"content": "x"}], "string 'role'"),
    ([{"role": "user", "content": 7}], "string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "Only text content parts"),
])
def test_malformed_conversations_are_refused_in_one_sentence(llm, messages, match):
    with pytest.raises(PromptError, match=match):
        llm.chat(messages)


def test_chat_template_kwargs_set_the_rendering_flags_as_in_vllm(llm, hf_tokenizer):
    """chat_template_kwargs' add_generation_prompt and tools take the place of the arguments'; the
    messages or the return type cannot be set there."""
    messages = [{"role": "user", "content": "value"}]
    want = hf_tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tools=TOOLS, tokenize=False,
                                            add_generation_prompt=False)
    out = llm.chat(messages, SamplingParams(max_new_tokens=1), chat_template=TEMPLATE,
                   chat_template_kwargs={"add_generation_prompt": False, "tools": TOOLS})[0]
    assert out.prompt_token_ids == hf_tokenizer.encode(want, add_special_tokens=False), want
    for key in ("messages", "tokenize", "return_dict"):
        with pytest.raises(PromptError, match=f"cannot set '{key}'"):
            llm.chat(messages, chat_template_kwargs={key: True})


def test_conflicting_flags_and_a_failing_template_are_refused(llm):
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(PromptError, match="cannot both be true"):
        llm.chat(messages, continue_final_message=True)
    with pytest.raises(PromptError, match="could not render"):
        llm.chat(messages, chat_template="{{ messages[5]['content'] }}")
    with pytest.raises(PromptError, match="final message"):  # transformers says it
        llm.chat(messages + [{"role": "assistant", "content": "y"}], chat_template="{{ messages[0]['content'] }}",
                 add_generation_prompt=False, continue_final_message=True)
