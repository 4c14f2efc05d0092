"""Chat messages to prompt tokens, for `LLM.chat` and the server's chat endpoint: the model's chat
template (the tokenizer's apply_chat_template, with the tools and chat_template_kwargs given), or a
template given in its place (`--chat-template`, `LLM.chat(chat_template=)`), or, for a model that
ships none (the embedded tiny-docs model, the presets' byte tokenizer), FALLBACK_TEMPLATE: a
`tools: [...]` line when tools are given, one `role: content` line per message (an assistant
message's tool calls as JSON after its content), then `assistant:` when a generation prompt is
asked for. `continue_final_message` leaves the last message open for the model to go on with it
(rendered up to the end of its content, as transformers does), in place of a generation prompt."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from flexsgl.errors import PromptError, describe, short_repr

FALLBACK_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
                     "{% for m in messages %}{{ m['role'] }}: {{ m.get('content') or '' }}"
                     "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")


# apply_chat_template's own arguments that chat_template_kwargs may not set: the messages, the
# template, and what would make it return anything but the prompt's text
RENDER_ARGUMENTS = frozenset({"messages", "conversation", "chat_template", "tokenize", "return_dict", "return_tensors",
                              "padding", "truncation", "max_length", "tokenizer_kwargs",
                              "return_assistant_tokens_mask"})


def load_template(value: str) -> str:
    """`--chat-template`: a file's path, or the template itself (text holding `{{` or `{%`);
    ValueError (one sentence) for neither."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value!r} could not be read ({describe(e)}).") from None
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")
    return value


def checked_template(value: str) -> str:
    """load_template's template, once Jinja parses it (ValueError, one sentence, where it does not:
    refused at start-up, not blamed on each request)."""
    template = load_template(value)
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError as e:
        if "'generation'" in (e.message or ""):  # transformers' own tag (assistant masks), which it parses
            return template
        raise ValueError(f"--chat-template is not a valid Jinja template ({(e.message or '').rstrip('.')}, line "
                         f"{e.lineno}).") from None
    return template


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def text_content(content) -> str | None:
    """A message's content as the template takes it: a string, None, or OpenAI's content parts
    joined from their text (`[{"type": "text", "text": ...}]`); PromptError for any other part."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise PromptError(f"Only text content parts are supported, got {short_repr(part)}.")
            texts.append(part["text"])
        return "".join(texts)
    raise PromptError(f"A message's content must be a string or a list of text parts, got {short_repr(content)}.")


def conversation(messages) -> list[dict]:
    """`messages` (a list of {"role": str, "content": ...} mappings; other keys, such as tool_calls,
    kept) as the template takes them, content parts joined; PromptError naming what is wrong."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (list, tuple)) or not messages:
        raise PromptError(f"A conversation must be a non-empty list of messages, got {short_repr(messages)}.")
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise PromptError(f"Each message must be a mapping with a string 'role', got {short_repr(m)}.")
        out.append({**m, "content": text_content(m["content"])} if "content" in m else dict(m))
    return out


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None,
           tools: list[dict] | None = None, template: str | None = None,
           continue_final_message: bool = False) -> str:
    """The prompt text of `messages`; a template that fails on them raises PromptError (400).
    `kwargs` (chat_template_kwargs) go to the template; as in vLLM, they may set
    add_generation_prompt, continue_final_message and tools over the arguments."""
    kwargs = dict(kwargs or {})
    taken = sorted(set(kwargs) & RENDER_ARGUMENTS)
    if taken:
        raise PromptError(f"chat_template_kwargs cannot set {taken[0]!r}, an argument of the rendering itself.")
    add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
    tools = kwargs.pop("tools", tools)
    if continue_final_message and add_generation_prompt:
        raise PromptError("continue_final_message and add_generation_prompt cannot both be true: "
                          "the model either goes on with the last message or starts a new one.")
    if tools:
        kwargs["tools"] = tools
    try:
        if (template is not None or has_template(tokenizer)) and hasattr(tokenizer, "apply_chat_template"):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 chat_template=template, **kwargs)
        from jinja2 import StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(undefined=StrictUndefined)
        kwargs.setdefault("tools", None)
        text = env.from_string(template or FALLBACK_TEMPLATE).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:
        raise PromptError(f"The chat template could not render these messages ({describe(e)}).") from None
    return _open_final_message(text, messages) if continue_final_message else text


def _open_final_message(text: str, messages: list[dict]) -> str:
    """`text` cut after the last message's content, its trailing spaces kept where the template kept
    them (transformers' continue_final_message)."""
    content = (messages[-1].get("content") or "").lstrip()
    final = content.rstrip()
    if final not in text:
        raise PromptError("continue_final_message needs the last message's content, which the rendered chat "
                          "does not hold.")
    at = text.rindex(final)
    return text[:at + (len(content) if text[at:at + len(content)] == content else len(final))]


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: the template wrote any special tokens it wants."""
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as e:
        raise PromptError(f"The chat prompt could not be tokenized ({describe(e)}).") from None
    if not ids:
        raise PromptError("The chat prompt has no tokens once tokenized.")
    return ids
