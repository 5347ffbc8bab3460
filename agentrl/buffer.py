"""Staleness-bounded buffer between the rollout manager and the trainer.

Versions count trainer optimizer steps: the trainer at version ``v`` has applied ``v``
steps, and tokens sampled by engine weights of version ``w`` are ``v - w`` stale when
the trainer at ``v`` learns from them.  ``η = max_staleness`` bounds that lag twice:

* **admission** (AReaL/SkyRL): at most ``(η + v + 1)·B`` groups may ever be committed
  (trained + in training + ready + running), where B = groups per step.  Because each
  step trains exactly B groups this is ``(η + 1)·B − (in_training + ready + running)``.
  With η = 0 nothing new starts while a batch trains, so training is exactly
  synchronous on-policy.
  ``overprovision`` (a fraction of B, default 0) admits that many extra groups: under
  heavy-tailed generation the trainer takes the groups that finish first and the
  stragglers that outlive the bound are dropped (counted) — compute traded for trainer
  utilisation.
* **hard drop**: at take time any group whose *oldest sampled token* is more than η
  versions behind is dropped (a straggler that outlived the bound), so no trained token
  is ever more than η stale.  The rollout manager cancels a running group as soon as it
  holds such a token (:meth:`StalenessBuffer.oldest_trainable_version`), which frees its
  admission slot and its engine slots early instead of finishing doomed work.

**Errored episodes and the baseline.**  An error the policy causes (``failure_rewards``: by
default ``timeout``, ``context_length`` and ``program``: an agent program that failed after the
model replied) keeps the episode in its group as a failure: its reward
is that kind's failure reward (0 by default), so it counts in the group's mean baseline and its
sampled tokens train with its (negative) advantage.  Dropping it would baseline the group on
the survivors and reward erroring (an arm that times out half the time would look better than it
is).  Any other kind (endpoint, parse, env, tool, sandbox, rubric: infrastructure) leaves the group
with the fate ``errored``, and the baseline is the mean over the rest.  The mean baseline includes
each episode's own reward, so an advantage is (n−1)/n times the leave-one-out one: a group that
lost members to infrastructure errors weighs a little less (1/2 at n = 2, 7/8 at n = 8).

Every episode is tracked by id in the :class:`~agentrl.ledger.Ledger` from the moment its
group is admitted until it reaches one fate (trained, stale, filtered, errored, interrupted,
skipped); :meth:`StalenessBuffer.held_ids` is what the buffer itself holds, so the ledger's
live set can be checked against reality every step.  When too many finished groups in a row
were untrainable, :meth:`take` raises :class:`BufferStalled` naming what happened (errors by
kind and their first message, stale drops, or valid-but-equal rewards: only the last blames
the policy).

:class:`AdaptiveStaleness` (optional) moves η between bounds each step: up by one when
the trainer waited on data for more than ``idle_max`` of its step, down by one when the
measured mismatch KL(μ‖π_θ) exceeds ``kl_max``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import FIX_BY_KIND
from agentrl.ledger import Ledger, LedgerError
from agentrl.types import Group, Task, Trajectory

# Error kinds the policy causes, and the reward such an episode keeps in its group (buffer.failure_rewards)
POLICY_ERRORS = {"timeout": 0.0, "context_length": 0.0, "program": 0.0}


class BufferStalled(RuntimeError):
    """Too many finished groups in a row were untrainable; the message says why and what to fix."""


@dataclass
class AdaptiveStaleness:
    """Raise η when the trainer starves, lower it when the off-policy gap grows."""

    low: int = 0
    high: int = 4
    idle_max: float = 0.1
    kl_max: float = 0.02
    last_reason: str = "init"

    def update(self, eta: int, trainer_idle_frac: float, mismatch_kl: float) -> int:
        if mismatch_kl > self.kl_max and eta > self.low:
            self.last_reason = f"kl {mismatch_kl:.3g} > {self.kl_max:g}: lower"
            return eta - 1
        if trainer_idle_frac > self.idle_max and eta < self.high and mismatch_kl <= self.kl_max:
            self.last_reason = f"idle {trainer_idle_frac:.2f} > {self.idle_max:g}: raise"
            return eta + 1
        self.last_reason = "hold"
        return max(self.low, min(self.high, eta))


@dataclass
class Batch:
    """What :meth:`StalenessBuffer.take` hands the trainer."""

    groups: list[Group]
    version: int
    wait_s: float
    staleness: list[int] = field(default_factory=list)  # per trained token: version - token version
    max_staleness: int = 0  # the η this batch was admitted and drop-checked under

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


@dataclass
class _Untrainable:
    """Why recent finished groups could not be trained (for the stall message)."""

    run: int = 0  # groups in a row
    episodes: int = 0
    errored: Counter = field(default_factory=Counter)  # (kind, first reason) -> episodes
    stale: int = 0
    equal_rewards: list[float] = field(default_factory=list)

    def reset(self) -> None:
        self.run, self.episodes, self.stale = 0, 0, 0
        self.errored.clear()
        self.equal_rewards.clear()

    def message(self) -> str:
        total = max(1, self.episodes)
        if self.errored and sum(self.errored.values()) >= total / 2:
            (kind, reason), n = self.errored.most_common(1)[0]
            fix = FIX_BY_KIND.get(kind, "see rollouts.jsonl")
            return (f"the last {self.run} finished groups could not be trained: {sum(self.errored.values())}/"
                    f"{self.episodes} episodes errored, most in {kind}: {reason}; {fix}")
        if self.stale >= total / 2:
            return (f"the last {self.run} finished groups were all too stale to train ({self.stale}/{self.episodes} "
                    "episodes dropped as stale): raise buffer.max_staleness or lower trainer.push_every")
        r = self.equal_rewards
        mean = sum(r) / max(1, len(r))
        return (f"the last {self.run} finished groups had no learning signal: every episode of each group got the "
                f"same reward (mean {mean:.3f}). The policy produced no learning signal: strengthen the warm start "
                "(sft.steps / sft.target_reward), raise rollout.temperature or lower trainer.lr")


@dataclass(eq=False)
class RunningGroup:
    """One admitted group whose episodes are running: they are live in the ledger, with no fate yet."""

    id: str
    task: Task
    episode_ids: list[str]
    owner: str = ""  # the rollout worker running it (the buffer actor's record); "" in one process
    oldest_version: int | None = None  # the oldest weight version any of its episodes sampled with
    doomed: bool = False  # cancelled: it held a token too stale to ever be trained
    runner: asyncio.Task | None = None  # the asyncio task running it, in the process that runs it
    counted: bool = True  # a rollout worker's group: False until the buffer actor acknowledged its start

    def saw(self, version: int | None) -> None:
        """An episode of the group sampled tokens down to weight version ``version``."""
        if version is not None and (self.oldest_version is None or version < self.oldest_version):
            self.oldest_version = version


class RunningGroups:
    """The one record of running groups, kept by the buffer the rollout manager admits through.

    Admission counts it, checkpoints re-queue its tasks, the ledger check holds its episodes; the
    rollout manager runs what it records (``runner``) and reads the staleness of each group from
    it.  The call that gives a group its fate (``put``, ``fail_group``, ``drop_running_group``,
    ``interrupt_group``, ``abandon_group``) ends its record, so a group is running in one place or
    in none."""

    def __init__(self) -> None:
        self._groups: dict[str, RunningGroup] = {}

    def start(self, group_id: str, task: Task, episode_ids: list[str], *, counted: bool = True) -> RunningGroup:
        if group_id in self._groups:
            raise LedgerError(f"group {group_id} started twice")
        run = self._groups[group_id] = RunningGroup(group_id, task, list(episode_ids), counted=counted)
        return run

    def end(self, group_id: str) -> RunningGroup:
        """Remove a group that reached its fate (or stops being this process's to run)."""
        run = self._groups.pop(group_id, None)
        if run is None:
            raise LedgerError(f"group {group_id} is not running (never started, or its fate was given twice)")
        return run

    def end_all(self) -> list[RunningGroup]:
        out, self._groups = list(self._groups.values()), {}
        return out

    def get(self, group_id: str) -> RunningGroup | None:
        return self._groups.get(group_id)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    def __iter__(self) -> Iterator[RunningGroup]:
        return iter(list(self._groups.values()))  # a copy: a fate given while iterating ends a record

    def __len__(self) -> int:
        return len(self._groups)

    def episode_ids(self) -> set[str]:
        return {e for run in self._groups.values() for e in run.episode_ids}


class StalenessBuffer:
    """Scored groups waiting to be trained, with admission control and the episode ledger."""

    def __init__(
        self,
        batch_groups: int,
        max_staleness: int,
        *,
        filter_zero_variance: bool = True,
        adaptive: AdaptiveStaleness | None = None,
        min_valid_episodes: int = 2,
        overprovision: float = 0.0,
        stall_groups: int = 0,
        std_normalize: bool = False,
        failure_rewards: dict[str, float] | None = None,
    ) -> None:
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.filter_zero_variance = filter_zero_variance
        self.adaptive = adaptive
        self.min_valid_episodes = min_valid_episodes
        self.overprovision = overprovision
        self.stall_groups = stall_groups  # 0 = never give up waiting
        self.std_normalize = std_normalize
        # error kinds the policy causes → the reward such an episode keeps in its group (module docstring)
        self.failure_rewards = dict(POLICY_ERRORS if failure_rewards is None else failure_rewards)
        self.version = 0
        self.ledger = Ledger()
        self._untrainable = _Untrainable()
        self.running = RunningGroups()  # admitted groups whose episodes run: the one record of them
        self._abandoned: set[str] = set()  # episodes of groups cancelled at shutdown (in flight at exit)
        self._ready: list[Group] = []
        self._in_training: list[Group] = []
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ admission

    def capacity(self) -> int:
        """Groups the rollout manager may start now (never negative)."""
        if self.oldest_trainable_version() > self.version:
            return 0  # η = 0 while a batch trains: anything sampled now is stale on arrival
        committed = len(self._in_training) + len(self._ready) + len(self.running)
        cap = (self.max_staleness + 1) * self.batch_groups + int(self.overprovision * self.batch_groups)
        return max(0, cap - committed)

    def start_group(self, group_id: str, task: Task, episode_ids: list[str]) -> RunningGroup:
        """Reserve one group's admission slot and start its episodes in the ledger; returns its record."""
        if group_id in self.running:
            raise LedgerError(f"group {group_id} started twice")
        self.ledger.start(episode_ids, group_id, task.id)
        return self.running.start(group_id, task, episode_ids)

    def oldest_trainable_version(self) -> int:
        """Tokens sampled by weights older than this can never be trained.

        A group still running is trained at the next take at the earliest, which happens
        at ``version + 1`` when a batch is in training.  In adaptive mode η may still rise
        by then, so the bound uses its ceiling.
        """
        eta = self.adaptive.high if self.adaptive is not None else self.max_staleness
        return self.version + (1 if self._in_training else 0) - eta

    def drop_running_group(self, group_id: str, reason: str) -> None:
        """A running group was cancelled because it could no longer be trained: stale."""
        ids = self.running.end(group_id).episode_ids
        self.ledger.settle(ids, "stale", step=self.version, reason=reason)
        self._untrainable.stale += len(ids)
        self._note_untrainable(len(ids))

    def fail_group(self, group_id: str, reason: str, kind: str) -> None:
        """A running group raised instead of returning episodes: all of them errored."""
        ids = self.running.end(group_id).episode_ids
        self.ledger.settle(ids, "errored", step=self.version, reason=reason, kind=kind)
        self._untrainable.errored[(kind, reason)] += len(ids)
        self._note_untrainable(len(ids))

    def interrupt_group(self, group_id: str, reason: str) -> Task:
        """A running group was lost with its runner (a rollout worker died): its episodes are
        interrupted; returns its task, to be run again."""
        run = self.running.end(group_id)
        self.ledger.settle(run.episode_ids, "interrupted", step=self.version, reason=reason)
        self._changed.set()
        return run.task

    def abandon_group(self, group_id: str) -> None:
        """A group cancelled at shutdown: its episodes stay in flight (interrupted on resume)."""
        self._abandoned.update(self.running.end(group_id).episode_ids)
        self._changed.set()

    def put(self, group: Group) -> None:
        """A group finished and was scored: errored episodes settle, then the group is filtered or queued."""
        ids = self.running.end(group.id).episode_ids
        if sorted(t.id for t in group.trajectories) != sorted(ids):
            raise LedgerError(f"group {group.id} came back with other episodes than it started with")
        n_episodes = len(group.trajectories)
        valid = []
        for t in group.trajectories:
            if t.errored:
                kind = t.error_kind or "env"
                self._untrainable.errored[(kind, t.error or "")] += 1
                if kind not in self.failure_rewards:  # infrastructure: out of the group
                    self.ledger.settle([t.id], "errored", step=self.version, reason=t.error, kind=kind)
                    continue
                t.reward = self.failure_rewards[kind]  # the policy's doing: a failure, in the baseline
                self.ledger.note_failure(kind, t.error)
            valid.append(t)
        group.trajectories = valid
        group.assign_advantages(self.std_normalize)
        if len(valid) < self.min_valid_episodes:
            self._settle_filtered(valid, f"{len(valid)} valid episodes < {self.min_valid_episodes}")
            self._note_untrainable(n_episodes)
        elif self.filter_zero_variance and len({t.reward for t in valid}) == 1:
            self._settle_filtered(valid, f"every reward was {valid[0].reward:g}")
            self._untrainable.equal_rewards.extend(t.reward for t in valid)
            self._note_untrainable(n_episodes)
        else:
            self._ready.append(group)
            self._untrainable.reset()
        self._changed.set()

    # ------------------------------------------------------------------ training side

    async def take(self) -> Batch:
        """Wait for ``batch_groups`` groups within the staleness bound (oldest first)."""
        t0 = time.perf_counter()
        while True:
            self._drop_stale()
            if len(self._ready) >= self.batch_groups:
                break
            if self.stall_groups and self._untrainable.run >= self.stall_groups:
                raise BufferStalled(self._untrainable.message())
            self._changed.clear()
            await self._changed.wait()
        self._ready.sort(key=lambda g: _oldest_version(g, self.version))
        groups, self._ready = self._ready[: self.batch_groups], self._ready[self.batch_groups :]
        self._in_training = groups
        self._changed.set()
        return Batch(
            groups=groups, version=self.version, wait_s=time.perf_counter() - t0,
            staleness=[x for g in groups for x in g.staleness(self.version)], max_staleness=self.max_staleness,
        )

    def commit_step(self, new_version: int, skipped: dict[str, str] | None = None) -> list[str]:
        """The batch in training was applied (and pushed): its episodes are trained, except those the
        trainer left out (``skipped``: episode id → reason, e.g. a non-finite μ), which are skipped."""
        self._settle_skipped(skipped)
        ids = [t.id for g in self._in_training for t in g.trajectories if t.id not in (skipped or {})]
        self.ledger.settle(ids, "trained", step=new_version - 1)
        self._in_training = []
        self.version = new_version
        self._changed.set()
        return ids

    def skip_step(self, reason: str, skipped: dict[str, str] | None = None) -> list[str]:
        """The batch's optimizer step was skipped (every update non-finite): no new version.  Episodes
        in ``skipped`` settle with their own reason, the others with ``reason``."""
        self._settle_skipped(skipped)
        ids = [t.id for g in self._in_training for t in g.trajectories if t.id not in (skipped or {})]
        self.ledger.settle(ids, "skipped", step=self.version, reason=reason)
        self._in_training = []
        self._changed.set()
        return ids

    def close_out(self, reason: str) -> dict[str, int]:
        """The run ended normally (steps or wall budget): every episode still held gets its fate —
        ready ones ``unused``, running or cancelled ones ``interrupted`` — so the ledger closes.
        Returns the count per fate."""
        ready = [t.id for g in self._ready + self._in_training for t in g.trajectories]
        running = sorted({e for run in self.running.end_all() for e in run.episode_ids} | self._abandoned)
        self.ledger.settle(ready, "unused", step=self.version, reason=f"finished, not trained: {reason}")
        self.ledger.settle(running, "interrupted", step=self.version, reason=f"still running: {reason}")
        self._ready, self._in_training, self._abandoned = [], [], set()
        self._changed.set()
        return {"unused": len(ready), "interrupted": len(running)}

    def adapt(self, trainer_idle_frac: float, mismatch_kl: float) -> int:
        """Adaptive mode: move η by at most one step; returns the η now in force."""
        if self.adaptive is not None:
            self.max_staleness = self.adaptive.update(self.max_staleness, trainer_idle_frac, mismatch_kl)
        return self.max_staleness

    def held_ids(self) -> set[str]:
        """Episodes the buffer holds: admitted groups, ready, in training, abandoned at shutdown."""
        ids = self.running.episode_ids() | self._abandoned
        return ids | {t.id for g in self._ready + self._in_training for t in g.trajectories}

    def notify(self) -> None:
        """Wake waiters (e.g. an episode slot was freed)."""
        self._changed.set()

    async def wait_change(self) -> None:
        """Block until something that affects :meth:`capacity` happened."""
        self._changed.clear()
        await self._changed.wait()

    # ------------------------------------------------------------------ internals

    def _drop_stale(self) -> None:
        keep = []
        for g in self._ready:
            oldest = g.oldest_version()
            if oldest is not None and self.version - oldest > self.max_staleness:
                self.ledger.settle([t.id for t in g.trajectories], "stale", step=self.version,
                                   reason=f"token of version {oldest} at trainer version {self.version} > η={self.max_staleness}")
                self._untrainable.stale += len(g.trajectories)
                self._note_untrainable(len(g.trajectories))
            else:
                keep.append(g)
        if len(keep) != len(self._ready):
            self._ready = keep
            self._changed.set()

    def _settle_skipped(self, skipped: dict[str, str] | None) -> None:
        for eid, why in (skipped or {}).items():
            self.ledger.settle([eid], "skipped", step=self.version, reason=why)

    def _settle_filtered(self, trajs: list[Trajectory], reason: str) -> None:
        self.ledger.settle([t.id for t in trajs], "filtered", step=self.version, reason=reason)

    def _note_untrainable(self, episodes: int) -> None:
        self._untrainable.run += 1
        self._untrainable.episodes += episodes
        self._changed.set()

    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Ledger, version, η, the ready groups, and the tasks of running groups (to re-queue)."""
        return {
            "version": self.version,
            "max_staleness": self.max_staleness,
            "ledger": self.ledger.state_dict(),
            "ready": [g.to_dict() for g in self._ready],
            "running_tasks": [run.task.to_dict() for run in self.running],
        }

    def load_state_dict(self, state: dict[str, Any]) -> list[Task]:
        """Restore; episodes not in a ready group become interrupted.  Returns the tasks of the
        groups that were running, for the task sampler to re-queue."""
        self.version = state["version"]
        self.max_staleness = state["max_staleness"]
        self.ledger.load_state_dict(state["ledger"])
        self._ready = [Group.from_dict(g) for g in state["ready"]]
        ready = {t.id for g in self._ready for t in g.trajectories}
        lost = [eid for eid in self.ledger.live if eid not in ready]
        self.ledger.settle(lost, "interrupted", step=self.version, reason="in flight when the previous process stopped")
        self.running.end_all()  # a record is this process's: none survives it
        self._abandoned, self._in_training = set(), []
        return [Task.from_dict(t) for t in state.get("running_tasks", [])]


def _oldest_version(group: Group, default: int) -> int:
    oldest = group.oldest_version()
    return default if oldest is None else oldest
