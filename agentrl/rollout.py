"""RolloutManager: keeps many multi-turn episodes in flight and feeds the buffer.

One asyncio event loop.  For each task drawn from :class:`TaskSampler` the manager runs
a *group* of G episodes (``Environment.rollout``), scores the group with the env's
rubric and hands it to :class:`~agentrl.buffer.StalenessBuffer`.  It starts a new group
only when the buffer's ``capacity()`` allows it (staleness admission control) and there
are G free episode slots (``max_in_flight``).  Model calls go through
:class:`ManagedClient`: least-loaded endpoint per group (so a group's shared prompt hits
one engine's cache), an optional request-rate throttle (asyncio-throttle) per endpoint,
and retries with backoff on transient endpoint errors.  Each episode has a wall-clock
timeout; a timed-out or crashed episode becomes an errored trajectory, never an
exception.

Partial rollouts need nothing here: the engine pauses for a weight push and resumes
in-flight requests on the new weights, and every token carries the version that
sampled it, so an episode spanning updates is simply trained with per-token versions.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncio_throttle import Throttler

from agentrl.buffer import StalenessBuffer
from agentrl.types import Group, SamplingParams, Task, Trajectory


def _transient_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from agentrl.inference.client import EndpointError

        errs.append(EndpointError)
    except ImportError:  # the engine's client is optional for fake-client tests
        pass
    return tuple(errs)


def _is_permanent(e: BaseException) -> bool:
    # A prompt that does not fit will not fit on retry either.
    return any(cls.__name__ == "ContextLengthExceeded" for cls in type(e).__mro__)


class Endpoint:
    """One inference server: its client, a throttle, and how many episodes use it."""

    def __init__(self, client: Any, requests_per_s: float = 0.0) -> None:
        self.client = client
        self.active_episodes = 0
        self.calls = 0
        self.throttle = Throttler(rate_limit=max(1, int(math.ceil(requests_per_s))), period=1.0) if requests_per_s else None


class ManagedClient:
    """What an episode talks to: the endpoint's client plus throttle and retries.

    Everything but ``complete`` is forwarded to the underlying client unchanged.
    ``group`` (optional) learns the oldest weight version among the sampled tokens.
    """

    def __init__(
        self, endpoint: Endpoint, max_retries: int = 3, backoff_s: float = 0.2, group: _RunningGroup | None = None
    ) -> None:
        self._endpoint = endpoint
        self._max_retries = max_retries
        self._backoff_s = backoff_s
        self._transient = _transient_errors()
        self._group = group

    async def complete(self, *args: Any, **kwargs: Any) -> Any:
        ep = self._endpoint
        for attempt in range(self._max_retries + 1):
            if ep.throttle is not None:
                await ep.throttle.acquire()
            ep.calls += 1
            try:
                out = ep.client.complete(*args, **kwargs)
                out = await out if inspect.isawaitable(out) else out
                if self._group is not None:
                    self._group.saw(out)
                return out
            except self._transient as e:
                if attempt == self._max_retries or _is_permanent(e):
                    raise
                await asyncio.sleep(self._backoff_s * (2**attempt))
        raise AssertionError("unreachable")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._endpoint.client, name)


class TaskSampler:
    """Seeded epoch-wise shuffle over a task list; its cursor is checkpointed."""

    def __init__(self, tasks: Sequence[Task], seed: int = 0) -> None:
        if not tasks:
            raise ValueError("the environment's dataset is empty")
        self.tasks = list(tasks)
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> Task:
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        task = self.tasks[self._order[self.cursor]]
        self.cursor += 1
        return task

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)


TrajectorySink = Callable[[Trajectory], None]


class _RunningGroup:
    """A group's task and the oldest weight version any of its episodes sampled with."""

    __slots__ = ("task", "oldest_version", "doomed")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.oldest_version: int | None = None
        self.doomed = False

    def saw(self, completions: Any) -> None:
        for c in completions or ():
            vs = getattr(c, "versions", None)
            if vs:
                v = min(vs)
                if self.oldest_version is None or v < self.oldest_version:
                    self.oldest_version = v


class RolloutManager:
    """Runs groups of episodes under admission control until stopped."""

    def __init__(
        self,
        env: Any,
        clients: Sequence[Any],
        buffer: StalenessBuffer,
        sampler: TaskSampler,
        sampling: SamplingParams,
        *,
        group_size: int = 8,
        max_in_flight: int = 64,
        requests_per_s: float = 0.0,
        episode_timeout_s: float = 120.0,
        max_turns: int | None = None,
        max_retries: int = 3,
        on_trajectory: TrajectorySink | None = None,
    ) -> None:
        if not clients:
            raise ValueError("RolloutManager needs at least one client")
        self.env = env
        self.endpoints = [Endpoint(c, requests_per_s) for c in clients]
        self.buffer = buffer
        self.sampler = sampler
        self.sampling = sampling
        self.group_size = group_size
        self.max_in_flight = max_in_flight
        self.episode_timeout_s = episode_timeout_s
        self.max_turns = max_turns
        self.max_retries = max_retries
        self.on_trajectory = on_trajectory
        self.active_episodes = 0
        self.episodes_finished = 0
        self.sampled_tokens = 0
        self._running: list[_RunningGroup] = []
        self.groups_cancelled_stale = 0
        self._stopping = False

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        """Admit groups whenever the buffer and the in-flight cap allow; runs until stop()."""
        try:
            while not self._stopping:
                self._cancel_doomed()
                while self._can_admit():
                    self._start_group(self.sampler.next())
                await self.buffer.wait_change()
        finally:
            await self._cancel_all()

    def stop(self) -> None:
        self._stopping = True
        self.buffer.notify()

    def _can_admit(self) -> bool:
        if self._stopping or self.buffer.capacity() <= 0:
            return False
        # a group larger than the cap may run alone
        return self.active_episodes + self.group_size <= self.max_in_flight or self.active_episodes == 0

    def _cancel_doomed(self) -> None:
        """Stop groups that already hold a token too stale to ever be trained.

        The buffer would drop them on arrival anyway; cancelling now frees their admission
        slot (so a fresh group starts a step earlier) and their engine slots (the client
        disconnects, the engine aborts the request).
        """
        oldest_ok = self.buffer.oldest_trainable_version()
        for run in self._running:
            if not run.doomed and run.oldest_version is not None and run.oldest_version < oldest_ok:
                run.doomed = True
                self.groups_cancelled_stale += 1
                if run.task is not None:
                    run.task.cancel()

    def _start_group(self, task: Task) -> None:
        self.buffer.start_group(self.group_size)
        self.active_episodes += self.group_size
        run = _RunningGroup()
        run.task = asyncio.create_task(self._run_group(task, run))
        self._running.append(run)

    async def _run_group(self, task: Task, run: _RunningGroup) -> None:
        group = Group(task=task)
        endpoint = min(self.endpoints, key=lambda e: e.active_episodes)
        endpoint.active_episodes += self.group_size
        done = False
        try:
            trajs = await asyncio.gather(
                *(self._episode(endpoint, task, self.sampling, run) for _ in range(self.group_size))
            )
            group.trajectories = list(trajs)
            for t in group.trajectories:
                t.group_id = group.id
            await score_group(self.env, group.trajectories)
            for t in group.trajectories:
                self.sampled_tokens += t.num_sampled_tokens
                if self.on_trajectory is not None:
                    self.on_trajectory(t)
            self.episodes_finished += len(group.trajectories)
            self.buffer.put(group)
            done = True
        finally:
            endpoint.active_episodes -= self.group_size
            self._running.remove(run)
            if not done:
                if run.doomed:  # cancelled by _cancel_doomed: dropped as stale in the ledger
                    self.buffer.drop_running_group(self.group_size)
                else:  # cancelled at shutdown: its episodes stay in flight in the ledger
                    self.buffer.abandon_group(self.group_size)

    async def _episode(
        self, endpoint: Endpoint, task: Task, sampling: SamplingParams, run: _RunningGroup | None = None
    ) -> Trajectory:
        """One episode; frees its in-flight slot as soon as it ends (before group scoring)."""
        try:
            return await run_episode(
                self.env,
                ManagedClient(endpoint, self.max_retries, group=run),
                task,
                sampling,
                timeout_s=self.episode_timeout_s,
                max_turns=self.max_turns,
            )
        finally:
            self.active_episodes -= 1
            self.buffer.notify()

    async def _cancel_all(self) -> None:
        tasks = [r.task for r in self._running if r.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ evaluation

    async def evaluate(self, tasks: Sequence[Task], sampling: SamplingParams, concurrency: int = 64) -> list[Trajectory]:
        """Run one scored episode per task outside the buffer and ledger (held-out eval)."""
        clients = [ManagedClient(ep, self.max_retries) for ep in self.endpoints]
        return await evaluate_tasks(
            self.env, clients, tasks, sampling, concurrency=concurrency,
            timeout_s=self.episode_timeout_s, max_turns=self.max_turns,
        )


# ----------------------------------------------------------------------------- episode helpers


async def run_episode(
    env: Any, client: Any, task: Task, sampling: SamplingParams, *, timeout_s: float, max_turns: int | None
) -> Trajectory:
    """``env.rollout`` with a wall-clock limit; never raises (failures become ``error``)."""
    t0 = time.perf_counter()
    try:
        traj = await asyncio.wait_for(env.rollout(client, task, sampling, max_turns=max_turns), timeout_s)
    except TimeoutError:
        traj = Trajectory(task=task, error=f"timeout: episode exceeded {timeout_s:g}s", stop_reason="timeout")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # env.rollout promises not to raise; a bug there must not kill the run
        traj = Trajectory(task=task, error=f"{type(e).__name__}: {e}"[:500], stop_reason="error")
    traj.timing.setdefault("episode_s", time.perf_counter() - t0)
    return traj


async def evaluate_tasks(
    env: Any, clients: Sequence[Any], tasks: Sequence[Task], sampling: SamplingParams, *,
    concurrency: int = 64, timeout_s: float = 120.0, max_turns: int | None = None,
) -> list[Trajectory]:
    """One scored episode per task, spread over ``clients`` (never raises)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, task: Task) -> Trajectory:
        async with sem:
            traj = await run_episode(
                env, clients[i % len(clients)], task, sampling, timeout_s=timeout_s, max_turns=max_turns
            )
            await score_group(env, [traj])
            return traj

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


async def score_group(env: Any, trajs: list[Trajectory]) -> None:
    """Rubric scoring; a crash or a non-finite reward marks the episode errored."""
    live = [t for t in trajs if not t.errored]
    if not live:
        return
    try:
        await env.rubric.score_group(live)
    except Exception as e:
        for t in live:
            t.error = f"rubric: {type(e).__name__}: {e}"[:500]
        return
    for t in live:
        if t.error is None and not math.isfinite(t.reward):
            t.error = f"rubric: non-finite reward {t.reward!r}"
