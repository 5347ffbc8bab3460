"""The seams the RL recipe crosses, as typed protocols: each has a local implementation and one
answered by Ray actors (``cluster.rollout_workers``), and the recipe sees only the protocol.

==================  =============================================  ==============================================
protocol            local (one process)                            Ray side (agentrl.distributed.pool)
==================  =============================================  ==============================================
``LedgerView``      :class:`agentrl.ledger.Ledger`                 ``RemoteLedger`` (the buffer actor's ledger)
``TrainingBuffer``  :class:`agentrl.buffer.StalenessBuffer`        ``RemoteBuffer`` (the buffer actor)
``SamplerState``    :class:`agentrl.rollout.TaskSampler`           ``RemoteSampler`` (the sampler in that actor)
``RolloutSource``   :class:`agentrl.rollout.RolloutManager`        ``WorkerPool`` (N rollout worker actors)
``AdmissionBuffer`` :class:`agentrl.buffer.StalenessBuffer`        ``LeasedBuffer`` (in each rollout worker)
``TaskSource``      :class:`agentrl.rollout.TaskSampler`           ``LeasedBuffer`` (its leased tasks)
==================  =============================================  ==============================================

The first four are what the recipe calls (``rl_loop``, ``StepLog``, ``HeldOut``, ``checkpoint``,
``finish``); the last two are what a :class:`~agentrl.rollout.RolloutManager` calls, in the driver
or in a rollout worker (:mod:`agentrl.distributed.roles`).  tests/test_protocols.py checks that
every implementation has each member with the same parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from agentrl.buffer import Batch, RunningGroup, RunningGroups
    from agentrl.types import Group, SamplingParams, Task, Trajectory


@runtime_checkable
class LedgerView(Protocol):
    """Every episode's fate, as the recipe reads it (counts such as ``trained`` are attributes)."""

    def check(self, held: set[str]) -> None:
        """Raise LedgerError unless the live set is exactly ``held`` (plus what the holder tracks itself)."""

    def drain_records(self) -> list[dict[str, Any]]:
        """One record per episode that reached its fate since the last drain."""

    def as_metrics(self) -> dict[str, Any]: ...

    def top_error(self) -> str | None: ...


@runtime_checkable
class TrainingBuffer(Protocol):
    """Where finished groups wait for the trainer, within the staleness bound."""

    version: int  # the trainer version admission and staleness are measured against
    max_staleness: int
    ledger: Any  # a LedgerView
    adaptive: Any  # None, or something with ``last_reason``

    @property
    def ready_groups(self) -> int: ...

    async def take(self) -> Batch: ...

    def commit_step(self, new_version: int, skipped: dict[str, str] | None = None) -> list[str]: ...

    def skip_step(self, reason: str, skipped: dict[str, str] | None = None) -> list[str]: ...

    def close_out(self, reason: str) -> dict[str, int]: ...

    def adapt(self, trainer_idle_frac: float, mismatch_kl: float) -> int: ...

    def held_ids(self) -> set[str]: ...

    def state_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class SamplerState(Protocol):
    """The task sampler, as a checkpoint sees it."""

    def state_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class RolloutSource(Protocol):
    """What runs groups of episodes into the buffer until stopped, and evaluates held-out tasks."""

    active_episodes: int
    sampled_tokens: int
    groups_cancelled_stale: int

    async def run(self) -> None: ...

    def stop(self) -> None: ...

    def running_episode_ids(self) -> set[str]: ...

    async def evaluate(self, tasks: Sequence[Task], sampling: SamplingParams, concurrency: int = 64) -> list[Trajectory]: ...


@runtime_checkable
class AdmissionBuffer(Protocol):
    """The buffer as a rollout manager admits and settles groups through it.  ``running`` is the
    one record of its running groups: a call that gives a group its fate ends its record."""

    running: RunningGroups

    def capacity(self) -> int: ...

    def oldest_trainable_version(self) -> int: ...

    def start_group(self, group_id: str, task: Task, episode_ids: list[str]) -> RunningGroup: ...

    def put(self, group: Group) -> None: ...

    def fail_group(self, group_id: str, reason: str, kind: str) -> None: ...

    def drop_running_group(self, group_id: str, reason: str) -> None: ...

    def abandon_group(self, group_id: str) -> None: ...

    def notify(self) -> None: ...

    async def wait_change(self) -> None: ...


@runtime_checkable
class TaskSource(Protocol):
    """Where a rollout manager draws the task of its next group."""

    def next(self) -> Task: ...


__all__ = ["AdmissionBuffer", "LedgerView", "RolloutSource", "SamplerState", "TaskSource", "TrainingBuffer"]
