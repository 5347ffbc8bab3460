"""Messages → prompt token ids with a model's chat template: the one chat renderer.

The server's ``/tokenize`` and chat routes, the client's local rendering, the template
checker and SFT's demonstrations all render through here, so a prompt has the same ids
wherever it is built.
"""

from __future__ import annotations

from typing import Any


def _normalized(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":  # OpenAI's newer name for system
            m["role"] = "system"
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def render_chat_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """What ``/tokenize`` returns for ``messages``: the rendered template, encoded without
    extra special tokens (the template already writes them)."""
    text = tokenizer.apply_chat_template(
        _normalized(messages), tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
        **template_kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat_with_mask(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask) of a whole conversation: 1 on the tokens the template marks
    as generated (its ``{% generation %}`` blocks), for supervised fine-tuning."""
    enc = tokenizer.apply_chat_template(
        _normalized(messages), tools=tools or None, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(enc["input_ids"]), list(enc["assistant_masks"])
