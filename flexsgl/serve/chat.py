"""Chat messages to prompt text: the model's chat template (the tokenizer's apply_chat_template,
with the request's chat_template_kwargs), or, for a model that ships none (the embedded tiny-docs
model, the presets' byte tokenizer), FALLBACK_TEMPLATE: one `role: content` line per message, then
`assistant:` when a generation prompt is asked for."""

from __future__ import annotations

from flexsgl.errors import PromptError, describe

FALLBACK_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> str:
    """The prompt text of `messages`; a template that fails on them raises PromptError (400)."""
    kwargs = dict(kwargs or {})
    try:
        if has_template(tokenizer):
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined)
        return env.from_string(FALLBACK_TEMPLATE).render(messages=messages,
                                                         add_generation_prompt=add_generation_prompt, **kwargs)
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
