"""Network weight transport: the trainer streams weights to engines over HTTP, no shared filesystem.

The trainer side of ``inference.weight_transport = "http"`` (the engine's side, with its rules,
is :class:`agentrl.weights.receive.WeightReceiver`).  The wire protocol::

    POST /weights/begin   {transfer, transport: "http", weight_version, size, manifest,
                           chunks: [[offset, nbytes]], lora, signature}
    PUT  /weights/chunk?transfer=T&index=i        raw bytes of chunk i, header X-Agentrl-Signature
    POST /weights/commit  {transfer, signature}    every chunk arrived → checked, loaded as weight_version

The trainer lays every tensor out in one flat buffer (:mod:`agentrl.weights.manifest`) cut into
buckets of ``bucket_mb`` (a tensor may straddle two buckets), and builds each bucket as the
tensors arrive (``push_stream``: a sharded trainer's gather), so it never holds the whole buffer.  Each bucket
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
from agentrl.weights.sync import (
    Buckets,
    NamedTensors,
    checked_buckets,
    flat_bytes,
    items_of,
    one_bucket,
    url_root,
)

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
        items = items_of(named_tensors)
        return await self.push_stream(items, one_bucket(items), version, lora=lora)

    async def push_stream(self, specs: NamedTensors, buckets: Buckets, version: int, *, lora: bool = False) -> float:
        """:meth:`push` of tensors arriving in ``buckets`` (in the order of ``specs``): each engine takes every
        bucket as it comes (a few chunks in flight), so nothing here holds the whole set."""
        t0 = time.perf_counter()
        specs = items_of(specs)
        manifest, size = layout(specs)
        plan = chunk_plan(size, self.bucket_bytes)
        jobs: dict[str, Any] = {}
        tee = _Tee(buckets, len(self.remote) + len(self.local))
        if self.remote:
            key, transfer = wire.need_key(self.api_key), wire.new_transfer()
            for i, r in enumerate(self.remote):
                jobs[r] = self._push_http(r, key, transfer, manifest, size, plan, tee.stream(i), version, lora)
        for i, (r, sync) in enumerate(self.local.items(), start=len(self.remote)):
            jobs[r] = sync.push_stream(specs, tee.stream(i), version, lora=lora)
        roots = list(jobs)

        async def one(i: int, root: str) -> EnginePush:
            try:
                return await self._deadline(root, jobs[root])
            finally:
                tee.leave(i)  # an engine that failed or finished takes no more buckets

        pump = asyncio.ensure_future(tee.pump())
        try:
            outcomes = await asyncio.gather(*(one(i, r) for i, r in enumerate(roots)))
        finally:
            await pump  # every bucket was taken (or dropped): the trainer's gather is never left waiting
        self.results = list(outcomes)
        for res in outcomes:
            if res.ok:
                self.behind.pop(res.root, None)
            else:
                self.behind[res.root] = res.error or "failed"
        t1 = time.perf_counter()
        self.last_stats = {
            "total_s": t1 - t0, "engines_ok": float(sum(r.ok for r in outcomes)),
            "engines_failed": float(sum(not r.ok for r in outcomes)),
            "bytes": float(sum(t.numel() * t.element_size() for _, t in specs)), "chunks": float(len(plan)),
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

    async def _push_http(self, root: str, key: str, transfer: str, manifest: list[dict[str, Any]], size: int,
                         plan: list[tuple[int, int]], buckets: Buckets, version: int, lora: bool) -> None:
        http = self._client()
        await wire.begin(http, root, key, transfer=transfer, transport="http", version=version,
                         manifest=manifest, size=size, lora=lora, session=self.session, chunks=[list(c) for c in plan])
        try:
            window = asyncio.Semaphore(self.in_flight_chunks)
            sends: set[asyncio.Task] = set()

            async def send(i: int, data: bytes, sig: str) -> None:
                try:
                    await wire.call(http, "PUT", root + "/weights/chunk", params={"transfer": transfer, "index": i},
                                    content=data, headers={SIGNATURE_HEADER: sig})
                finally:
                    window.release()

            async def send_all(chunks: list[tuple[int, bytes, str]]) -> None:
                for i, data, sig in chunks:
                    await window.acquire()  # a few chunks in flight: the engine checks one while the next travels
                    for task in [t for t in sends if t.done()]:
                        sends.discard(task)
                        task.result()  # a refused chunk ends this engine's push
                    sends.add(asyncio.ensure_future(send(i, data, sig)))

            def signed(chunks: list[tuple[int, bytes]]) -> list[tuple[int, bytes, str]]:
                return [(i, data, signature(key, "chunk", transfer, str(i), data)) for i, data in chunks]

            chunker = _Chunker(plan)
            try:
                async for part in checked_buckets(manifest, buckets):
                    await send_all(await asyncio.to_thread(lambda part=part: signed(chunker.feed(part))))
                await send_all(await asyncio.to_thread(lambda: signed(chunker.finish())))
                await asyncio.gather(*sends)
            finally:
                for task in sends:
                    task.cancel()
            await wire.commit(http, root, key, transfer)
        except asyncio.CancelledError:  # past the deadline: abort without waiting on a hung engine
            task = asyncio.ensure_future(wire.abort(http, root, key, transfer))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise
        except BaseException:  # our transfer must not hold the engine until it expires
            await wire.abort(http, root, key, transfer)
            raise

    async def close(self) -> None:
        for sync in self.local.values():
            await sync.close()
        if self._http is not None and self._http[0] is asyncio.get_running_loop():
            await self._http[1].aclose()
        self._http = None


class _Chunker:
    """The flat buffer of a push (:mod:`agentrl.weights.manifest`'s layout) cut into the plan's chunks, built one
    chunk at a time from tensors that arrive in manifest order: only the chunk being filled is held here."""

    def __init__(self, plan: list[tuple[int, int]]):
        self.plan, self.index = plan, 0
        self.chunk = torch.zeros(plan[0][1] if plan else 0, dtype=torch.uint8)

    def feed(self, part: list[tuple[dict[str, Any], torch.Tensor]]) -> list[tuple[int, bytes]]:
        """Copy these tensors into place; the chunks they completed, (index, bytes)."""
        done: list[tuple[int, bytes]] = []
        for entry, t in part:
            data, pos = flat_bytes(t), int(entry["offset"])
            while data.numel():
                start, n = self.plan[self.index]
                if pos >= start + n:  # the rest of this chunk is padding
                    done.append(self._next())
                    continue
                take = min(data.numel(), start + n - pos)
                self.chunk[pos - start : pos - start + take].copy_(data[:take])
                data, pos = data[take:], pos + take
        return done

    def finish(self) -> list[tuple[int, bytes]]:
        """The chunks left (the last tensor's and any padding after it)."""
        done = []
        while self.index < len(self.plan):
            done.append(self._next())
        return done

    def _next(self) -> tuple[int, bytes]:
        out = (self.index, self.chunk.numpy().tobytes())
        self.index += 1
        if self.index < len(self.plan):
            self.chunk = torch.zeros(self.plan[self.index][1], dtype=torch.uint8)
        return out


class _Tee:
    """One stream of buckets to several engines' pushes, each taking every bucket in order; at most two buckets
    wait per engine (a one-bucket push and its end never wait on a slow engine; a longer stream goes at the pace
    of the slowest engine still within its deadline).  An engine that leaves (done, failed, past its deadline)
    takes no more, and the rest of the stream is still drained, so its producer (the trainer's gather) always
    runs to its end."""

    def __init__(self, source: Buckets, n: int):
        self.source = source
        self.queues: list[asyncio.Queue[Any] | None] = [asyncio.Queue(maxsize=2) for _ in range(n)]

    async def pump(self) -> None:
        try:
            async for bucket in self.source:
                for q in list(self.queues):
                    if q is not None:
                        await q.put(bucket)
            end: Any = _END
        except Exception as e:  # noqa: BLE001 - each engine's push raises it
            end = e
        for q in list(self.queues):
            if q is not None:
                await q.put(end)

    async def stream(self, i: int) -> Buckets:
        while (q := self.queues[i]) is not None:
            bucket = await q.get()
            if bucket is _END:
                return
            if isinstance(bucket, Exception):
                raise bucket
            yield bucket

    def leave(self, i: int) -> None:
        q, self.queues[i] = self.queues[i], None
        while q is not None and not q.empty():  # a put waiting on this queue goes through
            q.get_nowait()


_END = object()
