"""Shared by the engine benchmarks (a module, not a benchmark): random token-id prompts, and one
round of concurrent ``/v1/completions`` requests against an OpenAI-compatible server.

Its siblings import it by name (a script's own directory is on ``sys.path``)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from agentrl.errors import AgentrlError


def workload(vocab: int, requests: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``requests`` prompts of random ordinary token ids (the first 3 ids are special in agentrl's models)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]


async def completions_round(root_url: str, model: str, key: str, prompts: list[list[int]], new_tokens: int,
                            extra: dict[str, Any] | None = None) -> tuple[float, int]:  # fmt: skip
    """Send every prompt at once, each for exactly ``new_tokens`` tokens (``ignore_eos``, temperature 1),
    with ``extra`` added to each body (e.g. what a run asks: ``logprobs``, ``return_token_ids``);
    returns (wall seconds, completion tokens).  A refused request or a short completion raises
    :class:`AgentrlError` naming the server."""
    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=len(prompts) + 1)
    async with httpx.AsyncClient(base_url=root_url, timeout=1800, limits=limits,
                                 headers={"Authorization": f"Bearer {key}"}) as http:  # fmt: skip

        async def one(p: list[int]) -> int:
            r = await http.post("/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True,
                **(extra or {}),
            })  # fmt: skip
            if r.status_code != 200:
                raise AgentrlError(f"{root_url} answered {r.status_code}: {r.text[:300]}")
            done = r.json()["usage"]["completion_tokens"]
            if done != new_tokens:
                raise AgentrlError(f"{root_url} made {done} tokens, not {new_tokens} (ignore_eos was refused?)")
            return done

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0, sum(counts)
