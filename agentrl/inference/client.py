"""PolicyClient: the one async client the rest of agentrl uses to sample from a policy.

Built on ``openai.AsyncOpenAI`` (vLLM's extra fields travel in ``extra_body``), so it talks
to the embedded engine and to ``vllm serve`` alike.  Every call returns
:class:`Completion` objects carrying the exact sampled token ids, their sampling
logprobs μ and the weight version of every token.

Several base URLs are load-balanced (fewest requests in flight, ties round-robin).  A
transient failure (connection error, timeout, 5xx, 429) is retried on the next endpoint
with backoff; after ``max_retries`` retries the call raises :class:`EndpointError`, which
an environment records as an errored episode.  A prompt longer than the model's context
raises :class:`ContextLengthExceeded` immediately (stop reason ``prompt_too_long``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import openai

from agentrl.inference.render import render_chat_ids
from agentrl.types import Message, SamplingParams, ToolCall

T = TypeVar("T")


class EndpointError(Exception):
    """The inference endpoint failed (after retries) or rejected the request."""


class ContextLengthExceeded(EndpointError):
    """The prompt does not fit the model's context window."""


@dataclass
class Completion:
    """One sampled choice, token-exact."""

    text: str
    token_ids: list[int]
    logprobs: list[float]  # μ: sampling logprob of each token in token_ids
    versions: list[int]  # weight version that produced each token
    finish_reason: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)


def _root(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _is_context_error(e: openai.APIStatusError) -> bool:
    body = e.body if isinstance(e.body, dict) else {}
    err = body.get("error", body) if isinstance(body, dict) else {}
    code = err.get("code") if isinstance(err, dict) else None
    text = str(e).lower()
    return code == "context_length_exceeded" or "maximum context length" in text or "context length" in text


def _error_message(text: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the raw text."""
    try:
        body = json.loads(text)
        err = body.get("error", body) if isinstance(body, dict) else body
        return str(err.get("message", text) if isinstance(err, dict) else err)[:300]
    except ValueError:
        return text[:300]


class _HTTPStatus(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status, self.text = status, text


class _Endpoint:
    def __init__(self, base_url: str, api_key: str, timeout: float):
        self.root = _root(base_url)
        self.openai = openai.AsyncOpenAI(base_url=self.root + "/v1", api_key=api_key, timeout=timeout, max_retries=0)
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST JSON, return parsed JSON; non-2xx raises :class:`_HTTPStatus`."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # (a session is bound to one event loop; a client reused under a new loop gets a new one)
            # no connection cap: every in-flight request needs its own HTTP/1.1 connection
            self._loop = loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=self.timeout, headers=self.headers
            )
        async with self._session.post(self.root + path, data=json.dumps(body, separators=(",", ":"))) as r:
            text = await r.text()
            if r.status >= 400:
                raise _HTTPStatus(r.status, text)
            return json.loads(text)

    async def close(self) -> None:
        await self.openai.close()
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()


class PolicyClient:
    """Async sampling client over one or more OpenAI-compatible endpoints (see module doc)."""

    def __init__(
        self,
        base_url: str | list[str],
        model: str,
        *,
        api_key: str = "EMPTY",
        timeout: float = 120,
        max_retries: int = 3,
        default_version: int = 0,
        tokenizer: Any = None,
    ):
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("PolicyClient needs at least one base_url")
        self.model = model
        self.max_retries = max_retries
        # used when a server does not report per-token versions (plain vLLM)
        self.default_version = default_version
        self._endpoints = [_Endpoint(u, api_key, timeout) for u in urls]
        # A local copy of the served model's tokenizer (a path or a HF tokenizer) renders
        # prompts in-process: same template, same ids, no /tokenize round trip per turn.
        if isinstance(tokenizer, str | os.PathLike):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer
        self._rr = itertools.count()

    @property
    def base_urls(self) -> list[str]:
        return [e.root + "/v1" for e in self._endpoints]

    # ------------------------------------------------------------------ plumbing

    def _pick(self, exclude: _Endpoint | None = None) -> _Endpoint:
        candidates = [e for e in self._endpoints if e is not exclude] or self._endpoints
        low = min(e.in_flight for e in candidates)
        best = [e for e in candidates if e.in_flight == low]
        return best[next(self._rr) % len(best)]

    async def _call(self, fn: Callable[[_Endpoint], Awaitable[T]], what: str) -> T:
        last: Exception | None = None
        ep: _Endpoint | None = None
        for attempt in range(self.max_retries + 1):
            ep = self._pick(exclude=ep if last is not None else None)
            ep.in_flight += 1
            try:
                return await fn(ep)
            except openai.BadRequestError as e:
                if _is_context_error(e):
                    raise ContextLengthExceeded(f"{what}: {e.message}") from e
                raise EndpointError(f"{what} rejected by {ep.root}: {e.message}") from e
            except (openai.NotFoundError, openai.AuthenticationError, openai.PermissionDeniedError) as e:
                raise EndpointError(f"{what} rejected by {ep.root}: {e.message}") from e
            except openai.APIStatusError as e:
                if e.status_code < 500 and e.status_code not in (408, 409, 429):
                    if _is_context_error(e):
                        raise ContextLengthExceeded(f"{what}: {e.message}") from e
                    raise EndpointError(f"{what} rejected by {ep.root}: {e.message}") from e
                last = e
            except _HTTPStatus as e:
                if e.status < 500 and e.status not in (408, 409, 429):
                    if "context_length_exceeded" in e.text or "maximum context length" in e.text:
                        raise ContextLengthExceeded(f"{what}: {_error_message(e.text)}") from e
                    raise EndpointError(f"{what} rejected by {ep.root}: {_error_message(e.text)}") from e
                last = e
            except (openai.APIConnectionError, openai.APITimeoutError, aiohttp.ClientError, TimeoutError) as e:
                last = e
            finally:
                ep.in_flight -= 1
            if attempt < self.max_retries:
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt) * (0.5 + random.random()))
        raise EndpointError(f"{what} failed after {self.max_retries + 1} attempts: {last!r}") from last

    @staticmethod
    def _sampling_kwargs(s: SamplingParams, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "n": n}
        if s.seed is not None:
            kwargs["seed"] = s.seed
        if s.stop:
            kwargs["stop"] = s.stop
        extra: dict[str, Any] = {"return_token_ids": True, "skip_special_tokens": True}
        if s.top_k and s.top_k > 0:
            extra["top_k"] = s.top_k
        return kwargs, extra

    def _versions(self, choice: Any, n_tokens: int) -> list[int]:
        versions = getattr(choice, "token_versions", None)
        if isinstance(versions, list) and len(versions) == n_tokens:
            return [int(v) for v in versions]
        return [self.default_version] * n_tokens

    # ------------------------------------------------------------------ sampling

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Completion]:
        """Sample continuations of an exact token-id prompt (``/v1/completions``).

        The hot path of every rollout, so it speaks the OpenAI wire format directly over
        aiohttp instead of through the SDK's request/response models (~10× less CPU).
        """
        kwargs, extra = self._sampling_kwargs(sampling, n)
        body = {"model": self.model, "prompt": prompt_ids, "logprobs": 0, **kwargs, **extra}
        start_version = self.default_version  # for servers without per-token versions (vLLM)
        resp = await self._call(lambda ep: ep.post("/v1/completions", body), "completion")
        out = []
        for ch in sorted(resp["choices"], key=lambda c: c.get("index", 0)):
            ids = ch.get("token_ids") or []
            lps = (ch.get("logprobs") or {}).get("token_logprobs") or []
            if len(lps) != len(ids):
                raise EndpointError(f"endpoint returned {len(ids)} token ids but {len(lps)} logprobs")
            versions = ch.get("token_versions")
            if not (isinstance(versions, list) and len(versions) == len(ids)):
                versions = [start_version] * len(ids)
            out.append(
                Completion(
                    text=ch.get("text") or "",
                    token_ids=ids,
                    logprobs=lps,
                    versions=versions,
                    finish_reason=ch.get("finish_reason"),
                    prompt_token_ids=ch.get("prompt_token_ids") or resp.get("prompt_token_ids") or prompt_ids,
                )
            )
        return out

    async def chat(
        self,
        messages: list[Message] | list[dict[str, Any]],
        sampling: SamplingParams,
        tools: list[dict[str, Any]] | None = None,
        n: int = 1,
    ) -> list[Completion]:
        """Sample assistant replies (``/v1/chat/completions``); tool calls come back parsed."""
        kwargs, extra = self._sampling_kwargs(sampling, n)
        msgs = [m.to_dict() if isinstance(m, Message) else m for m in messages]
        if tools:
            kwargs["tools"] = tools

        async def go(ep: _Endpoint):
            return await ep.openai.chat.completions.create(
                model=self.model, messages=msgs, logprobs=True, extra_body=extra, **kwargs
            )

        resp = await self._call(go, "chat completion")
        prompt_ids = list(getattr(resp, "prompt_token_ids", None) or [])
        out = []
        for ch in sorted(resp.choices, key=lambda c: c.index):
            ids = list(getattr(ch, "token_ids", None) or [])
            content = ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
            lps = [float(c.logprob) for c in content]
            if len(lps) != len(ids):
                raise EndpointError(f"endpoint returned {len(ids)} token ids but {len(lps)} logprobs")
            calls = [
                ToolCall(name=tc.function.name, arguments=tc.function.arguments or "{}", id=tc.id)
                for tc in (ch.message.tool_calls or [])
            ]
            out.append(
                Completion(
                    text=ch.message.content or "",
                    token_ids=ids,
                    logprobs=lps,
                    versions=self._versions(ch, len(ids)),
                    finish_reason=ch.finish_reason,
                    tool_calls=calls,
                    prompt_token_ids=prompt_ids,
                )
            )
        return out

    # ------------------------------------------------------------------ tokens

    async def tokenize(
        self,
        *,
        messages: list[Message] | list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of a prompt string, or of messages rendered by the server's chat template."""
        if (messages is None) == (prompt is None):
            raise ValueError("tokenize needs exactly one of messages= or prompt=")
        if self.tokenizer is not None:
            if prompt is not None:
                return self.tokenizer.encode(prompt, add_special_tokens=False)
            dicts = [m.to_dict() if isinstance(m, Message) else m for m in messages]
            return render_chat_ids(self.tokenizer, dicts, tools, add_generation_prompt)
        body: dict[str, Any] = {"model": self.model}
        if messages is not None:
            body["messages"] = [m.to_dict() if isinstance(m, Message) else m for m in messages]
            body["add_generation_prompt"] = add_generation_prompt
            if tools:
                body["tools"] = tools
        else:
            body["prompt"] = prompt
            body["add_special_tokens"] = False

        return list((await self._call(lambda ep: ep.post("/tokenize", body), "tokenize"))["tokens"])

    async def detokenize(self, ids: list[int]) -> str:
        body = {"model": self.model, "tokens": list(ids)}
        return (await self._call(lambda ep: ep.post("/detokenize", body), "detokenize"))["prompt"]

    async def close(self) -> None:
        for ep in self._endpoints:
            await ep.close()

    async def __aenter__(self) -> PolicyClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
