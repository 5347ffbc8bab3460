"""PolicyClient's retries, failover, throttling, pinning and reply checks, against real HTTP
servers that misbehave on purpose (the well-behaved path is tested on the real engine)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from testkit import serve_app

from agentrl.errors import EndpointError, EndpointProbeError, MalformedResponse
from agentrl.inference import PolicyClient
from agentrl.types import SamplingParams


def completion_body(n_tokens: int = 3, *, logprobs: int | None = None) -> dict:
    ids = list(range(5, 5 + n_tokens))
    lps = [-0.5] * (n_tokens if logprobs is None else logprobs)
    return {"id": "c", "object": "text_completion", "model": "m", "choices": [
        {"index": 0, "text": "abc", "finish_reason": "stop", "token_ids": ids,
         "logprobs": {"token_logprobs": lps}, "token_versions": [3] * n_tokens}]}  # fmt: skip


class Server:
    """An aiohttp app on a free loopback port; ``script`` decides each /v1/completions reply."""

    def __init__(self, script):
        self.script, self.calls, self.times = script, 0, []

    async def __aenter__(self):
        app = web.Application()

        async def completions(request: web.Request) -> web.Response:
            self.calls += 1
            self.times.append(time.monotonic())
            body = await request.json()
            status, payload = await self.script(self.calls, body)
            return web.json_response(payload, status=status)

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/models", models)
        self.runner, port = await serve_app(app)
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


async def test_server_errors_are_retried_with_backoff_then_succeed():
    async def script(call, body):
        return (503, {"error": {"message": "overloaded"}}) if call <= 2 else (200, completion_body())

    async with Server(script) as srv, PolicyClient(srv.url, "m", max_retries=3) as pc:
        (c,) = await pc.complete([1, 2], SamplingParams(max_tokens=3))
    assert srv.calls == 3 and c.token_ids == [5, 6, 7] and c.versions == [3, 3, 3]
    assert srv.times[2] - srv.times[0] >= 0.1  # backoff waited (0.05–0.15 s, then 0.1–0.3 s)


async def test_retries_give_up_with_a_named_endpoint_error():
    async def script(call, body):
        return 500, {"error": {"message": "boom"}}

    async with Server(script) as srv, PolicyClient(srv.url, "m", max_retries=2) as pc:
        with pytest.raises(EndpointError, match="failed after 3 attempts") as info:
            await pc.complete([1], SamplingParams())
    assert srv.calls == 3 and info.value.error_kind == "endpoint"


async def test_client_errors_are_not_retried():
    async def script(call, body):
        return 400, {"error": {"message": "bad field"}}

    async with Server(script) as srv, PolicyClient(srv.url, "m", max_retries=3) as pc:
        with pytest.raises(EndpointError, match="HTTP 400.*bad field"):
            await pc.complete([1], SamplingParams())
    assert srv.calls == 1


async def test_a_malformed_reply_is_a_parse_error():
    async def script(call, body):
        return 200, completion_body(3, logprobs=1)

    async with Server(script) as srv, PolicyClient(srv.url, "m", max_retries=3) as pc:
        with pytest.raises(MalformedResponse, match="3 token ids but 1 logprobs") as info:
            await pc.complete([1], SamplingParams())
    assert info.value.error_kind == "parse" and srv.calls == 1


async def test_every_sampling_field_is_sent_explicitly():
    seen = {}

    async def script(call, body):
        seen.update(body)
        return 200, completion_body()

    async with Server(script) as srv, PolicyClient(srv.url, "m") as pc:
        await pc.complete([1], SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9))
    assert {k: seen[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n")} == {
        "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "n": 1}


async def test_request_rate_is_throttled_per_endpoint():
    async def script(call, body):
        return 200, completion_body()

    async with Server(script) as srv, PolicyClient(srv.url, "m", requests_per_s=5) as pc:
        calls = [asyncio.create_task(pc.complete([1], SamplingParams())) for _ in range(50)]
        await asyncio.sleep(0.5)
        assert 1 <= srv.calls <= 10  # 5 per second window; unthrottled would be all 50
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


async def test_a_pin_prefers_its_endpoint_and_fails_over_when_it_dies():
    async def ok(call, body):
        return 200, completion_body()

    async def down(call, body):
        return 503, {"error": {"message": "down"}}

    async with Server(ok) as a, Server(ok) as b, PolicyClient([a.url, b.url], "m") as pc:
        pin_a, pin_b = pc.pin(4), pc.pin(4)  # the second pin goes to the less loaded endpoint
        assert pin_a.endpoint is not pin_b.endpoint
        for _ in range(3):
            await pin_a.complete([1], SamplingParams())
        assert sorted([a.calls, b.calls]) == [0, 3]
        pin_a.release(), pin_b.release()
        assert all(ep.pinned == 0 for ep in pc.endpoints)
    async with Server(down) as dead, Server(ok) as alive, PolicyClient([dead.url, alive.url], "m") as pc:
        pin = pc.pin(1)
        pin.endpoint = pc.endpoints[0]  # pinned to the dead one
        (c,) = await pin.complete([1], SamplingParams())
        assert dead.calls == 1 and alive.calls == 1 and c.token_ids == [5, 6, 7]


async def test_probe_names_the_model_to_pass_and_the_missing_routes():
    async def ok(call, body):
        return 200, completion_body()

    async with Server(ok) as srv:
        async with PolicyClient(srv.url, "wrong") as pc:
            with pytest.raises(EndpointProbeError, match="pass --model m"):
                await pc.probe(token_path=False)
        async with PolicyClient(srv.url, "m") as pc:
            with pytest.raises(EndpointProbeError, match="no /v1/chat/completions route"):
                await pc.probe(token_path=False)
            with pytest.raises(EndpointProbeError, match="no /tokenize route.*--chat"):
                await pc.probe(token_path=True)
    async with PolicyClient("http://127.0.0.1:9/v1", "m") as pc:
        with pytest.raises(EndpointProbeError, match="cannot reach"):
            await pc.probe(token_path=False)


async def test_the_sampling_probe_wants_processed_logprobs_and_the_support():
    async def raw(call, body):  # a server that reports the model's raw logprobs (vLLM's default mode)
        return 200, completion_body(1)

    async with Server(raw) as srv, PolicyClient(srv.url, "m") as pc:
        with pytest.raises(EndpointProbeError, match="--logprobs-mode processed_logprobs"):
            await pc.probe_sampling(SamplingParams(temperature=0.7), [1, 2])

    async def processed_no_support(call, body):
        out = completion_body(1)
        if body["top_k"] == 1:
            out["choices"][0]["logprobs"]["token_logprobs"] = [0.0]
        return 200, out

    async with Server(processed_no_support) as srv, PolicyClient(srv.url, "m") as pc:
        await pc.probe_sampling(SamplingParams(temperature=0.7), [1, 2])  # nothing truncated: fine
        await pc.probe_sampling(SamplingParams(temperature=0.7, top_k=20), [1, 2])  # K = top_k is known
        with pytest.raises(EndpointProbeError, match="no token_support"):
            await pc.probe_sampling(SamplingParams(temperature=0.7, top_p=0.8), [1, 2])
        (c,) = await pc.complete([1], SamplingParams(temperature=0.7, top_k=20))
        assert c.support == [20]


async def test_special_tokens_stay_in_the_text_where_the_tool_markers_are_special_tokens():
    seen = []

    async def script(call, body):
        seen.append(body["skip_special_tokens"])
        return 200, completion_body()

    async with Server(script) as srv:
        for parser, skip in (("hermes", True), ("pythonic", True), ("mistral", False), ("llama3_json", False)):
            async with PolicyClient(srv.url, "m", tool_parser=parser) as pc:
                assert pc.tool_parser == parser
                await pc.complete([1], SamplingParams())
            assert seen[-1] is skip
