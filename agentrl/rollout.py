"""RolloutManager: keeps many multi-turn episodes in flight and feeds the buffer.

One asyncio event loop.  For each task drawn from :class:`TaskSampler` the manager runs
a *group* of G episodes (:func:`agentrl.episode.run_episode`, through the env's
``rollout``), scores the group with the env's rubric and hands it to
:class:`~agentrl.buffer.StalenessBuffer`.  It starts a new group only when the buffer's
``capacity()`` allows it (staleness admission control) and there are G free episode slots
(``max_in_flight``).  A group's episodes share one endpoint (``PolicyClient.pin``), so
their shared prompt hits one engine's cache; retries, failover and request-rate limits are
the client's.  A crashed, timed-out or failed episode becomes an errored trajectory
(with its error kind), never an exception.  The groups it runs are recorded once, in the
buffer's ``running`` (:class:`~agentrl.buffer.RunningGroups`): the manager keeps no list of its own.

Partial rollouts need nothing here: the engine pauses for a weight push and resumes
in-flight requests on the new weights, and every token carries the version that
sampled it, so an episode spanning updates is simply trained with per-token versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.buffer import RunningGroup
from agentrl.episode import error_text, settle_cleanups
from agentrl.errors import error_kind_of
from agentrl.ledger import LedgerError
from agentrl.protocols import AdmissionBuffer, TaskSource
from agentrl.rubrics import score_episodes
from agentrl.types import Completion, Group, SamplingParams, Task, Trajectory, new_id, oldest_version


class TaskSampler:
    """Seeded epoch-wise shuffle over a task list; its cursor is checkpointed."""

    def __init__(self, tasks: Sequence[Task], seed: int = 0) -> None:
        if not tasks:
            raise ValueError("the environment's dataset is empty")
        self.tasks = list(tasks)
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self.queued: list[Task] = []
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def requeue(self, tasks: Sequence[Task]) -> None:
        """Hand these tasks out before the next ones (groups interrupted by a crash)."""
        self.queued.extend(tasks)

    def next(self) -> Task:
        if self.queued:
            return self.queued.pop(0)
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        task = self.tasks[self._order[self.cursor]]
        self.cursor += 1
        return task

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "queued": [t.to_dict() for t in self.queued]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.queued = [Task.from_dict(t) for t in state.get("queued", [])]
        self._order = self._permutation(self.epoch)


TrajectorySink = Callable[[Trajectory], None]


class _Watched:
    """The client a group's episodes use: records on the group the oldest version each call sampled with."""

    def __init__(self, client: Any, group: RunningGroup) -> None:
        self._client, self._group = client, group

    async def complete(self, *args: Any, **kwargs: Any) -> list[Completion]:
        out = await self._client.complete(*args, **kwargs)
        self._group.saw(oldest_version(v for c in out or () for v in (c.versions or ())))
        return out

    async def chat(self, *args: Any, **kwargs: Any) -> list[Completion]:
        out = await self._client.chat(*args, **kwargs)
        self._group.saw(oldest_version(v for c in out or () for v in (c.versions or ())))
        return out

    async def tokenize(self, **kwargs: Any) -> list[int]:
        return await self._client.tokenize(**kwargs)


def admits(active: int, group_size: int, max_in_flight: int) -> bool:
    """The admission rule: a whole group starts when it fits under ``max_in_flight`` beside the
    ``active`` episodes; a group larger than the cap may run alone."""
    return active + group_size <= max_in_flight or active == 0


def admissible_groups(active: int, group_size: int, max_in_flight: int) -> int:
    """How many more whole groups :func:`admits` starts beside ``active`` episodes (from 0: a manager's
    peak is this many groups)."""
    n = 0
    while admits(active + n * group_size, group_size, max_in_flight):
        n += 1
    return n


def worker_share(max_in_flight: int, workers: int, group_size: int) -> int:
    """Each of ``workers`` rollout workers' ``max_in_flight``: an equal share, at least one group."""
    return max(group_size, max_in_flight // workers)


class RolloutManager:
    """Runs groups of episodes under admission control until stopped."""

    def __init__(
        self,
        env: Any,
        client: Any,
        buffer: AdmissionBuffer,
        sampler: TaskSource,
        sampling: SamplingParams,
        *,
        group_size: int = 8,
        max_in_flight: int = 64,
        episode_timeout_s: float = 120.0,
        max_turns: int | None = None,
        on_trajectory: TrajectorySink | None = None,
        admit: Callable[[], bool] | None = None,
    ) -> None:
        """``client``: a :class:`~agentrl.inference.PolicyClient` (or anything with its
        ``complete``/``chat``/``tokenize``; ``pin`` is used when present)."""
        self.env = env
        self.client = client
        self.admit = admit  # e.g. "no engine is down": nothing new starts while it is restarted
        self.buffer = buffer
        self.sampler = sampler
        self.sampling = sampling
        self.group_size = group_size
        self.max_in_flight = max_in_flight
        self.episode_timeout_s = episode_timeout_s
        self.max_turns = max_turns
        self.on_trajectory = on_trajectory
        self.active_episodes = 0
        self.episodes_finished = 0
        self.sampled_tokens = 0
        self.groups_cancelled_stale = 0
        self.sink_errors = 0  # on_trajectory raised (e.g. a task that cannot be logged)
        self.last_sink_error: str | None = None
        self._stopping = False

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        """Admit groups whenever the buffer and the in-flight cap allow; runs until stop()."""
        try:
            while not self._stopping:
                self._cancel_doomed()
                while self._can_admit():
                    self._start_group(self.sampler.next())
                if self.admit is not None and not self.admit():  # held: look again shortly
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.buffer.wait_change(), 0.25)
                    continue
                await self.buffer.wait_change()
        finally:
            await self._cancel_all()

    def stop(self) -> None:
        self._stopping = True
        self.buffer.notify()

    def _can_admit(self) -> bool:
        if self._stopping or self.buffer.capacity() <= 0 or (self.admit is not None and not self.admit()):
            return False
        return admits(self.active_episodes, self.group_size, self.max_in_flight)

    def _cancel_doomed(self) -> None:
        """Stop groups that already hold a token too stale to ever be trained.

        The buffer would drop them on arrival anyway; cancelling now frees their admission
        slot (so a fresh group starts a step earlier) and their engine slots (the client
        disconnects, the engine aborts the request).
        """
        oldest_ok = self.buffer.oldest_trainable_version()
        for run in self.buffer.running:
            if not run.doomed and run.oldest_version is not None and run.oldest_version < oldest_ok:
                run.doomed = True
                self.groups_cancelled_stale += 1
                if run.runner is not None:
                    run.runner.cancel()

    def _start_group(self, task: Task) -> None:
        group = Group(task=task)
        run = self.buffer.start_group(group.id, task, [new_id("ep_") for _ in range(self.group_size)])
        self.active_episodes += self.group_size
        run.runner = asyncio.create_task(self._run_group(group, run))

    def running_episode_ids(self) -> set[str]:
        """Episodes of the groups this manager runs, as the buffer records them (for the ledger
        check).  A record whose runner has ended was given no fate: :class:`LedgerError`."""
        ended = [run.id for run in self.buffer.running if run.runner is not None and run.runner.done()]
        if ended:
            raise LedgerError(f"{len(ended)} groups ended without a fate and still hold admission slots (e.g. {ended[0]})")
        return {e for run in self.buffer.running if run.runner is not None for e in run.episode_ids}

    async def _run_group(self, group: Group, run: RunningGroup) -> None:
        pin = self.client.pin(self.group_size) if hasattr(self.client, "pin") else None
        client = _Watched(pin or self.client, run)
        settled = False
        try:
            trajs = await gather_all(*(self._episode(client, group.task) for _ in range(self.group_size)))
            for t, eid in zip(trajs, run.episode_ids, strict=True):
                t.id, t.group_id = eid, group.id
            group.trajectories = list(trajs)
            await score_episodes(self.env.rubric, group.trajectories)
            finished = list(group.trajectories)
            self.buffer.put(group)  # settles errored/filtered episodes; sets the advantages the trainer uses
            settled = True
            self._finished(finished)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug below us must not lose the group: its episodes are errored, named
            if not settled:
                settled = True
                self.buffer.fail_group(group.id, f"group failed: {error_text(e)}", error_kind_of(e))
        finally:
            if pin is not None:
                pin.release()
            if not settled:  # the record ends here: one fate
                self._end_cancelled(run)

    def _finished(self, trajs: list[Trajectory]) -> None:
        for t in trajs:
            self.sampled_tokens += t.num_sampled_tokens
            if self.on_trajectory is not None:
                try:
                    self.on_trajectory(t)
                except Exception as e:  # logging must never cost an episode (it already has its fate)
                    self.sink_errors += 1
                    self.last_sink_error = error_text(e)
        self.episodes_finished += len(trajs)

    async def _episode(self, client: Any, task: Task) -> Trajectory:
        """One episode; frees its in-flight slot as soon as it ends (before group scoring)."""
        try:
            return await run_episode_of(
                self.env, client, task, self.sampling, timeout_s=self.episode_timeout_s, max_turns=self.max_turns
            )
        finally:
            self.active_episodes -= 1
            self.buffer.notify()

    def _end_cancelled(self, run: RunningGroup) -> None:
        if run.doomed:  # cancelled by _cancel_doomed: dropped as stale in the ledger
            self.buffer.drop_running_group(run.id, "cancelled: it held a token too stale to be trained")
        else:  # cancelled at shutdown: its episodes stay in flight in the ledger
            self.buffer.abandon_group(run.id)

    async def _cancel_all(self) -> None:
        runs = [r for r in self.buffer.running if r.runner is not None]
        for r in runs:
            r.runner.cancel()
        if runs:
            await asyncio.gather(*(r.runner for r in runs), return_exceptions=True)
        for r in runs:  # a runner cancelled before its first step never ran the finally that ends its record
            if self.buffer.running.get(r.id) is r:
                self._end_cancelled(r)
        await settle_cleanups()  # episodes cancelled mid-cleanup: their env cleanups finish before the env closes

    # ------------------------------------------------------------------ evaluation

    async def evaluate(self, tasks: Sequence[Task], sampling: SamplingParams, concurrency: int = 64) -> list[Trajectory]:
        """Run one scored episode per task outside the buffer and ledger (held-out eval)."""
        return await evaluate_tasks(
            self.env, self.client, tasks, sampling, concurrency=concurrency,
            timeout_s=self.episode_timeout_s, max_turns=self.max_turns,
        )


# ----------------------------------------------------------------------------- episodes outside a run


async def run_episode_of(
    env: Any, client: Any, task: Task, sampling: SamplingParams, *, timeout_s: float | None,
    max_turns: int | None, token_exact: bool = True,
) -> Trajectory:
    """``env.rollout`` under a wall limit (the tighter of the env's own and ``timeout_s``)."""
    own = getattr(env, "timeout_s", None)
    limit = min(x for x in (own, timeout_s) if x is not None) if (own or timeout_s) else None
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {"max_turns": max_turns, "timeout_s": limit}
    if not token_exact:
        kwargs["token_exact"] = False
    traj = await env.rollout(client, task, sampling, **kwargs)
    traj.timing.setdefault("episode_s", time.perf_counter() - t0)
    return traj


async def run_group(
    env: Any, client: Any, task: Task, sampling: SamplingParams, n: int, *, timeout_s: float | None = None,
    max_turns: int | None = None, token_exact: bool = True,
) -> list[Trajectory]:
    """``n`` scored episodes of one task on one endpoint (never raises)."""
    pin = client.pin(n) if hasattr(client, "pin") else None
    try:
        trajs = list(await gather_all(*(
            run_episode_of(env, pin or client, task, sampling, timeout_s=timeout_s, max_turns=max_turns,
                           token_exact=token_exact)
            for _ in range(n)
        )))  # fmt: skip
    finally:
        if pin is not None:
            pin.release()
    await score_episodes(env.rubric, trajs)
    return trajs


async def evaluate_tasks(
    env: Any, client: Any, tasks: Sequence[Task], sampling: SamplingParams, *,
    concurrency: int = 64, timeout_s: float | None = 120.0, max_turns: int | None = None,
) -> list[Trajectory]:
    """Held-out evaluation: one scored episode per task (the one evaluator RL, SFT and eval share)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> Trajectory:
        async with sem:
            (traj,) = await run_group(env, client, task, sampling, 1, timeout_s=timeout_s, max_turns=max_turns)
            return traj

    return list(await gather_all(*(one(t) for t in tasks)))


async def gather_all(*aws: Any) -> list[Any]:
    """``asyncio.gather`` that no awaitable outlives: when it is cancelled (or one raises) the
    others are cancelled and awaited before the exception propagates.  Plain ``gather`` returns
    as soon as the first child is cancelled, so a stopped manager's siblings kept running after
    the client and sandboxes were closed (found by ``benchmarks/soak.py``)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            if not t.done() and not t.cancelling():  # never twice: a wait_for inside would orphan its task
                t.cancel()
        while not all(t.done() for t in tasks):
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError:  # cancelled again while settling: it is re-raised below
                continue
        raise


def mean_reward(trajs: Sequence[Trajectory]) -> float:
    """Mean reward with errored episodes counted as 0 (the held-out eval score)."""
    return sum(t.reward for t in trajs if not t.errored) / len(trajs) if trajs else 0.0
