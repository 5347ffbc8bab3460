"""Trainer side of a weight push into running embedded engines on this host (no restart).

``await EmbeddedWeightSync(urls, transport).push(named_tensors, version) -> seconds``: each
engine opens a signed transfer and says where to write (``/weights/begin``), the trainer
writes the tensors there while generation goes on, then ``/pause`` every engine (the current
decode step finishes; requests stay in flight) → ``/weights/commit`` (checked, then swapped in
as ``version``) → ``/resume``.  Tokens generated afterwards carry the new version.

Transports:

- ``"shm"`` (same host): the engine hands out a shared-memory file it created in its own 0700
  directory, laid out by :mod:`agentrl.weights.manifest`; the trainer maps it (never grows it)
  and copies the tensors in.  A CPU engine points its parameters at that file (no copy) and
  hands out another one next time, so a push costs one memcpy per engine plus a few small HTTP
  calls; a CUDA engine copies from the mapping to the device.
- ``"disk"``: a safetensors file in the engine's weights dir (``--weights-dir``: put it on a
  shared filesystem for engines on other hosts), its SHA-256 signed in the commit.

``push_stream(specs, buckets, version)``: the same push from tensors that arrive a bucket at a time
(a sharded trainer's gather): the manifest comes from the specs (names, dtypes, shapes), each bucket
is written into its place as it arrives, so the trainer never holds the whole set; ``push`` is the
stream of one bucket.

Every message is signed with the engines' key (``api_key``, default ``AGENTRL_API_KEY``).
``push(..., lora=True)`` sends LoRA factors (``{module}.lora_A`` / ``.lora_B``) instead of
weights over the same transports; the engine merges them into its base weights
(:mod:`agentrl.weights.lora`), so a LoRA run moves only the adapters.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from agentrl.auth import auth_headers, client_key
from agentrl.errors import WeightSyncError
from agentrl.weights import sync as wire
from agentrl.weights.manifest import layout
from agentrl.weights.sync import (
    Buckets,
    NamedTensors,
    SafetensorsWriter,
    checked_buckets,
    items_of,
    one_bucket,
    url_root,
)


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
        """``api_key``: the engines' key (default ``AGENTRL_API_KEY``); every push is signed with it.
        ``work_dir`` is unused: an engine says where it reads (kept for callers that pass it)."""
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("make_weight_sync needs at least one engine URL")
        if transport not in ("shm", "disk"):
            raise ValueError(f"unknown weight transport {transport!r}; use 'shm' or 'disk'")
        self.roots = [url_root(u) for u in urls]
        self.transport = transport
        self.timeout = timeout
        self.api_key = api_key or client_key()
        self.session = wire.new_transfer()  # versions never decrease within it (engines check)
        self._maps: dict[str, torch.Tensor] = {}  # segment path -> our mapping of it
        self.last_stats: dict[str, float] = {}
        self._http: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None

    def _client(self) -> httpx.AsyncClient:
        """One HTTP client per event loop (building one costs ~30 ms of TLS setup)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop or self._http[1].is_closed:
            self._http = (loop, httpx.AsyncClient(timeout=self.timeout, headers=auth_headers(self.api_key)))
        return self._http[1]

    # ------------------------------------------------------------------ push

    async def push(self, named_tensors: NamedTensors, version: int, *, lora: bool = False) -> float:
        """``lora=True``: the tensors are LoRA factors for the engine to merge (adapter-only push)."""
        items = items_of(named_tensors)
        return await self.push_stream(items, one_bucket(items), version, lora=lora)

    async def push_stream(self, specs: NamedTensors, buckets: Buckets, version: int, *, lora: bool = False) -> float:
        """:meth:`push` of tensors arriving in ``buckets`` (in the order of ``specs``: names, dtypes, shapes): every
        engine's transfer opens from the manifest, each bucket is written into its place as it comes (nothing
        holds the whole set here), then one pause and commit."""
        t0 = time.perf_counter()
        key = wire.need_key(self.api_key)
        manifest, size = layout(items_of(specs))
        http, transfer = self._client(), wire.new_transfer()
        begun: list[str] = []
        writers: dict[str, Any] = {}

        async def stage(root: str) -> None:  # begin, then open the place the engine names
            answer = await wire.begin(http, root, key, transfer=transfer, transport=self.transport,
                                      version=version, manifest=manifest, size=size, lora=lora, session=self.session)
            begun.append(root)
            writers[root] = await asyncio.to_thread(self._writer, answer["path"], size, manifest)

        t_paused = t_written = t0
        committed: list[str] = []
        nbytes = 0
        try:
            # every stage finishes before a failure is raised: a begin still in flight when the
            # abort below ran left its transfer open, and the engine refused the next push (409)
            staged = await asyncio.gather(*(stage(r) for r in self.roots), return_exceptions=True)
            failed_stage = [s for s in staged if isinstance(s, BaseException)]
            if failed_stage:
                raise failed_stage[0]
            async for part in checked_buckets(manifest, buckets):
                await asyncio.to_thread(_write_part, list(writers.values()), part)
                nbytes += sum(t.numel() * t.element_size() for _, t in part)
            sha = {r: w.finish() for r, w in writers.items()}
            t_written = time.perf_counter()
            await self._all(http, "POST", "/pause", params={"mode": "keep"})
            t_paused = time.perf_counter()
            done = await asyncio.gather(*(wire.commit(http, r, key, transfer, sha.get(r)) for r in self.roots),
                                        return_exceptions=True)
            committed += [r for r, d in zip(self.roots, done, strict=True) if not isinstance(d, BaseException)]
            failed = [d for d in done if isinstance(d, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:
            for w in writers.values():
                w.close()
            await asyncio.gather(*(wire.abort(http, r, key, transfer) for r in begun if r not in committed))
            raise
        finally:
            await self._all(http, "POST", "/resume", check=False)
        t1 = time.perf_counter()
        self.last_stats = {
            "write_s": t_written - t0,
            "pause_s": t_paused - t_written,
            "load_s": t1 - t_paused,
            "total_s": t1 - t0,
            "bytes": float(nbytes),
        }
        return t1 - t0

    async def _all(self, http: httpx.AsyncClient, method: str, path: str, *, check: bool = True, **kw) -> list[Any]:
        async def one(root: str):
            try:
                return await wire.call(http, method, root + path, **kw)
            except WeightSyncError:
                if check:
                    raise
                return None

        return await asyncio.gather(*(one(root) for root in self.roots))

    # ------------------------------------------------------------------ transports

    def _writer(self, path: str, size: int, manifest: list[dict[str, Any]]) -> Any:
        if self.transport == "disk":
            return SafetensorsWriter(path, manifest)
        buf = self._maps.get(path)
        if buf is None:
            buf = self._maps[path] = wire.map_segment(path, size)
            while len(self._maps) > 2 * len(self.roots):  # each engine uses two in turn
                self._maps.pop(next(iter(self._maps)))
        return _ShmWriter(buf)

    async def close(self) -> None:
        if self._http is not None and self._http[0] is asyncio.get_running_loop():
            await self._http[1].aclose()
        self._http = None
        self._maps.clear()


class _ShmWriter:
    """Writes each tensor into its place in an engine's mapped segment (the manifest's offset)."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf

    def write(self, entry: dict[str, Any], t: torch.Tensor) -> None:
        off = entry["offset"]
        with torch.no_grad():
            self.buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)

    def finish(self) -> None:
        return None

    def close(self) -> None:
        pass


def _write_part(writers: list[Any], part: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
    for entry, t in part:
        for w in writers:
            w.write(entry, t)
