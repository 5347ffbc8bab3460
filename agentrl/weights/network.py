"""Network weight transport: the trainer streams weights to engines over HTTP, no shared filesystem.

Both sides of ``inference.weight_transport = "http"`` live here (like the manifest, they must
agree on the bytes).  The wire protocol, three engine routes
(:func:`agentrl.inference.server._network_weight_routes`)::

    POST /weights/begin   {transfer, weight_version, size, manifest, chunks: [[offset, nbytes, crc32]], lora}
    PUT  /weights/chunk?transfer=T&index=i        raw bytes of chunk i
    POST /weights/commit  {transfer}              every chunk arrived → load as weight_version

The trainer packs every tensor into one flat buffer laid out by :mod:`agentrl.weights.manifest`
and cuts it into buckets of ``bucket_mb`` (a tensor may straddle two buckets).  Each bucket
carries a CRC-32 (a corruption check, not an authentication), is checked on arrival and written
into the engine's staging buffer at its offset; generation goes on meanwhile.  Only the commit
stops generation, between two decode steps, for a pointer swap (a CPU engine whose dtypes match
points its parameters at the staging buffer) or one copy (CUDA).  A transfer id makes every
push distinct: a chunk or commit of an older transfer is refused, and a new ``begin`` replaces
an unfinished one (a retried push, a restarted trainer).

Engines on the trainer's host keep shared memory (:class:`~agentrl.weights.push.EmbeddedWeightSync`,
``shm``); the others get HTTP.  Each engine is pushed on its own with a deadline: a dead or
slow engine never blocks the others; it is reported in :attr:`HttpWeightSync.behind` with its
cause and gets the full weights, as the current version, at the next push.  Only a push that
reached no engine at all raises :class:`~agentrl.errors.WeightSyncError`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from agentrl.auth import auth_headers, client_key
from agentrl.errors import RequestError, WeightSyncError
from agentrl.weights.manifest import layout, manifest_views
from agentrl.weights.receive import check_named_tensors
from agentrl.weights.sync import NamedTensors, items_of, url_root

DEFAULT_BUCKET_MB = 32.0


def chunk_plan(size: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each bucket of a ``size``-byte buffer."""
    step = max(1, int(bucket_bytes))
    return [(off, min(step, size - off)) for off in range(0, size, step)]


def crc32(view: memoryview | bytes) -> int:
    return zlib.crc32(view) & 0xFFFFFFFF


# ----------------------------------------------------------------------------- engine side


@dataclass
class _Transfer:
    transfer: str
    version: int | None
    lora: bool
    manifest: list[dict[str, Any]]
    buffer: torch.Tensor  # uint8 staging buffer
    chunks: list[tuple[int, int, int]]  # (offset, nbytes, crc32)
    received: set[int] = field(default_factory=set)


class ChunkReceiver:
    """The engine's side: one transfer at a time, staged apart from the live weights."""

    def __init__(self) -> None:
        self.current: _Transfer | None = None

    def begin(self, transfer: str, size: int, manifest: list[dict[str, Any]], chunks: list[list[int]],
              version: int | None, lora: bool) -> None:
        """Allocate the staging buffer; the chunk plan must tile ``[0, size)`` exactly."""
        plan = [(int(o), int(n), int(c)) for o, n, c in chunks]
        pos = 0
        for i, (off, nbytes, _) in enumerate(plan):
            if off != pos or nbytes <= 0:
                raise RequestError(f"chunk {i} of transfer {transfer} starts at {off}, expected {pos}")
            pos += nbytes
        if pos != size:
            raise RequestError(f"transfer {transfer}: chunks cover {pos} bytes, the buffer has {size}")
        buffer = torch.empty(max(size, 1), dtype=torch.uint8)
        manifest_views(buffer, manifest)  # every entry must lie inside the buffer
        self.current = _Transfer(transfer, version, lora, manifest, buffer, plan)  # replaces an unfinished one

    def _transfer(self, transfer: str) -> _Transfer:
        cur = self.current
        if cur is None or cur.transfer != transfer:
            now = cur.transfer if cur is not None else "none"
            raise RequestError(f"transfer {transfer} is not in progress (current: {now}); begin it again",
                               code="unknown_transfer")
        return cur

    def chunk(self, transfer: str, index: int, data: bytes) -> None:
        """Check one chunk's length and CRC-32 and write it at its offset."""
        cur = self._transfer(transfer)
        if not 0 <= index < len(cur.chunks):
            raise RequestError(f"transfer {transfer} has {len(cur.chunks)} chunks, not index {index}")
        off, nbytes, crc = cur.chunks[index]
        if len(data) != nbytes:
            raise RequestError(f"chunk {index} of transfer {transfer}: {len(data)} bytes, expected {nbytes}")
        if crc32(data) != crc:
            raise RequestError(f"chunk {index} of transfer {transfer} failed its CRC-32 check (corrupted in transit)",
                               code="checksum_mismatch")
        memoryview(cur.buffer.numpy())[off : off + nbytes] = data
        cur.received.add(index)

    def take(self, transfer: str) -> _Transfer:
        """The complete transfer, ready to load (it stops being current)."""
        cur = self._transfer(transfer)
        missing = sorted(set(range(len(cur.chunks))) - cur.received)
        if missing:
            raise RequestError(f"transfer {transfer} is missing {len(missing)} of {len(cur.chunks)} chunks "
                               f"(first: {missing[:5]})", code="incomplete_transfer")
        self.current = None
        return cur


def load_views(model: torch.nn.Module, views: list[tuple[str, torch.Tensor]]) -> int:
    """Load staged tensors: a CPU parameter of the same dtype is pointed at its view (the staging
    buffer is the transfer's own, never reused), anything else is copied.  All checked first."""
    pairs = check_named_tensors(model, views)
    for (_, view), (dst, _) in zip(views, pairs, strict=True):
        if dst.device.type == "cpu" and dst.dtype == view.dtype:
            dst.data = view
        else:
            dst.data.copy_(view)
    return len(pairs)


# ----------------------------------------------------------------------------- trainer side


@dataclass
class EnginePush:
    """What one push did to one engine."""

    root: str
    ok: bool
    transport: str  # "http" | "shm"
    seconds: float
    error: str | None = None


class HttpWeightSync:
    """WeightSync over HTTP to remote engines, shared memory to the ones on the trainer's host."""

    def __init__(self, base_urls: str | list[str], *, local_urls: list[str] | None = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB, timeout: float = 300.0, connect_timeout: float = 10.0,
                 api_key: str | None = None):
        """``local_urls``: engines on the trainer's host (shared memory); every other one gets HTTP.
        ``api_key``: the engines' key (default ``AGENTRL_API_KEY``)."""
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("make_weight_sync needs at least one engine URL")
        local = {url_root(u) for u in local_urls or []}
        self.roots = [url_root(u) for u in urls]
        self.remote = [r for r in self.roots if r not in local]
        from agentrl.weights.push import EmbeddedWeightSync

        # one shm sync per local engine: a failure there stays that engine's
        self.api_key = api_key or client_key()
        self.local = {r: EmbeddedWeightSync(r, "shm", timeout=timeout, api_key=self.api_key)
                      for r in self.roots if r in local}
        self.bucket_bytes = max(1 << 16, int(bucket_mb * 2**20))
        self.timeout = timeout
        self.in_flight_chunks = 3
        self._http_timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._http: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None
        self._buf: torch.Tensor | None = None
        self._layout_key: tuple | None = None
        self._manifest: list[dict[str, Any]] = []
        self.behind: dict[str, str] = {}  # engine root -> why its last push failed (cleared when one succeeds)
        self.results: list[EnginePush] = []
        self.last_stats: dict[str, float] = {}

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop or self._http[1].is_closed:
            self._http = (loop, httpx.AsyncClient(timeout=self._http_timeout, headers=auth_headers(self.api_key)))
        return self._http[1]

    # ------------------------------------------------------------------ push

    async def push(self, named_tensors: NamedTensors, version: int, *, lora: bool = False) -> float:
        """Every engine gets the tensors as ``version``, each on its own (module doc)."""
        t0 = time.perf_counter()
        items = items_of(named_tensors)
        jobs: dict[str, Any] = {}
        chunks: list[tuple[int, int, int]] = []
        if self.remote:
            chunks, size = await asyncio.to_thread(self._pack, items)
            jobs.update({r: self._push_http(r, chunks, size, version, lora) for r in self.remote})
        t_packed = time.perf_counter()
        jobs.update({r: sync.push(items, version, lora=lora) for r, sync in self.local.items()})
        roots = list(jobs)
        outcomes = await asyncio.gather(*(self._deadline(r, jobs[r]) for r in roots))
        self.results = list(outcomes)
        for res in outcomes:
            if res.ok:
                self.behind.pop(res.root, None)
            else:
                self.behind[res.root] = res.error or "failed"
        t1 = time.perf_counter()
        self.last_stats = {
            "pack_s": t_packed - t0, "total_s": t1 - t0, "engines_ok": float(sum(r.ok for r in outcomes)),
            "engines_failed": float(sum(not r.ok for r in outcomes)),
            "bytes": float(sum(t.numel() * t.element_size() for _, t in items)), "chunks": float(len(chunks)),
        }
        if not any(r.ok for r in outcomes):
            causes = "; ".join(f"{r.root}: {r.error}" for r in outcomes)
            raise WeightSyncError(f"weight version {version} reached no engine: {causes}")
        return t1 - t0

    async def _deadline(self, root: str, job: Any) -> EnginePush:
        kind = "shm" if root in self.local else "http"
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(job, self.timeout)
        except TimeoutError:
            return EnginePush(root, False, kind, time.perf_counter() - t0, f"timed out after {self.timeout:g}s")
        except (WeightSyncError, httpx.HTTPError, OSError) as e:
            return EnginePush(root, False, kind, time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:300])
        return EnginePush(root, True, kind, time.perf_counter() - t0)

    async def _push_http(self, root: str, chunks: list[tuple[int, int, int]], size: int, version: int,
                         lora: bool) -> None:
        http, transfer = self._client(), uuid.uuid4().hex
        body = {"transfer": transfer, "weight_version": version, "size": size, "manifest": self._manifest,
                "chunks": [list(c) for c in chunks], "lora": lora}
        await self._post(http, root + "/weights/begin", json=body)
        assert self._buf is not None
        data, window = memoryview(self._buf.numpy()), asyncio.Semaphore(self.in_flight_chunks)

        async def send(i: int, off: int, nbytes: int) -> None:
            async with window:  # a few chunks in flight: the engine checks one while the next travels
                await self._post(http, root + "/weights/chunk", params={"transfer": transfer, "index": i},
                                 content=bytes(data[off : off + nbytes]), method="PUT")

        await asyncio.gather(*(send(i, off, n) for i, (off, n, _) in enumerate(chunks)))
        await self._post(http, root + "/weights/commit", json={"transfer": transfer})

    @staticmethod
    async def _post(http: httpx.AsyncClient, url: str, *, method: str = "POST", **kw: Any) -> Any:
        r = await http.request(method, url, **kw)
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except Exception:
                msg = r.text[:300]
            raise WeightSyncError(f"{url} → {r.status_code}: {msg}")
        return r.json()

    def _pack(self, items: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[int, int, int]], int]:
        """Copy every tensor into the flat buffer (reused while the layout holds); CRC each bucket."""
        key = tuple((n, t.dtype, tuple(t.shape)) for n, t in items)
        if key != self._layout_key:
            self._manifest, size = layout(items)
            self._buf, self._layout_key = torch.zeros(size, dtype=torch.uint8), key
        assert self._buf is not None
        with torch.no_grad():
            for (_, t), entry in zip(items, self._manifest, strict=True):
                nbytes, off = t.numel() * t.element_size(), entry["offset"]
                self._buf[off : off + nbytes].view(t.dtype).view(t.shape).copy_(t)
        size = int(self._buf.numel())
        data = memoryview(self._buf.numpy())
        return [(off, n, crc32(data[off : off + n])) for off, n in chunk_plan(size, self.bucket_bytes)], size

    async def close(self) -> None:
        for sync in self.local.values():
            await sync.close()
        if self._http is not None and self._http[0] is asyncio.get_running_loop():
            await self._http[1].aclose()
        self._http, self._buf, self._layout_key = None, None, None
