"""Checks, once before a run, that every endpoint can serve the chosen path: each failure is
an :class:`~agentrl.errors.EndpointProbeError` that says what to change (a flag, a server
option, another endpoint).  :meth:`~agentrl.inference.client.PolicyClient.probe` and
:meth:`~agentrl.inference.client.PolicyClient.probe_sampling` call these.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import aiohttp

from agentrl.errors import EndpointError, EndpointProbeError, MalformedResponse
from agentrl.inference.completions import choices_of
from agentrl.inference.endpoint import Endpoint, HTTPStatusError, error_message
from agentrl.types import SamplingParams

if TYPE_CHECKING:
    from agentrl.inference.client import PolicyClient


async def probe(client: PolicyClient, *, token_path: bool, training: bool = False) -> None:
    """Check once, before a run, that every endpoint can serve the chosen path; raise
    :class:`~agentrl.errors.EndpointProbeError` saying what to change.

    Every path: ``/v1/models`` lists ``model``.  Chat path (``token_path=False``): one
    1-token chat request learns what the route accepts and returns (:meth:`~agentrl.inference.client.PolicyClient.capabilities`).
    Token path: prompts are rendered by the local tokenizer, else by ``/tokenize`` (then
    required); where both exist they must agree.  ``training``: ``/v1/completions`` must
    return token ids and sampling logprobs for a token-id prompt (what the loss needs).
    """
    for ep in client.endpoints:
        try:
            await _probe_models(client, ep)
            if token_path:
                await _probe_tokenize(client, ep)
            else:
                await _probe_chat_route(client, ep)
            if training:
                await _probe_training(client, ep)
        except HTTPStatusError as e:
            hint = " (check --api-key)" if e.status in (401, 403) else ""
            raise EndpointProbeError(f"{ep.root} answered HTTP {e.status}{hint}: {error_message(e.text)}") from None
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise EndpointProbeError(
                f"cannot reach {ep.root} ({type(e).__name__}: {e or 'no answer'}); is the server running at --base-url?"
            ) from None
        except (MalformedResponse, EndpointError) as e:
            raise EndpointProbeError(f"{ep.root}: {e}") from None

async def _probe_models(client: PolicyClient, ep: Endpoint) -> None:
    listed = await ep.get("/v1/models")
    served = [m.get("id") for m in (listed.get("data") or []) if isinstance(m, dict)] if isinstance(listed, dict) else []
    if served and client.model not in served:
        raise EndpointProbeError(
            f"{ep.root} does not serve model {client.model!r}; it serves {served}: pass --model {served[0]}"
        )

async def _probe_chat_route(client: PolicyClient, ep: Endpoint) -> None:
    try:
        await client.probe_chat(ep)
    except HTTPStatusError as e:
        if e.status in (404, 405):
            raise EndpointProbeError(
                f"{ep.root} has no /v1/chat/completions route: drop --chat to sample token ids on /v1/completions"
            ) from None
        raise EndpointProbeError(
            f"{ep.root}/v1/chat/completions answered HTTP {e.status}: {error_message(e.text)}"
        ) from None

async def _probe_tokenize(client: PolicyClient, ep: Endpoint) -> None:
    sample = "Hello, world: 12+30 = 42."
    try:
        remote = await ep.post("/tokenize", {"model": client.model, "prompt": sample, "add_special_tokens": False})
    except HTTPStatusError as e:
        if client.tokenizer is not None:
            return  # prompts are rendered locally; /tokenize is only a fallback
        if e.status in (404, 405):
            raise EndpointProbeError(
                f"{ep.root} has no /tokenize route (a chat-only endpoint): pass --chat to use "
                "/v1/chat/completions, or --tokenizer DIR to render prompts locally"
            ) from None
        raise
    if client.tokenizer is not None and isinstance(remote, dict) and isinstance(remote.get("tokens"), list):
        local = client.tokenizer.encode(sample, add_special_tokens=False)
        if remote["tokens"] != local:
            raise EndpointProbeError(
                f"the local tokenizer does not match the served model's ({sample!r} is {local[:6]}... here, "
                f"{remote['tokens'][:6]}... at {ep.root}): pass --tokenizer with the served model's tokenizer dir"
            )

async def _probe_training(client: PolicyClient, ep: Endpoint) -> None:
    prompt = await client.tokenize(prompt="Hi", _prefer=ep) or [0]
    body = {"model": client.model, "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "logprobs": 0,
            "return_token_ids": True}
    try:
        resp = await ep.post("/v1/completions", body)
    except HTTPStatusError as e:
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
