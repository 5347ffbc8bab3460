"""ToolEnv: the model calls Python functions; each call's result comes back as a tool message.

    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: first addend
            b: second addend
        '''
        return a + b

    env = ToolEnv(tools=[add], dataset=[...], rubric=...)

Schemas (OpenAI ``{"type": "function", ...}``) come from the type hints and the docstring
(summary + ``Args:`` section).  Tools may be sync (run in a worker thread) or async.  Every
way a call can go wrong — unparsable text, unknown tool, arguments of the wrong type, the
tool raising, the tool timing out — becomes an ``Error: ...`` tool message the model sees and
a per-episode metric; the episode goes on.  Only :class:`~agentrl.errors.EpisodeError` (or
the types in ``stop_errors``) propagates and marks the episode errored (kind ``tool``, or
the error's own kind, e.g. ``sandbox``): use it for infrastructure faults.

Stateful tools: a parameter named ``state`` receives the episode's :class:`State`; names
listed in ``state_args`` are filled from ``state[name]``.  Both are hidden from the schema.
The episode ends when the model replies without any tool call.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from agentrl.envs.base import Environment, State
from agentrl.errors import EpisodeError, ToolError, error_kind_of
from agentrl.tool_format import get_parser
from agentrl.types import Message, ToolCall

_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns?|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX = re.compile(r"^\s*:param\s+(?:[\w\[\], ]+\s+)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(summary, {param: description}) from a Google- or Sphinx-style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for line in lines:
        if m := _SPHINX.match(line):
            current, params[m.group(1)] = m.group(1), m.group(2).strip()
            section = "sphinx"
            continue
        if m := _SECTION.match(line):
            section, current = m.group(1).lower(), None
            continue
        if section is None:
            summary.append(line)
        elif section in ("args", "arguments", "parameters"):
            m = _ARG_LINE.match(line)
            if m and (len(line) - len(line.lstrip())) <= 4:
                current = m.group(1).lstrip("*")
                params[current] = m.group(2).strip()
            elif current and line.strip():
                params[current] = (params[current] + " " + line.strip()).strip()
        elif section == "sphinx" and current and line.strip() and not line.lstrip().startswith(":"):
            params[current] += " " + line.strip()
    text = " ".join(s.strip() for s in summary).strip()
    return text, params


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


@dataclass
class Tool:
    """A Python function the model may call, with its argument validator and schema."""

    fn: Callable[..., Any]
    name: str
    args_model: type[BaseModel]
    schema: dict[str, Any]
    hidden: tuple[str, ...]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], state_args: Iterable[str] = ()) -> Tool:
        name = getattr(fn, "__name__", type(fn).__name__)
        sig = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception:
            hints = {}
        summary, docs = parse_docstring(inspect.getdoc(fn))
        hidden = {"state", *state_args}
        fields: dict[str, Any] = {}
        for p in sig.parameters.values():
            if p.name in hidden or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            default = ... if p.default is p.empty else p.default
            fields[p.name] = (hints.get(p.name, Any), default)
        model = create_model(f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields)
        params = _strip_titles(model.model_json_schema())
        params.pop("additionalProperties", None)
        for pname, desc in docs.items():
            if pname in params.get("properties", {}) and desc:
                params["properties"][pname]["description"] = desc
        params.setdefault("properties", {})
        params.setdefault("required", [])
        schema = {"type": "function", "function": {"name": name, "description": summary or name, "parameters": params}}
        return cls(fn, name, model, schema, tuple(h for h in hidden if h in sig.parameters))


def _render_result(value: Any, limit: int) -> str:
    if value is None:
        text = "(no output)"
    elif isinstance(value, str):
        text = value
    elif isinstance(value, dict | list | tuple | int | float | bool):
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = str(value)
    else:
        text = str(value)
    return text if len(text) <= limit else text[:limit] + f"... [truncated {len(text) - limit} chars]"


def _validation_summary(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "arguments"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


class ToolEnv(Environment):
    """Multi-turn tool use; see the module docstring."""

    def __init__(
        self,
        tools: Iterable[Callable[..., Any]] = (),
        *,
        state_args: Iterable[str] = (),
        tool_timeout_s: float = 30.0,
        max_result_chars: int = 4000,
        stop_errors: tuple[type[BaseException], ...] = (EpisodeError,),
        show_tools: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.show_tools = show_tools
        self.state_args = tuple(state_args)
        self.tools: dict[str, Tool] = {}
        self.tool_timeout_s = tool_timeout_s
        self.max_result_chars = max_result_chars
        self.stop_errors = stop_errors
        for fn in tools:
            self.add_tool(fn)

    def add_tool(self, fn: Callable[..., Any], state_args: Iterable[str] = ()) -> Tool:
        tool = Tool.from_function(fn, (*self.state_args, *state_args))
        if tool.name in self.tools:
            raise ValueError(f"two tools named {tool.name!r}")
        self.tools[tool.name] = tool
        return tool

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """Schemas given to the chat template; ``show_tools=False`` keeps them out of the prompt
        (a tiny model trained on the task does not need to read them)."""
        if not self.show_tools:
            return None
        return [t.schema for t in self.tools.values()] or None

    def parse_assistant(self, text: str, state: State) -> Message:
        """Split the model's text with its tool-call format (``state.tool_parser``)."""
        parsed = get_parser(state.tool_parser).parse(text)
        state["parse_errors"] = parsed.errors
        return Message("assistant", parsed.content, tool_calls=parsed.tool_calls)

    async def update_tool_args(self, tool: Tool, args: dict[str, Any], state: State) -> dict[str, Any]:
        """Fill hidden arguments. Override to inject per-episode resources differently."""
        for name in tool.hidden:
            if name == "state":
                args["state"] = state
            elif name in state:
                args[name] = state[name]
            else:
                raise EpisodeError(f"tool {tool.name!r} needs state[{name!r}], which setup() did not provide")
        return args

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        errors = state.pop("parse_errors", [])
        if not assistant_msg.tool_calls and not errors:
            state.done = True  # the model answered instead of calling a tool
            return []
        replies = []
        for err in errors:
            state.count("tool_errors")
            state.count("tool_parse_errors")
            replies.append(Message("tool", f"Error: {err}"))
        for call in assistant_msg.tool_calls:
            state.count("tool_calls")
            if call.name in self.tools:
                state.count(f"tool_calls/{call.name}")
            replies.append(Message("tool", await self.call_tool(call, state), tool_call_id=call.id, name=call.name))
        return replies

    async def call_tool(self, call: ToolCall, state: State) -> str:
        """Run one call; any failure the model caused comes back as ``Error: ...`` text."""

        def fail(kind: str, message: str) -> str:
            state.count("tool_errors")
            state.count(f"tool_{kind}")
            if kind == "raised":  # named: a tool that always raises is the env's bug (env test)
                state.count(f"tool_raised/{call.name}")
            return f"Error: {message}"

        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return fail("unknown", f"unknown tool {call.name!r}; available tools: {known}")
        try:
            raw = json.loads(call.arguments or "{}")
        except (ValueError, RecursionError):
            return fail("bad_args", f"arguments of {call.name!r} are not valid JSON")
        if not isinstance(raw, dict):
            return fail("bad_args", f"arguments of {call.name!r} must be a JSON object")
        try:
            validated = tool.args_model.model_validate(raw)
        except ValidationError as e:
            return fail("bad_args", f"invalid arguments for {call.name!r}: {_validation_summary(e)}")
        kwargs = {name: getattr(validated, name) for name in type(validated).model_fields}
        kwargs = await self.update_tool_args(tool, kwargs, state)
        # the call runs inside the episode's own task (no wait_for task that a repeated
        # cancellation could leave running after the episode ended, on a released sandbox)
        limit = asyncio.timeout(self.tool_timeout_s)
        try:
            async with limit:
                if inspect.iscoroutinefunction(tool.fn):
                    result = await tool.fn(**kwargs)
                else:
                    result = await asyncio.to_thread(tool.fn, **kwargs)
                    if inspect.isawaitable(result):
                        result = await result
        except TimeoutError as e:
            if not limit.expired():  # the tool's own TimeoutError: it raised
                return fail("raised", f"TimeoutError: {e}"[: self.max_result_chars])
            return fail("timeouts", f"tool {call.name!r} timed out after {self.tool_timeout_s:g}s")
        except self.stop_errors as e:
            if error_kind_of(e) == "env":  # raised inside the tool: the tool's failure, named
                raise ToolError(f"tool {call.name!r} failed: {type(e).__name__}: {e}"[:500]) from e
            raise
        except Exception as e:
            return fail("raised", f"{type(e).__name__}: {e}"[: self.max_result_chars])
        return _render_result(result, self.max_result_chars)
