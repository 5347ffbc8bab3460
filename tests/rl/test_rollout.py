"""RolloutManager against a fake env/engine: admission, faults, staleness bound, ledger."""

import asyncio

import pytest
from rl_fakes import FakeClient, FakeEngine, FakeEnv, FakeRubric

from agentrl.buffer import StalenessBuffer
from agentrl.recipes.rl import rl_loop
from agentrl.rollout import RolloutManager, TaskSampler, admissible_groups, worker_share
from agentrl.types import Message, SamplingParams


def _manager(env, engines, buf, **kw):
    kw.setdefault("group_size", 4)
    return RolloutManager(env, FakeClient(list(engines)), buf, TaskSampler(env.dataset(), seed=0), SamplingParams(), **kw)


async def _train(buf, engines, mgr, steps, on_batch=None):
    """A stand-in trainer: take, 'train', push (bump the engines' version), commit."""
    staleness = []
    for step in range(steps):
        batch = await buf.take()
        staleness.extend(batch.staleness)
        if on_batch:
            on_batch(batch)
        await asyncio.sleep(0.005)
        for e in engines:
            e.version = step + 1
        buf.commit_step(step + 1)
    mgr.stop()
    return staleness


async def _run(eta, steps=8, heavy=True, filter_zero=True):
    """The real scheduler (rl_loop) with a stand-in train step and push."""
    engines = [FakeEngine(latency_s=0.004, heavy_tail=heavy), FakeEngine(latency_s=0.004, heavy_tail=heavy)]
    buf = StalenessBuffer(batch_groups=3, max_staleness=eta, filter_zero_variance=filter_zero)
    mgr = _manager(FakeEnv(), engines, buf, max_in_flight=16)
    staleness, versions = [], []

    async def train(batch):
        staleness.extend(batch.staleness)
        await asyncio.sleep(0.005)
        return {}

    async def push(version):
        for e in engines:
            e.version = version
        return 0.0

    async def on_step(rep):
        versions.append(rep.version)

    nxt = await rl_loop(buf, mgr, start_step=0, steps=steps, train=train, push=push, on_step=on_step)
    assert nxt == steps and versions == list(range(1, steps + 1))
    return buf, mgr, engines, staleness


@pytest.mark.parametrize("eta", [0, 1, 2])
async def test_no_trained_token_is_more_than_eta_stale_and_the_ledger_adds_up(eta):
    buf, mgr, engines, staleness = await _run(eta)
    assert staleness and max(staleness) <= eta
    lg = buf.ledger
    assert lg.trained == 8 * 3 * 4  # whole groups of 4, 3 per step
    assert lg.started == lg.trained + lg.stale + lg.filtered + lg.errored + lg.unused + lg.interrupted + lg.in_flight
    assert mgr.active_episodes == 0
    assert all(e.calls > 0 for e in engines)  # both endpoints were used


async def test_a_normal_end_settles_every_episode_the_ledger_closes():
    """Finished-but-untrained episodes end ``unused`` and running ones ``interrupted`` (they used to
    be left without a fate: 40–64 per run of the quickstart)."""
    buf, mgr, _, _ = await _run(2)
    lg = buf.ledger
    assert lg.in_flight == 0 and lg.unused + lg.interrupted > 0
    assert lg.started == sum(lg.counts.values())
    records = [r for r in lg.drain_records() if r["fate"] in ("unused", "interrupted")]
    assert len(records) == lg.unused + lg.interrupted
    assert all("the run ended at step 8" in r["reason"] for r in records)
    assert buf.held_ids() == set() and mgr.running_episode_ids() == set()


async def test_adaptive_staleness_moves_eta_and_every_batch_obeys_its_own_bound():
    """Adaptive mode: η changes between steps; each batch's staleness stays within the η it was taken under."""
    from agentrl.buffer import AdaptiveStaleness

    engines = [FakeEngine(latency_s=0.004, heavy_tail=True)]
    # idle_max 0: the trainer always counts as idle, so η climbs one step at a time to the cap
    buf = StalenessBuffer(
        batch_groups=2, max_staleness=0, filter_zero_variance=False,
        adaptive=AdaptiveStaleness(0, 3, idle_max=0.0, kl_max=1.0),
    )  # fmt: skip
    mgr = _manager(FakeEnv(), engines, buf, max_in_flight=16)
    seen: list[tuple[int, int]] = []

    async def train(batch):
        seen.append((batch.max_staleness, max(batch.staleness, default=0)))
        await asyncio.sleep(0.005)
        return {}

    async def push(version):
        engines[0].version = version
        return 0.0

    await rl_loop(buf, mgr, start_step=0, steps=10, train=train, push=push, on_step=lambda rep: asyncio.sleep(0))
    bounds = [b for b, _ in seen]
    assert bounds[0] == 0 and max(bounds) == 3 and bounds == sorted(bounds)
    assert all(worst <= bound for bound, worst in seen)


async def test_eta_zero_is_synchronous():
    buf, _, _, staleness = await _run(0)
    assert set(staleness) == {0}
    assert buf.ledger.stale == 0


async def test_in_flight_cap_is_respected():
    engine = FakeEngine(latency_s=0.002)
    buf = StalenessBuffer(batch_groups=4, max_staleness=4)
    mgr = _manager(FakeEnv(), [engine], buf, max_in_flight=8)
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, mgr.active_episodes)
            await asyncio.sleep(0.001)

    w = asyncio.create_task(watch())
    runner = asyncio.create_task(mgr.run())
    await _train(buf, [engine], mgr, 3)
    await runner
    w.cancel()
    assert 4 <= peak <= 8


@pytest.mark.parametrize(("group_size", "cap"), [(4, 10), (4, 8), (6, 4)])
async def test_the_admission_rule_the_checks_use_is_the_managers(group_size, cap):
    """A served env's room check (recipes/rl.py), the Ray workers' shares (distributed/pool.py) and
    their leased room (distributed/roles.py) used to recompute the manager's admission: one rule,
    ``admissible_groups``, is what they use and what the manager does (whole groups, one above the cap)."""
    engine = FakeEngine(latency_s=0.05)
    buf = StalenessBuffer(batch_groups=64, max_staleness=4)
    mgr = _manager(FakeEnv(), [engine], buf, group_size=group_size, max_in_flight=cap)
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, mgr.active_episodes)
            await asyncio.sleep(0.002)

    w = asyncio.create_task(watch())
    runner = asyncio.create_task(mgr.run())
    await asyncio.sleep(0.3)
    mgr.stop()
    await runner
    w.cancel()
    assert peak == group_size * admissible_groups(0, group_size, cap) == max(group_size, cap // group_size * group_size)
    assert worker_share(64, 8, 16) == 16 and worker_share(96, 4, 4) == 24


async def test_failures_become_errored_episodes_not_crashes():
    env = FakeEnv(rubric=FakeRubric(raise_on={"a2"}), crash_on="a1", hang_on="a3")
    engine = FakeEngine()
    buf = StalenessBuffer(batch_groups=1, max_staleness=3)
    mgr = _manager(env, [engine], buf, group_size=2, episode_timeout_s=0.05)
    tasks = env.dataset()
    for i in (1, 2, 3):
        mgr._start_group(tasks[i])
    while buf.ledger.in_flight:
        await asyncio.wait_for(buf.wait_change(), 5)
    # the crash and the rubric error are errored; the hang is a timeout, the policy's doing: both
    # episodes stay in their group as failures (reward 0), which is then filtered (equal rewards)
    assert (buf.ledger.errored, buf.ledger.filtered, buf.ledger.failed_kinds["timeout"]) == (4, 2, 2)


def test_task_sampler_resumes_its_order():
    env = FakeEnv()
    a = TaskSampler(env.dataset(), seed=3)
    first = [a.next().answer for _ in range(70)]
    b = TaskSampler(env.dataset(), seed=3)
    for _ in range(30):
        b.next()
    c = TaskSampler(env.dataset(), seed=3)
    c.load_state_dict(b.state_dict())
    assert [c.next().answer for _ in range(40)] == first[30:]


class _FirstGroupStalls(FakeEnv):
    """The first task's episodes sample one turn, then hang (a straggler that never ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled_task: str | None = None
        self.stalled = asyncio.Event()  # set once its episodes sampled and hang
        self.cancelled = 0

    async def rollout(self, client, task, sampling, *, max_turns=None, timeout_s=None):
        self.stalled_task = self.stalled_task or task.id
        if task.id != self.stalled_task:
            return await super().rollout(client, task, sampling, max_turns=max_turns, timeout_s=timeout_s)
        await client.complete([1, 2, 3], sampling)
        self.stalled.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def test_a_group_that_can_no_longer_be_trained_is_cancelled_and_counted_stale():
    env = _FirstGroupStalls()
    engine = FakeEngine(latency_s=0.002)
    buf = StalenessBuffer(batch_groups=1, max_staleness=1, filter_zero_variance=False)
    mgr = _manager(env, [engine], buf, group_size=2, max_in_flight=8)

    async def train(batch):
        assert max(batch.staleness) <= 1
        await asyncio.sleep(0.005)
        return {}

    async def push(version):
        engine.version = version
        return 0.0

    await rl_loop(buf, mgr, start_step=0, steps=5, train=train, push=push)
    # its version-0 tokens became untrainable at version 2: cancelled then, not at shutdown
    assert mgr.groups_cancelled_stale == 1 and env.cancelled == 2
    lg = buf.ledger
    assert lg.stale == 2 and lg.trained == 5 * 2
    assert lg.started == lg.trained + lg.stale + lg.filtered + lg.errored + lg.unused + lg.interrupted + lg.in_flight
    stale = [r for r in buf.ledger.drain_records() if r["fate"] == "stale"]
    assert len(stale) == 2 and "too stale" in stale[0]["reason"]


async def test_a_group_cancelled_as_stale_is_running_nowhere():
    """Running groups have one record (the buffer's ``running``): at every step it holds exactly the
    groups whose runners are alive in the event loop, and a group cancelled as stale is gone from
    every view of what runs (records, the manager's ids, what the buffer holds, the ledger's live set,
    the checkpoint's re-queued tasks) while its episodes are counted stale once.  Two copies of the
    running groups (manager and buffer, synced by calls) could drift apart here."""
    env = _FirstGroupStalls()
    engine = FakeEngine(latency_s=0.002)
    buf = StalenessBuffer(batch_groups=1, max_staleness=1, filter_zero_variance=False)
    mgr = _manager(env, [engine], buf, group_size=2, max_in_flight=8)
    views = []

    def runners_alive() -> int:  # counted from the event loop, not from any record
        return sum(1 for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "RolloutManager._run_group")

    def look() -> None:
        running_ids = mgr.running_episode_ids()
        assert len(buf.running) == runners_alive()
        assert running_ids == buf.running.episode_ids() <= buf.held_ids() <= set(buf.ledger.live)
        assert len(buf.state_dict()["running_tasks"]) == len(buf.running)
        views.append((mgr.groups_cancelled_stale, {run.id for run in buf.running}, running_ids, buf.held_ids(),
                      set(buf.ledger.live)))

    async def train(batch):
        await asyncio.sleep(0.005)
        return {}

    async def push(version):
        engine.version = version
        return 0.0

    async def on_step(rep):
        # look once every group the manager must cancel at this version has been cancelled and its
        # runner has ended (awaited, not left to how far the event loop got): none, or the stalled one
        while must_end := [run.runner for run in buf.running if run.runner is not None and (
                run.doomed or (run.oldest_version is not None and run.oldest_version < buf.oldest_trainable_version()))]:
            _, alive = await asyncio.wait(must_end, timeout=30)
            assert not alive, "the manager did not cancel a group holding an untrainable token"
        look()

    async def watch_the_stalled_group() -> None:
        await env.stalled.wait()
        (run,) = [r for r in buf.running if r.task.id == env.stalled_task]
        await asyncio.wait([run.runner])
        look()  # the first moment after its runner ended, whenever in the step that was
        assert run.doomed, "the stalled group was cancelled at shutdown, not as stale"

    watcher = asyncio.create_task(watch_the_stalled_group())
    await rl_loop(buf, mgr, start_step=0, steps=5, train=train, push=push, on_step=on_step)
    await asyncio.wait_for(watcher, 5)
    stale = [r for r in buf.ledger.drain_records() if r["fate"] == "stale"]
    assert mgr.groups_cancelled_stale == 1 and len(stale) == 2 == len({r["id"] for r in stale})
    group, episodes = stale[0]["group"], {r["id"] for r in stale}
    after = [v for v in views if v[0] == 1]
    assert after, "the stalled group was never cancelled during the run"
    for _, groups, running_ids, held, live in after:
        assert group not in groups and not episodes & (running_ids | held | live)
    assert len(buf.running) == 0 == runners_alive() and mgr.running_episode_ids() == set()


async def test_a_group_whose_logging_or_env_raises_is_not_lost():
    """A task that cannot be logged, or an env whose rollout raises (a bug): the episodes get a
    fate with the cause, the run goes on, and the ledger check (run every step) still holds."""

    class Raising(FakeEnv):
        async def rollout(self, client, task, sampling, *, max_turns=None, timeout_s=None):
            if task.answer == "a1":
                raise TypeError("rollout() got an unexpected keyword argument 'x'")
            return await super().rollout(client, task, sampling, max_turns=max_turns, timeout_s=timeout_s)

    env = Raising()
    buf = StalenessBuffer(batch_groups=1, max_staleness=3, filter_zero_variance=False)
    logged = []

    def sink(t):
        if t.task.answer == "a2":
            raise TypeError("Object of type set is not JSON serializable")
        logged.append(t.id)

    mgr = _manager(env, [FakeEngine()], buf, group_size=2, on_trajectory=sink)
    tasks = env.dataset()
    for i in (1, 2, 4):
        mgr._start_group(tasks[i])
    while len(buf.running):
        await asyncio.sleep(0.01)
    lg = buf.ledger
    assert lg.errored == 2 and lg.in_flight == 4 and buf.ready_groups == 2  # a2's group is fine, only unlogged
    assert "group failed: TypeError" in lg.first_error["env"]
    assert mgr.sink_errors == 2 and len(logged) == 2
    buf.ledger.check(mgr.running_episode_ids() | buf.held_ids())


async def test_training_rollouts_keep_the_envs_own_max_turns_unless_the_config_sets_one():
    """rollout.max_turns has one owner: unset (the default) it is the env's own, as in `agentrl eval`
    (it used to be 4 everywhere: the capitals example's 3 became 4, a GymEnv's 30 became 4)."""
    from agentrl.config import RolloutConfig
    from agentrl.envs import MultiTurnEnv
    from agentrl.envs.check import ScriptedClient
    from agentrl.rollout import run_group

    class Never(MultiTurnEnv):
        async def step(self, state, msg):
            return [Message("user", "again")]

    env = Never(dataset=["go"], max_turns=3)
    task = next(iter(env.dataset()))
    for cfg, turns in ((RolloutConfig(), 3), (RolloutConfig(max_turns=5), 5)):
        (traj,) = await run_group(env, ScriptedClient(lambda p: "no"), task, cfg.sampling(), 1, max_turns=cfg.max_turns)
        assert traj.stop_reason == "max_turns" and len(traj.turns) == turns


class _BreaksOnSecondDraw:
    """A task source whose second draw raises: the first group is admitted, then the admission
    loop raises in the same pass, before that group's runner took its first step."""

    def __init__(self, tasks) -> None:
        self.tasks, self.draws = list(tasks), 0

    def next(self):
        self.draws += 1
        if self.draws == 2:
            raise RuntimeError("task source broke")
        return self.tasks[0]


async def test_a_group_cancelled_before_its_first_step_still_gets_a_fate():
    """``run`` stopped by an error in admission cancels a runner that never ran: its ``finally`` (which
    ends the record) never runs, so the record used to outlive the run, holding an admission slot and
    episodes with no fate (``running_episode_ids`` raised LedgerError, the ledger check failed)."""

    class Counting(FakeEnv):
        started = 0

        async def rollout(self, *a, **kw):
            self.started += 1
            return await super().rollout(*a, **kw)

    env = Counting()
    buf = StalenessBuffer(batch_groups=2, max_staleness=0)  # room for two groups: the second draw happens
    src = _BreaksOnSecondDraw(env.dataset())
    mgr = RolloutManager(env, FakeClient(FakeEngine()), buf, src, SamplingParams(), group_size=2, max_in_flight=8)
    with pytest.raises(RuntimeError, match="task source broke"):
        await asyncio.wait_for(mgr.run(), 10)
    assert src.draws == 2 and env.started == 0  # the group was admitted; its runner never took a step
    assert len(buf.running) == 0 and mgr.running_episode_ids() == set()
    assert buf.ledger.in_flight == 2  # cancelled at shutdown: in flight, like any group cancelled then
    buf.ledger.check(mgr.running_episode_ids() | buf.held_ids())
    assert buf.close_out("the run failed") == {"unused": 0, "interrupted": 2}
    lg = buf.ledger
    assert lg.in_flight == 0 and lg.started == 2 == lg.interrupted == sum(lg.counts.values())
