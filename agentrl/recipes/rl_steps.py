"""Phase 6 of `agentrl run` around each scheduler step: what :func:`agentrl.recipes.rl.rl_loop`
calls between its numbered phases, in the order a step uses it.

    RunSteps          the hooks rl_loop calls: train, push, after_step (metrics row, held-out eval,
                      logs, checkpoint), should_stop
    Rollouts          the rollout side: one local RolloutManager, or Ray rollout workers around one
                      buffer actor (``cluster.rollout_workers``), with the buffer and sampler that answer
    FinishedEpisodes  rollouts.jsonl as episodes finish; their rewards for the next metrics row
    HeldOut           held-out evaluation on a fixed version (``[eval]``)
    check_evaluation  an evaluation's errored episodes: named beside its reward, or (every one errored by
                      no fault of the policy) a one-line stop, here and in SFT's greedy evaluations
    StepLog           one metrics row per step (the namespaced schema of :mod:`agentrl.metrics`)
    RunLogs           RUN_DIR/{metrics,ledger,rollouts,eval_rollouts}.jsonl
    checkpoint        trainer, buffer, sampler, and how far each log had been written
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.buffer import POLICY_ERRORS, Batch
from agentrl.config import Config, EvalConfig
from agentrl.errors import FIX_BY_KIND, AgentrlError
from agentrl.metrics import JSONLLogger, LiveProgress, open_metrics_logger
from agentrl.protocols import RolloutSource, SamplerState, TrainingBuffer
from agentrl.recipes.engines import Engines, Supervisor
from agentrl.rollout import RolloutManager, mean_reward
from agentrl.types import SamplingParams, Task, Trajectory

if TYPE_CHECKING:
    from agentrl.recipes.rl import RLState


@dataclass
class StepReport:
    """What :func:`~agentrl.recipes.rl.rl_loop` hands its ``on_step`` after each applied step."""

    step: int  # 0-based optimizer step just applied
    version: int  # trainer version after it (= step + 1)
    batch: Batch
    stats: dict[str, float]
    trained_ids: list[str]
    wait_s: float  # trainer idle, waiting for data
    train_s: float
    push_s: float
    step_wall_s: float  # wall time of this whole step (wait + train + push)


@dataclass
class RunSteps:
    """What the recipe does around each scheduler step: :func:`~agentrl.recipes.rl.rl_loop` calls
    :meth:`train`, :meth:`push`, :meth:`after_step` and :meth:`should_stop`."""

    cfg: Config
    run_dir: Path
    trainer: Any
    rollouts: Rollouts
    engines: Engines
    supervisor: Supervisor
    held_out: HeldOut
    steplog: StepLog
    logs: RunLogs
    live: LiveProgress
    out_of_time: bool = False
    checkpointed: int = -1  # the newest version this process checkpointed
    stepped: bool = False  # whether this process took a step

    async def train(self, batch: Batch) -> dict[str, float]:
        """2) loss, backward, optimizer step, in a worker thread (rollouts keep running)."""
        return await asyncio.to_thread(self.trainer.step, batch.groups)

    async def push(self, version: int) -> float:
        """3) live push; an evaluation in flight finishes first (it runs on one fixed version)."""
        await self.held_out.before_push()
        return await self.supervisor.push(version)

    def should_stop(self) -> bool:
        return self.out_of_time

    async def after_step(self, rep: StepReport) -> None:
        """5) metrics row, held-out eval, ledger lines, checkpoint."""
        cfg, buffer = self.cfg, self.rollouts.buffer
        self.stepped = True
        row = self.steplog.row(rep, self.rollouts.step_rewards())  # 5a) metrics
        row.update(self.rollouts.metrics())
        row["engine/restarts"] = self.supervisor.restarts
        row.update(await self.engines.metrics())
        self.out_of_time = bool(cfg.run.max_wall_s) and row["time/wall_s"] > cfg.run.max_wall_s
        final = rep.version == cfg.trainer.steps or self.out_of_time
        await self.held_out.after_step(rep.version, final)  # 5b) held-out eval (the final one waits)
        row.update(self.held_out.take_result())
        row["ledger/top_error"] = buffer.ledger.top_error()
        self.logs.drain_ledger(buffer)  # 5c) logs
        self.logs.metrics.log(row)
        self.live.update(row)
        every = cfg.trainer.checkpoint_every
        if final or (every and rep.version % every == 0):  # 5d) checkpoint
            await self._checkpoint(rep.version)

    async def end_early(self, version: int) -> None:
        """The wall budget ran out while the trainer waited for data after ``version``: that step's
        row did not know it was the last, so the final weights get their held-out eval (a row of
        its own: the step's number again, times, ledger and ``eval/*`` only) and their checkpoint here.  No step, no change: nothing to add."""
        self.live.note(waited_note(self.cfg.run.max_wall_s, version, self.rollouts.buffer.ledger))
        if not self.stepped:
            return
        if version % self.cfg.trainer.push_every:  # the engines still serve an older version: evaluate the final one
            await self.push(version)
        result = await self.held_out.close(version)
        if result:
            now = time.perf_counter()  # when the eval ended; the ledger as the run ends
            row = {"step": version - 1, "version": version, "time/wall_s": now - self.steplog.t_start,
                   "time/rl_wall_s": now - self.steplog.t_loop, **self.rollouts.buffer.ledger.as_metrics(), **result}
            self.logs.metrics.log(row)
            self.live.note(f"final weights (version {version}): eval/reward_mean {result['eval/reward_mean']:.3f}")
        if self.checkpointed != version:
            await self._checkpoint(version)

    async def _checkpoint(self, version: int) -> None:
        await checkpoint(self.run_dir, self.trainer, self.rollouts.buffer, self.rollouts.sampler, version,
                         keep=self.cfg.trainer.keep_checkpoints)  # fmt: skip
        self.checkpointed = version


@dataclass
class Rollouts:
    """The rollout side as the loop sees it: one local :class:`RolloutManager`, or
    (``cluster.rollout_workers``) Ray rollout workers around one buffer actor, with the
    buffer and sampler that answer for it."""

    manager: RolloutSource  # RolloutManager | agentrl.distributed.pool.WorkerPool
    buffer: TrainingBuffer  # StalenessBuffer | RemoteBuffer
    sampler: SamplerState  # TaskSampler | RemoteSampler
    finished: FinishedEpisodes
    pool: Any = None  # the WorkerPool, in Ray mode

    @classmethod
    def start(cls, cfg: Config, env: Any, engines: Engines, state: RLState, logs: RunLogs, start_model: Path) -> Rollouts:
        finished = FinishedEpisodes(logs.rollouts, state.buffer)
        if cfg.cluster.rollout_workers:  # the buffer and sampler move into the buffer actor
            from agentrl.distributed.pool import start_rollout_workers

            pool = start_rollout_workers(cfg, env, engines.client, state.buffer, state.sampler, start_model)
            return cls(pool, pool.buffer, pool.sampler, finished, pool)
        ro = cfg.rollout
        manager = RolloutManager(
            env, engines.client, state.buffer, state.sampler, ro.sampling(), group_size=ro.group_size,
            max_in_flight=ro.max_in_flight, episode_timeout_s=ro.episode_timeout_s, max_turns=ro.max_turns,
            on_trajectory=finished.saw, admit=engines.all_alive,
        )  # fmt: skip
        return cls(manager, state.buffer, state.sampler, finished)

    def step_rewards(self) -> list[float]:
        """Rewards of the episodes finished since the last step (the workers' arrive through the actor)."""
        if self.pool is not None:
            for record in self.pool.drain_rollouts():
                self.finished.saw_record(record)
        return self.finished.take_rewards()

    def metrics(self) -> dict[str, Any]:
        return self.pool.metrics() if self.pool is not None else {}

    @property
    def on_engines(self) -> Callable[[list[str], bool], Awaitable[None]] | None:
        """Workers in other processes follow the engines' addresses and hold admission while one is down."""
        return self.pool.set_engines if self.pool is not None else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class FinishedEpisodes:
    """Episodes finished since the last step: a line each in rollouts.jsonl as they arrive, and
    their rewards for the next metrics row."""

    def __init__(self, out: JSONLLogger, buffer: TrainingBuffer) -> None:
        self.out, self.buffer = out, buffer
        self.rewards: list[float] = []

    def saw(self, traj: Any) -> None:
        """The local RolloutManager's ``on_trajectory``."""
        if not traj.errored:
            self.rewards.append(traj.reward)
        self.out.log({"oldest_version": traj.oldest_version(), "trainer_version": self.buffer.version, **traj.to_dict()})

    def saw_record(self, record: dict[str, Any]) -> None:
        """A finished episode drained from the buffer actor (Ray rollout workers)."""
        if record["error"] is None:
            self.rewards.append(record["reward"])
        self.out.log(record)

    def take_rewards(self) -> list[float]:
        out, self.rewards = self.rewards, []
        return out


class EvaluationErrored(AgentrlError):
    """Every episode of a held-out evaluation errored by no fault of the policy: its reward would
    read 0, as if the model had not learnt yet.  Failed work, not bad input: exit 1, as a stall."""

    exit_code = 1


def _kind(t: Trajectory) -> str:
    return t.error_kind or "env"


def errored_note(trajs: Sequence[Trajectory]) -> tuple[str, str] | None:
    """``("3/10 held-out episodes errored, most in rubric: <its first message>", "rubric")``: the
    note, in the stall message's words, and the kind it names; None when none errored."""
    kinds = Counter(_kind(t) for t in trajs if t.errored)
    if not kinds:
        return None
    kind = kinds.most_common(1)[0][0]
    first = next(t.error or "" for t in trajs if t.errored and _kind(t) == kind)
    first = " ".join(first.split())[:300]  # one line: a program's stderr has newlines
    return f"{kinds.total()}/{len(trajs)} held-out episodes errored, most in {kind}: {first}", kind


def check_evaluation(trajs: Sequence[Trajectory], what: str, policy_kinds: Collection[str]) -> str | None:
    """An evaluation's errored-episode note (None: none errored).  Raises :class:`EvaluationErrored`
    when every episode errored in a kind the policy does not cause (``policy_kinds``:
    ``buffer.failure_rewards``' kinds): no reward was measured, and none will be until it is fixed."""
    errored = errored_note(trajs)
    if errored is None:
        return None
    note, kind = errored
    if all(t.errored and _kind(t) not in policy_kinds for t in trajs):
        fix = FIX_BY_KIND.get(kind, "see the episodes in `agentrl view`")
        raise EvaluationErrored(f"{what}: {note}; {fix} (no episode was scored: the model's reward cannot be measured)")
    return note


def waited_note(max_wall_s: float, step: int, ledger: Any) -> str:
    """Why the wall budget ran out while the trainer waited for a batch: errored episodes when there
    were any (a broken rubric or env looks like an unlucky run otherwise), else filtered groups."""
    counts = ledger.as_metrics()
    head = f"run.max_wall_s ({max_wall_s:g}s) ran out while the trainer waited for a batch at step {step}"
    filtered = f"{counts.get('ledger/filtered', 0):g} episodes filtered so far"
    errored = counts.get("ledger/errored", 0)
    if not errored:
        return f"{head} ({filtered}: see buffer.filter_zero_variance and the rewards in `agentrl view`)"
    kinds = {k.removeprefix("ledger/errored/"): n for k, n in counts.items() if k.startswith("ledger/errored/")}
    kind = max(kinds, key=kinds.__getitem__) if kinds else "env"
    fix = FIX_BY_KIND.get(kind, "see `agentrl view`")
    return f"{head} ({errored:g} episodes errored so far, most: {ledger.top_error()}; {fix}; {filtered})"


class HeldOut:
    """Held-out evaluation on a fixed weight version (``[eval]``): before the first step, every
    ``eval.every`` steps in the background, and on the final weights.

    A step's metrics row carries the evaluation that finished since the previous row.  The final
    step can hold two (the one that finished during it, or the warm start's on a 1-step run, and the
    final weights'): the final one is ``eval/*``, the one before it ``eval/earlier/*``.

    ``policy_kinds``: the error kinds the policy causes (``buffer.failure_rewards``); a baseline whose
    every episode errored otherwise stops the run (:func:`check_evaluation`)."""

    def __init__(self, manager: RolloutSource, tasks: list[Task], ec: EvalConfig, max_tokens: int,
                 record: Callable[[int, list[Any]], None] | None = None,
                 policy_kinds: Collection[str] = tuple(POLICY_ERRORS)):
        self.manager, self.tasks, self.every, self.record = manager, tasks, ec.every, record
        self.concurrency, self.policy_kinds = ec.concurrency, policy_kinds
        self.sampling = SamplingParams(max_tokens=max_tokens, temperature=ec.temperature)
        self.running: asyncio.Task | None = None
        self.finished: list[dict[str, Any]] = []  # results not in a metrics row yet, oldest first
        self.evaluated: set[int] = set()  # versions evaluated or being evaluated

    async def evaluate(self, version: int) -> dict[str, Any]:
        return (await self._evaluate(version))[0]

    async def _evaluate(self, version: int) -> tuple[dict[str, Any], list[Trajectory]]:
        """The metrics of one evaluation, and its episodes."""
        self.evaluated.add(version)
        t0 = time.perf_counter()
        trajs = await self.manager.evaluate(self.tasks, self.sampling, concurrency=self.concurrency)
        if self.record is not None:
            self.record(version, trajs)
        return {
            "eval/reward_mean": mean_reward(trajs),
            "eval/errored": sum(1 for t in trajs if t.errored),
            "eval/version": version,
            "eval/seconds": time.perf_counter() - t0,
        }, trajs

    async def baseline(self, version: int) -> str:
        """The weights before any step (the warm start); returns the line that reports it, naming
        errored episodes.  Raises :class:`EvaluationErrored` when every one errored by no fault of
        the policy: training on would read the broken setup as a model with nothing learnt."""
        result, trajs = await self._evaluate(version)
        self.finished.append(result)
        note = check_evaluation(trajs, "warm-start evaluation", self.policy_kinds)
        return f"warm start: eval/reward_mean {result['eval/reward_mean']:.3f}" + (f" ({note})" if note else "")

    async def before_push(self) -> None:
        """An evaluation runs on one fixed version: finish it before the weights change."""
        if self.running is not None:
            self.finished.append(await self.running)
            self.running = None

    async def after_step(self, version: int, final: bool) -> None:
        if self.every <= 0 or not (final or version % self.every == 0):
            return
        if final:  # rollouts stop after this step: evaluate the final weights right away
            await self.before_push()
            self.manager.stop()
            self.finished.append(await self.evaluate(version))
        elif self.running is None:  # one still running: no push since it started, the engines serve its weights
            self.running = asyncio.create_task(self.evaluate(version))

    async def close(self, version: int) -> dict[str, Any]:
        """The run ended after ``version`` without a final step: the evaluation still owed to a
        metrics row, and the final weights' unless one of that version ran; ``{}`` when none."""
        if self.every <= 0:
            return {}
        await self.before_push()
        if version not in self.evaluated:
            self.manager.stop()
            self.finished.append(await self.evaluate(version))
        return self.take_result() if self.finished else {}

    def take_result(self) -> dict[str, Any]:
        """The newest finished evaluation as ``eval/*``, one finished before it as ``eval/earlier/*``
        (at most two wait: the final step's two, see the class docstring)."""
        *earlier, newest = self.finished or [{}]
        self.finished = []
        row = dict(newest)
        if earlier:
            row.update({k.replace("eval/", "eval/earlier/", 1): v for k, v in earlier[-1].items()})
        return row

    def cancel(self) -> None:
        if self.running is not None:
            self.running.cancel()


@dataclass
class StepLog:
    """Per-step metrics rows (the namespaced schema of :mod:`agentrl.metrics`)."""

    manager: RolloutSource
    buffer: TrainingBuffer
    pusher: Any  # WeightPusher: the last push's stats
    t_start: float
    t_loop: float = field(default_factory=time.perf_counter)
    last_t: float = field(default_factory=time.perf_counter)
    last_tokens: int = 0

    def row(self, rep: StepReport, finished_rewards: list[float]) -> dict[str, Any]:
        """``finished_rewards``: every episode finished since the last step."""
        now, buffer, manager = time.perf_counter(), self.buffer, self.manager
        rewards = [t.reward for t in rep.batch.trajectories]
        st, stats = rep.batch.staleness, rep.stats
        row: dict[str, Any] = {
            "step": rep.step,
            "version": rep.version,
            "rollout/reward_mean": statistics.fmean(finished_rewards) if finished_rewards else None,
            "rollout/episodes": len(finished_rewards),
            "rollout/tokens_per_s": (manager.sampled_tokens - self.last_tokens) / max(now - self.last_t, 1e-9),
            "rollout/in_flight": manager.active_episodes,
            "rollout/groups_cancelled_stale": manager.groups_cancelled_stale,
            "train/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "train/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            **train_metrics(stats),
            "train/seconds": rep.train_s,
            "train/idle_frac": rep.wait_s / max(rep.step_wall_s, 1e-9),
            "buffer/staleness_mean": statistics.fmean(st) if st else 0.0,
            "buffer/staleness_max": max(st, default=0),
            "buffer/max_staleness": rep.batch.max_staleness,
            "buffer/max_staleness_next": buffer.max_staleness,
            "buffer/ready": buffer.ready_groups,
            "weights/push_s": rep.push_s,
            "weights/push_mb": self.pusher.last_stats.get("bytes", 0.0) / 2**20,
            **buffer.ledger.as_metrics(),
            "time/wall_s": now - self.t_start,
            "time/rl_wall_s": now - self.t_loop,
        }
        if buffer.adaptive is not None:
            row["buffer/adaptive_reason"] = buffer.adaptive.last_reason
        self.last_t, self.last_tokens = now, manager.sampled_tokens
        return row


def train_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """Every number the trainer reported, as ``train/<name>`` (a statistic it adds is logged without
    an edit here); ``train_tokens`` is ``train/tokens``."""
    return {f"train/{'tokens' if k == 'train_tokens' else k}": float(v) for k, v in stats.items()
            if k != "skipped" and isinstance(v, int | float)}  # a logged step was never skipped whole


class RunLogs:
    """RUN_DIR/{metrics,ledger,rollouts,eval_rollouts}.jsonl (metrics also to TensorBoard / W&B)."""

    def __init__(self, run_dir: Path, cfg: Config) -> None:
        self.rollouts, self.ledger, self.eval_rollouts = (
            JSONLLogger(run_dir / f"{name}.jsonl") for name in ("rollouts", "ledger", "eval_rollouts"))
        self.metrics = open_metrics_logger(run_dir, cfg.metrics, cfg.model_dump(mode="json"))

    def record_eval(self, version: int, trajs: list[Any]) -> None:
        """The same held-out tasks at every eval version."""
        for t in trajs:
            self.eval_rollouts.log({"eval_version": version, **t.to_dict()})

    def drain_ledger(self, buffer: TrainingBuffer) -> None:
        """One line per episode that reached its fate since the last drain."""
        for record in buffer.ledger.drain_records():
            self.ledger.log(record)

    def close(self) -> None:
        for log in (self.ledger, self.rollouts, self.eval_rollouts, self.metrics):
            log.close()


LOGS = ("metrics", "ledger", "rollouts", "eval_rollouts")  # RUN_DIR/<name>.jsonl, cut back on --resume


async def checkpoint(
    run_dir: Path, trainer: Any, buffer: TrainingBuffer, sampler: SamplerState, version: int, keep: int = 2
) -> None:
    """Trainer, buffer (with the ledger), sampler, and how far each log had been written."""
    from agentrl.trainer.checkpoint import save_checkpoint

    logs = {name: (run_dir / f"{name}.jsonl").stat().st_size for name in LOGS if (run_dir / f"{name}.jsonl").exists()}
    state = {"step": version, "buffer": buffer.state_dict(), "sampler": sampler.state_dict(), "logs": logs}
    # the sharded trainer's ranks write their own shards into the checkpoint; the others hand over one state
    # dict (a trainer actor's comes through Ray)
    trainer_state = getattr(trainer, "write_state", None) or await asyncio.to_thread(trainer.state_dict)
    await asyncio.to_thread(save_checkpoint, run_dir, version, trainer_state, state, keep)
