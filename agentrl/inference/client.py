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

Around it: :mod:`~agentrl.inference.endpoint` (one server: session, throttle, load, error
replies), :mod:`~agentrl.inference.completions` (the token path's request and reply format),
:mod:`~agentrl.inference.chat` (the chat path's) and :mod:`~agentrl.inference.probe` (the
checks before a run).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

from agentrl.auth import client_key
from agentrl.errors import (
    AgentrlError,
    ContextLengthExceeded,
    EndpointError,
    MalformedResponse,
)
from agentrl.inference import probe as probing
from agentrl.inference.chat import ChatCaps, chat_body, drop_fields, read_reply, rejected_fields
from agentrl.inference.completions import (  # noqa: F401  (generate_body, from_generate, support_from_top: here too)
    choices_of,
    from_generate,
    generate_body,
    read_completions,
    sampling_body,
    support_from_top,
    truncates,
)
from agentrl.inference.endpoint import Endpoint, HTTPStatusError, error_message, is_context_error, url_root
from agentrl.render import RenderCache, render_chat_ids
from agentrl.retry import Transient, is_transient_status, retrying
from agentrl.tool_format import resolve_tool_parser
from agentrl.types import Completion, Message, SamplingParams

T = TypeVar("T")
# a prompt or conversation with more text than this renders on a thread, uncached: a multi-MB tool
# output (an agent program's, say) took seconds of the run's event loop, which every episode shares
OFF_LOOP_CHARS = 64 << 10


#: files one of which a HF tokenizer dir holds (fast, sentencepiece, BPE, WordPiece vocabularies)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def clip(text: str, limit: int = 200) -> str:
    """``text`` on one line, at most about ``limit`` characters: cut at a word boundary with an
    ellipsis, never mid-word."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0] if " " in text[:limit] else text[:limit]
    return cut.rstrip(" ,;:(") + "…"


def no_tokenizer(path: str | os.PathLike) -> str | None:
    """The one-line reason when the dir ``path`` holds no tokenizer (None when it holds one)."""
    from pathlib import Path

    d = Path(path)
    if any((d / f).is_file() for f in TOKENIZER_FILES):
        return None
    missing = " / ".join(f for f in ("tokenizer.json", "tokenizer_config.json") if not (d / f).is_file())
    return f"no tokenizer in {str(path)!r} ({missing} missing): copy the base model's tokenizer files into it"


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A local HF tokenizer; a one-line :class:`~agentrl.errors.AgentrlError` when there is none."""
    from pathlib import Path

    if not Path(path).is_dir():
        raise AgentrlError(f"tokenizer dir {str(path)!r} is not a directory (expected a HF model or tokenizer dir)")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        if (reason := no_tokenizer(path)) is not None:
            raise AgentrlError(f"{reason}, or use the base model's dir instead (eval: --tokenizer DIR)") from None
        raise AgentrlError(f"cannot load a tokenizer from {str(path)!r}: {type(e).__name__}: {clip(str(e))}") from None
    if not getattr(tok, "chat_template", None):
        raise AgentrlError(
            f"the tokenizer in {str(path)!r} has no chat template to render prompts with: add one (chat_template "
            "in its tokenizer_config.json, or a chat_template.jinja beside it) or use a tokenizer dir that has one; "
            f"`agentrl model check-template {path}` checks it"
        )
    return tok


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
        probe_settings: Any = None,
    ):
        """``api_key``: sent as ``Authorization: Bearer`` (default ``AGENTRL_API_KEY``, else a
        placeholder).  ``cache_salt``: salt token requests with the weight version (vLLM's ``cache_salt``), so a
        server's prefix cache never serves K/V computed by older weights.  ``support_logprobs``
        (vLLM: its ``--max-logprobs``, N): a server that reports no ``token_support`` gives the
        support size K of a top-p/min-p sample through its top-N processed logprobs, where every
        token outside the kept set is at the floor: K = the entries above it, exact when K < N.
        ``vllm_generate``: token requests go to vLLM's ``/inference/v1/generate`` (``vllm serve
        --enable-scale-out``), whose replies say which weight version sampled each token.
        ``probe_settings``: the settings the probe's messages name (:class:`agentrl.inference.probe.Settings`;
        default: the command line's ``--base-url``, ``--api-key``, ...)."""
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("PolicyClient needs at least one base_url")
        self.model = model
        # whether a key was given (else the probe says so on an HTTP 401, not "a wrong key")
        self.key_given = bool(api_key or client_key())
        self.probe_settings = probe_settings
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
            except HTTPStatusError as e:
                raise self._classify(what, ep, e.status, error_message(e.text), None, e) from e
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                raise Transient(e, ep.root) from e
            finally:
                ep.in_flight -= 1

        return await retrying(attempt, what=what, max_retries=self.max_retries, exhausted=EndpointError)

    @staticmethod
    def _classify(what: str, ep: Endpoint, status: int, message: str, code: Any, cause: Exception) -> Exception:
        if is_transient_status(status):
            return Transient(cause, ep.root)
        if is_context_error(message, code) or is_context_error(getattr(cause, "text", "")):
            return ContextLengthExceeded(f"{what}: {message}")
        return EndpointError(f"{what} rejected by {ep.root} (HTTP {status}): {message}")

    # ------------------------------------------------------------------ sampling

    async def complete(
        self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1, *, _prefer: Endpoint | None = None
    ) -> list[Completion]:
        """Sample continuations of an exact token-id prompt (``/v1/completions``).

        The hot path of every rollout, so it speaks the OpenAI wire format directly over
        aiohttp instead of through the SDK's request/response models (~10× less CPU).
        """
        body = {"model": self.model, "prompt": prompt_ids, "logprobs": 0, **sampling_body(sampling, n, self.tool_parser)}
        top_n = self.support_logprobs if truncates(sampling) else 0
        if top_n:  # K from the top-N processed logprobs, keyed by token id (token texts can collide)
            body.update(logprobs=top_n, return_tokens_as_token_ids=True)
        if self.cache_salt:  # vLLM: prefix-cache blocks are shared only within one weight version
            body["cache_salt"] = f"v{self.default_version}"
        start_version = self.default_version  # for servers without per-token versions
        if self.vllm_generate:
            body = generate_body(body)
            resp = await self._call(lambda ep: ep.post("/inference/v1/generate", body), "completion", _prefer)
            choices = [from_generate(ch, start_version) for ch in choices_of(resp)]
        else:
            resp = await self._call(lambda ep: ep.post("/v1/completions", body), "completion", _prefer)
            choices = choices_of(resp)
        return read_completions(resp, choices, prompt_ids, sampling, start_version, top_n)

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
                await self.probe_chat(ep)
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
            except HTTPStatusError as e:
                message = error_message(e.text)
                if is_context_error(message) or is_context_error(e.text):
                    raise
                fields = rejected_fields(e.status, message, body)
                if not fields:
                    raise
                body = drop_fields(body, fields, ep.chat_caps)
        raise MalformedResponse(f"{ep.root} kept refusing chat requests: {body}")

    async def probe_chat(self, ep: Endpoint) -> ChatCaps:
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

    # ------------------------------------------------------------------ probing (agentrl.inference.probe)

    async def probe(self, *, token_path: bool, training: bool = False) -> None:
        """Check once, before a run, that every endpoint can serve the chosen path (token ids or
        chat; ``training``: token ids and sampling logprobs); raise
        :class:`~agentrl.errors.EndpointProbeError` saying what to change."""
        await probing.probe(self, token_path=token_path, training=training)

    async def probe_sampling(self, sampling: SamplingParams, prompt_ids: list[int]) -> None:
        """Once before training: the endpoint reports μ of the *processed* distribution, and the
        support whenever top-p or min-p truncate it."""
        await probing.probe_sampling(self, sampling, prompt_ids)

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
                if len(prompt) > OFF_LOOP_CHARS:
                    return await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=False)
                return self.tokenizer.encode(prompt, add_special_tokens=False)
            dicts = [m.to_dict() if isinstance(m, Message) else m for m in messages]
            if self._renders is None or self._renders.tokenizer is not self.tokenizer:
                self._renders = RenderCache(self.tokenizer)
            if sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else len(str(m.get("content")))
                   for m in dicts) > OFF_LOOP_CHARS:  # fmt: skip
                return await asyncio.to_thread(render_chat_ids, self.tokenizer, dicts, tools, add_generation_prompt)
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
