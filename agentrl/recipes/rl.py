"""`agentrl run`: async RL from a config to a trained model, in numbered phases.

    1. run dir      RUN_DIR/config.toml; refuse to overwrite a run unless --resume
    2. warm start   the SFT recipe (builds the tiny model if asked; cached)
    3. env          load_environment(env.name, **env.args): training and held-out tasks
    4. engines      start the embedded engine(s) on the warm start, or connect to base_url;
                    one PolicyClient over every endpoint; the WeightSync that reaches them
    5. state        trainer, staleness buffer, task sampler; restored on --resume
    6. loop         :func:`rl_loop`: rollouts flow into the buffer while the trainer steps,
                    weights are pushed live; per step a metrics row, the ledger's fates,
                    held-out eval every eval.every steps, checkpoints
    7. finish       final eval and checkpoint, RUN_DIR/final (an HF model dir), summary.json

Where each setting acts: ``[env]`` → phase 3; ``[inference]``/``[cluster]`` → phase 4;
``[trainer]``/``[buffer]``/``[rollout]`` → phase 5 (Trainer, StalenessBuffer,
RolloutManager); ``[eval]`` → :class:`HeldOut`; ``[run]`` → phases 1 and 6.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.auth import run_key
from agentrl.buffer import AdaptiveStaleness, Batch, BufferStalled, StalenessBuffer
from agentrl.config import BufferConfig, Config, EvalConfig
from agentrl.errors import AgentrlError, RunDirExists
from agentrl.metrics import JSONLLogger, LiveProgress, open_metrics_logger
from agentrl.protocols import RolloutSource, SamplerState, TrainingBuffer
from agentrl.recipes.engines import Engines, Supervisor, WeightPusher, open_engines, preflight
from agentrl.rollout import RolloutManager, TaskSampler, mean_reward
from agentrl.types import SamplingParams, Task


def train(cfg: Config, *, resume: bool = False, progress: bool = True) -> Path:
    """Run async RL as configured; returns the run directory."""
    # 1) run dir (and the engine checks that would otherwise fail only after the warm start)
    preflight(cfg)
    run_dir = cfg.run_dir
    prepare_run_dir(run_dir, cfg, resume)
    if resume:  # at once: the engine and the trainer take a while to start
        say(resume_note(run_dir, cfg))
    threads = torch_threads(cfg)
    import torch

    torch.set_num_threads(threads)
    # 2) warm start
    from agentrl.recipes.sft import warm_start

    try:
        start_model = warm_start(cfg, progress=progress)
    except KeyboardInterrupt:
        say("interrupted during the SFT warm start: it is saved only when it finishes, so the next run "
            "starts it again (no RL step had run)")
        raise
    # 3-7) everything that runs inside the event loop
    try:
        asyncio.run(_run(cfg, run_dir, start_model, resume=resume, threads=threads, show=progress))
    except KeyboardInterrupt:
        say(interrupted_note(run_dir, cfg))
        raise
    return run_dir


def say(text: str) -> None:
    """A line on stderr, progress display or not (what the user must know to carry on)."""
    from rich.console import Console

    Console(stderr=True).print(text, highlight=False, soft_wrap=True)


def resume_note(run_dir: Path, cfg: Config) -> str:
    from agentrl.trainer.checkpoint import checkpoint_step, latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    where = (f"resuming {run_dir} from checkpoint step {checkpoint_step(ckpt)}" if ckpt is not None
             else f"--resume: no complete checkpoint in {run_dir}; starting from step 0")
    if cfg.run.max_wall_s:  # time/wall_s counts this process only
        where += f"; run.max_wall_s ({cfg.run.max_wall_s:g}s) starts again now"
    return where


def interrupted_note(run_dir: Path, cfg: Config) -> str:
    """What an interrupted run kept, and how to continue it."""
    from agentrl.trainer.checkpoint import checkpoint_step, latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        every = cfg.trainer.checkpoint_every
        return (f"interrupted before the first checkpoint (trainer.checkpoint_every = {every}): "
                "--resume would start again from step 0")
    return (f"interrupted: the last complete checkpoint is step {checkpoint_step(ckpt)} ({ckpt}); run the same "
            "command with --resume to continue from it (steps after it are redone)")


def torch_threads(cfg: Config) -> int:
    """Torch CPU threads for the trainer and the embedded engine each: one by default.

    They run side by side and share the machine with rollouts; with two threads each,
    SmolLM2-135M ran 8x slower on a busy 2-core machine (the threads wait on each other).
    On a quiet many-core machine, ``trainer.num_threads`` buys speed."""
    return cfg.trainer.num_threads or 1


def prepare_run_dir(run_dir: Path, cfg: Config, resume: bool) -> None:
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise RunDirExists(
            f"{run_dir} already holds a run; pass --resume to continue it, or choose another --run.name / --run.dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())


async def _run(cfg: Config, run_dir: Path, start_model: Path, *, resume: bool, threads: int, show: bool) -> None:
    t_start = time.perf_counter()
    live = LiveProgress(cfg.trainer.steps, enabled=show, max_wall_s=cfg.run.max_wall_s)
    # 3) env
    from agentrl.plugins import load_environment

    env = load_environment(cfg.env.name, **cfg.env.args)
    train_tasks = list(env.dataset())
    eval_tasks = list(env.eval_dataset() or train_tasks)[: cfg.eval.num_tasks]
    # 4) engines, client, weight sync
    live.note("starting the inference engine(s) ..." if not cfg.inference.base_url else "connecting ...")
    engines = await asyncio.to_thread(open_engines, cfg, start_model, threads, run_key(run_dir))
    state: RLState | None = None
    try:
        # the endpoint serves the model, and reports μ on the basis the trainer mirrors (before any work)
        await engines.client.probe(token_path=True, training=True)
        await engines.check_key()
        probe_ids = await engines.client.tokenize(prompt="Hello")
        await engines.client.probe_sampling(cfg.rollout.sampling(), probe_ids or [0])
        # 5) state
        state = await asyncio.to_thread(build_state, cfg, start_model, train_tasks, run_dir, resume, live)
        await _train_loop(cfg, run_dir, env, eval_tasks, engines, state, live, t_start, start_model)
    finally:
        live.close()
        try:
            if state is not None and hasattr(state.trainer, "close"):  # a trainer actor (before Ray may stop)
                await asyncio.to_thread(state.trainer.close)
        finally:
            try:
                await env.close()
            finally:
                await engines.close()


# ----------------------------------------------------------------------------- 5) state


@dataclass
class RLState:
    """What a checkpoint restores: trainer, buffer, task sampler and the step to resume at."""

    trainer: Any  # agentrl.trainer.Trainer
    buffer: StalenessBuffer
    sampler: TaskSampler
    start_step: int = 0


def make_buffer(bc: BufferConfig, batch_groups: int, std_normalize: bool = False) -> StalenessBuffer:
    adaptive = AdaptiveStaleness(bc.min_staleness, bc.max_staleness_cap, bc.adaptive_idle_max, bc.adaptive_kl_max)
    return StalenessBuffer(
        batch_groups, bc.max_staleness, filter_zero_variance=bc.filter_zero_variance,
        adaptive=adaptive if bc.adaptive else None, overprovision=bc.overprovision, stall_groups=bc.stall_groups,
        std_normalize=std_normalize, failure_rewards=bc.failure_rewards,
    )


def build_state(
    cfg: Config, start_model: Path, train_tasks: list[Task], run_dir: Path, resume: bool, live: LiveProgress
) -> RLState:
    from agentrl.trainer.trainer import Trainer

    if cfg.cluster.trainer_actor:  # its own Ray actor; the same calls reach it (agentrl.distributed.trainer_actor)
        from agentrl.distributed.trainer_actor import start_trainer_actor

        live.note("starting the trainer actor ...")
        # its threads follow its own reservation, not the driver's cores
        threads = cfg.trainer.num_threads or max(1, int(cfg.cluster.trainer_cpus))
        trainer = start_trainer_actor(cfg, start_model, run_dir, threads)
    elif cfg.trainer.world_size > 1:  # N rank processes, FSDP2 (agentrl.trainer.sharded)
        from agentrl.trainer.sharded import ShardedTrainer

        live.note(f"starting {cfg.trainer.world_size} trainer ranks ...")
        trainer = ShardedTrainer(start_model, cfg.trainer, cfg.rollout.sampling(), seed=cfg.run.seed, run_dir=run_dir)
    else:
        trainer = Trainer(start_model, cfg.trainer, cfg.rollout.sampling(), seed=cfg.run.seed)
    try:
        return _restore(cfg, trainer, train_tasks, run_dir, resume, live)
    except BaseException:
        if hasattr(trainer, "close"):
            trainer.close()
        raise


def _restore(cfg: Config, trainer: Any, train_tasks: list[Task], run_dir: Path, resume: bool, live: LiveProgress) -> RLState:
    from agentrl.trainer.checkpoint import latest_checkpoint, load_checkpoint

    buffer = make_buffer(cfg.buffer, cfg.trainer.batch_groups, cfg.trainer.loss.std_normalize)
    state = RLState(trainer, buffer, TaskSampler(train_tasks, seed=cfg.run.seed))
    ckpt = latest_checkpoint(run_dir) if resume else None
    offsets: dict[str, int] = {}
    if ckpt is not None:
        trainer_state, saved = load_checkpoint(ckpt)
        trainer.load_state_dict(trainer_state)
        state.sampler.load_state_dict(saved["sampler"])
        # episodes that were running become interrupted; their tasks are handed out again first
        state.sampler.requeue(state.buffer.load_state_dict(saved["buffer"]))
        state.start_step = saved["step"]
        offsets = saved.get("logs", {})
        live.note(f"resumed from {ckpt} at step {state.start_step}")
    if resume:  # everything written after the checkpoint is redone: cut the logs back to it
        for name in LOGS:
            path = run_dir / f"{name}.jsonl"
            if path.exists():
                os.truncate(path, min(offsets.get(name, 0), path.stat().st_size))
    return state


LOGS = ("metrics", "ledger", "rollouts", "eval_rollouts")  # RUN_DIR/<name>.jsonl, cut back on --resume


# ----------------------------------------------------------------------------- 6) the loop


@dataclass
class StepReport:
    step: int  # 0-based optimizer step just applied
    version: int  # trainer version after it (= step + 1)
    batch: Batch
    stats: dict[str, float]
    trained_ids: list[str]
    wait_s: float  # trainer idle, waiting for data
    train_s: float
    push_s: float
    step_wall_s: float  # wall time of this whole step (wait + train + push)


async def rl_loop(
    buffer: TrainingBuffer,
    manager: RolloutSource,
    *,
    start_step: int,
    steps: int,
    train: Callable[[Batch], Awaitable[dict[str, float]]],
    push: Callable[[int], Awaitable[float]],
    on_step: Callable[[StepReport], Awaitable[None]] | None = None,
    push_every: int = 1,
    should_stop: Callable[[], bool] = lambda: False,
    guards: tuple[asyncio.Task, ...] = (),
) -> int:
    """The async scheduler: rollouts keep flowing while the trainer steps.

    One step (rollouts run beside it in the same event loop the whole time; training runs in
    a worker thread, so generation never waits for it)::

        batch = await buffer.take()          # 1) data: B groups within the staleness bound
        stats = await train(batch)           # 2) loss on π_θ/μ, backward, optimizer step
        push_s = await push(version + 1)     # 3) live push to every engine (every K steps)
        buffer.commit_step(version + 1)      # 4) ledger: trained; admission opens for v + 1
        check_ledger(buffer, manager)        #    the counted live set = what is really held
        await on_step(report)                # 5) metrics, eval, checkpoint

    An episode the trainer left out (a non-finite μ or advantage, or every update holding it
    non-finite: ``stats["skipped_ids"]``) gets the fate ``skipped`` with the trainer's reason; a
    step whose every optimizer update was non-finite is skipped whole: no version, no push, its
    episodes' fate is ``skipped``.

    ``guards``: background tasks the run depends on (the engine supervisor): one that ends
    while the trainer waits for data ends the loop with its exception.

    At a normal end every episode still held gets a fate: finished ones ``unused``, running
    ones ``interrupted`` (an exception leaves them live: ``--resume`` settles them).

    Runs steps ``start_step .. steps-1``; returns the number of the next step.
    """
    runner = asyncio.create_task(manager.run())
    step, skipped = start_step, 0
    try:
        while step < steps and not should_stop():
            t0 = time.perf_counter()
            take = asyncio.create_task(buffer.take())
            done, _ = await asyncio.wait({take, runner, *guards}, return_when=asyncio.FIRST_COMPLETED)
            if take not in done:  # the rollout manager or a guard died: surface its exception
                take.cancel()
                for task in done:
                    task.result()
                raise RuntimeError("rollout manager or engine supervisor stopped unexpectedly")
            batch = take.result()
            t1 = time.perf_counter()
            stats = await train(batch)
            t2 = time.perf_counter()
            left_out = stats.pop("skipped_ids", None) or {}  # episode id → why the trainer did not train it
            if stats.get("skipped"):  # every update non-finite: no version, no push; episodes skipped
                buffer.skip_step(f"optimizer step {step} skipped: every update had a non-finite gradient", left_out)
                skipped += 1
                check_ledger(buffer, manager)
                continue
            version = step + 1
            push_s = await push(version) if version % push_every == 0 or version == steps else 0.0
            trained_ids = buffer.commit_step(version, left_out)
            t3 = time.perf_counter()
            report = StepReport(step, version, batch, {**stats, "skipped_steps": float(skipped)}, trained_ids,
                                t1 - t0, t2 - t1, push_s, t3 - t0)
            buffer.adapt(report.wait_s / max(report.step_wall_s, 1e-9), stats.get("mismatch_kl", 0.0))
            check_ledger(buffer, manager)
            if on_step is not None:
                await on_step(report)
            step += 1
    finally:
        manager.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
    # a normal end (steps or the wall budget): what is still held gets its fate, the ledger closes
    buffer.close_out(f"the run ended at step {step}")
    check_ledger(buffer, manager)
    return step


def check_ledger(buffer: TrainingBuffer, manager: RolloutSource) -> None:
    """The ledger's live set must be exactly the episodes the manager and the buffer hold."""
    buffer.ledger.check(manager.running_episode_ids() | buffer.held_ids())


class HeldOut:
    """Held-out evaluation on a fixed weight version (``[eval]``): before the first step, every
    ``eval.every`` steps in the background, and on the final weights.

    A step's metrics row carries the evaluation that finished since the previous row.  The final
    step can hold two (the one that finished during it, or the warm start's on a 1-step run, and the
    final weights'): the final one is ``eval/*``, the one before it ``eval/earlier/*``."""

    def __init__(self, manager: RolloutSource, tasks: list[Task], ec: EvalConfig, max_tokens: int,
                 record: Callable[[int, list[Any]], None] | None = None):
        self.manager, self.tasks, self.every, self.record = manager, tasks, ec.every, record
        self.concurrency = ec.concurrency
        self.sampling = SamplingParams(max_tokens=max_tokens, temperature=ec.temperature)
        self.running: asyncio.Task | None = None
        self.finished: list[dict[str, Any]] = []  # results not in a metrics row yet, oldest first

    async def evaluate(self, version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        trajs = await self.manager.evaluate(self.tasks, self.sampling, concurrency=self.concurrency)
        if self.record is not None:
            self.record(version, trajs)
        return {
            "eval/reward_mean": mean_reward(trajs),
            "eval/errored": sum(1 for t in trajs if t.errored),
            "eval/version": version,
            "eval/seconds": time.perf_counter() - t0,
        }

    async def baseline(self, version: int) -> float:
        """The weights before any step (the warm start); returns the reward."""
        self.finished.append(await self.evaluate(version))
        return self.finished[-1]["eval/reward_mean"]

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


@dataclass
class RunSteps:
    """What the recipe does around each scheduler step: :func:`rl_loop` calls :meth:`train`,
    :meth:`push`, :meth:`after_step` and :meth:`should_stop`."""

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
            await checkpoint(self.run_dir, self.trainer, buffer, self.rollouts.sampler, rep.version,
                             keep=cfg.trainer.keep_checkpoints)  # fmt: skip


async def _train_loop(
    cfg: Config, run_dir: Path, env: Any, eval_tasks: list[Task], engines: Engines, state: RLState,
    live: LiveProgress, t_start: float, start_model: Path,
) -> None:
    logs = RunLogs(run_dir, cfg)
    rollouts: Rollouts | None = None
    try:
        # 6a) wiring: the rollout side (local, or Ray workers), held-out eval, weight push under the engine supervisor
        rollouts = Rollouts.start(cfg, env, engines, state, logs, start_model)
        manager, buffer = rollouts.manager, rollouts.buffer
        held_out = HeldOut(manager, eval_tasks, cfg.eval, cfg.rollout.max_tokens, record=logs.record_eval)
        pusher = WeightPusher(state.trainer, engines, lora_push=cfg.trainer.lora_push)
        supervisor = Supervisor(engines, pusher, buffer, live, on_change=rollouts.on_engines)
        # 6b) the engines serve the trainer's weights, as its version; a baseline eval before any rollout competes
        await engines.align(pusher, state.start_step)
        if cfg.eval.every > 0 and state.start_step == 0:
            live.note(f"evaluating the warm-start model on {len(eval_tasks)} held-out tasks ...")
            live.note(f"warm start: eval/reward_mean {await held_out.baseline(0):.3f}")
        steps = RunSteps(cfg, run_dir, state.trainer, rollouts, engines, supervisor, held_out,
                         StepLog(manager, buffer, pusher, t_start), logs, live)  # fmt: skip
        # 6c) the loop: data, train, push, commit, after_step (rl_loop's numbered phases)
        watcher = asyncio.create_task(supervisor.watch())
        try:
            await rl_loop(
                buffer, manager, start_step=state.start_step, steps=cfg.trainer.steps, train=steps.train,
                push=steps.push, on_step=steps.after_step, push_every=cfg.trainer.push_every,
                should_stop=steps.should_stop, guards=(watcher,),
            )  # fmt: skip
        except BufferStalled as e:
            raise TrainingStalled(
                f"training stalled at step {buffer.version}: {e} (checkpoints and logs so far are kept)"
            ) from None
        finally:
            watcher.cancel()
            logs.drain_ledger(buffer)
        held_out.cancel()
        # 7) finish
        await finish(cfg, run_dir, state.trainer, buffer, start_model, live, t_start)
    finally:
        logs.close()
        if rollouts is not None:
            rollouts.close()


class TrainingStalled(AgentrlError):
    """The buffer stalled: the message names what happened and what to change (exit 1)."""

    exit_code = 1


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


# ----------------------------------------------------------------------------- 7) finish


async def finish(
    cfg: Config, run_dir: Path, trainer: Any, buffer: TrainingBuffer, start_model: Path, live: LiveProgress,
    t_start: float,
) -> None:
    final_dir = run_dir / "final"
    await asyncio.to_thread(save_model, trainer, start_model, final_dir)
    summary = {"steps": cfg.trainer.steps, "version": buffer.version, "ledger": buffer.ledger.as_metrics(),
               "final_model": str(final_dir), "wall_s": time.perf_counter() - t_start}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    lg = buffer.ledger
    live.note(
        f"done: {lg.trained} episodes trained, {lg.stale} stale, {lg.filtered} filtered, "
        f"{lg.errored} errored, {lg.unused} finished but unused, {lg.interrupted} interrupted (of {lg.started}); "
        f"model: {final_dir}"
    )


def save_model(trainer: Any, tokenizer_dir: str | Path, out: Path) -> None:
    """The trainer's current weights as an HF model dir (written beside, then renamed)."""
    import shutil

    from transformers import AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.merged_model().save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
