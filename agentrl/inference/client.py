"""PolicyClient: the one client the rest of agentrl samples a policy through.

It talks to the embedded engine and to ``vllm serve`` alike (OpenAI API plus vLLM's
token-exact fields) and is the one owner of:

- **load balancing** over several base URLs: least outstanding work (requests in flight
  plus episodes pinned), ties round-robin.  :meth:`PolicyClient.pin` binds a caller (an
  episode, or a whole group so its shared prompt hits one engine's cache) to one endpoint;
  its calls go there first and fail over to the others;
- **retries** (:mod:`agentrl.retry`): a transient failure (connection error, timeout, 5xx,
  429) is retried on another endpoint with jittered backoff; after ``max_retries`` the call
  raises :class:`~agentrl.errors.EndpointError`.  A prompt longer than the model's context
  raises :class:`~agentrl.errors.ContextLengthExceeded` at once; a reply of the wrong shape
  :class:`~agentrl.errors.MalformedResponse`;
- **request-rate throttling** per endpoint (asyncio-throttle), when ``requests_per_s`` is set.

Every call returns :class:`~agentrl.types.Completion` records carrying the exact sampled
token ids, their behaviour logprobs μ, their support and the weight version of every token.
The chat path (:meth:`PolicyClient.chat`, for endpoints without token routes) is
hosted-API-safe: it sends each endpoint only the fields it accepts and keeps token data only
where it comes back (:mod:`agentrl.inference.chat`).  Both paths speak raw JSON over aiohttp.
``tool_parser`` names the served model's tool-call format (:mod:`agentrl.tool_format`); the
episode loop parses the model's text with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from asyncio_throttle import Throttler

from agentrl.auth import client_key
from agentrl.errors import (
    AgentrlError,
    ContextLengthExceeded,
    EndpointError,
    EndpointProbeError,
    MalformedResponse,
)
from agentrl.inference.chat import ChatCaps, chat_body, drop_fields, read_reply, rejected_fields
from agentrl.render import RenderCache
from agentrl.retry import Transient, is_transient_status, retrying
from agentrl.tool_format import get_parser, resolve_tool_parser
from agentrl.types import Completion, Message, SamplingParams

T = TypeVar("T")


def url_root(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A local HF tokenizer; a one-line :class:`~agentrl.errors.AgentrlError` when there is none."""
    from pathlib import Path

    if not Path(path).is_dir():
        raise AgentrlError(f"tokenizer dir {str(path)!r} is not a directory (expected a HF model or tokenizer dir)")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise AgentrlError(f"cannot load a tokenizer from {str(path)!r}: {type(e).__name__}: {str(e)[:200]}") from None
    if not getattr(tok, "chat_template", None):
        raise AgentrlError(f"the tokenizer in {str(path)!r} has no chat template to render prompts with")
    return tok


def _error_message(text: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the raw text."""
    try:
        body = json.loads(text)
        err = body.get("error", body) if isinstance(body, dict) else body
        return str(err.get("message", text) if isinstance(err, dict) else err)[:300]
    except ValueError:
        return text[:300]


def _is_context_error(text: str, code: Any = None) -> bool:
    low = text.lower()
    return code == "context_length_exceeded" or "context_length_exceeded" in low or "maximum context length" in low


class _HTTPStatus(Exception):
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
        async with self._http().get(self.root + path) as r:
            text = await r.text()
            if r.status >= 400:
                raise _HTTPStatus(r.status, text)
            try:
                return json.loads(text)
            except ValueError as e:
                raise MalformedResponse(f"{self.root}{path} answered non-JSON: {text[:200]!r}") from e

    async def text(self, path: str) -> str:
        """GET a non-JSON route (vLLM's Prometheus ``/metrics``)."""
        async with self._http().get(self.root + path) as r:
            body = await r.text()
            if r.status >= 400:
                raise _HTTPStatus(r.status, body)
            return body

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST JSON, return parsed JSON; non-2xx raises :class:`_HTTPStatus`."""
        async with self._http().post(self.root + path, data=json.dumps(body, separators=(",", ":"))) as r:
            text = await r.text()
            if r.status >= 400:
                raise _HTTPStatus(r.status, text)
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


class PolicyClient:
    """Async sampling client over one or more OpenAI-compatible endpoints (see module doc)."""

    def __init__(
        self,
        base_url: str | list[str],
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 120,
        max_retries: int = 3,
        default_version: int = 0,
        tokenizer: Any = None,
        requests_per_s: float = 0.0,
        cache_salt: bool = False,
        tool_parser: str | None = None,
        support_logprobs: int = 0,
        vllm_generate: bool = False,
    ):
        """``api_key``: sent as ``Authorization: Bearer`` (default ``AGENTRL_API_KEY``, else a
        placeholder).  ``cache_salt``: salt token requests with the weight version (vLLM's ``cache_salt``), so a
        server's prefix cache never serves K/V computed by older weights.  ``support_logprobs``
        (vLLM: its ``--max-logprobs``, N): a server that reports no ``token_support`` gives the
        support size K of a top-p/min-p sample through its top-N processed logprobs, where every
        token outside the kept set is at the floor: K = the entries above it, exact when K < N.
        ``vllm_generate``: token requests go to vLLM's ``/inference/v1/generate`` (``vllm serve
        --enable-scale-out``), whose replies say which weight version sampled each token."""
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("PolicyClient needs at least one base_url")
        self.model = model
        self.api_key = api_key or client_key() or "EMPTY"  # rollout workers build their clients with it
        self.max_retries = max_retries
        # used when a server does not report per-token versions (plain vLLM)
        self.default_version = default_version
        self.cache_salt = cache_salt
        self.support_logprobs = support_logprobs
        self.vllm_generate = vllm_generate
        self.endpoints = [Endpoint(u, self.api_key, timeout, requests_per_s) for u in urls]
        # A local copy of the served model's tokenizer (a path or a HF tokenizer) renders
        # prompts in-process: same template, same ids, no /tokenize round trip per turn.
        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self._renders: RenderCache | None = None  # made on first use, for the tokenizer then set
        # the model's tool-call format, read by the episode's parse step (agentrl.tool_format):
        # named, else detected from the local tokenizer's chat template, else hermes
        self.tool_parser = resolve_tool_parser(tool_parser, getattr(tokenizer, "chat_template", None)).name
        self._rr = itertools.count()
        self.retries = 0  # attempts after a transient failure (failovers to another endpoint)

    @property
    def base_urls(self) -> list[str]:
        return [e.root + "/v1" for e in self.endpoints]

    def rebase(self, base_urls: list[str]) -> list[int]:
        """Follow engines that came back at new addresses (``base_urls`` in the order given at
        start); pins and load counts stay.  Returns the indices that moved."""
        moved = [i for i, (e, u) in enumerate(zip(self.endpoints, base_urls, strict=True)) if e.root != url_root(u)]
        for i in moved:
            self.endpoints[i].rebase(base_urls[i])
        return moved

    # ------------------------------------------------------------------ routing

    def _pick(self, exclude: Endpoint | None = None) -> Endpoint:
        candidates = [e for e in self.endpoints if e is not exclude] or self.endpoints
        low = min(e.load for e in candidates)
        best = [e for e in candidates if e.load == low]
        return best[next(self._rr) % len(best)]

    def pin(self, weight: int = 1) -> PinnedClient:
        """A view of this client bound to the least-loaded endpoint (``release()`` when done).

        ``weight`` is how many episodes share the pin (a group): it counts as load there.
        """
        ep = self._pick()
        ep.pinned += weight
        return PinnedClient(self, ep, weight)

    async def _call(self, fn: Callable[[Endpoint], Awaitable[T]], what: str, prefer: Endpoint | None = None) -> T:
        """Run ``fn`` on an endpoint with the retry policy; failures classified (module doc)."""
        tried: list[Endpoint] = []

        async def attempt(i: int) -> T:
            ep = prefer if (i == 0 and prefer is not None) else self._pick(exclude=tried[-1] if tried else None)
            tried.append(ep)
            self.retries += i > 0
            if ep.throttle is not None:
                await ep.throttle.acquire()
            ep.in_flight += 1
            ep.calls += 1
            try:
                return await fn(ep)
            except _HTTPStatus as e:
                raise self._classify(what, ep, e.status, _error_message(e.text), None, e) from e
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                raise Transient(e, ep.root) from e
            finally:
                ep.in_flight -= 1

        return await retrying(attempt, what=what, max_retries=self.max_retries, exhausted=EndpointError)

    @staticmethod
    def _classify(what: str, ep: Endpoint, status: int, message: str, code: Any, cause: Exception) -> Exception:
        if is_transient_status(status):
            return Transient(cause, ep.root)
        if _is_context_error(message, code) or _is_context_error(getattr(cause, "text", "")):
            return ContextLengthExceeded(f"{what}: {message}")
        return EndpointError(f"{what} rejected by {ep.root} (HTTP {status}): {message}")

    # ------------------------------------------------------------------ sampling

    def _sampling_body(self, s: SamplingParams, n: int) -> dict[str, Any]:
        """Every sampling field, explicitly: server-side defaults never change the distribution.
        Special tokens stay in the text where the model's tool-call markers are special tokens
        (``[TOOL_CALLS]``, ``<|python_tag|>``), as vLLM's own tool parsers ask for."""
        body: dict[str, Any] = {
            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "n": n,
            "top_k": s.top_k if s.top_k and s.top_k > 0 else -1, "min_p": s.min_p,
            "return_token_ids": True, "skip_special_tokens": not get_parser(self.tool_parser).special_markers,
        }  # fmt: skip
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop:
            body["stop"] = s.stop
        return body

    def _choice_tokens(self, ch: dict[str, Any], ids: list[int], logprobs: list[float], start_version: int):
        if len(logprobs) != len(ids):
            raise MalformedResponse(f"endpoint returned {len(ids)} token ids but {len(logprobs)} logprobs")
        versions = ch.get("token_versions")
        if not (isinstance(versions, list) and len(versions) == len(ids)):
            versions = [start_version] * len(ids)
        support = ch.get("token_support")
        if not (isinstance(support, list) and len(support) == len(ids)):
            support = []
        return versions, support

    async def complete(
        self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1, *, _prefer: Endpoint | None = None
    ) -> list[Completion]:
        """Sample continuations of an exact token-id prompt (``/v1/completions``).

        The hot path of every rollout, so it speaks the OpenAI wire format directly over
        aiohttp instead of through the SDK's request/response models (~10× less CPU).
        """
        body = {"model": self.model, "prompt": prompt_ids, "logprobs": 0, **self._sampling_body(sampling, n)}
        top_n = self.support_logprobs if _truncates(sampling) else 0
        if top_n:  # K from the top-N processed logprobs, keyed by token id (token texts can collide)
            body.update(logprobs=top_n, return_tokens_as_token_ids=True)
        if self.cache_salt:  # vLLM: prefix-cache blocks are shared only within one weight version
            body["cache_salt"] = f"v{self.default_version}"
        start_version = self.default_version  # for servers without per-token versions
        if self.vllm_generate:
            body = generate_body(body)
            resp = await self._call(lambda ep: ep.post("/inference/v1/generate", body), "completion", _prefer)
            choices = [from_generate(ch, start_version) for ch in _choices(resp)]
        else:
            resp = await self._call(lambda ep: ep.post("/v1/completions", body), "completion", _prefer)
            choices = _choices(resp)
        out = []
        for ch in sorted(choices, key=lambda c: c.get("index", 0)):
            ids = ch.get("token_ids") or []
            lps = (ch.get("logprobs") or {}).get("token_logprobs") or []
            versions, support = self._choice_tokens(ch, ids, lps, start_version)
            if not support and ids and _top_k_only(sampling):  # the support is top_k itself
                support = [sampling.top_k] * len(ids)
            if not support and ids and top_n:
                support = support_from_top(ch, len(ids), top_n)
            out.append(
                Completion(
                    text=ch.get("text") or "", token_ids=ids, logprobs=lps, versions=versions,
                    finish_reason=ch.get("finish_reason"), support=support,
                    prompt_token_ids=ch.get("prompt_token_ids") or resp.get("prompt_token_ids") or prompt_ids,
                    prompt_tokens=len(prompt_ids), completion_tokens=len(ids),
                )
            )  # fmt: skip
        return out

    async def chat(
        self,
        messages: list[Message] | list[dict[str, Any]],
        sampling: SamplingParams,
        tools: list[dict[str, Any]] | None = None,
        n: int = 1,
        *,
        _prefer: Endpoint | None = None,
    ) -> list[Completion]:
        """Sample assistant replies (``/v1/chat/completions``); tool calls come back parsed.

        Hosted-API-safe (:mod:`agentrl.inference.chat`): each endpoint is probed once for the
        fields it accepts and whether token ids/logprobs come back; the request carries only
        what it accepts.  Token ids and logprobs are filled only where the endpoint returns
        them (vLLM, the embedded engine); ``prompt_tokens``/``completion_tokens`` always.
        """
        msgs = [m.to_dict() if isinstance(m, Message) else m for m in messages]

        async def go(ep: Endpoint) -> list[Completion]:
            if not ep.chat_caps.probed:
                await self._probe_chat(ep)
            body = chat_body(self.model, msgs, sampling, tools, n, ep.chat_caps, where=ep.root)
            resp = await self._post_chat(ep, body)
            return read_reply(resp, n, ep.chat_caps, self.default_version)

        return await self._call(go, "chat completion", _prefer)

    async def _post_chat(self, ep: Endpoint, body: dict[str, Any]) -> Any:
        """POST a chat request; a 400/422 that refuses optional fields drops them (remembered
        for the endpoint) and sends again."""
        for _ in range(len(body) + 1):
            try:
                return await ep.post("/v1/chat/completions", body)
            except _HTTPStatus as e:
                message = _error_message(e.text)
                if _is_context_error(message) or _is_context_error(e.text):
                    raise
                fields = rejected_fields(e.status, message, body)
                if not fields:
                    raise
                body = drop_fields(body, fields, ep.chat_caps)
        raise MalformedResponse(f"{ep.root} kept refusing chat requests: {body}")

    async def _probe_chat(self, ep: Endpoint) -> ChatCaps:
        """Learn, with one 1-token request, what ``ep``'s chat route accepts and returns."""
        caps = ep.chat_caps
        async with ep.chat_lock():
            if caps.probed:
                return caps
            body = chat_body(self.model, [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), None, 1,
                             caps, where=ep.root)
            read_reply(await self._post_chat(ep, body), 1, caps, self.default_version)
            caps.probed = True
        return caps

    def capabilities(self) -> list[str]:
        """One line per endpoint whose chat route was probed: what it gives the chat path."""
        return [f"{ep.root}: {ep.chat_caps.summary()}" for ep in self.endpoints if ep.chat_caps.probed]

    # ------------------------------------------------------------------ probing

    async def probe(self, *, token_path: bool, training: bool = False) -> None:
        """Check once, before a run, that every endpoint can serve the chosen path; raise
        :class:`~agentrl.errors.EndpointProbeError` saying what to change.

        Every path: ``/v1/models`` lists ``model``.  Chat path (``token_path=False``): one
        1-token chat request learns what the route accepts and returns (:meth:`capabilities`).
        Token path: prompts are rendered by the local tokenizer, else by ``/tokenize`` (then
        required); where both exist they must agree.  ``training``: ``/v1/completions`` must
        return token ids and sampling logprobs for a token-id prompt (what the loss needs).
        """
        for ep in self.endpoints:
            try:
                await self._probe_models(ep)
                if token_path:
                    await self._probe_tokenize(ep)
                else:
                    await self._probe_chat_route(ep)
                if training:
                    await self._probe_training(ep)
            except _HTTPStatus as e:
                hint = " (check --api-key)" if e.status in (401, 403) else ""
                raise EndpointProbeError(f"{ep.root} answered HTTP {e.status}{hint}: {_error_message(e.text)}") from None
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                raise EndpointProbeError(
                    f"cannot reach {ep.root} ({type(e).__name__}: {e or 'no answer'}); is the server running at --base-url?"
                ) from None
            except (MalformedResponse, EndpointError) as e:
                raise EndpointProbeError(f"{ep.root}: {e}") from None

    async def _probe_models(self, ep: Endpoint) -> None:
        listed = await ep.get("/v1/models")
        served = [m.get("id") for m in (listed.get("data") or []) if isinstance(m, dict)] if isinstance(listed, dict) else []
        if served and self.model not in served:
            raise EndpointProbeError(
                f"{ep.root} does not serve model {self.model!r}; it serves {served}: pass --model {served[0]}"
            )

    async def _probe_chat_route(self, ep: Endpoint) -> None:
        try:
            await self._probe_chat(ep)
        except _HTTPStatus as e:
            if e.status in (404, 405):
                raise EndpointProbeError(
                    f"{ep.root} has no /v1/chat/completions route: drop --chat to sample token ids on /v1/completions"
                ) from None
            raise EndpointProbeError(
                f"{ep.root}/v1/chat/completions answered HTTP {e.status}: {_error_message(e.text)}"
            ) from None

    async def _probe_tokenize(self, ep: Endpoint) -> None:
        sample = "Hello, world: 12+30 = 42."
        try:
            remote = await ep.post("/tokenize", {"model": self.model, "prompt": sample, "add_special_tokens": False})
        except _HTTPStatus as e:
            if self.tokenizer is not None:
                return  # prompts are rendered locally; /tokenize is only a fallback
            if e.status in (404, 405):
                raise EndpointProbeError(
                    f"{ep.root} has no /tokenize route (a chat-only endpoint): pass --chat to use "
                    "/v1/chat/completions, or --tokenizer DIR to render prompts locally"
                ) from None
            raise
        if self.tokenizer is not None and isinstance(remote, dict) and isinstance(remote.get("tokens"), list):
            local = self.tokenizer.encode(sample, add_special_tokens=False)
            if remote["tokens"] != local:
                raise EndpointProbeError(
                    f"the local tokenizer does not match the served model's ({sample!r} is {local[:6]}... here, "
                    f"{remote['tokens'][:6]}... at {ep.root}): pass --tokenizer with the served model's tokenizer dir"
                )

    async def _probe_training(self, ep: Endpoint) -> None:
        prompt = await self.tokenize(prompt="Hi", _prefer=ep) or [0]
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "logprobs": 0,
                "return_token_ids": True}
        try:
            resp = await ep.post("/v1/completions", body)
        except _HTTPStatus as e:
            raise EndpointProbeError(
                f"training samples token-id prompts on /v1/completions, and {ep.root} answered HTTP {e.status}: "
                f"{_error_message(e.text)} (serve the model with `agentrl serve` or vLLM)"
            ) from None
        ch = (_choices(resp) or [{}])[0]
        missing = [] if ch.get("token_ids") else ["the sampled token ids (vLLM's return_token_ids)"]
        if not (ch.get("logprobs") or {}).get("token_logprobs"):
            missing.append("their sampling logprobs")
        if missing:
            raise EndpointProbeError(
                f"training needs {' and '.join(missing)} from /v1/completions for token-id prompts; {ep.root} "
                "does not return them: train against `agentrl serve` or vLLM >= 0.10.2, or only evaluate this "
                "endpoint (agentrl eval --chat)"
            )

    async def probe_sampling(self, sampling: SamplingParams, prompt_ids: list[int]) -> None:
        """Once before training: the endpoint must report μ of the *processed* distribution (after
        temperature/top-k/top-p), and the sampling support whenever top-p or min-p truncate it."""
        t = sampling.temperature if sampling.temperature > 0 else 1.0
        one = dataclasses.replace(sampling, max_tokens=1, temperature=t, top_k=1, top_p=1.0, min_p=0.0, seed=0)
        (c,) = await self.complete(prompt_ids, one)
        if c.logprobs and c.logprobs[0] < -1e-3:  # with top_k = 1 the processed logprob is exactly 0
            raise EndpointProbeError(
                f"{self.base_urls[0]} returns raw logprobs ({c.logprobs[0]:.3f} for a top_k=1 sample, not 0): "
                "the trainer needs the sampling distribution's; start vLLM with --logprobs-mode processed_logprobs"
            )
        if sampling.temperature > 0 and (sampling.top_p < 1 or sampling.min_p > 0):
            try:
                (c,) = await self.complete(prompt_ids, dataclasses.replace(sampling, max_tokens=1, seed=0))
            except EndpointError as e:  # K not exact from the top-N logprobs (support_from_top)
                raise EndpointProbeError(f"{self.base_urls[0]}: {e}") from None
            if c.token_ids and not c.support:
                raise EndpointProbeError(
                    f"{self.base_urls[0]} reports no token_support, so with rollout.top_p < 1 or min_p > 0 the "
                    "trainer cannot rebuild the distribution μ came from: set rollout.top_p = 1 and min_p = 0 "
                    "(top_k alone is fine), or train on the embedded engine"
                )

    # ------------------------------------------------------------------ tokens

    async def tokenize(
        self,
        *,
        messages: list[Message] | list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        add_generation_prompt: bool = True,
        _prefer: Endpoint | None = None,
    ) -> list[int]:
        """Token ids of a prompt string, or of messages rendered by the model's chat template."""
        if (messages is None) == (prompt is None):
            raise ValueError("tokenize needs exactly one of messages= or prompt=")
        if self.tokenizer is not None:
            if prompt is not None:
                return self.tokenizer.encode(prompt, add_special_tokens=False)
            dicts = [m.to_dict() if isinstance(m, Message) else m for m in messages]
            if self._renders is None or self._renders.tokenizer is not self.tokenizer:
                self._renders = RenderCache(self.tokenizer)
            return self._renders.ids(dicts, tools, add_generation_prompt)
        body: dict[str, Any] = {"model": self.model}
        if messages is not None:
            body["messages"] = [m.to_dict() if isinstance(m, Message) else m for m in messages]
            body["add_generation_prompt"] = add_generation_prompt
            if tools:
                body["tools"] = tools
        else:
            body["prompt"] = prompt
            body["add_special_tokens"] = False
        resp = await self._call(lambda ep: ep.post("/tokenize", body), "tokenize", _prefer)
        if not isinstance(resp, dict) or not isinstance(resp.get("tokens"), list):
            raise MalformedResponse("tokenize: the endpoint's reply has no 'tokens' list")
        return list(resp["tokens"])

    async def detokenize(self, ids: list[int]) -> str:
        body = {"model": self.model, "tokens": list(ids)}
        return (await self._call(lambda ep: ep.post("/detokenize", body), "detokenize"))["prompt"]

    async def close(self) -> None:
        for ep in self.endpoints:
            await ep.close()

    async def __aenter__(self) -> PolicyClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class PinnedClient:
    """A :class:`PolicyClient` whose calls go to one endpoint first (see :meth:`PolicyClient.pin`)."""

    def __init__(self, client: PolicyClient, endpoint: Endpoint, weight: int):
        self.client, self.endpoint, self._weight = client, endpoint, weight

    @property
    def tool_parser(self) -> str:
        return self.client.tool_parser

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Completion]:
        return await self.client.complete(prompt_ids, sampling, n, _prefer=self.endpoint)

    async def chat(self, messages: Any, sampling: SamplingParams, tools: Any = None, n: int = 1) -> list[Completion]:
        return await self.client.chat(messages, sampling, tools, n, _prefer=self.endpoint)

    async def tokenize(self, **kwargs: Any) -> list[int]:
        return await self.client.tokenize(**kwargs, _prefer=self.endpoint)

    def release(self) -> None:
        """The pinned work is over: its weight no longer counts as load."""
        if self._weight:
            self.endpoint.pinned -= self._weight
            self._weight = 0


# vLLM's top logprob for a token outside the kept set (the embedded engine's too: sampling.TOP_LOGPROB_FLOOR;
# that module imports torch, which this client never needs)
_TOP_FLOOR = -9999.0


def generate_body(completions_body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/completions`` body as vLLM's ``/inference/v1/generate`` takes it (token ids in,
    vLLM's own SamplingParams fields, text detokenized)."""
    b = dict(completions_body)
    sampling = {k: b.pop(k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
                                      "logprobs", "skip_special_tokens") if k in b}  # fmt: skip
    out = {"model": b["model"], "token_ids": b["prompt"], "sampling_params": {**sampling, "detokenize": True},
           "output_mode": "text", "return_token_ids": True}  # fmt: skip
    if "cache_salt" in b:
        out["cache_salt"] = b["cache_salt"]
    return out


def from_generate(ch: dict[str, Any], start_version: int) -> dict[str, Any]:
    """A ``/inference/v1/generate`` choice in ``/v1/completions`` shape, with ``token_versions``
    read from its weight-version spans (a token outside every span: ``start_version``)."""
    ids = ch.get("token_ids") or []
    content = (ch.get("logprobs") or {}).get("content") or []
    versions = [start_version] * len(ids)
    for span in ch.get("weight_versions") or []:
        v = str(span.get("version", ""))
        if v.isdigit():
            for i in range(max(0, int(span["start"])), min(len(ids), int(span["end"]))):
                versions[i] = int(v)
    return {
        "index": ch.get("index", 0), "text": ch.get("text") or "", "token_ids": ids,
        "finish_reason": ch.get("finish_reason"), "token_versions": versions,
        "logprobs": {"token_logprobs": [e.get("logprob") for e in content],
                     "top_logprobs": [{i: t.get("logprob") for i, t in enumerate(e.get("top_logprobs") or [])}
                                      for e in content]},
    }  # fmt: skip


def _truncates(s: SamplingParams) -> bool:
    """Whether the kept set is decided by the distribution (top-p, min-p), not by top_k alone."""
    return s.temperature > 0 and (s.top_p < 1 or s.min_p > 0)


def support_from_top(ch: dict[str, Any], n_tokens: int, top_n: int) -> list[int]:
    """Support sizes K from a choice's top-``top_n`` processed logprobs (vLLM: a token outside the
    kept set is at the floor, -9999).  Fewer than ``top_n`` entries above the floor is K exactly;
    ``top_n`` of them only says K ≥ ``top_n``: :class:`EndpointError` (the episode is errored,
    nothing is trained on a guessed distribution)."""
    tops = (ch.get("logprobs") or {}).get("top_logprobs")
    if not (isinstance(tops, list) and len(tops) == n_tokens):
        raise MalformedResponse(f"the endpoint returned {n_tokens} tokens but no top logprobs for each")
    support = []
    for top in tops:
        kept = sum(1 for v in (top or {}).values() if isinstance(v, int | float) and v > _TOP_FLOOR)
        if kept >= top_n:
            raise EndpointError(
                f"support size unknown: {kept} of the top {top_n} logprobs are in the kept set, so K ≥ {top_n} and "
                "the trainer cannot rebuild μ; lower rollout.top_p (or raise min_p), or start vLLM with a larger "
                "--max-logprobs"
            )
        support.append(kept)
    return support


def _top_k_only(s: SamplingParams) -> bool:
    return s.temperature > 0 and s.top_k is not None and s.top_k > 0 and s.top_p >= 1 and s.min_p <= 0


def _choices(resp: Any) -> list[dict[str, Any]]:
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list):
        raise MalformedResponse("the endpoint's reply has no 'choices' list")
    return choices
