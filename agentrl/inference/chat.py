"""The hosted-API-safe chat path: what an endpoint's ``/v1/chat/completions`` accepts, the
request bodies built for it, and its replies read back into :class:`~agentrl.types.Completion`.

Pure functions and one small record; :class:`~agentrl.inference.client.PolicyClient` does
the HTTP.  The rules:

- **Probe once, send only what is accepted.**  vLLM-style extensions (``top_k``, ``min_p``,
  ``return_token_ids``, ``skip_special_tokens``) and ``logprobs`` are sent until the
  endpoint rejects one with HTTP 400/422 (the OpenAI API answers "Unrecognized request
  argument supplied: top_k"); :func:`rejected_fields` reads which, the field goes into
  :attr:`ChatCaps.rejected` and the request is sent again without it.  ``max_tokens``
  becomes ``max_completion_tokens`` where the endpoint asks for that.  An extension at its
  neutral value (``top_k=-1``, ``min_p=0``) is simply left out where refused; one the
  sampling really needs raises :class:`~agentrl.errors.EndpointError` instead of silently
  sampling from another distribution.
- **Token data only when it is whole.**  Token ids and their logprobs are kept together;
  logprobs without token ids (a hosted API) are dropped and, once the probe has seen that,
  no longer asked for.  Evaluation needs neither; ``usage`` counts stand in for lengths.
- **Raw JSON, no SDK.**  Requests are plain dicts and replies plain ``json.loads`` output:
  the OpenAI SDK's model building cost ~4 CPU-ms per call (``benchmarks/rollout_overhead.py
  --path chat`` measures both).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import EndpointError, MalformedResponse
from agentrl.types import Completion, SamplingParams, ToolCall, new_id

# Request fields an OpenAI-like server may refuse, in the order they are given up.
EXTENSIONS = ("top_k", "min_p", "return_token_ids", "skip_special_tokens")
OPTIONAL = (*EXTENSIONS, "logprobs", "seed")
# how servers say "a field I do not know" without naming it
_REFUSAL = re.compile(r"unrecognized|unknown (?:field|param|argument|key)|extra (?:inputs|fields)|not permitted", re.I)


@dataclass
class ChatCaps:
    """What one endpoint's chat route accepts and returns, learned from its replies."""

    rejected: set[str] = field(default_factory=set)  # request fields it answered 400/422 to
    token_ids: bool | None = None  # replies carry token ids (None: not known yet)
    logprobs: bool | None = None  # replies carry per-token logprobs
    max_tokens_field: str = "max_tokens"  # or max_completion_tokens (newer OpenAI models)
    probed: bool = False

    def summary(self) -> str:
        """One line for the user: what this endpoint gives the chat path."""
        ext = [f for f in EXTENSIONS if f not in self.rejected]
        parts = [
            f"vLLM extensions: {', '.join(ext) if ext else 'none accepted'}",
            f"token ids: {'yes' if self.token_ids else 'no'}",
            f"logprobs: {'yes' if self.logprobs else 'no'}",
        ]
        if self.max_tokens_field != "max_tokens":
            parts.append(f"uses {self.max_tokens_field}")
        return "; ".join(parts)


def _neutral(name: str, value: Any) -> bool:
    """Is leaving ``name`` out the same as sending ``value`` (the OpenAI default)?"""
    if name == "top_k":
        return value is None or value <= 0
    if name == "min_p":
        return not value
    return True  # return_token_ids, skip_special_tokens, logprobs, seed change no distribution


def chat_body(
    model: str, messages: list[dict[str, Any]], sampling: SamplingParams, tools: list[dict[str, Any]] | None,
    n: int, caps: ChatCaps, *, where: str = "the endpoint",
) -> dict[str, Any]:
    """The request for ``caps``: every sampling field the endpoint accepts, explicitly (so
    server-side defaults never change the distribution), and nothing it refused."""
    body: dict[str, Any] = {"model": model, "messages": messages, caps.max_tokens_field: sampling.max_tokens,
                            "temperature": sampling.temperature, "top_p": sampling.top_p, "n": n}
    optional: dict[str, Any] = {
        "top_k": sampling.top_k if sampling.top_k and sampling.top_k > 0 else -1, "min_p": sampling.min_p,
        "return_token_ids": True, "skip_special_tokens": True,
    }  # fmt: skip
    if caps.token_ids is not False:  # logprobs are only kept next to token ids
        optional["logprobs"] = True
    if sampling.seed is not None:
        optional["seed"] = sampling.seed
    for name, value in optional.items():
        if name not in caps.rejected:
            body[name] = value
        elif not _neutral(name, value):
            raise EndpointError(f"{where} does not accept {name!r}, but the sampling sets {name}={value!r}; "
                                f"leave {name} at its default for this endpoint")
    if sampling.stop:
        body["stop"] = sampling.stop
    if tools:
        body["tools"] = tools
    return body


def rejected_fields(status: int, message: str, body: dict[str, Any]) -> list[str]:
    """The optional fields of ``body`` a 400/422 refused (what to drop before sending again);
    ``["max_tokens"]`` when the endpoint wants ``max_completion_tokens``; [] otherwise."""
    if status not in (400, 422):
        return []
    low = message.lower()
    if "max_tokens" in body and "max_tokens" in low and "max_completion_tokens" in low:
        return ["max_tokens"]
    named = [f for f in OPTIONAL if f in body and re.search(rf"\b{f}\b", low)]
    if named:
        return named
    if _REFUSAL.search(low):  # refused something unnamed: give up every extension at once
        return [f for f in EXTENSIONS if f in body]
    return []


def drop_fields(body: dict[str, Any], fields: list[str], caps: ChatCaps) -> dict[str, Any]:
    """``body`` without ``fields`` (remembered in ``caps``); ``max_tokens`` is renamed instead."""
    body = dict(body)
    for f in fields:
        if f == "max_tokens":
            caps.max_tokens_field = "max_completion_tokens"
            body["max_completion_tokens"] = body.pop("max_tokens")
            continue
        caps.rejected.add(f)
        value = body.pop(f, None)
        if not _neutral(f, value):
            raise EndpointError(f"the endpoint does not accept {f!r}, but the sampling sets {f}={value!r}")
    return body


def _text(content: Any) -> str:
    """Message content as text (some APIs answer a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""


def _tool_calls(message: dict[str, Any]) -> list[ToolCall]:
    calls = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MalformedResponse(f"the endpoint returned a tool call without a function name: {str(tc)[:200]}")
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args if args is not None else {}, ensure_ascii=False)
        calls.append(ToolCall(name=fn["name"], arguments=args or "{}", id=tc.get("id") or new_id("call_")))
    return calls


def read_reply(resp: Any, n: int, caps: ChatCaps, default_version: int) -> list[Completion]:
    """A chat reply → one :class:`Completion` per choice; learns token ids/logprobs into ``caps``."""
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list):
        raise MalformedResponse("the endpoint's reply has no 'choices' list")
    prompt_ids = resp.get("prompt_token_ids") or []
    usage = resp.get("usage") if isinstance(resp.get("usage"), dict) else {}
    out = []
    for ch in sorted(choices, key=lambda c: c.get("index", 0)):
        message = ch.get("message") or {}
        ids = ch.get("token_ids") or []
        entries = (ch.get("logprobs") or {}).get("content") or []
        if caps.token_ids is None:
            caps.token_ids, caps.logprobs = bool(ids), bool(entries)
        lps: list[float] = []
        if ids and entries:
            if len(entries) != len(ids):
                raise MalformedResponse(f"endpoint returned {len(ids)} token ids but {len(entries)} logprobs")
            lps = [float(e["logprob"]) for e in entries]
        versions = ch.get("token_versions")
        if not (isinstance(versions, list) and len(versions) == len(ids)):
            versions = [default_version] * len(ids)
        support = ch.get("token_support")
        if not (isinstance(support, list) and len(support) == len(ids) and lps):
            support = []
        out.append(Completion(
            text=_text(message.get("content")), token_ids=ids, logprobs=lps, versions=versions if lps or ids else [],
            finish_reason=ch.get("finish_reason"), support=support, tool_calls=_tool_calls(message),
            prompt_token_ids=prompt_ids, prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids)),
            completion_tokens=len(ids) or (int(usage.get("completion_tokens") or 0) if n == 1 else 0),
        ))  # fmt: skip
    return out


__all__ = ["EXTENSIONS", "ChatCaps", "chat_body", "drop_fields", "read_reply", "rejected_fields"]
