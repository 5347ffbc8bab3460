"""Running groups across the Ray seam, in one event loop: the buffer actor's record (with the worker
that runs each group) and each worker's record must never disagree about a group that has a fate.

The actor's methods are called in-process through a stand-in for its Ray handle (``.remote``
awaits the method), beside the real Ray test of the same path (test_rollout_workers.py), so a
drift between the two records shows here even where a Ray cluster cannot start."""

from __future__ import annotations

import asyncio
import types

import pytest
from rl_fakes import FakeClient, FakeEngine, FakeEnv

from agentrl.buffer import StalenessBuffer
from agentrl.rollout import RolloutManager, TaskSampler
from agentrl.types import SamplingParams

roles = pytest.importorskip("agentrl.distributed.roles")  # needs ray (only imported, never started)


class InProcessActor:
    """``actor.method.remote(*args)`` runs ``BufferActorImpl.method`` as a task of its own in this
    event loop; as with a Ray actor, a caller that stops waiting does not cancel the call."""

    def __init__(self, impl: object) -> None:
        self.impl = impl

    def __getattr__(self, name: str) -> types.SimpleNamespace:
        method = getattr(self.impl, name)
        return types.SimpleNamespace(remote=lambda *a: asyncio.shield(asyncio.ensure_future(method(*a))))


class FirstGroupStalls(FakeEnv):
    """The first task's episodes sample one turn, then hang: a straggler cancelled as stale."""

    stalled_task: str | None = None

    async def rollout(self, client, task, sampling, *, max_turns=None, timeout_s=None):
        self.stalled_task = self.stalled_task or task.id
        if task.id != self.stalled_task:
            return await super().rollout(client, task, sampling, max_turns=max_turns, timeout_s=timeout_s)
        await client.complete([1, 2, 3], sampling)
        await asyncio.sleep(3600)


async def test_a_group_with_a_fate_is_running_nowhere_on_the_actor_or_any_worker():
    env, engine = FirstGroupStalls(), FakeEngine(latency_s=0.002)
    impl = roles.BufferActorImpl(StalenessBuffer(batch_groups=2, max_staleness=1, filter_zero_variance=False),
                                 TaskSampler(env.dataset()))
    actor = InProcessActor(impl)
    workers = []
    for name in ("w0", "w1"):
        _, incarnation = await impl.worker_started(name)
        leased = roles.LeasedBuffer(actor, name, lambda: 2, incarnation)
        manager = RolloutManager(env, FakeClient(engine), leased, leased, SamplingParams(), group_size=2,
                                 max_in_flight=4, admit=leased.engines_up)
        leased.start()
        workers.append((name, leased, manager, asyncio.create_task(manager.run())))

    fated: set[str] = set()  # groups whose episodes have a fate in the ledger

    def check() -> None:
        owners = impl.buffer.running
        fated.update(r["group"] for r in impl.buffer.ledger.drain_records())
        assert not fated & {run.id for run in owners}  # a group with a fate is no longer running on the actor
        for name, leased, manager, _ in workers:
            mine = {run.id for run in leased.running}
            assert not fated & mine, name  # ... nor on the worker that ran it
            counted = {run.id for run in leased.running if run.counted}  # the actor acknowledged their start
            on_actor = {run.id for run in owners if run.owner == name}
            assert counted <= on_actor, name  # (the actor may still hold one whose fate is in the outbox)
            assert manager.running_episode_ids() == leased.running.episode_ids()

    for step in range(6):
        await impl.take()
        engine.version = step + 1
        await impl.commit_step(step + 1)
        running = set().union(*(leased.running_episode_ids() for _, leased, _, _ in workers))
        await impl.check_ledger(running)  # the ledger's live set = what the actor holds ⊇ what workers run
        check()
    for _, leased, manager, task in workers:
        manager.stop()
        await task
        await leased.close()  # delivers every fate the worker gave
    check()
    assert sum(m.groups_cancelled_stale for _, _, m, _ in workers) == 1 and impl.buffer.ledger.stale == 2
    assert len(impl.buffer.running) == 0 and all(len(leased.running) == 0 for _, leased, _, _ in workers)
    impl.buffer.close_out("test over")
    impl.buffer.ledger.check(impl.buffer.held_ids())
