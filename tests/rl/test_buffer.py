"""StalenessBuffer and the episode ledger: admission, hard drop, filtering, fates by id, checks."""

import asyncio

import pytest
from rl_fakes import make_traj

from agentrl.buffer import AdaptiveStaleness, BufferStalled, StalenessBuffer
from agentrl.ledger import Ledger, LedgerError
from agentrl.types import Group, Message, Task


def _start(buf, versions, rewards=(0.0, 1.0)):
    """Admit a group (ids reserved in the ledger) and return it, finished, ready to put."""
    task = Task(prompt=[Message("user", "q")])
    g = Group(task=task, trajectories=[make_traj(versions, r) for r in rewards])
    buf.start_group(g.id, task, [t.id for t in g.trajectories])
    return g


def _check(buf, extra=()):
    """The real check: counts add up and the live set is exactly what the buffer holds."""
    buf.ledger.check(buf.held_ids() | set(extra))


async def test_admission_cap_is_eta_plus_one_batches_of_uncommitted_groups():
    buf = StalenessBuffer(batch_groups=2, max_staleness=1)
    assert buf.capacity() == 4
    groups = [_start(buf, [0]) for _ in range(3)]
    assert buf.capacity() == 1
    buf.put(groups[0])
    buf.put(groups[1])
    assert buf.capacity() == 1  # ready groups still count
    batch = await buf.take()
    assert len(batch.groups) == 2
    assert buf.capacity() == 1  # in-training groups count until the step is committed
    trained = buf.commit_step(1)
    assert buf.capacity() == 3
    assert buf.ledger.trained == 4 and len(set(trained)) == 4
    _check(buf)
    records = buf.ledger.drain_records()
    assert sorted(r["id"] for r in records) == sorted(trained) and {r["fate"] for r in records} == {"trained"}


@pytest.mark.parametrize("overprovision", [0.0, 2.0])
async def test_eta_zero_admits_nothing_while_a_batch_trains(overprovision):
    # even with spare (over-provisioned) slots: tokens sampled now would be stale on arrival
    buf = StalenessBuffer(batch_groups=1, max_staleness=0, overprovision=overprovision)
    g = _start(buf, [0])
    assert buf.capacity() == int(overprovision)
    buf.put(g)
    await buf.take()
    assert buf.capacity() == 0
    assert buf.oldest_trainable_version() == 1
    buf.commit_step(1)
    assert buf.capacity() == 1 + int(overprovision)


async def test_groups_older_than_eta_are_dropped_at_take_time_with_their_ids():
    buf = StalenessBuffer(batch_groups=1, max_staleness=1)
    buf.version = 3
    old, fresh = _start(buf, [1, 3]), _start(buf, [2, 3])
    buf.put(old)  # oldest token 2 versions behind → dropped
    buf.put(fresh)
    batch = await buf.take()
    assert max(batch.staleness) == 1
    assert buf.ledger.stale == 2
    stale = [r for r in buf.ledger.drain_records() if r["fate"] == "stale"]
    assert sorted(r["id"] for r in stale) == sorted(t.id for t in old.trajectories)
    assert "version 1" in stale[0]["reason"]
    _check(buf)


async def test_take_waits_until_a_full_batch_is_ready():
    buf = StalenessBuffer(batch_groups=2, max_staleness=1)
    a, b = _start(buf, [0]), _start(buf, [0])
    buf.put(a)
    waiter = asyncio.create_task(buf.take())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    buf.put(b)
    batch = await asyncio.wait_for(waiter, 1)
    assert len(batch.groups) == 2 and batch.wait_s > 0


def test_zero_variance_and_errored_episodes_get_their_fates_and_kinds():
    buf = StalenessBuffer(batch_groups=4, max_staleness=1)
    buf.put(_start(buf, [0], rewards=(1.0, 1.0)))  # all equal → filtered
    g = _start(buf, [0], rewards=(0.0, 1.0, 1.0))
    g.trajectories[0].error, g.trajectories[0].error_kind = "sandbox died", "sandbox"
    buf.put(g)  # one errored, two valid with equal reward → filtered
    g = _start(buf, [0], rewards=(0.0, 1.0, 1.0))
    g.trajectories[2].error, g.trajectories[2].error_kind = "EndpointError: 503", "endpoint"
    buf.put(g)  # one errored, two valid with different rewards → ready
    assert (buf.ledger.filtered, buf.ledger.errored, buf.ready_groups) == (4, 2, 1)
    assert buf.ledger.as_metrics()["ledger/errored/sandbox"] == 1
    assert buf.ledger.as_metrics()["ledger/errored/endpoint"] == 1
    assert buf.capacity() == 2 * 4 - 1  # filtered groups free their admission slot (top-up)
    # infrastructure errors leave the group: the advantages are over the other episodes only
    assert [t.advantage for t in g.trajectories] == pytest.approx([-0.5, 0.5])
    _check(buf)


def test_filter_can_be_disabled():
    buf = StalenessBuffer(batch_groups=1, max_staleness=0, filter_zero_variance=False)
    buf.put(_start(buf, [0], rewards=(1.0, 1.0)))
    assert buf.ready_groups == 1


def test_the_ledger_check_catches_a_lost_episode_and_a_double_count():
    buf = StalenessBuffer(batch_groups=2, max_staleness=1)
    g = _start(buf, [0])
    _check(buf)
    buf.running.end(g.id)  # a group vanishes without a fate (the bug the check exists for)
    with pytest.raises(LedgerError, match="live but held by no one"):
        _check(buf)
    ledger = Ledger()
    ledger.start(["a", "b"], "g", "t")
    ledger.settle(["a"], "trained", step=0)
    with pytest.raises(LedgerError, match="not live"):
        ledger.settle(["a"], "stale", step=1)  # counted twice
    ledger.counts["trained"] += 1  # a count that no id backs
    with pytest.raises(LedgerError, match="does not add up"):
        ledger.check({"b"})


def test_a_group_that_failed_becomes_errored_episodes_with_the_reason():
    buf = StalenessBuffer(batch_groups=1, max_staleness=1)
    g = _start(buf, [0])
    buf.fail_group(g.id, "group failed: TypeError: Object of type set is not JSON serializable", "env")
    assert buf.ledger.errored == 2 and buf.ledger.in_flight == 0
    assert {r["reason"] for r in buf.ledger.drain_records()} == {
        "group failed: TypeError: Object of type set is not JSON serializable"}
    _check(buf)


def test_a_put_with_other_episodes_than_started_is_refused():
    buf = StalenessBuffer(batch_groups=1, max_staleness=1)
    g = _start(buf, [0])
    g.trajectories.append(make_traj([0], 1.0))
    with pytest.raises(LedgerError, match="other episodes"):
        buf.put(g)


async def test_a_skipped_step_settles_its_episodes_as_skipped_and_keeps_the_version():
    buf = StalenessBuffer(batch_groups=1, max_staleness=1)
    buf.put(_start(buf, [0]))
    await buf.take()
    ids = buf.skip_step("non-finite gradient")
    assert buf.version == 0 and buf.ledger.skipped == 2 and len(ids) == 2
    _check(buf)


async def test_episodes_the_trainer_left_out_are_skipped_with_its_reason_the_rest_trained():
    buf = StalenessBuffer(batch_groups=1, max_staleness=1)
    g = _start(buf, [0], rewards=(0.0, 1.0, 0.5))
    buf.put(g)
    await buf.take()
    bad = g.trajectories[1].id
    trained = buf.commit_step(1, {bad: "non-finite μ (nan) at sampled token 0 of sequence 0"})
    assert sorted(trained) == sorted(t.id for t in g.trajectories if t.id != bad)
    assert (buf.ledger.trained, buf.ledger.skipped, buf.version) == (2, 1, 1)
    assert [r["reason"] for r in buf.ledger.drain_records() if r["fate"] == "skipped"] == [
        "non-finite μ (nan) at sampled token 0 of sequence 0"]
    _check(buf)


def test_state_roundtrip_marks_running_episodes_interrupted_and_returns_their_tasks():
    buf = StalenessBuffer(batch_groups=2, max_staleness=1)
    running, done = _start(buf, [0]), _start(buf, [0])
    buf.put(done)
    state = buf.state_dict()
    fresh = StalenessBuffer(batch_groups=2, max_staleness=1)
    requeue = fresh.load_state_dict(state)
    assert [t.id for t in requeue] == [running.task.id]
    assert fresh.ready_groups == 1
    assert fresh.ledger.interrupted == 2 and fresh.ledger.in_flight == 2  # the ready group's episodes
    assert {r["id"] for r in fresh.ledger.drain_records()} == {t.id for t in running.trajectories}
    _check(fresh)


async def test_a_stall_names_the_error_not_the_policy():
    buf = StalenessBuffer(batch_groups=1, max_staleness=1, stall_groups=3)
    for _ in range(3):
        g = _start(buf, [0])
        for t in g.trajectories:
            t.error, t.error_kind = "reward function 'correct' returned nan, not a finite number", "rubric"
        buf.put(g)
    with pytest.raises(BufferStalled, match=r"6/6 episodes errored, most in rubric: reward function 'correct'.*fix the rubric"):
        await buf.take()
    eq = StalenessBuffer(batch_groups=1, max_staleness=1, stall_groups=2)
    for _ in range(2):
        eq.put(_start(eq, [0], rewards=(1.0, 1.0)))
    with pytest.raises(BufferStalled, match="same reward.*warm start"):
        await eq.take()


async def test_stale_drops_count_toward_the_stall_detector():
    buf = StalenessBuffer(batch_groups=1, max_staleness=0, stall_groups=2)
    buf.version = 5
    for _ in range(2):
        buf.put(_start(buf, [0]))
    with pytest.raises(BufferStalled, match="too stale"):
        await buf.take()


@pytest.mark.parametrize(
    ("eta", "idle", "kl", "expect"),
    [(1, 0.5, 0.0, 2), (4, 0.5, 0.0, 4), (2, 0.0, 0.1, 1), (0, 0.0, 0.1, 0), (2, 0.05, 0.01, 2), (2, 0.5, 0.1, 1)],
)
def test_adaptive_staleness_rule(eta, idle, kl, expect):
    ad = AdaptiveStaleness(low=0, high=4, idle_max=0.1, kl_max=0.02)
    assert ad.update(eta, idle, kl) == expect


def _bandit_gradient(failure_rewards):
    """Mean REINFORCE gradient on the logit of the risky arm (p = 0.5), through the real buffer.

    The risky arm times out half the time and otherwise scores 1 (worth 0.5 with a timeout as a
    failure); the safe arm always scores 0.6.  Timeouts are the policy's doing: the gradient must
    point to the safe arm."""
    import random

    rng = random.Random(0)
    buf = StalenessBuffer(batch_groups=1, max_staleness=1, failure_rewards=failure_rewards)
    total, groups = 0.0, 4000
    for _ in range(groups):
        task = Task(prompt=[Message("user", "q")])
        trajs, arms = [], {}
        for _ in range(4):
            risky = rng.random() < 0.5
            t = make_traj([0], 1.0 if risky else 0.6)
            if risky and rng.random() < 0.5:
                t.reward, t.error, t.error_kind = 0.0, "episode exceeded its wall limit of 120s", "timeout"
            arms[t.id] = risky
            trajs.append(t)
        g = Group(task=task, trajectories=trajs)
        buf.start_group(g.id, task, [t.id for t in trajs])
        buf.put(g)
        total += sum(t.advantage * (float(arms[t.id]) - 0.5) for t in g.trajectories if buf.ready_groups)
        buf._ready.clear()  # only the advantages matter here
    return total / groups


def test_an_episode_that_timed_out_stays_in_its_group_as_a_failure_so_erroring_does_not_pay():
    assert _bandit_gradient(None) < -0.02  # the default: timeouts are failures (reward 0)
    assert _bandit_gradient({}) > 0.02  # dropped from the group (the old rule): erroring would pay


def test_policy_errors_train_as_failures_and_infrastructure_errors_leave_the_group():
    buf = StalenessBuffer(batch_groups=1, max_staleness=1, failure_rewards={"timeout": -1.0})
    g = _start(buf, [0], rewards=(1.0, 1.0, 0.0, 0.5))
    g.trajectories[0].error, g.trajectories[0].error_kind = "episode exceeded its wall limit of 9s", "timeout"
    g.trajectories[1].error, g.trajectories[1].error_kind = "sandbox died", "sandbox"
    timed_out = g.trajectories[0]
    buf.put(g)
    assert buf.ready_groups == 1 and timed_out in g.trajectories and len(g.trajectories) == 3
    assert timed_out.reward == -1.0 and timed_out.advantage == pytest.approx(-1.0 - (-1.0 + 0.0 + 0.5) / 3)
    assert buf.ledger.errored == 1 and buf.ledger.as_metrics()["ledger/failed/timeout"] == 1
    _check(buf)
