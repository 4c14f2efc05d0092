"""Chat messages to prompt text: the model's chat template (the tokenizer's apply_chat_template,
with the request's tools and chat_template_kwargs), or the server's `--chat-template` in its
place, or, for a model that ships none (the embedded tiny-docs model, the presets' byte
tokenizer), FALLBACK_TEMPLATE: a `tools: [...]` line when tools are given, one `role: content`
line per message (an assistant message's tool calls as JSON after its content), then `assistant:`
when a generation prompt is asked for."""

from __future__ import annotations

from pathlib import Path

from flexsgl.errors import PromptError, describe

FALLBACK_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
                     "{% for m in messages %}{{ m['role'] }}: {{ m.get('content') or '' }}"
                     "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")


def load_template(value: str) -> str:
    """`--chat-template`: a file's path, or the template itself (text holding `{{` or `{%`);
    ValueError (one sentence) for neither."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value!r} could not be read ({describe(e)}).") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None,
           tools: list[dict] | None = None, template: str | None = None) -> str:
    """The prompt text of `messages`; a template that fails on them raises PromptError (400)."""
    kwargs = dict(kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        if (template is not None or has_template(tokenizer)) and hasattr(tokenizer, "apply_chat_template"):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 chat_template=template, **kwargs)
        from jinja2 import StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(undefined=StrictUndefined)
        kwargs.setdefault("tools", None)
        return env.from_string(template or FALLBACK_TEMPLATE).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:
        raise PromptError(f"The chat template could not render these messages ({describe(e)}).") from None


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: the template wrote any special tokens it wants."""
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    except Exception as e:
        raise PromptError(f"The chat prompt could not be tokenized ({describe(e)}).") from None
    if not ids:
        raise PromptError("The chat prompt has no tokens once tokenized.")
    return ids
