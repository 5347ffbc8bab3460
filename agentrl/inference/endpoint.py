"""One inference server as the client sees it: its address, HTTP session, throttle and load,
and how its error replies read.

:class:`~agentrl.inference.client.PolicyClient` routes over several of these; this module
knows nothing of sampling.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import aiohttp
from asyncio_throttle import Throttler

from agentrl.errors import MalformedResponse
from agentrl.inference.chat import ChatCaps


def url_root(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def error_message(text: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the raw text."""
    try:
        body = json.loads(text)
        err = body.get("error", body) if isinstance(body, dict) else body
        return str(err.get("message", text) if isinstance(err, dict) else err)[:300]
    except ValueError:
        return text[:300]


def is_context_error(text: str, code: Any = None) -> bool:
    """Whether an error reply says the prompt is longer than the model's context."""
    low = text.lower()
    return code == "context_length_exceeded" or "context_length_exceeded" in low or "maximum context length" in low


class HTTPStatusError(Exception):
    """A non-2xx reply: its status and body, for the caller to classify."""

    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status, self.text = status, text


class Endpoint:
    """One inference server: its address, HTTP sessions, throttle and load."""

    def __init__(self, base_url: str, api_key: str, timeout: float, requests_per_s: float = 0.0):
        self.root = url_root(base_url)
        self.chat_caps = ChatCaps()  # what its chat route accepts and returns (agentrl.inference.chat)
        self._chat_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.throttle = Throttler(rate_limit=max(1, math.ceil(requests_per_s)), period=1.0) if requests_per_s else None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0  # requests being served now
        self.pinned = 0  # callers bound to this endpoint (episodes of pinned groups)
        self.calls = 0

    @property
    def load(self) -> int:
        return self.in_flight + self.pinned

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # a session is bound to one event loop; no connection cap: every in-flight
            # request needs its own HTTP/1.1 connection
            self._loop = loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=self.timeout, headers=self.headers
            )
        return self._session

    async def get(self, path: str) -> Any:
        """GET JSON, return it parsed; non-2xx raises :class:`HTTPStatusError`."""
        return self._json(path, await self._send("GET", path))

    async def text(self, path: str) -> str:
        """GET a non-JSON route (vLLM's Prometheus ``/metrics``)."""
        return await self._send("GET", path)

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST JSON, return parsed JSON; non-2xx raises :class:`HTTPStatusError`."""
        return self._json(path, await self._send("POST", path, json.dumps(body, separators=(",", ":"))))

    async def _send(self, method: str, path: str, data: str | None = None) -> str:
        async with self._http().request(method, self.root + path, data=data) as r:
            text = await r.text()
            if r.status >= 400:
                raise HTTPStatusError(r.status, text)
            return text

    def _json(self, path: str, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError as e:
            raise MalformedResponse(f"{self.root}{path} answered non-JSON: {text[:200]!r}") from e

    def chat_lock(self) -> asyncio.Lock:
        """A lock for the one capability probe, bound to the running loop."""
        loop = asyncio.get_running_loop()
        if self._chat_lock is None or self._chat_lock[0] is not loop:
            self._chat_lock = (loop, asyncio.Lock())
        return self._chat_lock[1]

    def rebase(self, base_url: str) -> None:
        """The engine behind this endpoint came back at another address (a restarted actor);
        pinned groups keep their pin and load counts stay."""
        self.root = url_root(base_url)

    async def close(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
