"""Tool-call text formats as named parsers: how a model of each family writes a tool call.

The names are the ones users pass to vLLM's ``--tool-call-parser``:

=============  =====================================================================
``hermes``     Hermes / Qwen2.5 / the tiny model: ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>``
               blocks after optional text.
``llama3_json`` Llama 3.1–3.3 (alias ``llama4_json``): the whole reply is ``{"name": .., "parameters": {..}}``
               (several joined by ``;``), optionally after ``<|python_tag|>``.
``mistral``    Mistral: ``[TOOL_CALLS] [{"name": .., "arguments": {..}, "id": "9 alnum"}]`` (v3), or
               ``[TOOL_CALLS]name[ARGS]{..}`` (v11).
``pythonic``   Llama 3.2 / Llama 4 (alias ``llama4_pythonic``): the whole reply is a Python list of calls,
               ``[f(a=1, b='x'), g()]``, optionally inside ``<|python_start|>…<|python_end|>``.
=============  =====================================================================

Each :class:`ToolParser` turns a model's raw text into content + :class:`~agentrl.types.ToolCall`
objects (:meth:`~ToolParser.parse`) and writes calls the way the family does
(:meth:`~ToolParser.format`).  Parsing never raises: whatever is wrong (invalid JSON, no
name, arguments that are not an object, an unclosed tag) becomes a line in
``ParsedReply.errors``, which ToolEnv turns into an error tool message so the model can learn.

Special tokens: engines decode with ``skip_special_tokens`` (the embedded engine always; the
policy client asks vLLM to keep them for families with ``special_markers``), so markers that
are special tokens in a family's tokenizer (``[TOOL_CALLS]``, ``<|python_tag|>``) may be
missing from the text.  Every parser therefore also reads its format without its
markers: a reply that *is* a JSON array of ``{"name", "arguments"}`` objects is a Mistral
call list, a reply that starts with ``{"name"`` is a Llama-3 call.

One registry (:func:`get_parser`, :func:`parser_names`); :func:`detect_tool_parser` names
the family from a chat template's text when exactly one family's markers appear in it;
:func:`resolve_tool_parser` is the one rule every component uses: an explicit name, else
the detected family, else ``hermes``.
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import random
import re
import string
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.tool_json import (
    TAGS_IN_STRINGS,
    arguments_object,
    call_from_object,
    is_json,
    json_state,
    json_values,
    short,
)
from agentrl.types import ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
DEFAULT_PARSER = "hermes"


class ToolParserNotFound(AgentrlError):
    """No tool-call parser by that name."""


@dataclass
class ParsedReply:
    """A model's reply split into plain text, well-formed tool calls and problems found."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- shared pieces


class ToolParser:
    """One family's tool-call format.  Subclasses implement :meth:`_parse` and :meth:`format`."""

    name: str = ""
    aliases: tuple[str, ...] = ()
    # text a chat template of this family contains (any one of them), for auto-detection
    markers: tuple[str, ...] = ()
    # text that rules the family out even when a marker is present
    excludes: tuple[str, ...] = ()
    # the family's markers are special tokens: ask token-path servers to keep them in the text
    special_markers: bool = False

    def parse(self, text: str) -> ParsedReply:
        """Split ``text`` into content and tool calls. Never raises, whatever the text."""
        if not isinstance(text, str):
            return ParsedReply(content="", errors=[f"reply is not text ({type(text).__name__})"])
        try:
            return self._parse(text)
        except Exception as e:  # a parser bug must not end the episode: the model sees it as an error
            return ParsedReply(content=text.strip(), errors=[f"{self.name} parser failed: {type(e).__name__}: {e}"[:300]])

    def _parse(self, text: str) -> ParsedReply:
        raise NotImplementedError

    def format(self, content: str, tool_calls: list[ToolCall]) -> str:
        """The text of a whole assistant turn as this family writes it (what :meth:`parse` reads)."""
        raise NotImplementedError

    def detect(self, template: str) -> bool:
        """Does this chat template's text write tool calls in this family's format?"""
        return any(m in template for m in self.markers) and not any(x in template for x in self.excludes)

    def __repr__(self) -> str:
        return f"<ToolParser {self.name}>"


# ----------------------------------------------------------------------------- hermes


class HermesParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks anywhere after free text (Hermes, Qwen2.5)."""

    name = "hermes"
    markers = (OPEN_TAG,)
    excludes = ("<function=",)  # Qwen3-Coder's XML calls inside <tool_call>

    def format(self, content: str, tool_calls: list[ToolCall]) -> str:
        parts = [content] if content else []
        parts.extend(format_tool_call(tc) for tc in tool_calls)
        return "\n".join(parts)

    def _parse(self, text: str) -> ParsedReply:
        content_parts: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = 0
        while True:
            start = text.find(OPEN_TAG, pos)
            if start < 0:
                content_parts.append(_unmatched_close(text[pos:], errors))
                break
            content_parts.append(_unmatched_close(text[pos:start], errors))
            body_start = start + len(OPEN_TAG)
            end = _block_end(text, body_start)
            if end < 0:
                errors.append(f"unclosed {OPEN_TAG} (expected {CLOSE_TAG}): {short(text[body_start:])!r}")
                break
            body = text[body_start:end]
            if OPEN_TAG in body and not is_json(body):  # nested open tags: the outer blocks are malformed
                errors.append(f"{OPEN_TAG} opened again before {CLOSE_TAG}")
                pos = body_start + body.rindex(OPEN_TAG)  # not the next one: a run of tags stays linear
                continue
            call, err = _parse_block(body)
            if call is not None:
                calls.append(call)
            else:
                errors.append(err or "malformed tool call")
            pos = end + len(CLOSE_TAG)
        return ParsedReply(content="".join(content_parts).strip(), tool_calls=calls, errors=errors)


def _block_end(text: str, body_start: int) -> int:
    """Where the ``</tool_call>`` closing the block at ``body_start`` is (-1: none).

    The first one, unless the object before it ends inside a string: then the call writes the
    tag in its strings, and the next few are tried (a few: a run of tags must stay linear).
    """
    first = end = text.find(CLOSE_TAG, body_start)
    if end < 0 or not text[body_start:end].lstrip().startswith("{"):  # a call is an object
        return first
    state = json_state(text[body_start:end])
    for _ in range(TAGS_IN_STRINGS):
        if state != "in a string" or (end := text.find(CLOSE_TAG, end + len(CLOSE_TAG))) < 0:
            break
        state = json_state(text[body_start:end])
        if state == "whole":
            return end
    return first


def _unmatched_close(text: str, errors: list[str]) -> str:
    if CLOSE_TAG in text:
        errors.append(f"{CLOSE_TAG} without a matching {OPEN_TAG}")
        return text.replace(CLOSE_TAG, "")
    return text


def _parse_block(body: str) -> tuple[ToolCall | None, str | None]:
    """One ``<tool_call>`` block's JSON body → (call, None) or (None, error message)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        return None, f"invalid JSON in tool call ({type(e).__name__}): {short(body)!r}"
    return call_from_object(obj, ("arguments",))


def format_tool_call(call: ToolCall) -> str:
    """One ``<tool_call>`` block exactly as the Hermes templates render it (no surrounding newlines)."""
    body = json.dumps({"name": call.name, "arguments": arguments_object(call.arguments)}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"


# ----------------------------------------------------------------------------- llama3_json


class Llama3JsonParser(ToolParser):
    """The reply is one or more ``{"name": .., "parameters": {..}}`` objects (``;``-separated),
    optionally after ``<|python_tag|>``; text before the tag is content."""

    name = "llama3_json"
    aliases = ("llama4_json",)
    BOT = "<|python_tag|>"
    special_markers = True
    markers = ("<|python_tag|>", '"parameters": ')
    excludes = ("[TOOL_CALLS]", OPEN_TAG, "[func_name1(", "<|python_start|>")  # '"parameters"' is a weak marker

    def format(self, content: str, tool_calls: list[ToolCall]) -> str:
        calls = "; ".join(
            json.dumps({"name": tc.name, "parameters": arguments_object(tc.arguments)}, ensure_ascii=False)
            for tc in tool_calls
        )
        if content and calls:
            return f"{content}{self.BOT}{calls}"
        return content or calls

    def _parse(self, text: str) -> ParsedReply:
        if self.BOT in text:
            content, body = text.split(self.BOT, 1)
        elif re.match(r'\s*\{\s*"name"\s*:', text):  # the tag was a special token the server skipped
            content, body = "", text
        else:
            return ParsedReply(content=text.strip())
        values, err = json_values(body, separators=" \t\r\n;")
        calls, errors = [], [err] if err else []
        for obj in values:
            call, e = call_from_object(obj, ("parameters", "arguments"))
            if call is not None:
                calls.append(call)
            else:
                errors.append(e or "malformed tool call")
        return ParsedReply(content=content.strip(), tool_calls=calls, errors=errors)


# ----------------------------------------------------------------------------- mistral


_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A tool-call id of the form Mistral's templates require (9 alphanumeric characters)."""
    return "".join(random.choices(_ID_CHARS, k=9))


def is_mistral_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 9 and value.isalnum() and value.isascii()


class MistralParser(ToolParser):
    """``[TOOL_CALLS]`` then a JSON array of calls (v3) or ``name[ARGS]{json}`` (v11); text
    before the first marker is content.  Call ids are 9 alphanumeric characters (the model's
    own when it wrote one), as Mistral templates require."""

    name = "mistral"
    BOT = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    special_markers = True
    markers = (BOT,)

    def format(self, content: str, tool_calls: list[ToolCall]) -> str:
        if not tool_calls:
            return content
        objs = []
        for tc in tool_calls:
            obj: dict[str, Any] = {"name": tc.name, "arguments": arguments_object(tc.arguments)}
            if is_mistral_id(tc.id):
                obj["id"] = tc.id
            objs.append(obj)
        return f"{content}{self.BOT} {json.dumps(objs, ensure_ascii=False)}"

    def _parse(self, text: str) -> ParsedReply:
        if self.BOT not in text:
            if re.match(r"\s*\[\s*\{", text):  # the marker was a special token the server skipped
                values, err = json_values(text)
                if not err and len(values) == 1 and isinstance(values[0], list) and values[0] and all(
                    isinstance(v, dict) and "name" in v for v in values[0]
                ):
                    return self._from_objects(values[0], "")
            return ParsedReply(content=text.strip())
        content = text[: text.index(self.BOT)]
        calls: list[ToolCall] = []
        errors: list[str] = []
        for chunk in self._chunks(text):
            self._chunk(chunk.strip(), calls, errors)
        return ParsedReply(content=content.strip(), tool_calls=calls, errors=errors)

    def _chunks(self, text: str) -> list[str]:
        """What follows each ``[TOOL_CALLS]`` marker; a chunk whose JSON stops inside a string runs on
        through the next few markers (the call writes the marker in its strings) if that makes it whole."""
        parts, out, i = text.split(self.BOT)[1:], [], 0
        while i < len(parts):
            chunk, j = parts[i], i
            state = json_state(self._json_of(parts[i]))
            for k in range(i + 1, min(len(parts), i + 1 + TAGS_IN_STRINGS)):
                if state != "in a string":
                    break
                longer = self.BOT.join(parts[i : k + 1])
                state = json_state(self._json_of(longer))
                if state == "whole":  # merged only if that makes the call whole: else the next call stays its own
                    chunk, j = longer, k
            out.append(chunk)
            i = j + 1
        return out

    def _json_of(self, chunk: str) -> str:
        """The JSON part of a chunk (as :meth:`_chunk` reads it)."""
        return self._split(chunk.strip())[1] or ""

    _V11_NAME = re.compile(r"([A-Za-z_][\w.\-]*)\s*(?=\{)")

    def _split(self, chunk: str) -> tuple[str | None, str | None]:
        """A stripped chunk as (name, its JSON): v3's array or object has no name; v11 is
        ``name[ARGS]{json}`` or ``name{json}``; (None, None) when no name can be read."""
        if chunk[:1] in ("[", "{"):
            return None, chunk
        name, sep, rest = chunk.partition(self.ARGS)
        if sep:
            return name.strip(), rest
        m = self._V11_NAME.match(chunk)
        return (m.group(1), chunk[m.end() :]) if m else (None, None)

    def _from_objects(self, objs: list[Any], content: str) -> ParsedReply:
        calls, errors = [], []
        for obj in objs:
            self._add(obj, calls, errors)
        return ParsedReply(content=content, tool_calls=calls, errors=errors)

    def _add(self, obj: Any, calls: list[ToolCall], errors: list[str]) -> None:
        own = obj.get("id") if isinstance(obj, dict) else None
        call, err = call_from_object(obj, ("arguments", "parameters"), own if is_mistral_id(own) else mistral_call_id())
        if call is not None:
            calls.append(call)
        else:
            errors.append(err or "malformed tool call")

    def _chunk(self, chunk: str, calls: list[ToolCall], errors: list[str]) -> None:
        """What follows one ``[TOOL_CALLS]`` marker."""
        if not chunk:
            errors.append(f"{self.BOT} with no call after it")
            return
        name, rest = self._split(chunk)
        if rest is None:
            errors.append(f"cannot read a tool call after {self.BOT}: {short(chunk)!r}")
            return
        values, err = json_values(rest)
        if name is None:  # v3: a JSON array (or a single object)
            for v in values:
                for obj in v if isinstance(v, list) else [v]:
                    self._add(obj, calls, errors)
            if err:
                errors.append(err)
            return
        if err or len(values) != 1:
            errors.append(err or f"tool call {name!r} needs exactly one JSON arguments object")
            return
        self._add({"name": name, "arguments": values[0]}, calls, errors)


# ----------------------------------------------------------------------------- pythonic


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.AST) -> Any:
    """A JSON value from a Python literal expression (``true``/``false``/``null`` accepted too)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | type(None)):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotLiteral("a non-finite number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _NotLiteral("a sign on something that is not a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise _NotLiteral("a dict key that is not a string")
            out[key] = _literal(v)
        return out
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    raise _NotLiteral(f"{type(node).__name__} is not a literal value")


def _py(value: Any) -> str:
    """A JSON value as a Python literal."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    return repr(value)


class PythonicParser(ToolParser):
    """The reply is a Python list of calls with keyword arguments, ``[f(a=1), g(b='x')]``
    (Llama 3.2 / Llama 4), optionally inside ``<|python_start|>…<|python_end|>``."""

    name = "pythonic"
    aliases = ("llama4_pythonic",)
    START, END = "<|python_start|>", "<|python_end|>"
    markers = ("[func_name1(", START)
    _LOOKS_LIKE_CALLS = re.compile(r"\s*\[\s*[^\W\d][\w.]*\s*\(")  # a Python name: any letter or _ first

    def format(self, content: str, tool_calls: list[ToolCall]) -> str:
        if not tool_calls:
            return content
        calls = []
        for tc in tool_calls:
            args = arguments_object(tc.arguments)
            kwargs = ", ".join(f"{k}={_py(v)}" for k, v in args.items()) if isinstance(args, dict) else ""
            calls.append(f"{tc.name}({kwargs})")
        body = "[" + ", ".join(calls) + "]"
        return f"{content}{self.START}{body}{self.END}" if content else body

    def _parse(self, text: str) -> ParsedReply:
        content, body = "", text
        if self.START in text:
            content, body = text.split(self.START, 1)
            body = body.split(self.END, 1)[0]
        elif not self._LOOKS_LIKE_CALLS.match(text):
            return ParsedReply(content=text.strip())
        if self.START not in text:
            content = text  # it only looked like calls: if it is not, the text stays the reply
        try:
            tree = ast.parse(body.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            return ParsedReply(content.strip(), errors=[f"invalid pythonic tool call ({type(e).__name__}): {short(body)!r}"])
        if not isinstance(tree.body, ast.List) or not all(isinstance(e, ast.Call) for e in tree.body.elts):
            return ParsedReply(content.strip(), errors=[f"tool calls must be a Python list of calls: {short(body)!r}"])
        if self.START not in text:
            content = ""
        calls, errors = [], []
        for node in tree.body.elts:
            call, err = self._call(node)
            if call is not None:
                calls.append(call)
            else:
                errors.append(err)
        return ParsedReply(content=content.strip(), tool_calls=calls, errors=errors)

    @staticmethod
    def _call(node: ast.Call) -> tuple[ToolCall | None, str]:
        try:
            name = ast.unparse(node.func)
        except Exception:
            name = ""
        if not all(part.isidentifier() for part in name.split(".")):
            return None, "a tool call's function must be a plain name"
        if node.args:
            return None, f"tool call {name!r} must pass its arguments by keyword"
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None, f"tool call {name!r} cannot use **kwargs"
            try:
                args[kw.arg] = _literal(kw.value)
            except (_NotLiteral, RecursionError) as e:
                return None, f"argument {kw.arg!r} of tool call {name!r} is not a literal: {e}"
        return call_from_object({"name": name, "arguments": args}, ("arguments",))


# ----------------------------------------------------------------------------- the registry


_PARSERS: dict[str, ToolParser] = {}
_ALIASES: dict[str, str] = {}


def register(parser: ToolParser) -> ToolParser:
    """Add a parser under its name and aliases (a later one with the same name replaces it)."""
    _PARSERS[parser.name] = parser
    for alias in parser.aliases:
        _ALIASES[alias] = parser.name
    return parser


for _p in (HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser()):
    register(_p)


def parser_names() -> list[str]:
    """Registered parser names (aliases not included)."""
    return sorted(_PARSERS)


def get_parser(name: str | ToolParser | None = None) -> ToolParser:
    """The parser called ``name`` (or an alias of it); None means ``hermes``."""
    if isinstance(name, ToolParser):
        return name
    key = DEFAULT_PARSER if name is None else _ALIASES.get(name, name)
    parser = _PARSERS.get(key)
    if parser is None:
        known = sorted([*_PARSERS, *_ALIASES])
        close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ToolParserNotFound(f"no tool-call parser {name!r}{hint} (available: {', '.join(parser_names())}, or auto)")
    return parser


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The one family whose markers the template contains; None when none or several do."""
    if not chat_template:
        return None
    found = [p.name for p in _PARSERS.values() if p.detect(chat_template)]
    return found[0] if len(found) == 1 else None


def resolve_tool_parser(name: str | None, chat_template: str | None = None) -> ToolParser:
    """The one rule: an explicit name; else (``None``/``"auto"``) the family detected in the
    chat template; else ``hermes``."""
    if name not in (None, "", "auto"):
        return get_parser(name)
    return get_parser(detect_tool_parser(chat_template) or DEFAULT_PARSER)


def chat_template_of(model_dir: Any) -> str | None:
    """A local model/tokenizer directory's chat template text, read from its files (no
    tokenizer load): ``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``."""
    from pathlib import Path

    d = Path(model_dir)
    try:
        if (d / "chat_template.jinja").is_file():
            return (d / "chat_template.jinja").read_text()
        for fname in ("chat_template.json", "tokenizer_config.json"):
            if (d / fname).is_file():
                tpl = json.loads((d / fname).read_text()).get("chat_template")
                if isinstance(tpl, list):  # named templates: the default one
                    tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
                if isinstance(tpl, str):
                    return tpl
    except (OSError, ValueError, AttributeError):
        return None
    return None


# ----------------------------------------------------------------------------- hermes, as before


def format_assistant_text(content: str, tool_calls: list[ToolCall]) -> str:
    """The text of a whole Hermes assistant turn: content, then each call on its own lines."""
    return _PARSERS["hermes"].format(content, tool_calls)


def parse_tool_calls(text: str, parser: str | ToolParser | None = None) -> ParsedReply:
    """Split ``text`` into content and tool calls with ``parser`` (default ``hermes``). Never raises."""
    return get_parser(parser).parse(text)


__all__ = [
    "CLOSE_TAG", "DEFAULT_PARSER", "OPEN_TAG", "ParsedReply", "ToolParser", "ToolParserNotFound",
    "chat_template_of", "detect_tool_parser", "format_assistant_text", "format_tool_call", "get_parser",
    "mistral_call_id", "parse_tool_calls", "parser_names", "register", "resolve_tool_parser",
]
