"""JSON pieces the tool-call parsers share (:mod:`agentrl.tool_format`): a decoded call object
checked into a :class:`~agentrl.types.ToolCall`, consecutive JSON values, and whether a piece of
JSON stops inside a string (a call that writes its family's markers in its strings)."""

from __future__ import annotations

import json
from typing import Any

from agentrl.types import ToolCall

TAGS_IN_STRINGS = 4  # markers a call may write inside its JSON strings and still be read whole
_DECODER, _SPACE = json.JSONDecoder(), " \t\r\n"


def short(text: str, limit: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def arguments_object(raw: str) -> Any:
    """The arguments as a JSON value; raw text that is not JSON stays a string."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


def call_from_object(obj: Any, arg_keys: tuple[str, ...], call_id: str | None = None) -> tuple[ToolCall | None, str | None]:
    """A decoded JSON call object → (call, None) or (None, error message)."""
    if not isinstance(obj, dict):
        return None, f"tool call must be a JSON object with 'name' and '{arg_keys[0]}', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, "tool call is missing a 'name' string"
    args = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None, f"arguments of tool call {name!r} are not a JSON object"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, f"arguments of tool call {name!r} must be a JSON object, got {type(args).__name__}"
    try:
        encoded = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError, TypeError):
        return None, f"arguments of tool call {name!r} cannot be re-encoded as JSON"
    if not (is_text(name) and is_text(encoded)):  # "\ud800" decodes to a str no tokenizer or socket takes
        return None, f"tool call {name!r} has an unpaired surrogate escape (\\ud800-\\udfff), which is not text"
    if call_id:
        return ToolCall(name=name.strip(), arguments=encoded, id=call_id), None
    return ToolCall(name=name.strip(), arguments=encoded), None


def is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_values(text: str, pos: int = 0, separators: str = _SPACE) -> tuple[list[Any], str | None]:
    """Consecutive JSON values in ``text`` from ``pos`` (between ``separators``); an error for
    what is left that does not decode."""
    values, pos, e = _decode_run(text, pos, separators)
    return values, None if e is None else f"invalid JSON in tool call ({type(e).__name__}): {short(text[pos:])!r}"


def json_state(s: str) -> str:
    """``whole`` (``s`` is JSON values and spaces), ``in a string`` (it stops inside one), or ``other``."""
    values, _, e = _decode_run(s, 0, _SPACE)
    if e is None:
        return "whole" if values else "other"
    return "in a string" if isinstance(e, json.JSONDecodeError) and e.msg.startswith("Unterminated string") else "other"


def _decode_run(text: str, pos: int, separators: str) -> tuple[list[Any], int, Exception | None]:
    """The values decoded from ``pos`` on, where decoding stopped, and why (None: at the end)."""
    values: list[Any] = []
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos >= len(text):
            return values, pos, None
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError) as e:
            return values, pos, e
        values.append(value)


def is_json(s: str) -> bool:
    try:
        json.loads(s)
    except (ValueError, RecursionError):
        return False
    return True
