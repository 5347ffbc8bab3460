"""StalenessBuffer: admission, hard drop, filtering, ledger, checkpoint state."""

import asyncio

import pytest
from rl_fakes import make_traj

from agentrl.buffer import AdaptiveStaleness, StalenessBuffer
from agentrl.types import Group, Message, Task


def _group(versions, rewards=(0.0, 1.0)):
    return Group(task=Task(prompt=[Message("user", "q")]), trajectories=[make_traj(versions, r) for r in rewards])


def _ledger_adds_up(buf):
    lg = buf.ledger
    assert lg.started == lg.trained + lg.stale + lg.filtered + lg.errored + lg.interrupted + lg.in_flight
    assert lg.in_flight >= 0


async def test_admission_cap_is_eta_plus_one_batches_of_uncommitted_groups():
    buf = StalenessBuffer(batch_groups=2, max_staleness=1)
    assert buf.capacity() == 4
    for _ in range(3):
        buf.start_group(2)
    assert buf.capacity() == 1
    buf.put(_group([0]))
    buf.put(_group([0]))
    assert buf.capacity() == 1  # ready groups still count
    batch = await buf.take()
    assert len(batch.groups) == 2
    assert buf.capacity() == 1  # in-training groups count until the step is committed
    buf.commit_step(1)
    assert buf.capacity() == 3
    assert buf.ledger.trained == 4
    _ledger_adds_up(buf)


@pytest.mark.parametrize("overprovision", [0.0, 2.0])
async def test_eta_zero_admits_nothing_while_a_batch_trains(overprovision):
    # even with spare (over-provisioned) slots: tokens sampled now would be stale on arrival
    buf = StalenessBuffer(batch_groups=1, max_staleness=0, overprovision=overprovision)
    buf.start_group(2)
    assert buf.capacity() == int(overprovision)
    buf.put(_group([0]))
    await buf.take()
    assert buf.capacity() == 0
    assert buf.oldest_trainable_version() == 1
    buf.commit_step(1)
    assert buf.capacity() == 1 + int(overprovision)


async def test_groups_older_than_eta_are_dropped_at_take_time():
    buf = StalenessBuffer(batch_groups=1, max_staleness=1)
    buf.version = 3
    buf.start_group(2)
    buf.start_group(2)
    buf.put(_group([1, 3]))  # oldest token 2 versions behind → dropped
    buf.put(_group([2, 3]))
    batch = await buf.take()
    assert max(batch.staleness) == 1
    assert buf.ledger.stale == 2
    assert buf.drain_fates()["stale"] and not buf.drain_fates()["stale"]
    _ledger_adds_up(buf)


async def test_take_waits_until_a_full_batch_is_ready():
    buf = StalenessBuffer(batch_groups=2, max_staleness=1)
    buf.start_group(2)
    buf.start_group(2)
    buf.put(_group([0]))
    waiter = asyncio.create_task(buf.take())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    buf.put(_group([0]))
    batch = await asyncio.wait_for(waiter, 1)
    assert len(batch.groups) == 2 and batch.wait_s > 0


def test_zero_variance_and_errored_episodes_are_accounted():
    buf = StalenessBuffer(batch_groups=4, max_staleness=1)
    buf.start_group(2)
    buf.put(_group([0], rewards=(1.0, 1.0)))  # all equal → filtered
    buf.start_group(3)
    g = _group([0], rewards=(0.0, 1.0, 1.0))
    g.trajectories[0].error = "sandbox died"
    buf.put(g)  # one errored, two valid with equal reward → filtered
    buf.start_group(3)
    g = _group([0], rewards=(0.0, 1.0, 1.0))
    g.trajectories[2].error = "timeout"
    buf.put(g)  # one errored, two valid with different rewards → ready
    assert (buf.ledger.filtered, buf.ledger.errored, buf.ready_groups) == (4, 2, 1)
    assert buf.capacity() == 2 * 4 - 1  # filtered groups free their admission slot (top-up)
    _ledger_adds_up(buf)


def test_filter_can_be_disabled():
    buf = StalenessBuffer(batch_groups=1, max_staleness=0, filter_zero_variance=False)
    buf.start_group(2)
    buf.put(_group([0], rewards=(1.0, 1.0)))
    assert buf.ready_groups == 1


def test_state_roundtrip_marks_running_episodes_interrupted():
    buf = StalenessBuffer(batch_groups=2, max_staleness=1)
    buf.start_group(2)
    buf.start_group(2)
    buf.put(_group([0]))
    state = buf.state_dict()
    fresh = StalenessBuffer(batch_groups=2, max_staleness=1)
    fresh.load_state_dict(state)
    assert fresh.ready_groups == 1
    assert fresh.ledger.interrupted == 2 and fresh.ledger.in_flight == 2
    _ledger_adds_up(fresh)


@pytest.mark.parametrize(
    ("eta", "idle", "kl", "expect"),
    [(1, 0.5, 0.0, 2), (4, 0.5, 0.0, 4), (2, 0.0, 0.1, 1), (0, 0.0, 0.1, 0), (2, 0.05, 0.01, 2), (2, 0.5, 0.1, 1)],
)
def test_adaptive_staleness_rule(eta, idle, kl, expect):
    ad = AdaptiveStaleness(low=0, high=4, idle_max=0.1, kl_max=0.02)
    assert ad.update(eta, idle, kl) == expect
