"""The viewer's door (README "Keys and ports"), each test an attack on a real viewer server: a
stranger reads the run, a page from another site or a rebound DNS name reads it, a slow client
holds connections."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from door import LOCAL_HOSTS, assert_foreign_hosts_refused, assert_foreign_origins_refused, closed_within

from agentrl.guard import Limits
from agentrl.viewer.server import ViewerServer


@pytest.fixture()
def eval_dir(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"env": "calc", "model": "m"}))
    rec = {"task_index": 0, "rollout": 0, "messages": [{"role": "user", "content": "secret prompt"}],
           "reward": 1.0, "error": None, "stop_reason": "done", "turns": 1, "metrics": {}}
    (tmp_path / "results.jsonl").write_text(json.dumps(rec) + "\n")
    return tmp_path


def test_a_stranger_cannot_read_the_run(eval_dir):
    with ViewerServer(eval_dir) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        for path in ("/", "/api/meta", "/api/poll", "/static/app.js", "/api/episode/x"):
            r = http.get(path)
            assert r.status_code == 401 and "?token=" in r.json()["error"]["message"], path
            assert srv.key not in r.text
            assert http.get(path, params={"token": srv.key[:-1]}).status_code == 401
        assert http.get("/api/meta", headers={"Authorization": f"Bearer {srv.key}"}).json()["kind"] == "eval"


def test_token_once_then_an_httponly_strict_cookie(eval_dir):
    with ViewerServer(eval_dir) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        r = http.get("/", params={"token": srv.key, "tab": "episodes"}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/?tab=episodes"  # the token leaves the URL
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and srv.key not in cookie  # derived, not the key
        assert http.get("/api/poll").status_code == 200  # the client kept the cookie
        assert "secret prompt" in json.dumps(http.get("/api/poll").json())
        http.cookies.clear()
        assert http.get("/api/poll").status_code == 401
        forged = cookie.split(";")[0].split("=", 1)[0] + "=" + "0" * 64
        assert http.get("/api/poll", headers={"Cookie": forged}).status_code == 401


def test_a_rebound_name_or_another_sites_page_is_refused(eval_dir):
    with ViewerServer(eval_dir) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        auth = {"Authorization": f"Bearer {srv.key}"}
        port = urlparse(srv.url).port
        assert_foreign_hosts_refused(http, "GET", "/api/meta", port, auth)
        assert_foreign_origins_refused(http, "GET", "/api/meta", auth)
        for host in LOCAL_HOSTS:
            assert http.get("/api/meta", headers={"Host": host.format(port=port), **auth}).status_code == 200, host
    with ViewerServer(eval_dir, allowed_hosts=("viewer.lan",), allowed_origins=("http://dash.lan",)) as srv:
        auth = {"Authorization": f"Bearer {srv.key}"}
        assert httpx.get(srv.url + "api/meta", headers={"Host": "viewer.lan", "Origin": "http://dash.lan", **auth},
                         timeout=30).status_code == 200  # fmt: skip


def test_slow_clients_are_closed_and_connections_capped(eval_dir):
    limits = Limits(header_timeout_s=1.0, body_idle_s=1.0, max_connections=4)
    with ViewerServer(eval_dir, limits=limits) as srv:
        addr = urlparse(srv.url)
        where = (addr.hostname, addr.port)
        # headers that never end, and a body that stops halfway
        slow_head, slow_body = socket.create_connection(where), socket.create_connection(where)
        slow_head.sendall(b"GET /api/meta HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow_body.sendall(b"POST /api/meta HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n0123456789")
        assert closed_within(slow_head, 10) and closed_within(slow_body, 10)
        slow_head.close()
        slow_body.close()
        # four idle connections fill the cap: the next request is told to come back (503), not queued
        idle = [socket.create_connection(where) for _ in range(4)]
        time.sleep(0.2)
        try:
            r = httpx.get(srv.url + "api/meta", headers={"Authorization": f"Bearer {srv.key}"}, timeout=30)
            assert r.status_code == 503
        finally:
            for s in idle:
                s.close()
        time.sleep(1.5)
        assert httpx.get(srv.url + "api/meta", headers={"Authorization": f"Bearer {srv.key}"},
                         timeout=30).status_code == 200  # fmt: skip


def _drip(sock: socket.socket, seconds: float) -> bool:
    """Send one body byte every 0.3 s for up to ``seconds``; True once the server has closed."""
    sock.settimeout(0.3)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            sock.sendall(b"x")
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def test_a_refused_caller_cannot_hold_its_connection_by_dripping_the_body(eval_dir):
    """A refusal answered the caller and then kept reading its unread body, and a byte every
    few seconds is never a pause: a caller with no key held a connection slot for ever (1,024
    of them made every request a 503).  A refusal now closes the connection; a keyed body must
    be all in within ``body_total_s``."""
    limits = Limits(body_idle_s=1.0, body_total_s=2.0, max_connections=8)
    with ViewerServer(eval_dir, limits=limits) as srv:
        addr = urlparse(srv.url)
        head = "POST /api/meta HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n{auth}\r\n"
        for auth in ("", "Authorization: Bearer wrong\r\n", "Origin: http://attacker.example\r\n"):
            sock = socket.create_connection((addr.hostname, addr.port))
            sock.sendall(head.format(auth=auth).encode())
            assert _drip(sock, 1.5), f"a refused caller ({auth.strip() or 'no key'}) still holds its connection"
            sock.close()
        keyed = socket.create_connection((addr.hostname, addr.port))
        keyed.sendall(head.format(auth=f"Authorization: Bearer {srv.key}\r\n").encode())
        t0 = time.monotonic()
        assert _drip(keyed, 10), "a body dripped a byte every 0.3 s was never cut off"
        assert 1.5 < time.monotonic() - t0 < 6
        keyed.close()


@pytest.mark.parametrize(("path", "location"), [
    ("//evil.example/x", "/evil.example/x"),  # a network-path reference: the browser would leave for evil.example
    ("/%5Cevil.example/", "/evil.example/"),  # "/\host": browsers read a backslash as a slash
    ("/a%0d%0aSet-Cookie:%20x=1", "/a%0D%0ASet-Cookie:%20x=1"),  # decoded CR/LF stays out of the header
])
def test_the_login_redirect_stays_on_this_server(eval_dir, path, location):
    with ViewerServer(eval_dir) as srv, httpx.Client(timeout=30) as http:
        r = http.get(f"{srv.url}{path}?token={srv.key}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == location, (r.status_code, r.headers)
