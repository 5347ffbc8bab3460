"""The viewer's HTTP server: one FastAPI app over a :class:`~agentrl.viewer.data.RunView`.

Routes: ``/`` (the page), ``/static/<file>`` (its script and style, shipped in the package:
no CDN, works offline), ``/api/meta`` (run name, config, chart layout), ``/api/poll`` (what
the run gained past the page's cursors, a bounded page at a time; the page polls it to follow a
live run) and ``/api/episode/<id>`` (one episode with its tokens).  A malformed record is skipped
and counted, or shown as far as it can be: no route answers 500 for what a run wrote.  It binds
to loopback by default.

Every route needs the viewer's key (:mod:`agentrl.guard`): ``--api-key`` or ``AGENTRL_API_KEY``,
else one made at start.  A script sends it as ``Authorization: Bearer KEY``; a browser opens
the printed URL once with ``?token=KEY`` and gets an HttpOnly, SameSite=Strict cookie in return
(then the token leaves the address bar).  Host and Origin are checked as on the engine.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

from agentrl.auth import ServerKey, server_key
from agentrl.guard import Guard, Limits, uvicorn_config
from agentrl.viewer.data import RunView

STATIC = Path(__file__).parent / "static"
_ASSETS = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
_NO_CACHE = {"Cache-Control": "no-store"}


def create_app(view: RunView, key: ServerKey | None = None, *, port: int = 0, allowed_hosts: tuple[str, ...] = (),
               allowed_origins: tuple[str, ...] = (), limits: Limits | None = None) -> Any:
    """The viewer's app; with ``key`` every route needs it (a login cookie per ``port``)."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import FileResponse, JSONResponse

    app = FastAPI(title="agentrl viewer", docs_url=None, redoc_url=None, openapi_url=None)
    # cookies are kept per host, not per port: each viewer its own cookie name
    app.add_middleware(Guard, key=key, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins,
                       limits=limits or Limits(), login_cookie=f"agentrl-viewer-{port}")

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=_NO_CACHE)

    @app.get("/static/{name}")
    def static(name: str) -> FileResponse:
        if name not in _ASSETS:  # a fixed set: no path from the request reaches the file system
            raise HTTPException(404)
        return FileResponse(STATIC / name, media_type=_ASSETS[name], headers=_NO_CACHE)

    @app.get("/api/meta")
    def meta() -> JSONResponse:
        return JSONResponse(view.meta(), headers=_NO_CACHE)

    @app.get("/api/poll")
    def poll(epoch: int = 0, metrics: int = 0, episodes: int = 0, fates: int = 0) -> JSONResponse:
        return JSONResponse(view.poll(epoch, metrics, episodes, fates), headers=_NO_CACHE)

    @app.get("/api/episode/{eid}")
    def episode(eid: str) -> JSONResponse:
        ep = view.episode(eid)
        if ep is None:
            raise HTTPException(404, f"no episode {eid!r}")
        return JSONResponse(ep, headers=_NO_CACHE)

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one), so the URL is known before the server runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def _app(view: RunView, sock: socket.socket, host: str, key: ServerKey, allowed_hosts: tuple[str, ...],
         allowed_origins: tuple[str, ...], limits: Limits | None) -> Any:
    return create_app(view, key, port=sock.getsockname()[1], allowed_hosts=(host, *allowed_hosts),
                      allowed_origins=allowed_origins, limits=limits)


class ViewerServer:
    """The viewer on a background thread (tests, notebooks): ``with ViewerServer(run_dir) as s: s.login_url``.

    ``url``: the viewer's root (send ``Authorization: Bearer s.key``); ``login_url``: the same
    with ``?token=``, for a browser."""

    def __init__(self, run_dir: str | Path, host: str = "127.0.0.1", port: int = 0,
                 tokenizer: str | Path | None = None, *, api_key: str | None = None,
                 allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = (),
                 limits: Limits | None = None) -> None:
        import uvicorn

        self.view = RunView(run_dir, tokenizer=tokenizer)
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.key = server_key(api_key).value
        self.login_url = f"{self.url}?token={self.key}"
        app = _app(self.view, self.sock, host, server_key(self.key), allowed_hosts, allowed_origins, limits)
        self.server = uvicorn.Server(uvicorn_config(app, limits or Limits(), log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ViewerServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8765, tokenizer: str | Path | None = None,
          on_ready: Any = print, *, api_key: str | None = None, allowed_hosts: tuple[str, ...] = (),
          allowed_origins: tuple[str, ...] = ()) -> None:
    """Serve the viewer until interrupted (``agentrl view RUN_DIR --serve``); prints its URL, with
    ``?token=`` when the key was made here (Jupyter's way)."""
    import uvicorn

    view = RunView(run_dir, tokenizer=tokenizer)
    sock = bind(host, port)
    key = server_key(api_key)
    url = url_of(sock) if key.explicit else f"{url_of(sock)}?token={key.value}"
    note = "  (the API key given opens it: ?token=KEY once)" if key.explicit else ""
    on_ready(f"agentrl viewer for {view.root} ({view.kind}): {url}  (Ctrl-C to stop){note}")
    app = _app(view, sock, host, key, allowed_hosts, allowed_origins, None)
    try:
        uvicorn.Server(uvicorn_config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    finally:
        sock.close()
