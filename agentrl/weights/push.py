"""Trainer side of a weight push into running embedded engines (no restart).

``await EmbeddedWeightSync(urls, transport).push(named_tensors, version) -> seconds``:
``/pause`` every engine (the current decode step finishes; requests stay in flight) → move
the tensors → ``/update_weights_from_*`` with ``weight_version=version`` → ``/resume``.
Tokens generated afterwards carry the new version.

Transports:

- ``"shm"`` (same host): tensors are copied into one flat file in ``/dev/shm`` laid out by
  :mod:`agentrl.weights.manifest`.  A CPU engine maps that file and points its parameters
  at it, so after the first push a push costs one memcpy on the trainer side plus three
  small HTTP calls; a CUDA engine copies from the mapping to the device.
- ``"disk"``: a safetensors file in ``work_dir`` and ``/update_weights_from_disk``; works
  across hosts that share a filesystem.

``push(..., lora=True)`` sends LoRA factors (``{module}.lora_A`` / ``.lora_B``) instead of
weights over the same transports; the engine merges them into its base weights
(:mod:`agentrl.weights.lora`), so a LoRA run moves only the adapters.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from agentrl.auth import auth_headers, client_key
from agentrl.errors import WeightSyncError
from agentrl.weights.manifest import layout
from agentrl.weights.sync import NamedTensors, items_of, url_root


class EmbeddedWeightSync:
    """WeightSync for agentrl's embedded engines (see module doc for the transports)."""

    def __init__(
        self,
        base_urls: str | list[str],
        transport: Literal["shm", "disk"] = "shm",
        *,
        work_dir: str | Path | None = None,
        timeout: float = 300.0,
        api_key: str | None = None,
    ):
        """``api_key``: the engines' key (default ``AGENTRL_API_KEY``); their weight routes need it."""
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("make_weight_sync needs at least one engine URL")
        if transport not in ("shm", "disk"):
            raise ValueError(f"unknown weight transport {transport!r}; use 'shm' or 'disk'")
        self.roots = [url_root(u) for u in urls]
        self.transport = transport
        self.timeout = timeout
        self.api_key = api_key or client_key()
        default_dir = "/dev/shm" if transport == "shm" and os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.work_dir = Path(work_dir or default_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._tag = f"agentrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._shm_path: Path | None = None
        self._shm_buf: torch.Tensor | None = None
        self._manifest: list[dict[str, Any]] | None = None
        self._layout_key: tuple | None = None
        self._last_disk: Path | None = None
        self.last_stats: dict[str, float] = {}
        self._http: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None

    def _client(self) -> httpx.AsyncClient:
        """One HTTP client per event loop (building one costs ~30 ms of TLS setup)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop or self._http[0].is_closed():
            self._http = (loop, httpx.AsyncClient(timeout=self.timeout, headers=auth_headers(self.api_key)))
        return self._http[1]

    # ------------------------------------------------------------------ push

    async def push(self, named_tensors: NamedTensors, version: int, *, lora: bool = False) -> float:
        """``lora=True``: the tensors are LoRA factors for the engine to merge (adapter-only push)."""
        t0 = time.perf_counter()
        items = items_of(named_tensors)
        http = self._client()
        t_paused = t_written = t0
        aliased = False  # the write went into the buffer CPU engines already map as their weights
        try:  # pause, write, load: whatever fails, every engine is resumed
            await self._all(http, "POST", "/pause", params={"mode": "keep"})
            t_paused = time.perf_counter()
            if self.transport == "shm":
                reused = self._layout_key == tuple((n, t.dtype, tuple(t.shape)) for n, t in items)
                manifest, size = await asyncio.to_thread(self._write_shm, items)
                aliased, t_written = reused, time.perf_counter()
                body = {
                    "path": str(self._shm_path), "size": size, "manifest": manifest, "weight_version": version,
                    "lora": lora,
                }
                await self._all(http, "POST", "/update_weights_from_shm", json=body)
            else:
                path = await asyncio.to_thread(self._write_disk, items, version)
                t_written = time.perf_counter()
                body = {"model_path": str(path), "weight_version": version, "lora": lora}
                await self._all(http, "POST", "/update_weights_from_disk", json=body)
                self._drop_old_disk(path)
        except BaseException:
            if aliased:  # CPU engines alias the shared buffer: they already hold the new weights
                await self._all(http, "POST", "/update_weight_version", check=False, json={"weight_version": version})
            raise
        finally:
            await self._all(http, "POST", "/resume", check=False)
        t1 = time.perf_counter()
        self.last_stats = {
            "pause_s": t_paused - t0,
            "write_s": t_written - t_paused,
            "load_s": t1 - t_written,
            "total_s": t1 - t0,
            "bytes": float(sum(t.numel() * t.element_size() for _, t in items)),
        }
        return t1 - t0

    async def _all(self, http: httpx.AsyncClient, method: str, path: str, *, check: bool = True, **kw) -> list[Any]:
        async def one(root: str):
            try:
                r = await http.request(method, root + path, **kw)
            except httpx.HTTPError as e:
                if check:
                    raise WeightSyncError(f"{root}{path}: {e!r}") from e
                return None
            if check and r.status_code >= 400:
                try:
                    msg = r.json()["error"]["message"]
                except Exception:
                    msg = r.text[:300]
                raise WeightSyncError(f"{root}{path} → {r.status_code}: {msg}")
            return r.json() if r.status_code < 400 else None

        return await asyncio.gather(*(one(root) for root in self.roots))

    # ------------------------------------------------------------------ transports

    def _write_shm(self, items: list[tuple[str, torch.Tensor]]) -> tuple[list[dict[str, Any]], int]:
        key = tuple((n, t.dtype, tuple(t.shape)) for n, t in items)
        if key != self._layout_key:  # (re)allocate the file for this set of tensors
            manifest, size = layout(items)
            self._close_shm()
            self._shm_path = self.work_dir / f"{self._tag}-{uuid.uuid4().hex[:6]}.bin"
            self._shm_buf = torch.from_file(str(self._shm_path), shared=True, size=size, dtype=torch.uint8)
            self._manifest, self._layout_key = manifest, key
        assert self._shm_buf is not None and self._manifest is not None
        with torch.no_grad():
            for (_, t), entry in zip(items, self._manifest, strict=True):
                nbytes = t.numel() * t.element_size()
                off = entry["offset"]
                self._shm_buf[off : off + nbytes].view(t.dtype).view(t.shape).copy_(t)
        return self._manifest, int(self._shm_buf.numel())

    def _write_disk(self, items: list[tuple[str, torch.Tensor]], version: int) -> Path:
        from safetensors.torch import save_file

        path = self.work_dir / f"{self._tag}-v{version}.safetensors"
        tensors = {}
        seen: dict[int, str] = {}
        for name, t in items:  # safetensors refuses shared storage (tied weights): clone those
            t = t.to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            tensors[name] = t.clone() if ptr in seen else t
            seen[ptr] = name
        save_file(tensors, str(path))
        return path

    def _drop_old_disk(self, keep: Path) -> None:
        if self._last_disk is not None and self._last_disk != keep:
            self._last_disk.unlink(missing_ok=True)
        self._last_disk = keep

    def _close_shm(self) -> None:
        self._shm_buf = None
        if self._shm_path is not None:
            self._shm_path.unlink(missing_ok=True)  # engines keep their mappings alive
            self._shm_path = None

    async def close(self) -> None:
        if self._http is not None and self._http[0] is asyncio.get_running_loop():
            await self._http[1].aclose()
        self._http = None
        self._close_shm()
        if self._last_disk is not None:
            self._last_disk.unlink(missing_ok=True)
            self._last_disk = None
        self._layout_key = None

    def __del__(self) -> None:
        try:
            self._close_shm()
        except Exception:
            pass
