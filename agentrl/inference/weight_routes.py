"""The engine server's weight routes: pause/resume, versions, and weight pushes.

Mounted by :func:`agentrl.inference.server.create_app`; the trainer side is :mod:`agentrl.weights`.
Every push goes through one :class:`~agentrl.weights.receive.WeightReceiver` (its module doc
has the rules: signed, the model's own size, no host path from a caller, one transfer at a
time, checked before the swap, versions only increase)::

    POST /weights/begin   {transfer, transport: http|shm|disk, weight_version, size, manifest,
                           chunks (http), lora, signature}   → {transfer, path?, signature?}
    PUT  /weights/chunk?transfer=T&index=i   raw bytes, header X-Agentrl-Signature
    POST /weights/commit  {transfer, sha256 (disk), signature}
    POST /weights/abort   {transfer, signature}
    POST /update_weight_version   {weight_version, signature}
    POST /update_weights_from_disk {model_path (inside the weights dir), weight_version?, lora?, signature}

These routes parse and answer; a refusal is an OpenAI-style error with the receiver's status
(401 unsigned, 409 a transfer in progress or an older version, 400 a push that does not fit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from agentrl.errors import RequestError
from agentrl.inference.core import CoreClient, RemoteReceiver
from agentrl.inference.protocol import APIError
from agentrl.weights.manifest import SIGNATURE_HEADER
from agentrl.weights.receive import STATUS, WeightReceiver

if TYPE_CHECKING:
    from agentrl.inference.server import EngineServer


def weight_routes(app: FastAPI, srv: EngineServer, key: str | None, weights_dir: str | Path | None = None,
                  shm_dir: str | Path | None = None) -> None:
    """``/pause``, ``/resume``, versions and weight pushes; ``key``: the engine's API key, which
    signs every push (None: pushes are refused); ``weights_dir``: where disk pushes land;
    ``shm_dir``: where the engine makes its private shared-memory dir (default ``/dev/shm``)."""
    engine = srv.engine
    shm_parent = str(shm_dir) if shm_dir is not None else None
    if isinstance(engine, CoreClient):  # split: the receiver lives beside the model, in the core
        rx: WeightReceiver | RemoteReceiver = engine.receiver(key, weights_dir, shm_parent)
    else:
        rx = WeightReceiver(engine, key, weights_dir=weights_dir, shm_parent=shm_parent)
    srv.weights = rx

    async def call(fn: Callable, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except RequestError as e:
            raise APIError(STATUS.get(e.code, 400), str(e), param=e.param, code=e.code) from e

    async def body_of(http: Request) -> dict[str, Any]:
        try:
            body = await http.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        return body

    @app.post("/pause")
    async def pause(mode: str = "keep"):
        if mode != "keep":
            raise APIError(400, f"pause mode {mode!r} is not supported; use mode=keep", param="mode")
        await asyncio.to_thread(engine.pause)
        return {"is_paused": True}

    @app.post("/resume")
    async def resume():
        await asyncio.to_thread(engine.resume)
        return {"is_paused": False}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": await asyncio.to_thread(lambda: engine.is_paused)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await asyncio.to_thread(engine.reset_prefix_cache)
        return {"success": True}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": await asyncio.to_thread(lambda: engine.version)}

    @app.post("/update_weight_version")
    async def update_weight_version(http: Request):
        body = await body_of(http)
        version = body.get("weight_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise APIError(400, "weight_version must be an integer", param="weight_version")
        new = await call(rx.set_version, version, body.get("signature"))
        return {"success": True, "weight_version": new}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(http: Request):
        return await call(rx.load_disk, await body_of(http))

    @app.post("/weights/begin")
    async def begin(http: Request):
        return await call(rx.begin, await body_of(http))

    @app.put("/weights/chunk")
    async def chunk(transfer: str, index: int, http: Request):
        declared = http.headers.get("content-length", "")
        if not declared.isdigit() or int(declared) > rx.max_bytes():  # never read more than a model's worth
            raise APIError(413, "a chunk needs a Content-Length no larger than the model", code="too_large")
        await call(rx.chunk, transfer, index, await http.body(), http.headers.get(SIGNATURE_HEADER))
        return {"transfer": transfer, "index": index}

    @app.post("/weights/commit")
    async def commit(http: Request):
        body = await body_of(http)
        return await call(rx.commit, str(body.get("transfer")), body.get("signature"), body.get("sha256"))

    @app.post("/weights/abort")
    async def abort(http: Request):
        body = await body_of(http)
        await call(rx.abort, str(body.get("transfer")), body.get("signature"))
        return {"aborted": True}
