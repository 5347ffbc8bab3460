"""The viewer's HTTP server: one FastAPI app over a :class:`~agentrl.viewer.data.RunView`.

Routes: ``/`` (the page), ``/static/<file>`` (its script and style, shipped in the package:
no CDN, works offline), ``/api/meta`` (run name, config, chart layout), ``/api/poll`` (what
the run gained past the page's cursors; the page polls it to follow a live run) and
``/api/episode/<id>`` (one episode with its tokens).  It binds to loopback by default.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

from agentrl.viewer.data import RunView

STATIC = Path(__file__).parent / "static"
_ASSETS = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
_NO_CACHE = {"Cache-Control": "no-store"}


def create_app(view: RunView) -> Any:
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import FileResponse, JSONResponse

    app = FastAPI(title="agentrl viewer", docs_url=None, redoc_url=None, openapi_url=None)

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


class ViewerServer:
    """The viewer on a background thread (tests, notebooks): ``with ViewerServer(run_dir) as s: s.url``."""

    def __init__(self, run_dir: str | Path, host: str = "127.0.0.1", port: int = 0,
                 tokenizer: str | Path | None = None) -> None:
        import uvicorn

        self.view = RunView(run_dir, tokenizer=tokenizer)
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        config = uvicorn.Config(create_app(self.view), log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ViewerServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8765, tokenizer: str | Path | None = None,
          on_ready: Any = print) -> None:
    """Serve the viewer until interrupted (``agentrl view RUN_DIR --serve``)."""
    import uvicorn

    view = RunView(run_dir, tokenizer=tokenizer)
    sock = bind(host, port)
    on_ready(f"agentrl viewer for {view.root} ({view.kind}): {url_of(sock)}  (Ctrl-C to stop)")
    try:
        uvicorn.Server(uvicorn.Config(create_app(view), log_level="warning", access_log=False)).run(sockets=[sock])
    finally:
        sock.close()
