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

The :class:`Ledger` gives every started episode exactly one fate — trained,
dropped-stale, filtered (zero-variance group or too few valid episodes), errored, or
in flight (running / waiting; at exit that is "in-flight-at-exit", and after a crash
"interrupted") — and the counts always add up to episodes started.

:class:`AdaptiveStaleness` (optional) moves η between bounds each step: up by one when
the trainer waited on data for more than ``idle_max`` of its step, down by one when the
measured mismatch KL(μ‖π_θ) exceeds ``kl_max``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.types import Group, Trajectory, new_id


class BufferStalled(RuntimeError):
    """Too many finished groups in a row were untrainable (e.g. every reward equal)."""


@dataclass
class Ledger:
    """Episode fates. ``in_flight`` = started minus every final fate."""

    started: int = 0
    trained: int = 0
    stale: int = 0
    filtered: int = 0
    errored: int = 0
    interrupted: int = 0  # in flight when an earlier process died (counted on --resume)

    @property
    def in_flight(self) -> int:
        return self.started - self.trained - self.stale - self.filtered - self.errored - self.interrupted

    def as_metrics(self) -> dict[str, int]:
        return {
            "ledger/started": self.started,
            "ledger/trained": self.trained,
            "ledger/stale": self.stale,
            "ledger/filtered": self.filtered,
            "ledger/errored": self.errored,
            "ledger/interrupted": self.interrupted,
            "ledger/in_flight": self.in_flight,
        }


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


class StalenessBuffer:
    """Scored groups waiting to be trained, with admission control and the ledger."""

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
    ) -> None:
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.filter_zero_variance = filter_zero_variance
        self.adaptive = adaptive
        self.min_valid_episodes = min_valid_episodes
        self.overprovision = overprovision
        self.stall_groups = stall_groups  # 0 = never give up waiting
        self.std_normalize = std_normalize
        self._untrainable_run = 0
        self._recent_rewards: list[float] = []
        self.version = 0
        self.ledger = Ledger()
        self._ready: list[Group] = []
        self._running_groups = 0
        self._running_episodes = 0
        self._in_training: list[Group] = []
        self._changed = asyncio.Event()
        self._fates: dict[str, list[str]] = {"stale": [], "filtered": [], "errored": []}

    # ------------------------------------------------------------------ admission

    def capacity(self) -> int:
        """Groups the rollout manager may start now (never negative)."""
        if self.oldest_trainable_version() > self.version:
            return 0  # η = 0 while a batch trains: anything sampled now is stale on arrival
        committed = len(self._in_training) + len(self._ready) + self._running_groups
        cap = (self.max_staleness + 1) * self.batch_groups + int(self.overprovision * self.batch_groups)
        return max(0, cap - committed)

    def start_group(self, n_episodes: int) -> None:
        """Reserve one group's admission slot before its episodes start."""
        self._running_groups += 1
        self._running_episodes += n_episodes
        self.ledger.started += n_episodes

    def oldest_trainable_version(self) -> int:
        """Tokens sampled by weights older than this can never be trained.

        A group still running is trained at the next take at the earliest, which happens
        at ``version + 1`` when a batch is in training.  In adaptive mode η may still rise
        by then, so the bound uses its ceiling.
        """
        eta = self.adaptive.high if self.adaptive is not None else self.max_staleness
        return self.version + (1 if self._in_training else 0) - eta

    def drop_running_group(self, n_episodes: int) -> None:
        """A running group was cancelled because it could no longer be trained: stale."""
        self._running_groups -= 1
        self._running_episodes -= n_episodes
        self.ledger.stale += n_episodes
        self._fates["stale"].extend(new_id("ep_") for _ in range(n_episodes))  # never finished: no rollout row
        self._changed.set()

    def abandon_group(self, n_episodes: int) -> None:
        """A reserved group never produced a result (cancelled at shutdown): stays in flight."""
        self._running_groups -= 1
        self._running_episodes -= n_episodes

    def put(self, group: Group) -> None:
        """A group finished and was scored: classify its episodes, queue the trainable part."""
        self._running_groups -= 1
        self._running_episodes -= len(group.trajectories)
        errored = [t for t in group.trajectories if t.errored]
        valid = [t for t in group.trajectories if not t.errored]
        self._settle("errored", errored)
        group.trajectories = valid
        group.assign_advantages(self.std_normalize)
        self._recent_rewards = ([t.reward for t in valid] + self._recent_rewards)[:256]
        if len(valid) < self.min_valid_episodes:
            self._settle("filtered", valid)
            self._untrainable_run += 1
        elif self.filter_zero_variance and len({t.reward for t in valid}) == 1:
            self._settle("filtered", valid)
            self._untrainable_run += 1
        else:
            self._ready.append(group)
            self._untrainable_run = 0
        self._changed.set()

    # ------------------------------------------------------------------ training side

    async def take(self) -> Batch:
        """Wait for ``batch_groups`` groups within the staleness bound (oldest first)."""
        t0 = time.perf_counter()
        while True:
            self._drop_stale()
            if len(self._ready) >= self.batch_groups:
                break
            if self.stall_groups and self._untrainable_run >= self.stall_groups:
                r = self._recent_rewards
                raise BufferStalled(
                    f"the last {self._untrainable_run} finished groups were all untrainable (equal rewards or "
                    f"errors; recent mean reward {sum(r) / max(1, len(r)):.3f})"
                )
            self._changed.clear()
            await self._changed.wait()
        self._ready.sort(key=lambda g: _oldest_version(g, self.version))
        groups, self._ready = self._ready[: self.batch_groups], self._ready[self.batch_groups :]
        self._in_training = groups
        self._changed.set()
        staleness = [x for g in groups for x in g.staleness(self.version)]
        return Batch(
            groups=groups, version=self.version, wait_s=time.perf_counter() - t0, staleness=staleness,
            max_staleness=self.max_staleness,
        )

    def commit_step(self, new_version: int) -> list[str]:
        """The batch in training was applied and pushed; returns its episode ids."""
        ids = [t.id for g in self._in_training for t in g.trajectories]
        self.ledger.trained += len(ids)
        self._in_training = []
        self.version = new_version
        self._changed.set()
        return ids

    def adapt(self, trainer_idle_frac: float, mismatch_kl: float) -> int:
        """Adaptive mode: move η by at most one step; returns the η now in force."""
        if self.adaptive is not None:
            self.max_staleness = self.adaptive.update(self.max_staleness, trainer_idle_frac, mismatch_kl)
        return self.max_staleness

    def drain_fates(self) -> dict[str, list[str]]:
        """Episode ids that reached a non-trained fate since the last call."""
        out, self._fates = self._fates, {"stale": [], "filtered": [], "errored": []}
        return out

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
                self._settle("stale", g.trajectories)
            else:
                keep.append(g)
        if len(keep) != len(self._ready):
            self._ready = keep
            self._changed.set()

    def _settle(self, fate: str, trajs: list[Trajectory]) -> None:
        setattr(self.ledger, fate, getattr(self.ledger, fate) + len(trajs))
        self._fates[fate].extend(t.id for t in trajs)

    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    @property
    def running_episodes(self) -> int:
        return self._running_episodes

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Ledger, version, η and the ready groups (running episodes cannot be saved)."""
        return {
            "version": self.version,
            "max_staleness": self.max_staleness,
            "ledger": asdict(self.ledger),
            "ready": [g.to_dict() for g in self._ready],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; episodes that were running when the state was saved become interrupted."""
        self.version = state["version"]
        self.max_staleness = state["max_staleness"]
        self.ledger = Ledger(**state["ledger"])
        self._ready = [Group.from_dict(g) for g in state["ready"]]
        self.ledger.interrupted += self.ledger.in_flight - sum(len(g.trajectories) for g in self._ready)
        self._running_groups = self._running_episodes = 0
        self._in_training = []


def _oldest_version(group: Group, default: int) -> int:
    oldest = group.oldest_version()
    return default if oldest is None else oldest
