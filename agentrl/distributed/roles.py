"""Rollout workers on Ray sharing one buffer actor: admission, staleness and the ledger stay global.

Local mode is one event loop: :class:`~agentrl.rollout.RolloutManager` calls the
:class:`~agentrl.buffer.StalenessBuffer` synchronously.  Here the same two classes run apart:

    BufferActor (one, async Ray actor)          RolloutWorker (N actors, one event loop each)
      StalenessBuffer + TaskSampler               RolloutManager (unchanged)
      leases: admission slot + task  ──────────►  LeasedBuffer: the buffer/sampler the manager
      start/put/fail/drop/abandon   ◄──────────     calls synchronously; a leaser task asks for
      take/commit_step (trainer side)               slots in batches, an outbox forwards the
                                                    manager's calls in order

A lease is an admission slot the actor reserved (counted against ``capacity()``) and the
next task of the one global sampler; a worker asks only for as many as its share of
``max_in_flight`` lets it start, and turns each into a started group at once, so the global
bound holds up to a lease in transit.  The staleness bound the manager uses to cancel doomed
groups comes back with every reply.

Supervision: a worker actor is created with Ray's ``max_restarts``.  A restarted worker
reports in (:meth:`BufferActorImpl.worker_started`): the groups the dead instance was running
settle as ``interrupted`` in the ledger and their tasks, with its unused leases, go back to
the front of the sampler, so another group re-runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import ray

from agentrl.buffer import Batch, RunningGroup, RunningGroups, StalenessBuffer
from agentrl.rollout import RolloutManager, TaskSampler, admissible_groups
from agentrl.types import Group, SamplingParams, Task

LEASE_POLL_S = 0.5  # a lease request waits at most this long on the actor for a free slot


class BufferActorImpl:
    """The one buffer of a distributed run (wrapped by ``ray.remote`` in :func:`buffer_actor`)."""

    def __init__(self, buffer: StalenessBuffer, sampler: TaskSampler) -> None:
        self.buffer, self.sampler = buffer, sampler
        self.leases: dict[str, list[Task]] = {}  # worker -> tasks leased, group not started yet
        self.groups_by_worker: dict[str, int] = {}  # groups each worker put (finished and scored)
        self.worker_restarts = 0
        self.asking: dict[str, int] = {}  # workers waiting in lease() now
        self.last_ask: dict[str, float] = {}  # worker -> when its last lease() returned
        self.incarnation: dict[str, int] = {}  # bumped at (re)start and at close: older leases are refused
        self.leases_by_worker: dict[str, int] = {}  # slots leased to each worker (for the fairness check)
        self.rollouts: list[dict[str, Any]] = []  # finished episodes since the driver last drained them
        self.engines: list[str] | None = None  # the engines' current addresses (the driver's supervisor sets them)
        self.engines_down = False  # an engine is down: no new leases until it is back

    def _status(self) -> dict[str, Any]:
        return {"version": self.buffer.version, "oldest_trainable": self.buffer.oldest_trainable_version(),
                "engines": self.engines, "engines_down": self.engines_down}  # fmt: skip

    def _free(self) -> int:
        return self.buffer.capacity() - sum(len(t) for t in self.leases.values())

    def _held(self, worker: str) -> int:
        """Admission slots a worker holds: leases not started yet and its running groups."""
        return len(self.leases.get(worker, ())) + sum(1 for run in self.buffer.running if run.owner == worker)

    def _grant(self, worker: str, n: int) -> int:
        """How many of the free slots ``worker`` may lease now.

        Fair share: the slots the workers that want work hold or could take, split evenly; what
        another wanting worker lacks of its share is reserved for it.  A worker wants work while
        it asks (or asked within ``2 * LEASE_POLL_S``: its leaser asks again at once), so a dead
        or saturated worker reserves nothing and the others may use every slot."""
        free = self._free()
        if free <= 0 or self.engines_down:  # the local manager's admit gate, for every worker at once
            return 0
        now = time.monotonic()
        wanting = {w for w in self.incarnation if w in self.asking or now - self.last_ask.get(w, -1e9) < 2 * LEASE_POLL_S}
        wanting.add(worker)
        quota = -(-(free + sum(self._held(w) for w in wanting)) // len(wanting))
        reserved = sum(max(0, quota - self._held(w)) for w in wanting if w != worker)
        return max(0, min(n, free - reserved))

    # ------------------------------------------------------------------ worker side

    async def lease(self, worker: str, incarnation: int, n: int, wait_s: float = LEASE_POLL_S) -> dict[str, Any]:
        """Up to ``n`` admission slots with their tasks (fair share, :meth:`_grant`); waits up to
        ``wait_s`` for one.  A lease for a closed or dead instance of the worker gets nothing."""
        deadline = time.monotonic() + wait_s
        self.asking[worker] = self.asking.get(worker, 0) + 1
        try:
            while self._grant(worker, n) <= 0 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.buffer.wait_change(), max(0.0, deadline - time.monotonic()))
        finally:
            self.asking[worker] -= 1
            if not self.asking[worker]:
                del self.asking[worker]
            self.last_ask[worker] = time.monotonic()
        grant = self._grant(worker, n) if incarnation == self.incarnation.get(worker) else 0
        tasks = [self.sampler.next() for _ in range(grant)]
        self.leases.setdefault(worker, []).extend(tasks)
        self.leases_by_worker[worker] = self.leases_by_worker.get(worker, 0) + len(tasks)
        if tasks:  # another worker waiting in lease() re-checks its share
            self.buffer.notify()
        return {"tasks": tasks, **self._status()}

    async def start_group(self, worker: str, group_id: str, task: Task, episode_ids: list[str]) -> dict[str, Any]:
        held = self.leases.get(worker, [])
        lease = next((i for i, t in enumerate(held) if t.id == task.id), None)
        if lease is None:
            raise RuntimeError(f"worker {worker} started group {group_id} without a lease for task {task.id}")
        held.pop(lease)
        self.buffer.start_group(group_id, task, episode_ids).owner = worker
        return self._status()

    async def put(self, worker: str, group: Group) -> dict[str, Any]:
        self.rollouts.extend({"oldest_version": t.oldest_version(), "trainer_version": self.buffer.version,
                              "worker": worker, **t.to_dict()} for t in group.trajectories)  # fmt: skip
        self.buffer.put(group)
        self.groups_by_worker[worker] = self.groups_by_worker.get(worker, 0) + 1
        return self._status()

    async def fail_group(self, worker: str, group_id: str, reason: str, kind: str) -> dict[str, Any]:
        self.buffer.fail_group(group_id, reason, kind)
        return self._status()

    async def drop_running_group(self, worker: str, group_id: str, reason: str) -> dict[str, Any]:
        self.buffer.drop_running_group(group_id, reason)
        return self._status()

    async def abandon_group(self, worker: str, group_id: str) -> dict[str, Any]:
        self.buffer.abandon_group(group_id)
        return self._status()

    async def return_leases(self, worker: str) -> None:
        """A stopping worker gives its unused leases back (their tasks are handed out first);
        a lease still in transit to it is refused."""
        self.incarnation[worker] = self.incarnation.get(worker, 0) + 1
        self.sampler.requeue(self.leases.pop(worker, []))
        self.buffer.notify()

    async def worker_started(self, worker: str) -> tuple[int, int]:
        """A (re)started worker reports in: what its previous instance held is re-queued.

        Returns ``(groups re-queued, incarnation)``: 0 groups on a first start; the worker
        passes the incarnation with every lease, so a lease the dead instance asked for is refused."""
        self.incarnation[worker] = self.incarnation.get(worker, 0) + 1
        lost = [run.id for run in self.buffer.running if run.owner == worker]
        tasks = list(self.leases.pop(worker, []))
        for gid in lost:
            tasks.append(self.buffer.interrupt_group(gid, f"rollout worker {worker} died; the task was re-queued"))
        if lost:
            self.worker_restarts += 1
        self.sampler.requeue(tasks)
        self.buffer.notify()
        return len(lost), self.incarnation[worker]

    async def status(self) -> dict[str, Any]:
        """Version, staleness bound and engines, for a worker that has nothing to ask for."""
        return self._status()

    async def set_engines(self, urls: list[str], down: bool) -> None:
        """The driver's supervisor: the engines' addresses now, and whether one is down (a
        restarted engine may come back elsewhere; every worker's client follows at its next reply)."""
        self.engines, self.engines_down = list(urls), down
        self.buffer.notify()

    async def workers(self) -> list[str]:
        """The workers that reported in."""
        return sorted(self.incarnation)

    # ------------------------------------------------------------------ trainer side

    async def take(self) -> Batch:
        return await self.buffer.take()

    async def commit_step(self, version: int, skipped: dict[str, str] | None = None) -> list[str]:
        return self.buffer.commit_step(version, skipped)

    async def skip_step(self, reason: str, skipped: dict[str, str] | None = None) -> list[str]:
        return self.buffer.skip_step(reason, skipped)

    async def close_out(self, reason: str) -> dict[str, int]:
        return self.buffer.close_out(reason)

    async def adapt(self, trainer_idle_frac: float, mismatch_kl: float) -> int:
        return self.buffer.adapt(trainer_idle_frac, mismatch_kl)

    async def check_ledger(self, running_on_workers: set[str]) -> dict[str, float]:
        """The ledger's live set must equal what the buffer holds, and every episode a worker
        runs must be held (or have settled since the workers were asked); returns the ledger metrics."""
        held = self.buffer.held_ids()
        missing = running_on_workers - held - self.buffer.ledger.settled_since_drain()
        if missing:
            raise RuntimeError(f"{len(missing)} episodes run on workers but the buffer does not hold them "
                               f"(e.g. {sorted(missing)[:3]})")  # fmt: skip
        self.buffer.ledger.check(held)
        return self.buffer.ledger.as_metrics()

    async def ledger(self) -> Any:
        """A copy of the ledger (counts, live set, records not drained yet)."""
        return self.buffer.ledger

    async def drain_records(self) -> list[dict[str, Any]]:
        return self.buffer.ledger.drain_records()

    async def drain_rollouts(self) -> list[dict[str, Any]]:
        """Every episode the workers finished since the last call (the rollouts log)."""
        out, self.rollouts = self.rollouts, []
        return out

    async def view(self) -> dict[str, Any]:
        """What the driver's step row reads of the buffer."""
        b = self.buffer
        return {"version": b.version, "max_staleness": b.max_staleness, "ready": b.ready_groups,
                "adaptive_reason": b.adaptive.last_reason if b.adaptive is not None else None}  # fmt: skip

    async def state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(buffer, sampler) state for a checkpoint; leased tasks not started yet count as queued."""
        sampler = self.sampler.state_dict()
        sampler["queued"] += [t.to_dict() for held in self.leases.values() for t in held]
        return self.buffer.state_dict(), sampler

    async def owners(self) -> dict[str, str]:
        """Running group id -> the worker running it."""
        return {run.id: run.owner for run in self.buffer.running}

    async def stats(self) -> dict[str, Any]:
        return {"groups_by_worker": dict(self.groups_by_worker), "worker_restarts": self.worker_restarts,
                "leases_by_worker": dict(self.leases_by_worker),
                "ready": self.buffer.ready_groups,
                "leased": sum(len(t) for t in self.leases.values()), **self._status(),
                "ledger": self.buffer.ledger.as_metrics()}  # fmt: skip


def buffer_actor(buffer: StalenessBuffer, sampler: TaskSampler, *, name: str | None = None, num_cpus: float = 0) -> Any:
    """Start the buffer actor (an async actor: its methods run on one event loop, in call order)."""
    opts: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 1000}
    if name:
        opts["name"] = name
    return ray.remote(BufferActorImpl).options(**opts).remote(buffer, sampler)


class LeasedBuffer:
    """What a worker's RolloutManager sees as its buffer *and* its task sampler.

    ``capacity()`` is the number of leases held; ``next()`` hands out a leased task;
    the manager's state changes go to the actor through one ordered outbox."""

    def __init__(self, actor: Any, worker: str, room: Callable[[], int], incarnation: int = 1,
                 on_engines: Callable[[list[str]], None] | None = None) -> None:  # fmt: skip
        """``room()``: how many more groups the worker could start now (its in-flight share);
        ``incarnation``: what :meth:`BufferActorImpl.worker_started` returned; ``on_engines(urls)``:
        the engines' addresses changed (the worker's client follows)."""
        self.actor, self.worker, self.room, self.incarnation = actor, worker, room, incarnation
        self.on_engines, self.engines_down = on_engines, False
        self.tasks: list[Task] = []
        self.leased = self.started = 0  # leases received, groups started (this instance)
        self.version, self._oldest_trainable = 0, -(10**9)
        self._changed = asyncio.Event()
        self._outbox: asyncio.Queue[tuple[str, tuple[Any, ...]]] = asyncio.Queue()
        self.errors: list[str] = []
        self.failed = asyncio.Event()  # set when a background loop died or the actor refused a call
        self.running = RunningGroups()  # this worker's groups, ended when their fate is sent (counted: acknowledged)
        self._loops: list[asyncio.Task] = []

    def start(self) -> None:
        self._loops = [asyncio.create_task(self._guard(self._leaser())), asyncio.create_task(self._guard(self._sender()))]

    async def _guard(self, loop: Any) -> None:
        """A background loop that raises is recorded in ``errors`` and wakes the worker (never silent)."""
        try:
            await loop
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.errors.append(f"{loop.__name__}: {type(e).__name__}: {e}")
            self.failed.set()
            self._changed.set()
            raise

    async def close(self) -> None:
        """Deliver what the manager sent, stop leasing, give unused leases back."""
        await self._outbox.join()
        for t in self._loops:
            t.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self.tasks.clear()
        await self.actor.return_leases.remote(self.worker)

    def _seen(self, status: dict[str, Any]) -> None:
        self.version, self._oldest_trainable = status["version"], status["oldest_trainable"]
        self.engines_down = status["engines_down"]
        if status["engines"] is not None and self.on_engines is not None:
            self.on_engines(status["engines"])  # PolicyClient.rebase: moves only what changed

    async def _leaser(self) -> None:
        while True:
            want = self.room() - len(self.tasks)
            if want <= 0 and self.engines_down:  # nothing to ask for, but hear when the engine is back
                await asyncio.sleep(LEASE_POLL_S)
                self._seen(await self.actor.status.remote())
                continue
            if want <= 0:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), LEASE_POLL_S)
                continue
            out = await self.actor.lease.remote(self.worker, self.incarnation, want)
            self._seen(out)
            if out["tasks"]:
                self.leased += len(out["tasks"])
                self.tasks.extend(out["tasks"])
                self._changed.set()

    async def _sender(self) -> None:
        while True:
            method, args = await self._outbox.get()
            try:
                self._seen(await getattr(self.actor, method).remote(self.worker, *args))
                run = self.running.get(args[0]) if method == "start_group" else None
                if run is not None:  # the actor counts it now (unless its fate was given meanwhile)
                    run.counted = True
            except Exception as e:  # the actor refused (a ledger error): the run must hear of it
                self.errors.append(f"{method}: {type(e).__name__}: {e}")
                self.failed.set()
            finally:
                self._outbox.task_done()
                self._changed.set()

    # ------------------------------------------------------------------ the sampler the manager draws from

    def next(self) -> Task:
        return self.tasks.pop(0)

    # ------------------------------------------------------------------ the buffer the manager calls

    def capacity(self) -> int:
        return len(self.tasks)

    def engines_up(self) -> bool:
        """The manager's admit gate: a leased task waits while an engine is down."""
        return not self.engines_down

    def oldest_trainable_version(self) -> int:
        return self._oldest_trainable

    def start_group(self, group_id: str, task: Task, episode_ids: list[str]) -> RunningGroup:
        self.started += 1
        self._outbox.put_nowait(("start_group", (group_id, task, list(episode_ids))))
        return self.running.start(group_id, task, episode_ids, counted=False)

    def put(self, group: Group) -> None:
        group.drop_env_state()
        self.running.end(group.id)
        self._outbox.put_nowait(("put", (group,)))

    def fail_group(self, group_id: str, reason: str, kind: str) -> None:
        self.running.end(group_id)
        self._outbox.put_nowait(("fail_group", (group_id, reason, kind)))

    def drop_running_group(self, group_id: str, reason: str) -> None:
        self.running.end(group_id)
        self._outbox.put_nowait(("drop_running_group", (group_id, reason)))

    def abandon_group(self, group_id: str) -> None:
        self.running.end(group_id)
        self._outbox.put_nowait(("abandon_group", (group_id,)))

    def notify(self) -> None:
        self._changed.set()

    def running_episode_ids(self) -> set[str]:
        """Episodes of the groups the actor counts (it acknowledged their start) and this worker
        has given no fate yet (the actor may not have heard of it)."""
        return {e for run in self.running if run.counted for e in run.episode_ids}

    async def wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()


class RolloutWorkerImpl:
    """One rollout worker: an event loop running the local-mode RolloutManager on a LeasedBuffer."""

    def __init__(
        self, worker: str, actor: Any, env_name: str, env_args: dict[str, Any], client_factory: Callable[[], Any],
        sampling: SamplingParams, *, group_size: int, max_in_flight: int, episode_timeout_s: float = 120.0,
        max_turns: int | None = None, key_files: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        """``key_files``: the driver's key files (its run's ``api_key``), hidden from the programs
        a harness env starts here as they are in the driver (:func:`agentrl.auth.key_files`)."""
        from agentrl.auth import hide_key_files

        hide_key_files(key_files)
        self.worker, self.actor = worker, actor
        self.args = (env_name, env_args, client_factory, sampling)
        self.opts = {"group_size": group_size, "max_in_flight": max_in_flight,
                     "episode_timeout_s": episode_timeout_s, "max_turns": max_turns}  # fmt: skip
        self.manager: RolloutManager | None = None
        self.requeued = -1
        self.leased: LeasedBuffer | None = None

    async def run(self) -> dict[str, Any]:
        """Report in, then run rollouts until :meth:`stop`; returns the worker's counters."""
        from agentrl.plugins import load_environment

        env_name, env_args, client_factory, sampling = self.args
        env = load_environment(env_name, **env_args)
        client = self.client = client_factory()
        self.requeued, incarnation = await self.actor.worker_started.remote(self.worker)
        g, cap = self.opts["group_size"], self.opts["max_in_flight"]

        def room() -> int:
            return admissible_groups(self.manager.active_episodes if self.manager is not None else 0, g, cap)

        leased = self.leased = LeasedBuffer(self.actor, self.worker, room, incarnation, on_engines=getattr(client, "rebase", None))
        self.manager = RolloutManager(env, client, leased, leased, sampling, admit=leased.engines_up, **self.opts)
        leased.start()
        manager, failed = asyncio.create_task(self.manager.run()), asyncio.create_task(leased.failed.wait())
        try:
            await asyncio.wait([manager, failed], return_when=asyncio.FIRST_COMPLETED)
            if failed.done():  # a background loop died or the actor refused a call: stop, then say why
                self.manager.stop()
            await manager  # a crash of the manager itself propagates from here
        finally:
            failed.cancel()
            if not manager.done():
                manager.cancel()
            await leased.close()
            if hasattr(client, "close"):
                await client.close()
        if leased.errors:
            raise RuntimeError(f"rollout worker {self.worker} stopped: {leased.errors[0]}")
        return self.counters()

    async def stop(self) -> None:
        if self.manager is not None:
            self.manager.stop()

    def counters(self) -> dict[str, Any]:
        m = self.manager
        return {"worker": self.worker, "requeued": self.requeued, "episodes": m.episodes_finished if m else 0,
                "active": m.active_episodes if m else 0,
                "leases": self.leased.leased if self.leased else 0, "groups_started": self.leased.started if self.leased else 0,
                "calls": {e.root: (e.calls, e.in_flight, e.pinned) for e in self.client.endpoints} if m else {},
                "sampled_tokens": m.sampled_tokens if m else 0,
                "groups_cancelled_stale": m.groups_cancelled_stale if m else 0,
                "running_ids": sorted(self.leased.running_episode_ids()) if self.leased else []}  # fmt: skip

    async def pid(self) -> int:
        import os

        return os.getpid()


def rollout_worker(worker: str, actor: Any, *args: Any, num_cpus: float = 0, max_restarts: int = 2, **kwargs: Any) -> Any:
    """Start one rollout worker actor (restarted by Ray up to ``max_restarts`` times)."""
    cls = ray.remote(RolloutWorkerImpl).options(num_cpus=num_cpus, max_restarts=max_restarts, max_concurrency=1000)
    return cls.remote(worker, actor, *args, **kwargs)


__all__ = ["BufferActorImpl", "LeasedBuffer", "RolloutWorkerImpl", "buffer_actor", "rollout_worker"]
