"""Bounded requests on the engine (README "Keys and ports"), each test an attack on a real engine
process: a caller's own chat template, an 8 MB prompt, a 20 MB body, a connection that never
finishes its headers, a foreign Host (DNS rebinding), a page from another site."""

from __future__ import annotations

import asyncio
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from door import LOCAL_HOSTS, assert_foreign_hosts_refused, assert_foreign_origins_refused, closed_within

# 80 bytes of Jinja that loop for hours (transformers' sandbox caps one range, not two): the server ran
# a caller's template like this on its event loop, and /health froze
SLOW_TEMPLATE = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


async def _health_meanwhile(root: str, attack) -> tuple[httpx.Response, int]:
    """Run ``attack`` while polling /health; returns its response and how many polls answered."""
    answered = 0

    async def poll(http: httpx.AsyncClient) -> None:
        nonlocal answered
        while True:
            r = await http.get("/health", timeout=5)
            assert r.status_code == 200
            answered += 1
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=root, timeout=60) as http:
        poller = asyncio.create_task(poll(http))
        try:
            await asyncio.sleep(0.1)
            r = await attack(http)
            await asyncio.sleep(0.1)
            if poller.done():
                poller.result()  # the poll's own failure: /health did not answer
        finally:
            poller.cancel()
    return r, answered


@pytest.mark.parametrize("kwargs", [
    {"chat_template": SLOW_TEMPLATE},
    {"Chat_Template": SLOW_TEMPLATE},
    {"tool_template": SLOW_TEMPLATE},
    {"tokenizer_kwargs": {"chat_template": SLOW_TEMPLATE}},
])  # fmt: skip
async def test_a_callers_chat_template_is_refused(engine, kwargs):
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {**CHAT, "chat_template_kwargs": kwargs}
        r, answered = await _health_meanwhile(engine.root_url, lambda http, p=path, b=body: http.post(p, json=b))
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "chat_template_kwargs" in message and "refused" in message and "\n" not in message
        assert answered >= 2
    # a template variable is still a template variable
    ok = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(engine.base_url + "/chat/completions", json=ok, timeout=60).status_code == 200


async def test_an_8mb_prompt_is_refused_before_it_is_tokenized(engine):
    big = "ab " * (8_000_000 // 3)
    attacks = [
        ("/v1/completions", {"prompt": big, "max_tokens": 2}),
        ("/v1/completions", {"prompt": ["Hi", big], "max_tokens": 2}),
        ("/tokenize", {"prompt": big}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}], "max_tokens": 2}),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": big}]}]}),
    ]
    for path, body in attacks:
        r, _ = await _health_meanwhile(engine.root_url, lambda http, p=path, b=body: http.post(p, json=b))
        assert r.status_code == 400, (path, r.text[:300])
        err = r.json()["error"]
        # the byte check answered (the engine's own check counts tokens, after tokenizing)
        assert err["code"] == "context_length_exceeded" and " bytes" in err["message"], err
    # a prompt that fits is still served
    assert httpx.post(engine.base_url + "/completions", json={"prompt": "ab " * 20, "max_tokens": 2}).status_code == 200


def test_a_body_over_the_cap_is_413_before_it_is_read(engine):
    body = b'{"prompt": "' + b"a" * (20 << 20) + b'"}'
    with httpx.Client(base_url=engine.root_url, timeout=60) as http:
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "cap" in r.json()["error"]["message"], r.text[:300]

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(40):
                yield b"a" * (1 << 20)

        r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert http.get("/health").status_code == 200


def test_a_connection_that_never_finishes_its_headers_is_closed(engine):
    url = urlparse(engine.root_url)
    trickle = socket.create_connection((url.hostname, url.port))
    silent = socket.create_connection((url.hostname, url.port))
    try:
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        for _ in range(3):  # one more header line every 2 s: never the blank line that ends them
            time.sleep(2)
            trickle.sendall(b"X-Slow: 1\r\n")
        assert closed_within(trickle, 30 - (time.monotonic() - t0)), "the slowloris connection is still open"
        assert closed_within(silent, 5)
    finally:
        trickle.close()
        silent.close()
    assert httpx.get(engine.root_url + "/health").status_code == 200


def test_a_foreign_host_is_refused(engine):
    """DNS rebinding: a page at attacker.example whose name now points at 127.0.0.1."""
    port = urlparse(engine.root_url).port
    with httpx.Client(base_url=engine.root_url, timeout=30) as http:
        assert_foreign_hosts_refused(http, "GET", "/v1/models", port, engine.headers)
        assert_foreign_hosts_refused(http, "POST", "/pause", port, engine.headers)
        for host in LOCAL_HOSTS:
            assert http.get("/v1/models", headers={"Host": host.format(port=port)}).status_code == 200, host
        assert http.get("/health", headers={"Host": "attacker.example"}).status_code == 403


def test_a_page_from_another_site_is_refused(engine):
    """A cross-origin "simple" POST is sent without a preflight: the browser does not ask first."""
    with httpx.Client(base_url=engine.root_url, timeout=30) as http:
        assert_foreign_origins_refused(http, "POST", "/pause", {"Content-Type": "text/plain", **engine.headers})
        assert_foreign_origins_refused(http, "POST", "/v1/completions", {}, json={"prompt": "Hi", "max_tokens": 1})
        assert http.get("/is_paused", headers=engine.headers).json() == {"is_paused": False}
        same = http.post("/v1/completions", headers={"Origin": engine.root_url}, json={"prompt": "Hi", "max_tokens": 1})
        assert same.status_code == 200  # the server's own origin
