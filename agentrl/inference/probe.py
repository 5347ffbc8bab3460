"""Checks, once before a run, that every endpoint can serve the chosen path: each failure is
an :class:`~agentrl.errors.EndpointProbeError` that says what to change (a flag, a server
option, another endpoint).  :meth:`~agentrl.inference.client.PolicyClient.probe` and
:meth:`~agentrl.inference.client.PolicyClient.probe_sampling` call these.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import aiohttp

from agentrl.errors import EndpointDown, EndpointError, EndpointProbeError
from agentrl.inference.completions import choices_of
from agentrl.inference.endpoint import Endpoint, HTTPStatusError, error_message
from agentrl.types import SamplingParams

if TYPE_CHECKING:
    from agentrl.inference.client import PolicyClient


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the user sets, as the command at hand names it: every probe message says which
    setting to change (``agentrl eval`` has ``--base-url``; ``agentrl run``, ``inference.base_url``).

    ``base_url``: where the endpoints came from ("" for engines agentrl started itself).
    ``no_key`` / ``wrong_key``: what an HTTP 401 means when no key was given / when one was;
    ``key_fix``: how to give the endpoint's key.  ``model_fix``: how to name the served model
    (``{name}``: one it serves).  ``tokenize_fix``: what to do where the endpoint has no
    ``/tokenize``.  ``tokenizer_fix``: what to do where the local tokenizer is not the served
    model's.
    """

    base_url: str = "--base-url"
    no_key: str = "no API key was given"
    wrong_key: str = "it refused the API key given"
    key_fix: str = "pass --api-key or set AGENTRL_API_KEY to that server's key"
    model_fix: str = "pass --model {name}"
    tokenize_fix: str = "pass --chat to use /v1/chat/completions, or --tokenizer DIR to render prompts locally"
    tokenizer_fix: str = "pass --tokenizer with the served model's tokenizer dir"


#: ``agentrl eval`` (and any client whose maker named no settings)
CLI = Settings()
#: ``agentrl env test`` (no --chat, no --tokenizer: it samples token ids as training does)
ENV_TEST = Settings(
    tokenize_fix="test against a model dir (-m DIR) or an endpoint that has /tokenize (agentrl serve, vLLM)",
    tokenizer_fix="serve the model that -m names",
)
#: ``agentrl run`` against ``inference.base_url`` (its key: ``AGENTRL_API_KEY``, else a new one)
RUN = Settings(
    base_url="inference.base_url",
    no_key="it refused this run's API key (AGENTRL_API_KEY is not set)",
    wrong_key="it refused this run's API key (AGENTRL_API_KEY)",
    key_fix="set AGENTRL_API_KEY to that server's key (the file `agentrl serve` printed)",
    model_fix="set inference.model_name = \"{name}\"",
    tokenize_fix="serve the model with `agentrl serve` or vLLM, or keep its tokenizer files in model.path",
    tokenizer_fix="serve model.path's model at inference.base_url",
)
#: ``agentrl run`` on the engines it started itself
STARTED = dataclasses.replace(RUN, base_url="")


def settings_of(client: PolicyClient) -> Settings:
    """The settings a client's endpoints came from: its ``probe_settings`` where its maker set
    them (``agentrl run``), else the command line's (``--base-url``)."""
    return getattr(client, "probe_settings", None) or CLI


def _where(root: str, settings: Settings) -> str:
    return f"{root} ({settings.base_url})" if settings.base_url else f"the engine at {root}"


def _reason(e: BaseException) -> str:
    """Why a connection failed, in a few words (aiohttp's own text repeats the address)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        err = e.os_error
        if not isinstance(err, socket.gaierror) and err.errno and err.errno > 0:
            return os.strerror(err.errno).lower()  # "connection refused", not asyncio's "Connect call failed (...)"
        return (err.strerror or str(err) or type(err).__name__).lower()
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return "no answer before the timeout"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def explain(e: BaseException, root: str, settings: Settings, *, key_given: bool) -> EndpointProbeError | None:
    """The one-line :class:`~agentrl.errors.EndpointProbeError` for a failed request to ``root``
    (unreachable, a refused key, another HTTP error); None for any other exception."""
    where = _where(root, settings)
    if isinstance(e, HTTPStatusError):
        if e.status == 401:
            why = settings.wrong_key if key_given else settings.no_key
            return EndpointProbeError(f"{where} answered HTTP 401: {why}; {settings.key_fix}")
        if e.status == 403:
            return EndpointProbeError(f"{where} answered HTTP 403 ({error_message(e.text)}); {settings.key_fix}")
        if e.status in BUSY:
            return EndpointDown(f"{where} answered HTTP {e.status} ({error_message(e.text)}) to {len(RETRY_S) + 1} "
                                "tries: the server failed, not this command; see its log")
        return EndpointProbeError(f"{where} answered HTTP {e.status}: {error_message(e.text)}")
    if isinstance(e, aiohttp.ClientError | OSError | TimeoutError):
        fix = (f"start the server there or fix {settings.base_url}" if settings.base_url
               else "it stopped; see its log above")  # fmt: skip
        return EndpointProbeError(f"cannot reach {where}: {_reason(e)}; {fix}")
    if isinstance(e, EndpointError):  # MalformedResponse too
        return EndpointProbeError(f"{where}: {e}")
    return None


BUSY = (429, 500, 502, 503, 504)  # a server warming up, behind a restarting proxy, or overloaded: try again
RETRY_S = (0.5, 1.5)  # waits before the second and third tries


async def _tried(check: Callable[[], Awaitable[None]]) -> None:
    """``check()``, again after each of :data:`RETRY_S` while the server answers a :data:`BUSY` status."""
    for wait in (*RETRY_S, None):
        try:
            return await check()
        except HTTPStatusError as e:
            if e.status not in BUSY or wait is None:
                raise
        await asyncio.sleep(wait)


async def probe(client: PolicyClient, *, token_path: bool, training: bool = False,
                settings: Settings | None = None) -> None:
    """Check once, before a run, that every endpoint can serve the chosen path; raise
    :class:`~agentrl.errors.EndpointProbeError` saying what to change.

    Every path: ``/v1/models`` lists ``model``.  Chat path (``token_path=False``): one
    1-token chat request learns what the route accepts and returns (:meth:`~agentrl.inference.client.PolicyClient.capabilities`).
    Token path: prompts are rendered by the local tokenizer, else by ``/tokenize`` (then
    required); where both exist they must agree.  ``training``: ``/v1/completions`` must
    return token ids and sampling logprobs for a token-id prompt (what the loss needs).
    ``settings``: the names the messages give (default :func:`settings_of` the client).
    """
    settings = settings or settings_of(client)
    for ep in client.endpoints:

        async def check(ep: Endpoint = ep) -> None:
            await _probe_models(ep, client.model, settings)
            if token_path:
                await _probe_tokenize(client, ep, settings)
            else:
                await _probe_chat_route(client, ep)
            if training:
                await _probe_training(client, ep)

        try:
            await _tried(check)
        except (HTTPStatusError, aiohttp.ClientError, OSError, TimeoutError, EndpointError) as e:
            err = explain(e, ep.root, settings, key_given=getattr(client, "key_given", True))
            raise (err or e) from None


async def reachable(base_urls: Sequence[str], api_key: str | None, *, settings: Settings,
                    control_route: str | None = None, model: str | None = None, timeout: float = 10.0) -> None:
    """Before anything starts: every endpoint answers ``GET /v1/models`` with ``api_key``
    (None: no key was given) within ``timeout`` seconds, lists ``model`` where one is named, and,
    where ``control_route`` is given, does not refuse the key there (an agentrl engine guards its
    weight routes even when its OpenAI routes are open).  Raises a one-line
    :class:`~agentrl.errors.EndpointProbeError` (:func:`explain`)."""
    for url in base_urls:
        ep = Endpoint(url, api_key or "EMPTY", timeout)

        async def check(ep: Endpoint = ep) -> None:
            await _probe_models(ep, model, settings)
            if control_route is not None:
                try:
                    await ep.get(control_route)
                except HTTPStatusError as e:  # another server's routes (404) are the later probe's to judge
                    if e.status in (401, 403):
                        raise

        try:
            await _tried(check)
        except (HTTPStatusError, aiohttp.ClientError, OSError, TimeoutError, EndpointError) as e:
            raise (explain(e, ep.root, settings, key_given=api_key is not None) or e) from None
        finally:
            await ep.close()


def _served(listed: object) -> list[str]:
    """The model ids a ``/v1/models`` reply lists."""
    if not isinstance(listed, dict):
        return []
    return [m.get("id") for m in (listed.get("data") or []) if isinstance(m, dict)]


async def _probe_models(ep: Endpoint, model: str | None, settings: Settings) -> None:
    """``GET /v1/models`` answers, and lists ``model`` where one is named (and the list is not empty)."""
    served = _served(await ep.get("/v1/models"))
    if model is not None and served and model not in served:
        raise EndpointProbeError(
            f"{_where(ep.root, settings)} does not serve model {model!r}; it serves {served}: "
            + settings.model_fix.format(name=served[0])
        )

async def _probe_chat_route(client: PolicyClient, ep: Endpoint) -> None:
    try:
        await client.probe_chat(ep)
    except HTTPStatusError as e:
        if e.status in BUSY:
            raise  # tried again, then the server's failure (explain)
        if e.status in (404, 405):
            raise EndpointProbeError(
                f"{ep.root} has no /v1/chat/completions route: drop --chat to sample token ids on /v1/completions"
            ) from None
        raise EndpointProbeError(
            f"{ep.root}/v1/chat/completions answered HTTP {e.status}: {error_message(e.text)}"
        ) from None

async def _probe_tokenize(client: PolicyClient, ep: Endpoint, settings: Settings) -> None:
    sample = "Hello, world: 12+30 = 42."
    try:
        remote = await ep.post("/tokenize", {"model": client.model, "prompt": sample, "add_special_tokens": False})
    except HTTPStatusError as e:
        if client.tokenizer is not None:
            return  # prompts are rendered locally; /tokenize is only a fallback
        if e.status in (404, 405):
            raise EndpointProbeError(
                f"{_where(ep.root, settings)} has no /tokenize route (a chat-only endpoint): {settings.tokenize_fix}"
            ) from None
        raise
    if client.tokenizer is not None and isinstance(remote, dict) and isinstance(remote.get("tokens"), list):
        local = client.tokenizer.encode(sample, add_special_tokens=False)
        if remote["tokens"] != local:
            raise EndpointProbeError(
                f"the local tokenizer does not match the served model's ({sample!r} is {local[:6]}... here, "
                f"{remote['tokens'][:6]}... at {_where(ep.root, settings)}): {settings.tokenizer_fix}"
            )

async def _probe_training(client: PolicyClient, ep: Endpoint) -> None:
    prompt = await client.tokenize(prompt="Hi", _prefer=ep) or [0]
    body = {"model": client.model, "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "logprobs": 0,
            "return_token_ids": True}
    try:
        resp = await ep.post("/v1/completions", body)
    except HTTPStatusError as e:
        if e.status in BUSY:
            raise  # tried again, then the server's failure (explain)
        raise EndpointProbeError(
            f"training samples token-id prompts on /v1/completions, and {ep.root} answered HTTP {e.status}: "
            f"{error_message(e.text)} (serve the model with `agentrl serve` or vLLM)"
        ) from None
    ch = (choices_of(resp) or [{}])[0]
    missing = [] if ch.get("token_ids") else ["the sampled token ids (vLLM's return_token_ids)"]
    if not (ch.get("logprobs") or {}).get("token_logprobs"):
        missing.append("their sampling logprobs")
    if missing:
        raise EndpointProbeError(
            f"training needs {' and '.join(missing)} from /v1/completions for token-id prompts; {ep.root} "
            "does not return them: train against `agentrl serve` or vLLM >= 0.10.2, or only evaluate this "
            "endpoint (agentrl eval --chat)"
        )

async def probe_sampling(client: PolicyClient, sampling: SamplingParams, prompt_ids: list[int]) -> None:
    """Once before training: the endpoint must report μ of the *processed* distribution (after
    temperature/top-k/top-p), and the sampling support whenever top-p or min-p truncate it."""
    t = sampling.temperature if sampling.temperature > 0 else 1.0
    one = dataclasses.replace(sampling, max_tokens=1, temperature=t, top_k=1, top_p=1.0, min_p=0.0, seed=0)
    (c,) = await client.complete(prompt_ids, one)
    if c.logprobs and c.logprobs[0] < -1e-3:  # with top_k = 1 the processed logprob is exactly 0
        raise EndpointProbeError(
            f"{client.base_urls[0]} returns raw logprobs ({c.logprobs[0]:.3f} for a top_k=1 sample, not 0): "
            "the trainer needs the sampling distribution's; start vLLM with --logprobs-mode processed_logprobs"
        )
    if sampling.temperature > 0 and (sampling.top_p < 1 or sampling.min_p > 0):
        try:
            (c,) = await client.complete(prompt_ids, dataclasses.replace(sampling, max_tokens=1, seed=0))
        except EndpointError as e:  # K not exact from the top-N logprobs (support_from_top)
            raise EndpointProbeError(f"{client.base_urls[0]}: {e}") from None
        if c.token_ids and not c.support:
            raise EndpointProbeError(
                f"{client.base_urls[0]} reports no token_support, so with rollout.top_p < 1 or min_p > 0 the "
                "trainer cannot rebuild the distribution μ came from: set rollout.top_p = 1 and min_p = 0 "
                "(top_k alone is fine), or train on the embedded engine"
            )
