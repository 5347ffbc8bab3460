"""``stream=true`` on the embedded engine, driven by the official ``openai`` client (SSE)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from agentrl.inference.streaming import IncrementalDetokenizer

CHAT = [{"role": "user", "content": "hello, what is 3+4?"}]


@pytest.fixture(scope="module")
def client(engine):
    with openai.OpenAI(base_url=engine.base_url, api_key="EMPTY", max_retries=0) as c:
        yield c


def texts_by_index(chunks, field: str = "text") -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for ch in chunks:
        for c in ch.choices:
            piece = c.delta.content if field == "content" else c.text
            out.setdefault(c.index, []).append(piece or "")
    return out


def finish_by_index(chunks) -> dict[int, str]:
    return {c.index: c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason}


def test_incremental_detokenizer_never_splits_a_character(tokenizer):
    text = "héllo wörld: €100 → 日本語 ok 🎉🎉 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 3, "the test needs characters split over several byte tokens"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.finish(text) == text
    assert "".join(deltas) == text  # nothing was left for the end: the text ends on a whole character
    # with a hold-back the tail waits for finish(), and nothing is lost
    held = IncrementalDetokenizer(tokenizer, hold=4)
    deltas = [held.add([t]) for t in ids]
    assert "".join(deltas) == text[:-4] and held.finish(text) == text[-4:]


@pytest.mark.parametrize("seed, n", [(1, 1), (7, 2), (23, 3)])
def test_streamed_chat_concatenates_to_the_non_streamed_text(engine, client, seed, n):
    kw = {"model": engine.model, "messages": CHAT, "max_tokens": 60, "temperature": 1.0, "seed": seed, "n": n}
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    pieces = texts_by_index(chunks, "content")
    finishes = finish_by_index(chunks)
    for i, choice in enumerate(full.choices):
        first = next(ch.choices[0] for ch in chunks if ch.choices[0].index == i)
        assert first.delta.role == "assistant"
        assert "".join(pieces[i]) == choice.message.content
        assert finishes[i] == choice.finish_reason
        content = [p for p in pieces[i] if p]
        assert len(content) > 3, "the text should arrive in several chunks, not one blob"
        # a character split over byte tokens is held back: only the last piece may end mid-character
        assert not any(p.endswith("\ufffd") for p in content[:-1])
    assert chunks[-1].usage is None


def test_streamed_completions_n2_with_usage(engine, client):
    kw = {"model": engine.model, "prompt": [[1, 5, 9], [1, 6, 7]], "max_tokens": 20, "n": 2, "seed": 4,
          "extra_body": {"ignore_eos": True}}  # fmt: skip
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "text_completion" for ch in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == {
        "prompt_tokens": 6, "completion_tokens": 80, "total_tokens": 86,
    }  # fmt: skip
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None and len(ch.choices) == 1 for ch in body)
    pieces = texts_by_index(body)
    assert sorted(pieces) == [0, 1, 2, 3]
    assert {i: "".join(p) for i, p in pieces.items()} == {c.index: c.text for c in full.choices}
    assert finish_by_index(body) == {i: "length" for i in range(4)}


def test_streamed_token_ids_and_logprobs_match_non_streamed(engine, client):
    kw = {"model": engine.model, "messages": CHAT, "max_tokens": 40, "temperature": 0.9, "seed": 3,
          "logprobs": True, "top_logprobs": 2, "extra_body": {"return_token_ids": True}}  # fmt: skip
    full = client.chat.completions.create(**kw).model_dump()
    chunks = [ch.model_dump() for ch in client.chat.completions.create(**kw, stream=True)]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    choices = [c for ch in chunks for c in ch["choices"]]
    ids = [t for c in choices for t in c.get("token_ids") or []]
    versions = [v for c in choices for v in c.get("token_versions") or []]
    entries = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    ref = full["choices"][0]
    assert ids == ref["token_ids"] and len(ids) > 1
    assert versions == ref["token_versions"]
    assert [e["token"] for e in entries] == [e["token"] for e in ref["logprobs"]["content"]]
    assert [e["logprob"] for e in entries] == pytest.approx([e["logprob"] for e in ref["logprobs"]["content"]], abs=1e-5)
    assert [[t["token"] for t in e["top_logprobs"]] for e in entries] == [
        [t["token"] for t in e["top_logprobs"]] for e in ref["logprobs"]["content"]
    ]
    # every chunk's logprobs describe exactly the tokens it carries
    assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) for c in choices if c.get("token_ids"))

    # legacy completions logprobs: tokens, logprobs and text offsets line up across chunks too
    ckw = {"model": engine.model, "prompt": [1, 5, 9], "max_tokens": 30, "seed": 8, "logprobs": 1,
           "extra_body": {"return_token_ids": True, "ignore_eos": True}}  # fmt: skip
    cfull = client.completions.create(**ckw).model_dump()["choices"][0]
    cchunks = [c for ch in client.completions.create(**ckw, stream=True) for c in ch.model_dump()["choices"]]
    assert cchunks[0]["prompt_token_ids"] == [1, 5, 9]
    assert all("prompt_token_ids" not in c or c["prompt_token_ids"] is None for c in cchunks[1:])
    assert [t for c in cchunks for t in c["token_ids"]] == cfull["token_ids"]
    for key in ("tokens", "text_offset", "top_logprobs"):
        assert [x for c in cchunks for x in c["logprobs"][key]] == cfull["logprobs"][key]
    got = [x for c in cchunks for x in c["logprobs"]["token_logprobs"]]
    assert got == pytest.approx(cfull["logprobs"]["token_logprobs"], abs=1e-5)


def test_stop_string_never_leaks_into_the_stream(engine, client):
    kw = {"model": engine.model, "prompt": [1, 5, 9], "max_tokens": 40, "seed": 11, "extra_body": {"ignore_eos": True}}
    text = client.completions.create(**kw).choices[0].text
    start = next(i for i in range(8, len(text) - 4) if "\ufffd" not in text[i : i + 4] and text[i : i + 4].strip())
    stop = text[start : start + 4]
    expected = client.completions.create(**kw, stop=[stop]).choices[0]
    assert expected.finish_reason == "stop" and stop not in expected.text
    seen = ""
    chunks = list(client.completions.create(**kw, stop=[stop], stream=True))
    for ch in chunks:
        seen += ch.choices[0].text
        assert stop not in seen and expected.text.startswith(seen)
    assert seen == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_calls_are_streamed_parsed(engine, client, tools, tool_prompt):
    kw = {"model": engine.model, "messages": tool_prompt, "tools": tools, "temperature": 0, "max_tokens": 60}
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.delta for ch in chunks for c in ch.choices]
    assert not any("<tool_call>" in (d.content or "") for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "calculator", {"expression": "12+30"})
    ]
    assert calls[0].id and calls[0].type == "function"
    assert "".join(d.content or "" for d in deltas) == (full.message.content or "")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/v1/chat/completions", {"model": "no-such-model"}, 404, "model_not_found"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 400}]}, 400, "context_length_exceeded"),
        ("/v1/chat/completions", {"temperature": -1}, 400, None),
        ("/v1/chat/completions", {"n": 1000}, 400, None),
        ("/v1/completions", {"prompt": list(range(3, 500))}, 400, "context_length_exceeded"),
        ("/v1/completions", {"prompt": [1, 10**9]}, 400, None),
        ("/v1/completions", {"prompt": [1, 2], "echo": True}, 400, None),
        ("/v1/completions", {"prompt": [1, 2], "stream": False, "stream_options": {"include_usage": True}}, 400, None),
    ],
)
def test_bad_streaming_requests_get_json_errors(engine, path, body, status, code):
    base = {"model": engine.model, "max_tokens": 4, "stream": True}
    if path.endswith("/chat/completions"):
        base["messages"] = CHAT
    r = httpx.post(engine.root_url + path, json={**base, **body})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["message"]
    if code:
        assert err["code"] == code
    assert httpx.get(engine.root_url + "/metrics", headers=engine.headers).json()["running"] == 0


async def _stats(http: httpx.AsyncClient) -> dict:
    return (await http.get("/metrics")).json()


async def _settle(http: httpx.AsyncClient, aborted: int = 0) -> dict:
    """Stats once nothing is queued or running and at least ``aborted`` requests were aborted
    (a cancelled request is only counted at the engine's next step)."""
    for _ in range(1000):
        s = await _stats(http)
        if not s["queue_depth"] and not s["running"] and s["requests_aborted"] >= aborted:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not settle: {s}")


async def test_disconnect_before_the_first_token_aborts_the_request(engine):
    async with httpx.AsyncClient(base_url=engine.root_url, timeout=30, headers=engine.headers) as http:
        before = await _settle(http)
        await http.post("/pause")  # the request stays queued: it cannot finish before we hang up
        try:
            body = {"model": engine.model, "messages": CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(base_url=engine.base_url, timeout=30) as doomed:
                async with doomed.stream("POST", "/chat/completions", json=body) as r:
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                    lines = r.aiter_lines()
                    first = json.loads((await anext(lines)).removeprefix("data: "))
                    assert first["choices"][0]["delta"]["role"] == "assistant"
                    assert (await _stats(http))["queue_depth"] == 1
            for _ in range(500):  # the server sees the disconnect and cancels the queued request
                if (await _stats(http))["queue_depth"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert (await _stats(http))["queue_depth"] == 0
        finally:
            await http.post("/resume")
        s = await _settle(http, before["requests_aborted"] + 1)
        assert s["requests_aborted"] == before["requests_aborted"] + 1
        assert s["total_generated_tokens"] == before["total_generated_tokens"]


async def test_client_that_stops_reading_mid_stream_aborts_the_request(engine):
    async with httpx.AsyncClient(base_url=engine.root_url, timeout=30, headers=engine.headers) as http:
        before = await _settle(http)
        async with openai.AsyncOpenAI(base_url=engine.base_url, api_key="EMPTY", max_retries=0) as ac:
            stream = await ac.completions.create(
                model=engine.model, prompt=[1, 2], max_tokens=250, stream=True, extra_body={"ignore_eos": True}
            )
            try:
                async for chunk in stream:
                    assert chunk.choices[0].finish_reason is None
                    if chunk.choices[0].text:
                        break  # generating: hold the engine so it cannot finish, then hang up
                await http.post("/pause")
                assert (await _stats(http))["running"] == 1
            finally:
                await stream.close()
            try:
                for _ in range(500):  # "running" drops the sequence once its future is cancelled
                    if (await _stats(http))["running"] == 0:
                        break
                    await asyncio.sleep(0.01)
                assert (await _stats(http))["running"] == 0
            finally:
                await http.post("/resume")
        s = await _settle(http, before["requests_aborted"] + 1)
        assert s["requests_aborted"] == before["requests_aborted"] + 1
        assert s["total_generated_tokens"] - before["total_generated_tokens"] < 250
        # and the server keeps serving, streamed or not
        r = await http.post("/v1/completions", json={"model": engine.model, "prompt": [1, 2], "max_tokens": 3, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 3
        async with openai.AsyncOpenAI(base_url=engine.base_url, api_key="EMPTY", max_retries=0) as ac:
            chunks = [c async for c in await ac.completions.create(
                model=engine.model, prompt=[1, 2], max_tokens=3, stream=True, extra_body={"ignore_eos": True}
            )]  # fmt: skip
        assert chunks[-1].choices[0].finish_reason == "length"
