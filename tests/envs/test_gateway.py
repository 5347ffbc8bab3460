"""The gateway's HTTP server on its own (no agent program): real HTTP clients against a real
:class:`~agentrl.gateway.Gateway`, the scripted ChatML client as the policy."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from agentrl.envs import ScriptedClient
from agentrl.gateway import Gateway
from agentrl.types import Completion, SamplingParams

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


async def _open(gateway: Gateway, client: ScriptedClient, max_calls: int = 8):
    return await gateway.open(client, SAMPLING, tool_parser="hermes", max_calls=max_calls, max_total_tokens=None,
                              max_seq_len=None, token_exact=True)  # fmt: skip


async def test_fields_the_gateway_cannot_honour_are_named_and_unknown_ones_refused_before_any_sampling():
    """``logprobs: true`` got ``"logprobs": null`` back (the program then crashed on it, filed as the
    policy's failure), ``functions=`` rendered no tools, ``stream_options: "usage"`` raised after the
    turn was sampled and recorded (a 500, retried twice by the SDK: three recorded turns).  Each is now
    a 400 that names the field, before admission (no call counted, nothing sampled); fields the run
    overrides (temperature, seed, ...) and ones that ask for nothing (logprobs false) are served."""
    gateway = Gateway()
    try:
        client = ScriptedClient(lambda p: "x")
        s = await _open(gateway, client)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {s.key}"}) as http:

            async def post(extra: dict) -> tuple[int, str]:
                async with http.post(s.base_url + "/chat/completions", json={**BODY, **extra}) as r:
                    body = await r.json()
                    return r.status, (body.get("error") or {}).get("message", "")

            refused = {"logprobs": True, "top_logprobs": 3, "response_format": {"type": "json_object"},
                       "functions": [{"name": "f", "parameters": {}}], "logit_bias": {"5": -100},
                       "stream_options": "usage",
                       "stream": "yes", "model": 7, "best_of": 2, "temprature": 0.5}  # fmt: skip
            for key, value in refused.items():
                status, message = await post({key: value})
                assert status == 400 and key in message, (key, status, message)
            assert "Unrecognized request argument supplied: temprature" == (await post({"temprature": 0.5}))[1]
            assert s.calls == 0 and s.turns == [] and client.prompts == [] and s.admitted_refusals == 0
            served = {"temperature": 0.1, "top_p": 0.5, "seed": 3, "user": "u", "metadata": {"a": "b"},
                      "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}, "parallel_tool_calls": True,
                      "stream": False, "stream_options": None, "max_completion_tokens": 20, "min_tokens": 2,
                      "prompt_cache_retention": "24h", "skip_special_tokens": True}  # fmt: skip
            assert await post(served) == (200, "")
            with pytest.warns(UserWarning, match="'chat_template_kwargs', which is ignored"):
                assert await post({"chat_template_kwargs": {"enable_thinking": False}}) == (200, "")
        assert s.calls == 2 and len(s.turns) == 2
    finally:
        await gateway.close()


async def test_a_turn_ended_by_a_stop_string_is_not_continued_with_the_reply_the_program_saw():
    """A ReAct program stops its calls at "Observation:".  The engine keeps the stop string's ids (the
    reply's text drops it), so the turn has no end-of-turn token; the next call was joined to it
    anyway (its last id, ":", also sits in the re-rendered reply's tail): the sequence held
    "...Observation:" then the glue, tokens the program never sent.  Such a turn now ends its
    sequence, and the next call starts a fresh, counted one."""
    from agentrl.envs.check import IM_END, decode, encode

    class Stops(ScriptedClient):  # what the engine does with a stop string: ids through it, text before it
        async def complete(self, prompt_ids, sampling, n=1):
            self.prompts.append(list(prompt_ids))
            text = self.policy(decode(prompt_ids))
            for stop in sampling.stop or []:
                if stop in text:
                    cut = text.index(stop)
                    ids = encode(text[: cut + len(stop)])
                    return [Completion(text[:cut], ids, [-0.5] * len(ids), [0] * len(ids), "stop")]
            ids = [*encode(text), IM_END]
            return [Completion(text, ids, [-0.5] * len(ids), [0] * len(ids), "stop")]

    replies = iter(["Action: 2+3\nObservation: 5", "The answer is 5"])
    gateway = Gateway()
    try:
        s = await _open(gateway, Stops(lambda p: next(replies)))
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {s.key}"}) as http:
            url = s.base_url + "/chat/completions"
            async with http.post(url, json={**BODY, "stop": ["Observation:"]}) as r:
                first = (await r.json())["choices"][0]["message"]
            assert first["content"] == "Action: 2+3\n"
            messages = [*BODY["messages"], first, {"role": "user", "content": "Observation: 5"}]
            async with http.post(url, json={"model": "m", "messages": messages, "stop": ["Observation:"]}) as r:
                assert r.status == 200
        assert len(s.sequences) == 2 and s.template_breaks == 1, [decode(q.token_ids) for q in s.sequences]
        assert decode(s.sequences[0].token_ids).endswith("assistant\nAction: 2+3\nObservation:")
        fresh = await s.client.tokenize(messages=messages)
        assert s.sequences[1].token_ids[: len(fresh)] == fresh  # the program's conversation, as it sent it
    finally:
        await gateway.close()


async def test_one_episodes_calls_are_served_a_few_at_a_time():
    """Nothing bounded one episode's calls in flight: one program's threads could take every sampling
    slot of the engine.  At most MAX_IN_FLIGHT are served at once; the rest wait, and all are answered."""
    from agentrl.gateway import MAX_IN_FLIGHT

    running, most = 0, 0

    class Counting(ScriptedClient):
        async def complete(self, prompt_ids, sampling, n=1):
            nonlocal running, most
            running += 1
            most = max(most, running)
            try:
                await asyncio.sleep(0.2)
                return await super().complete(prompt_ids, sampling, n)
            finally:
                running -= 1

    gateway = Gateway()
    try:
        s = await _open(gateway, Counting(lambda p: "x"), max_calls=3 * MAX_IN_FLIGHT)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {s.key}"}) as http:

            async def call() -> int:
                async with http.post(s.base_url + "/chat/completions", json=BODY) as r:
                    return r.status

            statuses = await asyncio.wait_for(asyncio.gather(*(call() for _ in range(3 * MAX_IN_FLIGHT))), 60)
        assert statuses == [200] * (3 * MAX_IN_FLIGHT)
        assert most == MAX_IN_FLIGHT, most
    finally:
        await gateway.close()


async def test_a_body_over_the_limit_is_the_callers_413_not_a_gateway_failure():
    """A body over MAX_BODY read inside the gateway's handler raised aiohttp's own error, answered as
    "500 the gateway failed" (the SDK retried it twice, re-uploading it).  It is a 413, and the
    connection closes with the answer; declared or chunked alike."""
    from agentrl.gateway import MAX_BODY

    gateway = Gateway()
    try:
        s = await _open(gateway, ScriptedClient(lambda p: "x"))
        big = {**BODY, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
        payload = json.dumps(big).encode()

        async def chunked():
            for k in range(0, len(payload), 1 << 20):
                yield payload[k : k + (1 << 20)]

        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {s.key}"}) as http:
            for data in (payload, chunked()):
                async with http.post(s.base_url + "/chat/completions", data=data,
                                     headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                    assert r.status == 413, (r.status, await r.text())
        assert s.calls == 0 and s.turns == []
    finally:
        await gateway.close()
