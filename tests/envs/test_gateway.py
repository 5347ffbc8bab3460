"""The gateway's HTTP server on its own (no agent program): real HTTP clients against a real
:class:`~agentrl.gateway.Gateway`, the scripted ChatML client as the policy."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from agentrl.envs import ScriptedClient
from agentrl.gateway import Gateway
from agentrl.types import SamplingParams

SAMPLING = SamplingParams(max_tokens=200)
BODY = {"model": "m", "messages": [{"role": "user", "content": "What is 2+3?"}]}


async def test_calls_abandoned_in_the_refusal_queue_leave_it():
    """Past max_calls one episode's refusals wait one after another, the k-th (k-1) x 20 ms.  40 calls
    whose client gave up after 0.3 s (a timeout, a killed thread) stayed queued: each still waited its
    turn and counted, ~15 s of waits in all, and a live call made after them was answered only after
    every abandoned one.  A call whose client is gone now leaves the queue."""
    gateway = Gateway()
    try:
        s = await gateway.open(ScriptedClient(lambda p: "x"), SAMPLING, tool_parser="hermes", max_calls=1,
                               max_total_tokens=None, max_seq_len=None, token_exact=True)  # fmt: skip
        url, headers = s.base_url + "/chat/completions", {"Authorization": f"Bearer {s.key}"}
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=BODY, headers=headers) as r:
                assert r.status == 200  # the one call the episode has

            async def abandoned() -> int | None:
                try:
                    async with http.post(url, json=BODY, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=0.3)) as r:  # fmt: skip
                        return r.status
                except TimeoutError:
                    return None  # the client gave up and closed its connection

            statuses = await asyncio.gather(*(abandoned() for _ in range(40)))
            assert statuses.count(None) > 30 and set(statuses) <= {None, 400}, statuses
            await asyncio.sleep(0.2)  # the server hears of the closed connections
            counted = s.over_limit
            await asyncio.sleep(1.0)
            assert s.over_limit == counted, f"{s.over_limit - counted} abandoned calls still waited their turn"
            t0 = time.monotonic()
            async with http.post(url, json=BODY, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as r:
                assert r.status == 400 and "limit of 1 model calls" in (await r.json())["error"]["message"]
            waited = time.monotonic() - t0
            assert waited < 2.0, f"a live call waited {waited:.1f} s behind abandoned ones"
    finally:
        await gateway.close()


async def test_a_call_abandoned_while_sampling_stops_sampling_and_records_nothing():
    """A client that gave up on a call mid-sampling left it sampling on: the engine's work went on for
    nobody, and its turn was recorded, a sequence the program never saw.  Now the sampling is cancelled
    and nothing is recorded; the call still counts against max_calls (it was admitted)."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    class Slow(ScriptedClient):
        async def complete(self, prompt_ids, sampling, n=1):
            started.set()
            try:
                await asyncio.sleep(600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    gateway = Gateway()
    try:
        s = await gateway.open(Slow(lambda p: "x"), SAMPLING, tool_parser="hermes", max_calls=2,
                               max_total_tokens=None, max_seq_len=None, token_exact=True)  # fmt: skip
        async with aiohttp.ClientSession() as http:
            try:
                async with http.post(s.base_url + "/chat/completions", json=BODY,
                                     headers={"Authorization": f"Bearer {s.key}"},
                                     timeout=aiohttp.ClientTimeout(total=0.5)):  # fmt: skip
                    raise AssertionError("a reply came from a client that never replies")
            except TimeoutError:
                pass
        assert started.is_set()
        await asyncio.wait_for(cancelled.wait(), 10)  # the old code slept on for 600 s
        assert s.turns == [] and s.sequences == [] and s.refusals == 0 and s.calls == 1
    finally:
        await gateway.close()


@pytest.mark.parametrize("reply", ["x" * 100, "x"])
async def test_calls_sampling_at_once_share_the_episodes_token_budget(reply):
    """The budget check and the claim are one step: five concurrent calls against
    ``max_total_tokens=10`` sample at most 10 tokens in all (each saw the whole budget before:
    50).  A call that finds the budget claimed, not spent, waits for the claims: with 2-token
    replies (a token and the end of turn) all five are served."""

    class Slow(ScriptedClient):
        async def complete(self, prompt_ids, sampling, n=1):
            await asyncio.sleep(0.2)  # all five are sampling at once
            return await super().complete(prompt_ids, sampling, n)

    gateway = Gateway()
    try:
        s = await gateway.open(Slow(lambda p: reply), SAMPLING, tool_parser="hermes", max_calls=5,
                               max_total_tokens=10, max_seq_len=None, token_exact=True)  # fmt: skip
        async with aiohttp.ClientSession() as http:

            async def call() -> int:
                async with http.post(s.base_url + "/chat/completions", json=BODY,
                                     headers={"Authorization": f"Bearer {s.key}"}) as r:  # fmt: skip
                    return r.status

            statuses = await asyncio.wait_for(asyncio.gather(*(call() for _ in range(5))), 30)
        assert s.sampled_total <= 10, f"{s.sampled_total} tokens sampled against a budget of 10"
        if len(reply) > 10:
            assert sorted(statuses) == [200, 400, 400, 400, 400], statuses  # the rest: budget spent
        else:
            assert statuses == [200] * 5 and s.sampled_total == 10, (statuses, s.sampled_total)
        assert s._reserved == 0  # every claim released
    finally:
        await gateway.close()
