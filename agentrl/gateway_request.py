"""What an agent program's chat request may hold: the gateway's checks, before a call is admitted.

:func:`read_request` turns a ``/chat/completions`` body into (messages, tools, max_tokens, stop,
whether to parse tool calls), or raises :class:`Refused` (an OpenAI-style error the program gets).
Every field is one of: served; the run's own instead, so ignored (sampling is what the trainer
rebuilds μ from; bookkeeping; vLLM's sampling extras); ignored with one warning
(``chat_template_kwargs``); refused with what to do instead when it asks for something
(``logprobs: true``, a JSON response format, the legacy functions API, ...); or unknown, refused
as the OpenAI API refuses it.  Nothing here samples or records: a refused request leaves no trace.
"""

from __future__ import annotations

import warnings
from typing import Any

from agentrl.types import ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")

# request fields: served; the run's own instead (sampling, bookkeeping); refused, with why
SERVED = frozenset({"messages", "model", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "stop", "n",
                    "stream", "stream_options"})  # fmt: skip
IGNORED = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "user", "metadata", "store", "parallel_tool_calls", "service_tier",
                     "reasoning_effort", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                     "verbosity", "moderation",
                     # vLLM's sampling extras, sent through the SDK's extra_body
                     "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output", "length_penalty"})  # fmt: skip
# ignored, with one warning per process: the program asks for a rendering the run does not make
WARNED = {"chat_template_kwargs": "prompts are rendered with the model's chat template as the run configures it"}
_warned: set[str] = set()
UNSERVED = {
    "logprobs": "the gateway returns no logprobs (the run records the sampled ones itself)",
    "top_logprobs": "the gateway returns no logprobs (the run records the sampled ones itself)",
    "response_format": "decoding is not constrained: ask for the format in the prompt",
    "functions": "the legacy functions API is not served: pass tools=[{'type': 'function', ...}]",
    "function_call": "the legacy functions API is not served: pass tool_choice",
    "logit_bias": "the run's sampling is what the trainer rebuilds μ from: token biases cannot be applied",
    "modalities": "text only", "audio": "text only", "prediction": "predicted outputs are not served",
    "web_search_options": "no web search",
}  # values that ask for nothing (false, null, empty, text) pass: _asks_for_something


class Refused(Exception):
    """A call the gateway answers with an OpenAI-style error (status, message, code)."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def read_request(body: Any) -> tuple[list[dict], list[dict] | None, int | None, list[str] | None, bool]:
    """Check a chat request: (messages, tools, max_tokens, stop, whether to parse tool calls)."""
    if not isinstance(body, dict):
        raise Refused(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key in SERVED or key in IGNORED:
            continue
        if key in WARNED:
            if key not in _warned:
                _warned.add(key)
                warnings.warn(f"agentrl gateway: an agent program sent {key!r}, which is ignored: {WARNED[key]}",
                              stacklevel=2)  # fmt: skip
            continue
        if key not in UNSERVED:
            raise Refused(400, f"Unrecognized request argument supplied: {key}"[:300])
        if _asks_for_something(key, value):
            raise Refused(400, f"'{key}' is not supported by the agentrl gateway: {UNSERVED[key]}")
    if not isinstance(body.get("model"), (str, type(None))):
        raise Refused(400, "'model' must be a string")
    if body.get("stream") not in (None, True, False):
        raise Refused(400, "'stream' must be a boolean")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and options.get("include_usage") in (None, True, False)):
        raise Refused(400, "'stream_options' must be an object like {'include_usage': true}")
    if body.get("n", 1) not in (1, None):
        raise Refused(400, "n must be 1: the gateway samples one reply per call", "invalid_request_error")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise Refused(400, "'messages' must be a non-empty list")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise Refused(400, "'tools' must be a list of tool objects")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise Refused(400, "'max_tokens' must be a positive integer")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise Refused(400, "'stop' must be a string or a list of strings")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none", "required") and not isinstance(choice, dict):
        raise Refused(400, "'tool_choice' must be 'auto', 'none', 'required' or a named function")
    return messages, tools, max_tokens, stop, tools is not None and choice != "none"


def _asks_for_something(key: str, value: Any) -> bool:
    """Whether an :data:`UNSERVED` field asks for what the gateway does not give (false, null, empty,
    a text response format and text-only modalities ask for nothing)."""
    if not value:  # null, false, 0 (top_logprobs: 0 asks for none), "", [] and {}
        return False
    if key == "response_format":
        return not (isinstance(value, dict) and value.get("type") == "text")
    if key == "modalities":
        return value != ["text"]
    return True


def _message(m: Any, i: int) -> dict[str, Any]:
    """One message in the form the template gets and calls are compared in."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise Refused(400, f"messages[{i}] needs a role in {list(ROLES)}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise Refused(400, f"messages[{i}]: only text content parts are supported")
        content = "".join(str(p.get("text") or "") for p in content)
    elif content is not None and not isinstance(content, str):
        raise Refused(400, f"messages[{i}].content must be a string, text parts or null")
    role = "system" if m["role"] == "developer" else m["role"]
    out: dict[str, Any] = {"role": role, "content": content or ""}
    calls = m.get("tool_calls")
    if calls:
        try:
            out["tool_calls"] = [ToolCall.from_dict(tc).to_dict() for tc in calls]
        except (KeyError, TypeError, AttributeError):
            raise Refused(400, f"messages[{i}].tool_calls must be OpenAI tool-call objects") from None
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out
