"""Network weight transport: the trainer streams weights to engines over HTTP, no shared filesystem.

The trainer side of ``inference.weight_transport = "http"`` (the engine's side, with its rules,
is :class:`agentrl.weights.receive.WeightReceiver`).  The wire protocol::

    POST /weights/begin   {transfer, transport: "http", weight_version, size, manifest,
                           chunks: [[offset, nbytes]], lora, signature}
    PUT  /weights/chunk?transfer=T&index=i        raw bytes of chunk i, header X-Agentrl-Signature
    POST /weights/commit  {transfer, signature}    every chunk arrived → checked, loaded as weight_version

The trainer packs every tensor into one flat buffer laid out by :mod:`agentrl.weights.manifest`
and cuts it into buckets of ``bucket_mb`` (a tensor may straddle two buckets).  Each bucket
carries an HMAC-SHA256 under the engines' key over the transfer id, its index and its bytes (it
proves the sender and catches corruption); the engine checks it on arrival and writes the bucket
into its staging buffer, while generation goes on.  Only the commit stops generation, between
two decode steps, for a pointer swap (a CPU engine whose dtypes match points its parameters at
the staging buffer) or one copy (CUDA).  A transfer id is fresh per push; an engine refuses a
begin while another transfer is in progress, so a push that fails aborts its own transfer.

Engines on the trainer's host keep shared memory (:class:`~agentrl.weights.push.EmbeddedWeightSync`,
``shm``); the others get HTTP.  Each engine is pushed on its own with a deadline: a dead or
slow engine never blocks the others; it is reported in :attr:`HttpWeightSync.behind` with its
cause and gets the full weights, as the current version, at the next push.  Only a push that
reached no engine at all raises :class:`~agentrl.errors.WeightSyncError`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from agentrl.auth import auth_headers, client_key
from agentrl.errors import WeightSyncError
from agentrl.weights import sync as wire
from agentrl.weights.manifest import SIGNATURE_HEADER, layout, signature
from agentrl.weights.sync import NamedTensors, items_of, url_root

DEFAULT_BUCKET_MB = 32.0


def chunk_plan(size: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each bucket of a ``size``-byte buffer."""
    step = max(1, int(bucket_bytes))
    return [(off, min(step, size - off)) for off in range(0, size, step)]


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
        ``api_key``: the engines' key (default ``AGENTRL_API_KEY``); every message is signed with it."""
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("make_weight_sync needs at least one engine URL")
        local = {url_root(u) for u in local_urls or []}
        self.roots = [url_root(u) for u in urls]
        self.remote = [r for r in self.roots if r not in local]
        from agentrl.weights.push import EmbeddedWeightSync

        self.api_key = api_key or client_key()
        self.session = wire.new_transfer()  # versions never decrease within it (engines check)
        # one shm sync per local engine: a failure there stays that engine's
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
        self._aborts: set[asyncio.Task] = set()  # aborts of transfers that ran past their deadline
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
        chunks: list[tuple[int, int, str]] = []
        if self.remote:
            key, transfer = wire.need_key(self.api_key), wire.new_transfer()
            chunks, size = await asyncio.to_thread(self._pack, items, key, transfer)
            jobs.update({r: self._push_http(r, key, transfer, chunks, size, version, lora) for r in self.remote})
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

    async def _push_http(self, root: str, key: str, transfer: str, chunks: list[tuple[int, int, str]], size: int,
                         version: int, lora: bool) -> None:
        http = self._client()
        await wire.begin(http, root, key, transfer=transfer, transport="http", version=version,
                         manifest=self._manifest, size=size, lora=lora, session=self.session,
                         chunks=[[o, n] for o, n, _ in chunks])
        try:
            assert self._buf is not None
            data, window = memoryview(self._buf.numpy()), asyncio.Semaphore(self.in_flight_chunks)

            async def send(i: int, off: int, nbytes: int, sig: str) -> None:
                async with window:  # a few chunks in flight: the engine checks one while the next travels
                    await wire.call(http, "PUT", root + "/weights/chunk", params={"transfer": transfer, "index": i},
                                    content=bytes(data[off : off + nbytes]), headers={SIGNATURE_HEADER: sig})

            await asyncio.gather(*(send(i, off, n, sig) for i, (off, n, sig) in enumerate(chunks)))
            await wire.commit(http, root, key, transfer)
        except asyncio.CancelledError:  # past the deadline: abort without waiting on a hung engine
            task = asyncio.ensure_future(wire.abort(http, root, key, transfer))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise
        except BaseException:  # our transfer must not hold the engine until it expires
            await wire.abort(http, root, key, transfer)
            raise

    def _pack(self, items: list[tuple[str, torch.Tensor]], key: str,
              transfer: str) -> tuple[list[tuple[int, int, str]], int]:
        """Copy every tensor into the flat buffer (reused while the layout holds); sign each bucket."""
        shapes = tuple((n, t.dtype, tuple(t.shape)) for n, t in items)
        if shapes != self._layout_key:
            self._manifest, size = layout(items)
            self._buf, self._layout_key = torch.zeros(size, dtype=torch.uint8), shapes
        assert self._buf is not None
        with torch.no_grad():
            for (_, t), entry in zip(items, self._manifest, strict=True):
                nbytes, off = t.numel() * t.element_size(), entry["offset"]
                self._buf[off : off + nbytes].view(t.dtype).view(t.shape).copy_(t)
        size = int(self._buf.numel())
        data = memoryview(self._buf.numpy())
        return [(off, n, signature(key, "chunk", transfer, str(i), data[off : off + n]))
                for i, (off, n) in enumerate(chunk_plan(size, self.bucket_bytes))], size

    async def close(self) -> None:
        for sync in self.local.values():
            await sync.close()
        if self._http is not None and self._http[0] is asyncio.get_running_loop():
            await self._http[1].aclose()
        self._http, self._buf, self._layout_key = None, None, None
