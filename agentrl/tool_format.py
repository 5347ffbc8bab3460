"""The tool-call text format shared by the engine, the chat template and the environments.

Hermes / Qwen2.5 style: an assistant turn is free text followed by zero or more blocks

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3+4"}}
    </tool_call>

:func:`format_tool_call` writes one block; :func:`parse_tool_calls` reads a model's raw
text back into content + :class:`~agentrl.types.ToolCall` objects.  Parsing never raises:
whatever is wrong with a block (invalid JSON, no name, arguments that are not an object,
an unclosed tag) becomes a line in ``ParsedReply.errors``, which an environment turns into
an error tool message so the model can learn from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass
class ParsedReply:
    """A model's reply split into plain text, well-formed tool calls and problems found."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _arguments_object(raw: str) -> Any:
    """The arguments as a JSON value; raw text that is not JSON stays a string."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


def format_tool_call(call: ToolCall) -> str:
    """One ``<tool_call>`` block exactly as the chat template renders it (no surrounding newlines)."""
    body = json.dumps({"name": call.name, "arguments": _arguments_object(call.arguments)}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"


def format_assistant_text(content: str, tool_calls: list[ToolCall]) -> str:
    """The text of a whole assistant turn: content, then each call on its own lines."""
    parts = [content] if content else []
    parts.extend(format_tool_call(tc) for tc in tool_calls)
    return "\n".join(parts)


def _short(text: str, limit: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_block(body: str) -> tuple[ToolCall | None, str | None]:
    """One block's JSON body → (call, None) or (None, error message)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        return None, f"invalid JSON in tool call ({type(e).__name__}): {_short(body)!r}"
    if not isinstance(obj, dict):
        return None, f"tool call must be a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, "tool call is missing a 'name' string"
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None, f"arguments of tool call {name!r} are not a JSON object"
    if not isinstance(args, dict):
        return None, f"arguments of tool call {name!r} must be a JSON object, got {type(args).__name__}"
    try:
        encoded = json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError, TypeError):
        return None, f"arguments of tool call {name!r} cannot be re-encoded as JSON"
    return ToolCall(name=name.strip(), arguments=encoded), None


def parse_tool_calls(text: str) -> ParsedReply:
    """Split ``text`` into content and tool calls. Never raises, whatever the text."""
    if not isinstance(text, str):
        return ParsedReply(content="", errors=[f"reply is not text ({type(text).__name__})"])
    content_parts: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while True:
        start = text.find(OPEN_TAG, pos)
        if start < 0:
            tail = text[pos:]
            if CLOSE_TAG in tail:
                errors.append(f"{CLOSE_TAG} without a matching {OPEN_TAG}")
                tail = tail.replace(CLOSE_TAG, "")
            content_parts.append(tail)
            break
        before = text[pos:start]
        if CLOSE_TAG in before:
            errors.append(f"{CLOSE_TAG} without a matching {OPEN_TAG}")
            before = before.replace(CLOSE_TAG, "")
        content_parts.append(before)
        body_start = start + len(OPEN_TAG)
        end = text.find(CLOSE_TAG, body_start)
        if end < 0:
            errors.append(f"unclosed {OPEN_TAG} (expected {CLOSE_TAG}): {_short(text[body_start:])!r}")
            break
        body = text[body_start:end]
        if OPEN_TAG in body:  # nested open tag: the outer block is malformed
            errors.append(f"{OPEN_TAG} opened again before {CLOSE_TAG}")
            pos = body_start + body.index(OPEN_TAG)
            continue
        call, err = _parse_block(body)
        if call is not None:
            calls.append(call)
        else:
            errors.append(err or "malformed tool call")
        pos = end + len(CLOSE_TAG)
    content = "".join(content_parts).strip()
    return ParsedReply(content=content, tool_calls=calls, errors=errors)
