"""The door of agentrl's HTTP servers (the engine and the viewer on uvicorn; the env server and
the harness gateway on aiohttp): who may call, from where, how much, how slowly.  README: "Keys
and ports".

:class:`Guard` is plain ASGI middleware (one pass over the headers, no task or copy per
request) that checks, before any route runs:

1. **Host** (DNS rebinding): a loopback name, an IP literal (a rebinding attack needs a DNS
   name), or a name in ``allowed_hosts``; else 403.
2. **Origin** (a page on another site): absent (not a browser), the page's own origin, or one
   in ``allowed_origins``; else 403.  A browser can send a "simple" POST across origins
   without asking first, so the key alone is not the only wall.
3. **Key** (:mod:`agentrl.auth`): ``/health`` is open; control routes always need it; the
   routes ``public`` names (the OpenAI ones) need it only when the key was given explicitly.
   A missing or wrong key is a 401 with an OpenAI-style body that says how to fix it.
   ``login_cookie``: a browser may show the key once as ``?token=KEY`` and gets an HttpOnly,
   SameSite=Strict cookie in return (Jupyter's model).
4. **Body size**: a body over ``Limits.max_body_bytes`` is a 413 before it is read (a declared
   length), or as soon as it passes the cap (a chunked one).  Control routes, reached only
   with the key, are exempt: whoever holds it can replace the weights anyway.

:func:`uvicorn_config` adds what ASGI cannot see: a connection that does not finish a
request's headers within ``header_timeout_s`` of its first byte is closed (uvicorn has no
such timer: a slowloris client held its connection forever), as is one whose body stalls
for ``body_idle_s`` or is not all in ``body_total_s`` after its first byte; idle keep-alive connections close after ``keep_alive_s``; past
``max_connections`` connections or requests, new requests get a 503.

:class:`AiohttpDoor` gives the aiohttp servers :class:`Door`'s Host and Origin checks and the
same kind of connection rules (a header deadline, a whole-body deadline, idle keep-alive, a
connection cap past which a new connection is dropped).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from agentrl.auth import ServerKey, bearer, matches, sign

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
HEALTH = "/health"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Limits:
    """How much and how slowly a caller may send (defaults: the engine's and the viewer's)."""

    max_body_bytes: int = 16 << 20  # an 8 MB prompt still reaches the engine's own length check (a 400)
    header_timeout_s: float = 10.0  # a request's headers, from its first byte
    body_idle_s: float = 30.0  # the longest pause inside a request body
    body_total_s: float = 300.0  # a whole request body, from its first byte (a byte every 29 s is no pause)
    keep_alive_s: int = 30  # an idle keep-alive connection
    max_connections: int = 1024  # open connections (or requests in flight) before new requests get a 503


def split_names(text: str) -> tuple[str, ...]:
    """``"a, b,"`` -> ``("a", "b")`` (how ``--allowed-hosts`` / ``--allowed-origins`` are written)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def host_name(host: str) -> str:
    """The name part of a ``Host`` header (``[::1]:8000`` -> ``::1``), lowercased, no trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def cookie_value(key: str) -> str:
    """The login cookie's value: derived from the key, so the cookie never holds the key itself."""
    return sign(key, b"agentrl login cookie")


def _error(status: int, message: str, code: str) -> tuple[int, bytes]:
    kind = {401: "authentication_error", 403: "permission_error", 413: "invalid_request_error"}.get(status)
    body = {"error": {"message": message, "type": kind or "invalid_request_error", "param": None, "code": code}}
    return status, json.dumps(body).encode()


class Door:
    """Where a request may come from: the Host (DNS rebinding) and Origin (another site's page)
    checks of every agentrl server, uvicorn's (:class:`Guard`) and aiohttp's (:class:`AiohttpDoor`)."""

    def __init__(self, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = (), *,
                 flags: bool = True) -> None:
        """``flags``: a refusal names the ``--allowed-hosts`` / ``--allowed-origins`` flag that
        would allow it (False: a server that has none)."""
        self.flags = flags
        hosts = {host_name(h) for h in allowed_hosts if h.strip()}
        self.any_host = "*" in hosts
        self.hosts = frozenset(LOOPBACK_NAMES | hosts)
        origins = {o.strip().lower().rstrip("/") for o in allowed_origins if o.strip()}
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)

    def host_ok(self, host: str | None) -> bool:
        if host is None or self.any_host:  # no Host: HTTP/1.0, never a browser
            return True
        name = host_name(host)
        return name in self.hosts or is_ip(name)

    def origin_ok(self, origin: str, host: str | None) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if self.any_origin or origin in self.origins:
            return True
        _, sep, netloc = origin.partition("://")
        return bool(sep) and host is not None and netloc == host.strip().lower()

    def refusal(self, host: str | None, origin: str | None) -> tuple[int, bytes] | None:
        """The 403 (status, OpenAI-style body) for a request from the wrong place, else None."""
        if not self.host_ok(host):
            shown = host_name(host or "")[:100]
            how = f", or start it with --allowed-hosts {shown}" if self.flags else ""
            return _error(403, f"Host {shown!r} is not served here (a DNS-rebinding guard); connect to the server by "
                               f"IP or localhost{how}", "host_not_allowed")
        if origin is not None and not self.origin_ok(origin, host):
            shown = origin.strip()[:100]
            how = f"; start the server with --allowed-origins {shown} to allow that site" if self.flags else ""
            return _error(403, f"requests from pages at {shown!r} are refused (cross-origin){how}", "origin_not_allowed")
        return None


class Guard:
    """ASGI middleware: Host, Origin, key and body-size checks in front of ``app`` (module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        key: ServerKey | None,
        *,
        public: Callable[[str], bool] = lambda path: False,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        limits: Limits = Limits(),  # noqa: B008 (frozen)
        login_cookie: str | None = None,
    ) -> None:
        """``key`` None: no key checks (Host, Origin and size still hold).  ``public(path)``: a
        route that needs the key only when it was given explicitly.  ``allowed_hosts`` /
        ``allowed_origins``: more names / origins to accept (``*``: any)."""
        self.app, self.key, self.public, self.limits = app, key, public, limits
        self.door = Door(allowed_hosts, allowed_origins)
        self.cookie = login_cookie
        self._cookie_value = cookie_value(key.value) if key is not None and login_cookie else None

    # ------------------------------------------------------------------ checks

    def needs_key(self, path: str) -> bool:
        if self.key is None or path == HEALTH:
            return False
        return self.key.guards(control=not self.public(path))

    def _cookie_ok(self, cookies: str | None) -> bool:
        if not cookies or self._cookie_value is None:
            return False
        for part in cookies.split(";"):
            name, _, value = part.strip().partition("=")
            if name == self.cookie and matches(self._cookie_value, value):
                return True
        return False

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":  # no route takes one: refuse before the app sees it
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        host = origin = auth = length = cookies = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"authorization":
                auth = value.decode("latin-1")
            elif name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"cookie":
                cookies = value.decode("latin-1")
        if (refused := self.door.refusal(host, origin)) is not None:
            return await _reply(send, *refused, close=True)
        path = scope["path"]
        control = self.key is not None and path != HEALTH and not self.public(path)
        if self.needs_key(path):
            assert self.key is not None
            if not (matches(self.key.value, bearer(auth)) or self._cookie_ok(cookies)):
                if self.cookie and await self._login(scope, send):
                    return
                how = ("send the server's API key as `Authorization: Bearer KEY` (agentrl clients read "
                       "AGENTRL_API_KEY; a server that made its own key printed where it wrote it)")
                if self.cookie:
                    how += ", or open the page once as /?token=KEY"
                what = "a wrong API key" if auth is not None else "no API key"
                return await _reply(send, *_error(401, f"{path[:100]} needs the server's API key and got {what}: {how}",
                                                  "invalid_api_key"), headers=[(b"www-authenticate", b"Bearer")],
                                    close=True)
        if not control:  # whoever holds the key may replace the weights: its bodies are not capped here
            cap = self.limits.max_body_bytes
            if length is not None:
                try:
                    declared = int(length)
                except ValueError:
                    declared = cap + 1
                if declared > cap:
                    return await _reply(send, *self._too_large(), close=True)
            elif chunked:
                try:
                    body = await read_body(receive, cap)
                except BodyTooLarge:
                    return await _reply(send, *self._too_large(), close=True)
                if body is None:
                    return  # the client left before its body was in: nobody to answer
                receive = replay_body(body, receive)
        await self.app(scope, receive, send)

    def _too_large(self) -> tuple[int, bytes]:
        mb = self.limits.max_body_bytes / 2**20
        return _error(413, f"request body over the server's cap of {mb:g} MiB; send less (split the work "
                           "into several requests)", "body_too_large")

    async def _login(self, scope: Scope, send: Send) -> bool:
        """``?token=KEY``: set the login cookie and redirect to the same URL without the token."""
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        token = next((v for k, v in query if k == "token"), None)
        if self.key is None or self._cookie_value is None or not matches(self.key.value, token):
            return False
        rest = urlencode([(k, v) for k, v in query if k != "token"])
        # one leading slash, re-quoted: "//host" (or a backslash for the second slash) in Location sends a
        # browser to another site, and a decoded CR/LF must not reach a header
        path = quote("/" + scope["path"].lstrip("/\\"), safe="/:@!$&'()*+,;=-._~")
        where = path + (f"?{rest}" if rest else "")
        cookie = f"{self.cookie}={self._cookie_value}; Path=/; HttpOnly; SameSite=Strict"
        await _reply(send, 303, b"", headers=[(b"location", where.encode()), (b"set-cookie", cookie.encode()),
                                              (b"cache-control", b"no-store")])  # fmt: skip
        return True


async def _reply(send: Send, status: int, body: bytes, *, headers: list[tuple[bytes, bytes]] | None = None,
                 close: bool = False) -> None:
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]
    if close:  # the body we did not read is still on the wire (a refused caller could drip it for ever)
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    """A request body passed the cap it was read under."""


async def read_body(receive: Receive, cap: int | None = None) -> bytes | None:
    """The whole request body, or None if the client went away before it was all in (the app
    never sees a partial body).  Past ``cap`` bytes: :class:`BodyTooLarge`."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if cap is not None and size > cap:
            raise BodyTooLarge(f"request body over {cap} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the already-read ``body`` handed out once more first (for the app behind)."""
    sent = False

    async def again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


# ----------------------------------------------------------------------------- uvicorn


def guarded_protocol(limits: Limits) -> type:
    """uvicorn's h11 protocol with the header and body deadlines of ``limits`` (module doc)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        _body_since: float | None = None  # when the current request's body began to arrive

        def connection_made(self, transport: Any) -> None:
            self._timer = _Timer()
            super().connection_made(transport)
            self._arm(limits.header_timeout_s)  # a connection that never sends a request is closed too

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE:  # part of the next request's headers: the deadline runs from its first byte
                if not self._timer.pending:
                    self._arm(limits.header_timeout_s)
            elif state is h11.SEND_BODY:  # the body is arriving: it may pause, but not for long
                now = self.loop.time()
                if self._body_since is None:
                    self._body_since = now
                self._arm(min(limits.body_idle_s, self._body_since + limits.body_total_s - now))
            else:  # the request is all in
                self._body_since = None
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            self._timer.arm(seconds, self._expired)

        def _disarm(self) -> None:
            self._timer.cancel()

        def _expired(self) -> None:
            if self.flow is not None and self.flow.read_paused and self.conn.their_state is h11.SEND_BODY:
                self._arm(limits.body_idle_s)  # we stopped reading (the app is behind): not the client's stall
                if self._body_since is not None:
                    self._body_since += limits.body_idle_s  # nor is the time we spent not reading
                return
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11


class _Timer:
    """A connection's one pending deadline: arming again replaces it."""

    __slots__ = ("_handle",)

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, seconds: float, callback: Callable[..., None], *args: Any) -> None:
        self.cancel()
        self._handle = asyncio.get_running_loop().call_later(seconds, self._fire, callback, args)

    @property
    def pending(self) -> bool:
        return self._handle is not None

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self, callback: Callable[..., None], args: tuple) -> None:
        self._handle = None
        callback(*args)


def uvicorn_config(app: Any, limits: Limits = Limits(), **kwargs: Any) -> Any:  # noqa: B008 (frozen)
    """A ``uvicorn.Config`` for ``app`` with ``limits``' timeouts and connection cap."""
    import uvicorn

    return uvicorn.Config(
        app, http=guarded_protocol(limits), limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=64 * 1024, **kwargs,
    )  # fmt: skip


# ----------------------------------------------------------------------------- aiohttp


class AiohttpDoor:
    """The door of agentrl's aiohttp servers (the env server, the gateway): :class:`Door`'s Host
    and Origin checks as a middleware (a refusal closes the connection), and :meth:`listen`'s
    connections under the rules :func:`uvicorn_config` gives the others: headers within
    ``header_timeout_s`` of a connection's first byte, a request's body all in within
    ``body_total_s`` of its headers, an idle keep-alive connection closed after
    ``keep_alive_s``, at most ``max_connections`` open (aiohttp has none of these: an idle
    connection stayed open for an hour, and a thousand of them took the process's file
    descriptors)."""

    def __init__(self, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = (),
                 limits: Limits = Limits(), *, flags: bool = True) -> None:  # noqa: B008 (frozen)
        self.door, self.limits = Door(allowed_hosts, allowed_origins, flags=flags), limits
        self.open = 0  # connections now open

    @property
    def middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def door(request: Any, handler: Any) -> Any:
            watch = _Watched.of(request)
            if watch is not None:
                watch.request_started(request.content)
            try:
                refused = self.door.refusal(request.headers.get("Host"), request.headers.get("Origin"))
                if refused is not None:
                    return _aiohttp_reply(*refused, close=True)
                return await handler(request)  # which checks its key before it reads the body
            finally:
                if watch is not None:
                    watch.request_done()

        return door

    async def listen(self, runner: Any, host: str, port: int) -> asyncio.AbstractServer:
        """Serve ``runner`` (set up) on ``host:port`` under these rules; close the returned server
        before ``runner.cleanup()``."""
        room_for_connections(self.limits.max_connections)
        loop = asyncio.get_running_loop()
        return await loop.create_server(lambda: _Watched(runner.server(), self), host, port)


def room_for_connections(n: int) -> None:
    """Raise this process's soft open-file limit (to at most its hard one) so that ``n``
    connections fit beside the files it holds: with the common soft limit of 1,024, a cap of
    1,024 connections was no cap (the gateway shares the run's process)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 1024  # the process's own files, sockets and pipes
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class _Watched(asyncio.Protocol):
    """aiohttp's protocol for one connection, with :class:`AiohttpDoor`'s deadlines and cap."""

    def __init__(self, inner: Any, door: AiohttpDoor) -> None:
        self.inner, self.door = inner, door
        self.transport: Any = None
        self.busy = 0  # requests whose handler is running (the app's time, not the client's)
        self.idle = True  # between requests: no byte of the next one yet
        self.admitted = False  # under the cap: aiohttp saw the connection, and must see it end
        self._deadline, self._body_deadline = _Timer(), _Timer()

    @staticmethod
    def of(request: Any) -> _Watched | None:
        transport = request.transport
        protocol = transport.get_protocol() if transport is not None else None
        return protocol if isinstance(protocol, _Watched) else None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if self.door.open >= self.door.limits.max_connections:
            transport.abort()  # over the cap: refused before aiohttp sees it (connection_lost follows)
            return
        self.door.open += 1
        self.admitted = True
        self.inner.connection_made(transport)
        self._arm(self.door.limits.header_timeout_s)  # a connection that never sends a request is closed too

    def data_received(self, data: bytes) -> None:
        if self.idle and not self.busy:  # the next request's first bytes: its headers are due soon
            self.idle = False
            self._arm(self.door.limits.header_timeout_s)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline.cancel()
        self._body_deadline.cancel()
        if self.admitted:
            self.admitted = False
            self.door.open -= 1
            self.inner.connection_lost(exc)

    def request_started(self, body: Any) -> None:  # the headers are in (the middleware runs)
        self.busy += 1
        self._deadline.cancel()
        # the body must be all in by then, whether the handler reads it or is still busy elsewhere
        self._body_deadline.arm(self.door.limits.body_total_s, self._body_due, body)

    def _body_due(self, body: Any) -> None:
        if not body.is_eof() and self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def request_done(self) -> None:
        self._body_deadline.cancel()
        self.busy -= 1
        if not self.busy and self.transport is not None and not self.transport.is_closing():
            self.idle = True
            self._arm(self.door.limits.keep_alive_s)

    def _arm(self, seconds: float) -> None:
        self._deadline.arm(seconds, self._expired)

    def _expired(self) -> None:
        if not self.busy and self.transport is not None and not self.transport.is_closing():
            if self.transport.get_write_buffer_size():
                self.transport.abort()  # an answer it never reads: close() would wait on it for ever
            else:
                self.transport.close()


def _aiohttp_reply(status: int, body: bytes, *, close: bool = False) -> Any:
    from aiohttp import web

    response = web.Response(status=status, body=body, content_type="application/json")
    if close:
        response.force_close()
    return response
