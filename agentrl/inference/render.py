"""Messages → prompt token ids with a model's chat template (shared by server and client)."""

from __future__ import annotations

from typing import Any


def render_chat_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """What ``/tokenize`` returns for ``messages``: the rendered template, encoded without
    extra special tokens (the template already writes them)."""
    normalized = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":  # OpenAI's newer name for system
            m["role"] = "system"
        if m.get("content") is None:
            m["content"] = ""
        normalized.append(m)
    text = tokenizer.apply_chat_template(
        normalized, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)
