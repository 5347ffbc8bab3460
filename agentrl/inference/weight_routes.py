"""The engine server's weight routes: pause/resume, versions, full or LoRA updates from
disk or shared memory, and the network transfer (begin, chunks, commit).  Mounted by
:func:`agentrl.inference.server.create_app`; the trainer side is :mod:`agentrl.weights`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from agentrl.errors import RequestError
from agentrl.inference.protocol import (
    APIError,
    CommitWeightsRequest,
    DiskWeightsRequest,
    NetworkWeightsRequest,
    ShmWeightsRequest,
    VersionRequest,
    from_request_error,
)
from agentrl.weights.manifest import manifest_views
from agentrl.weights.network import ChunkReceiver, load_views
from agentrl.weights.receive import load_safetensors_path, read_safetensors

if TYPE_CHECKING:
    from agentrl.inference.server import EngineServer


def weight_routes(app: FastAPI, srv: EngineServer) -> None:
    """``/pause``, ``/resume``, versions, and full or LoRA weight updates (agentrl.weights)."""
    engine = srv.engine

    @app.post("/pause")
    async def pause(mode: str = "keep"):
        if mode != "keep":
            raise APIError(400, f"pause mode {mode!r} is not supported; use mode=keep", param="mode")
        await asyncio.to_thread(engine.pause)
        return {"is_paused": True}

    @app.post("/resume")
    async def resume():
        engine.resume()
        return {"is_paused": False}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await asyncio.to_thread(engine.reset_prefix_cache)
        return {"success": True}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.version}

    @app.post("/update_weight_version")
    async def update_weight_version(req: VersionRequest):
        version = await asyncio.to_thread(engine.update_weights, lambda m: None, req.weight_version)
        return {"success": True, "weight_version": version}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(req: DiskWeightsRequest):
        return await apply_update(
            srv, req.weight_version, req.lora,
            lambda m: load_safetensors_path(m, req.model_path), lambda: read_safetensors(req.model_path),
        )

    @app.post("/update_weights_from_shm")
    async def update_from_shm(req: ShmWeightsRequest):
        return await apply_update(
            srv, req.weight_version, req.lora,
            lambda m: srv.shared.apply(m, req.path, req.manifest, req.size),
            lambda: srv.shared.views(req.path, req.manifest, req.size),
        )


async def apply_update(srv: EngineServer, version: int | None, lora: bool, load: Callable,
                        read_factors: Callable) -> dict[str, Any]:
    """Full weights (``load(model)``) or LoRA factors (``read_factors()``) as ``version``."""

    def apply(model) -> int:
        if lora:
            return srv.adapters.apply(model, read_factors())
        n = load(model)
        srv.adapters.reset()  # new base weights: adapters merged before no longer apply
        return n

    t0 = time.perf_counter()
    count: list[int] = []
    try:
        new = await asyncio.to_thread(srv.engine.update_weights, lambda m: count.append(apply(m)), version)
    except RequestError as e:
        raise from_request_error(e) from e
    return {"success": True, "weight_version": new, "num_tensors": count[0] if count else 0,
            "seconds": time.perf_counter() - t0}


def network_weight_routes(app: FastAPI, srv: EngineServer) -> None:
    """``weight_transport = "http"``: begin, chunks, commit (:mod:`agentrl.weights.network`)."""
    rx = ChunkReceiver()

    async def call(fn: Callable, *args: Any) -> Any:  # a push that does not fit is the caller's 400
        try:
            return await asyncio.to_thread(fn, *args)
        except RequestError as e:
            raise from_request_error(e) from e

    @app.post("/weights/begin")
    async def begin(r: NetworkWeightsRequest):
        await call(rx.begin, r.transfer, r.size, r.manifest, r.chunks, r.weight_version, r.lora)
        return {"transfer": r.transfer, "chunks": len(r.chunks)}

    @app.put("/weights/chunk")
    async def chunk(transfer: str, index: int, http: Request):
        await call(rx.chunk, transfer, index, await http.body())
        return {"transfer": transfer, "index": index}

    @app.post("/weights/commit")
    async def commit(r: CommitWeightsRequest):
        t = await call(rx.take, r.transfer)
        views = manifest_views(t.buffer, t.manifest)
        return await apply_update(srv, t.version, t.lora, lambda m: load_views(m, views), lambda: views)
