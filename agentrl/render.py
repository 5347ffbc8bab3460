"""Messages → prompt token ids with a model's chat template: the one chat renderer.

The server's ``/tokenize`` and chat routes, the client's local rendering, the template
checker and SFT's demonstrations all render through here, so a prompt has the same ids
wherever it is built.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any


def _template_call(tc: Any) -> Any:
    """A tool call as chat templates expect it: ``function.arguments`` a mapping, not the JSON
    text the OpenAI API carries (Llama, Mistral and pythonic templates iterate or ``tojson``
    it; vLLM hands templates the same).  Arguments that are not a JSON object stay text."""
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        return tc
    args = tc["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return tc
        if isinstance(parsed, dict):
            return {**tc, "function": {**tc["function"], "arguments": parsed}}
    return tc


def _takes_json_text(tokenizer: Any) -> bool:
    """Does the template write JSON-text arguments itself (``arguments is string``, as Qwen's
    and the tiny model's do)?  Then they pass through as text: no decode here, no re-encode
    in the template (a fifth of a render's cost)."""
    tpl = getattr(tokenizer, "chat_template", None)
    return isinstance(tpl, str) and ("arguments is string" in tpl or "arguments is not string" in tpl)


def _normalized(messages: list[dict[str, Any]], mapping_args: bool = True) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":  # OpenAI's newer name for system
            m["role"] = "system"
        if m.get("content") is None:
            m["content"] = ""
        if mapping_args and m.get("tool_calls"):
            m["tool_calls"] = [_template_call(tc) for tc in m["tool_calls"]]
        out.append(m)
    return out


def render_chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The chat template's text for ``messages`` (OpenAI-style dicts)."""
    return tokenizer.apply_chat_template(
        _normalized(messages, not _takes_json_text(tokenizer)), tools=tools or None,
        add_generation_prompt=add_generation_prompt, tokenize=False,
        **template_kwargs,
    )


def render_chat_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """What ``/tokenize`` returns for ``messages``: the rendered template, encoded without
    extra special tokens (the template already writes them)."""
    text = render_chat_text(tokenizer, messages, tools, add_generation_prompt, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


class RenderCache:
    """:func:`render_chat_ids` for one tokenizer, remembering its last ``size`` renderings by
    exact content: a group's episodes open with the same messages (often a long system prompt
    with tool schemas), so G renders of the first prompt become one."""

    def __init__(self, tokenizer: Any, size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self.hits = self.misses = 0
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        try:  # key order kept: templates write mappings in their order (tojson), so it is part of the input
            key = json.dumps([messages, tools or None, add_generation_prompt])
        except (TypeError, ValueError):  # not plain JSON (an image object, say): render it every time
            return render_chat_ids(self.tokenizer, messages, tools, add_generation_prompt)
        hit = self._ids.get(key)
        if hit is not None:
            self.hits += 1
            self._ids.move_to_end(key)
            return list(hit)
        self.misses += 1
        ids = render_chat_ids(self.tokenizer, messages, tools, add_generation_prompt)
        self._ids[key] = tuple(ids)
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)
        return ids


def render_chat_with_mask(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask) of a whole conversation: 1 on the tokens the template marks
    as generated (its ``{% generation %}`` blocks), for supervised fine-tuning."""
    enc = tokenizer.apply_chat_template(
        _normalized(messages, not _takes_json_text(tokenizer)), tools=tools or None, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(enc["input_ids"]), list(enc["assistant_masks"])
