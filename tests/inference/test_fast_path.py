"""The generation routes' fast path (:class:`agentrl.inference.server.GenerationFastPath`):
it answers only well-formed, non-streaming requests, and hands everything else, body intact,
to the FastAPI app; on the real engine its answers equal FastAPI's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from door import RecordingApp
from fastapi.responses import StreamingResponse

from agentrl.guard import Guard
from agentrl.inference.engine import Engine
from agentrl.inference.engine_args import EngineArgs
from agentrl.inference.protocol import APIError, error_response
from agentrl.inference.server import GenerationFastPath, create_app
from tests.inference.conftest import MAX_MODEL_LEN


class _Server:
    """The two handlers the fast path calls, recording what they got."""

    def __init__(self, fail: APIError | None = None, delay: float = 0.0) -> None:
        self.seen: list[Any] = []
        self.fail, self.delay, self.cancelled = fail, delay, False

    async def completions(self, req: Any) -> dict[str, Any]:
        self.seen.append(req)
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.fail is not None:
            raise self.fail
        return {"object": "text_completion", "prompt": req.prompt}

    async def chat(self, req: Any) -> dict[str, Any]:
        self.seen.append(req)
        return {"object": "chat.completion", "n": len(req.messages)}

    async def completions_stream(self, req: Any) -> Any:
        self.seen.append(req)
        if self.fail is not None:
            raise self.fail

        async def events():
            yield b"data: one\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


async def _call(app: Any, path: str, body: bytes, *, method: str = "POST", content_type: bytes | None = b"application/json",
                chunks: int = 1, leave: bool = False) -> tuple[int | None, bytes]:
    headers = [(b"host", b"127.0.0.1")] + ([(b"content-type", content_type)] if content_type is not None else [])
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}
    step = max(1, -(-len(body) // chunks))
    messages = [{"type": "http.request", "body": body[i:i + step], "more_body": i + step < len(body)}
                for i in range(0, len(body), step)] or [{"type": "http.request", "body": b"", "more_body": False}]
    if leave:
        messages = messages[:1] + [{"type": "http.disconnect"}] if len(messages) > 1 else [{"type": "http.disconnect"}]
    pending = list(messages)
    status: list[int] = []
    out: list[bytes] = []

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)  # a live client: no disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        else:
            out.append(message.get("body", b""))

    await app(scope, receive, send)
    return (status[0] if status else None), b"".join(out)


async def _api_error(_: Any, e: APIError) -> Any:
    return error_response(e.status, e.message, e.type, e.param, e.code)


def _app(server: _Server) -> tuple[GenerationFastPath, RecordingApp]:
    inner = RecordingApp(299, b"inner")  # FastAPI's stand-in
    return GenerationFastPath(inner, server, {APIError: _api_error}), inner


async def test_a_well_formed_request_is_answered_without_the_app():
    server = _Server()
    app, inner = _app(server)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
    status, out = await _call(app, "/v1/completions", body, chunks=3)  # a body that arrives in parts
    assert (status, json.loads(out)) == (200, {"object": "text_completion", "prompt": [1, 2, 3]})
    assert inner.calls == [] and server.seen[0].max_tokens == 4
    status, out = await _call(app, "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
                              content_type=b"Application/JSON; charset=utf-8")
    assert (status, json.loads(out)) == (200, {"object": "chat.completion", "n": 1}) and inner.calls == []


@pytest.mark.parametrize("path, body, kw", [
    ("/v1/completions", b"{not json", {}),
    ("/v1/completions", b"", {}),
    ("/v1/completions", b"[1, 2]", {}),
    ("/v1/completions", b'{"prompt": [1], "max_tokens": "many"}', {}),  # a schema error: FastAPI words it
    ("/v1/completions", b"\xff\xfe\x00junk", {}),
    ("/v1/completions", b"[" * 100_000, {}),  # past json's recursion limit (FastAPI answers 400)
    ("/v1/completions", b'{"prompt": [1]}', {"content_type": b"text/plain"}),
    ("/v1/completions", b'{"prompt": [1]}', {"content_type": None}),  # FastAPI's call (strict_content_type)
    ("/v1/completions", b'{"prompt": [1]}', {"content_type": b"application/merge+json"}),
    ("/v1/completions", b'{"prompt": [1]}', {"method": "PUT"}),
    ("/v1/completions/", b'{"prompt": [1]}', {}),
    ("/tokenize", b'{"prompt": "x"}', {}),
])
async def test_anything_else_reaches_the_app_with_its_body(path, body, kw):
    server = _Server()
    app, inner = _app(server)
    status, out = await _call(app, path, body, chunks=2, **kw)
    assert (status, out) == (299, b"inner")
    assert inner.calls == [(path, body)]  # the whole body, replayed
    assert server.seen == []


async def test_a_stream_is_served_by_the_stream_handler():
    server = _Server()
    app, inner = _app(server)
    status, out = await _call(app, "/v1/completions", b'{"prompt": [1], "stream": true}')
    assert (status, out) == (200, b"data: one\n\ndata: [DONE]\n\n")
    assert inner.calls == [] and server.seen[0].stream is True


async def test_an_error_without_a_handler_propagates_as_from_the_route():
    app, _ = _app(_Server(fail=RuntimeError("engine core died")))  # the app has no handler for it: a 500
    with pytest.raises(RuntimeError, match="engine core died"):
        await _call(app, "/v1/completions", b'{"prompt": [1]}')


async def test_a_handler_error_is_an_openai_error_body():
    server = _Server(fail=APIError(404, "The model `x` does not exist.", type_="NotFoundError", param="model",
                                   code="model_not_found"))
    app, _ = _app(server)
    status, out = await _call(app, "/v1/completions", b'{"prompt": [1], "model": "x"}')
    assert status == 404
    assert json.loads(out) == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                         "param": "model", "code": "model_not_found"}}


async def test_a_client_that_leaves_is_not_answered_and_its_work_is_cancelled():
    server = _Server()
    app, inner = _app(server)
    assert await _call(app, "/v1/completions", b'{"prompt": [1, 2, 3, 4]}', chunks=2, leave=True) == (None, b"")
    assert inner.calls == [] and server.seen == []  # left mid-body: nothing ran

    server = _Server(delay=30)
    app, _ = _app(server)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")], "query_string": b""}
    messages = [{"type": "http.request", "body": b'{"prompt": [1]}', "more_body": False}]
    left = asyncio.Event()

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await left.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    task = asyncio.create_task(app(scope, receive, send))
    async with asyncio.timeout(10):
        while not server.seen:
            assert not task.done(), sent  # answered without calling the handler
            await asyncio.sleep(0.01)
        left.set()  # the client goes away while the engine works
        await task
    assert server.cancelled  # the engine's work was cancelled, not left to run to max_tokens
    assert sent[0]["status"] == 499


def _same(a: Any, b: Any) -> bool:
    """Equal JSON, floats within 1e-5 (the second request reads the first one's prefix cache,
    so its logprobs can differ in the last bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5 * max(1.0, abs(a))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a if k not in ("id", "created"))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 5, 9], "max_tokens": 6, "temperature": 0, "logprobs": 2, "return_token_ids": True}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "n": 2, "seed": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is 12+30?"}], "max_tokens": 8,
                              "temperature": 0, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "model": "no-such-model"}),  # an error from the handler
])
def test_the_fast_path_answers_as_the_fastapi_route_does(engine, path, body):
    """The same greedy request through the fast path (application/json) and through FastAPI's
    route (a +json type the fast path leaves to it): the same status and body."""
    def post(content_type: str) -> httpx.Response:
        return httpx.post(engine.root_url + path, content=json.dumps(body),
                          headers={**engine.headers, "content-type": content_type}, timeout=60)

    fast, routed = post("application/json"), post("application/vnd.agentrl+json")
    assert fast.status_code == routed.status_code
    assert fast.headers["content-type"] == routed.headers["content-type"]
    assert fast.json().keys() == routed.json().keys()
    assert _same(fast.json(), routed.json()), (fast.json(), routed.json())


async def test_the_engine_app_serves_generation_through_it_inside_the_guard(model_dir):
    """create_app's wiring: the Guard first, then the fast path, which answers well-formed
    requests (streams too) itself and passes a malformed one to the FastAPI route."""
    engine = Engine(model_dir, EngineArgs(max_batch_size=4, max_model_len=MAX_MODEL_LEN, device="cpu"))
    try:
        app = create_app(engine)
        assert [m.cls for m in app.user_middleware] == [Guard, GenerationFastPath]  # outermost first
        passed_on: list[str] = []
        (fast,) = [m for m in app.user_middleware if m.cls is GenerationFastPath]

        class Counting(GenerationFastPath):
            def __init__(self, inner: Any, **kw: Any) -> None:
                async def counted(scope: dict, receive: Any, send: Any) -> None:
                    passed_on.append(scope["path"])
                    await inner(scope, receive, send)

                super().__init__(counted, **kw)

        fast.cls = Counting
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as http:
            ok = await http.post("/v1/completions", json={"prompt": [1, 5, 9], "max_tokens": 3, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            chat = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 2, "temperature": 0})
            assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
            stream = await http.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 2, "stream": True})
            assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
            missing = await http.post("/v1/completions", json={"prompt": [1], "model": "nope"})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
            assert passed_on == []  # all four answered by the fast path
            bad = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": "many"})
            assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
            assert passed_on == ["/v1/completions"]  # FastAPI worded the schema error
            evil = await http.post("/v1/completions", json={"prompt": [1]}, headers={"host": "evil.example"})
            assert evil.status_code == 403 and passed_on == ["/v1/completions"]  # the Guard answered first
    finally:
        engine.close()
