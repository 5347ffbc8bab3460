"""SandboxPool: a hard cap on live sandboxes, pre-warming, reuse, rate limit, retries.

    async with SandboxPool("bwrap", limits, max_live=64, prewarm=8) as pool:
        async with pool.acquire() as sb:        # waits while max_live sandboxes exist
            await sb.exec("python3 main.py")
        # released: reset (processes killed, /work and /tmp emptied) and kept for reuse

Every sandbox the pool ever made counts against ``max_live`` from the moment its creation
starts until it is destroyed, so the cap holds during creation storms too.  Creation is
rate-limited (``creations_per_s``) and retried with exponential backoff on
:class:`SandboxError` (infrastructure), never on a command's own failure.  A sandbox whose
episode broke it, or whose reset fails, is destroyed instead of reused.  Closing the pool
(normal exit, cancellation or an exception in the ``async with`` body) destroys every
sandbox it made, idle or in use; SIGTERM and interpreter exit are covered by the cleanup
hooks in :mod:`agentrl.sandbox.base`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from agentrl.sandbox.base import AgentSandbox, SandboxError, SandboxLimits
from agentrl.sandbox.live import install_cleanup_hooks


@dataclass
class PoolStats:
    created: int = 0
    reused: int = 0
    destroyed: int = 0
    create_failures: int = 0
    """Failed creation attempts (each retried or, after the last, raised)."""
    live: int = 0
    idle: int = 0


class SandboxPool:
    def __init__(
        self,
        backend: str = "auto",
        limits: SandboxLimits | None = None,
        *,
        max_live: int = 16,
        prewarm: int = 0,
        reuse: bool = True,
        creations_per_s: float = 0.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        **options: Any,
    ) -> None:
        """``max_live``: most sandboxes in existence (idle + in use + being created).
        ``prewarm``: idle sandboxes kept ready.  ``reuse``: reset and reuse released
        sandboxes (else destroy them).  ``creations_per_s``: 0 = unlimited.  ``retries``:
        extra creation attempts after a SandboxError, with backoff doubling from ``backoff_s``.
        ``options``: backend options (docker: ``image=``)."""
        from agentrl.sandbox import resolve_backend

        if max_live < 1:
            raise ValueError("max_live must be >= 1")
        self.backend = resolve_backend(backend)
        self.limits = limits or SandboxLimits()
        self.max_live = max_live
        self.prewarm = min(prewarm, max_live)
        self.reuse = reuse
        self.creations_per_s = creations_per_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.options = options
        self.stats = PoolStats()
        self._all: set[AgentSandbox] = set()
        self._idle: list[AgentSandbox] = []
        self._slots = 0  # sandboxes existing or being created
        self._cond = asyncio.Condition()
        self._rate_lock = asyncio.Lock()
        self._next_create = 0.0
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    # --- lifecycle
    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Install cleanup hooks and create the pre-warmed sandboxes."""
        install_cleanup_hooks()
        if self.prewarm:
            await asyncio.gather(*(self._refill_one() for _ in range(self.prewarm)))

    async def close(self) -> None:
        """Destroy every sandbox this pool made (idempotent; safe under cancellation)."""
        self._closed = True
        for t in list(self._background):
            t.cancel()
        sandboxes = list(self._all)
        self._idle.clear()
        await asyncio.shield(asyncio.gather(*(sb.close() for sb in sandboxes), return_exceptions=True))
        for sb in sandboxes:
            self._forget(sb)

    # --- acquire / release
    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[AgentSandbox]:
        """A started sandbox for the duration of the block; released (reset or destroyed) after."""
        sb = await self.get()
        broken = False
        try:
            yield sb
        except BaseException:
            broken = True  # an exception mid-use may have left it half-way: do not reuse
            raise
        finally:
            await asyncio.shield(self.release(sb, reusable=not broken))

    async def get(self) -> AgentSandbox:
        """Take an idle sandbox, or create one when under ``max_live``, else wait."""
        if self._closed:
            raise SandboxError("sandbox pool is closed")
        dead: list[AgentSandbox] = []
        try:
            return await self._take_or_create(dead)
        finally:
            for sb in dead:
                await self._destroy(sb)

    async def _take_or_create(self, dead: list[AgentSandbox]) -> AgentSandbox:
        async with self._cond:
            while True:
                if self._closed:
                    raise SandboxError("sandbox pool is closed")
                while self._idle:
                    sb = self._idle.pop()
                    if sb.alive:
                        self.stats.reused += 1
                        self._schedule_refill()
                        return sb
                    dead.append(sb)
                if self._slots < self.max_live:
                    self._slots += 1
                    break
                await self._cond.wait()
        try:
            sb = await self._create()
        except BaseException:
            async with self._cond:
                self._slots -= 1
                self._cond.notify()
            raise
        self._schedule_refill()
        return sb

    async def release(self, sb: AgentSandbox, *, reusable: bool = True) -> None:
        """Give a sandbox back: reset and keep it for reuse, or destroy it."""
        keep = reusable and self.reuse and not self._closed and sb.alive
        if keep:
            try:
                await sb.reset()
            except (SandboxError, OSError):
                keep = False
        if keep:
            await self._park(sb)
        else:
            await self._destroy(sb)

    # --- internals
    async def _park(self, sb: AgentSandbox) -> None:
        """Keep a ready sandbox for the next get(), or destroy it if the pool has closed."""
        async with self._cond:
            if not self._closed:
                self._idle.append(sb)
                self._cond.notify()
                return
        await self._destroy(sb)

    async def _destroy(self, sb: AgentSandbox) -> None:
        await sb.close()  # outside the lock: a docker removal takes a round trip
        async with self._cond:
            if sb in self._all:
                self._forget(sb)
                self._slots -= 1
            self._cond.notify()

    def _forget(self, sb: AgentSandbox) -> None:
        if sb in self._all:
            self._all.discard(sb)
            self.stats.destroyed += 1

    async def _create(self) -> AgentSandbox:
        from agentrl.sandbox import make_sandbox

        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                delay = self.backoff_s * 2 ** (attempt - 1)
                await asyncio.sleep(delay * (0.5 + random.random()))
            await self._rate_wait()
            sb = make_sandbox(self.backend, self.limits, **self.options)
            self._all.add(sb)  # tracked before the first await: close() reaches it if cancelled
            try:
                await sb.start()
            except SandboxError as e:
                last = e
                self.stats.create_failures += 1
                self._all.discard(sb)
                continue
            except BaseException:
                self._all.discard(sb)
                await asyncio.shield(sb.close())
                raise
            if self._closed:
                await sb.close()
                self._all.discard(sb)
                raise SandboxError("sandbox pool closed during creation")
            self.stats.created += 1
            return sb  # type: ignore[return-value]
        raise SandboxError(f"could not create a {self.backend} sandbox after {self.retries + 1} attempts: {last}")

    async def _rate_wait(self) -> None:
        if self.creations_per_s <= 0:
            return
        loop = asyncio.get_running_loop()
        async with self._rate_lock:
            now = loop.time()
            wait = self._next_create - now
            self._next_create = max(now, self._next_create) + 1.0 / self.creations_per_s
        if wait > 0:
            await asyncio.sleep(wait)

    def _schedule_refill(self) -> None:
        """Keep ``prewarm`` idle sandboxes ready (in the background, within ``max_live``)."""
        missing = self.prewarm - len(self._idle) - len(self._background)
        for _ in range(max(0, missing)):
            if self._closed:
                return
            task = asyncio.get_running_loop().create_task(self._refill_one())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _refill_one(self) -> None:
        async with self._cond:
            if self._closed or self._slots >= self.max_live:
                return
            self._slots += 1
        try:
            sb = await self._create()
        except BaseException as e:
            async with self._cond:
                self._slots -= 1
                self._cond.notify()
            if isinstance(e, Exception):
                return  # a failed pre-warm is not an error: get() will try (and report) itself
            raise
        await self._park(sb)

    def snapshot(self) -> PoolStats:
        self.stats.live = len(self._all)
        self.stats.idle = len(self._idle)
        return self.stats
