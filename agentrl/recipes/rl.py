"""`agentrl run`: async RL from a config to a trained model, in numbered phases.

    1. run dir      RUN_DIR/config.toml; refuse to overwrite a run unless --resume
    2. warm start   the SFT recipe (builds the tiny model if asked; cached)
    3. env          load_environment(env.name, **env.args): training and held-out tasks
    4. engines      start the embedded engine(s) on the warm start, or connect to base_url;
                    one PolicyClient over every endpoint; the WeightSync that reaches them
    5. state        trainer, staleness buffer, task sampler; restored on --resume
    6. loop         :func:`rl_loop`: rollouts flow into the buffer while the trainer steps,
                    weights are pushed live; per step a metrics row, the ledger's fates,
                    held-out eval every eval.every steps, checkpoints (what a step calls
                    around its phases: :mod:`agentrl.recipes.rl_steps`)
    7. finish       final eval and checkpoint, RUN_DIR/final (an HF model dir), summary.json

Where each setting acts: ``[env]`` → phase 3; ``[inference]``/``[cluster]`` → phase 4;
``[trainer]``/``[buffer]``/``[rollout]`` → phase 5 (Trainer, StalenessBuffer,
RolloutManager); ``[eval]`` → :class:`~agentrl.recipes.rl_steps.HeldOut`; ``[run]`` → phases 1 and 6.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.auth import run_key
from agentrl.buffer import AdaptiveStaleness, Batch, BufferStalled, StalenessBuffer
from agentrl.config import BufferConfig, Config
from agentrl.episode import settle_cleanups
from agentrl.errors import AgentrlError, CheckpointError, RunDirExists
from agentrl.metrics import LiveProgress
from agentrl.protocols import RolloutSource, TrainingBuffer
from agentrl.recipes.engines import Engines, Supervisor, WeightPusher, open_engines, preflight
from agentrl.recipes.rl_steps import LOGS, HeldOut, Rollouts, RunLogs, RunSteps, StepLog, StepReport
from agentrl.rollout import TaskSampler, admissible_groups, worker_share
from agentrl.types import Task


def train(cfg: Config, *, resume: bool = False, progress: bool = True) -> Path:
    """Run async RL as configured; returns the run directory."""
    # 1) run dir (and the engine and env-server checks that would otherwise fail only after the warm start)
    preflight(cfg)
    if (warning := served_env_room(cfg)) is not None:
        say(warning)
    run_dir = cfg.run_dir
    prepare_run_dir(run_dir, cfg, resume)
    if resume:  # at once: the engine and the trainer take a while to start
        say(resume_note(run_dir, cfg))
    threads = torch_threads(cfg)
    import torch

    torch.set_num_threads(threads)
    # 2) warm start (none trained when a checkpoint will be loaded: its weights replace the warm start's)
    from agentrl.recipes.sft import warm_start
    from agentrl.trainer.checkpoint import latest_checkpoint

    try:
        start_model = warm_start(cfg, progress=progress, resumed_from=latest_checkpoint(run_dir) if resume else None)
    except KeyboardInterrupt:
        say("interrupted during the SFT warm start: it is saved only when it finishes, so the next run "
            "starts it again (no RL step had run)")
        raise
    # 3-7) everything that runs inside the event loop
    _sigint_seen.clear()
    try:
        asyncio.run(_run(cfg, run_dir, start_model, resume=resume, threads=threads, show=progress))
    except KeyboardInterrupt:
        say(interrupted_note(run_dir, cfg))
        raise
    except Exception:
        if not _sigint_seen.is_set():
            raise
        # Ctrl-C reaches the whole process group: an engine it stopped can fail a push before the
        # cancellation arrives here. That is still the user's interrupt, not a failed run.
        say(interrupted_note(run_dir, cfg))
        raise KeyboardInterrupt from None
    finally:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return run_dir


_sigint_seen = threading.Event()
_asyncio_sigint: Any = None


def _on_sigint(signum: int, frame: Any) -> None:
    _sigint_seen.set()
    if callable(_asyncio_sigint):
        _asyncio_sigint(signum, frame)
    else:
        raise KeyboardInterrupt


def _record_sigint() -> None:
    """Put a recorder in front of asyncio's own Ctrl-C handler (which cancels the main task)."""
    global _asyncio_sigint
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not _on_sigint:
        _asyncio_sigint = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, _on_sigint)


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


def served_env_room(cfg: Config) -> str | None:
    """A served env (``env.name`` is a URL) must let this run hold its episodes open at once: the
    rollouts at their peak (admission starts whole groups) and a held-out evaluation beside them.
    Raises :class:`AgentrlError` when they cannot fit (one line naming the server flag); a warning
    when Ray rollout workers might reach it from several machines (each its own client)."""
    from agentrl.envs.remote import check_room, is_env_url

    if not is_env_url(cfg.env.name):
        return None
    ro, n, g = cfg.rollout, cfg.cluster.rollout_workers, cfg.rollout.group_size
    cap = worker_share(ro.max_in_flight, n, g) if n else ro.max_in_flight
    rollouts = max(n, 1) * g * admissible_groups(0, g, cap)  # a manager's peak: whole groups, one even above the cap
    evals = min(cfg.eval.concurrency, cfg.eval.num_tasks) if cfg.eval.every > 0 else 0
    where = f" over {n} rollout workers" if n else ""
    what = f"rollout.max_in_flight{where}: {rollouts} + eval.concurrency: {evals}"
    return check_room(cfg.env.name, rollouts + evals, what, one_client=not n)


def torch_threads(cfg: Config) -> int:
    """Torch CPU threads for the trainer and the embedded engine each: one by default.

    They run side by side and share the machine with rollouts; with two threads each,
    SmolLM2-135M ran 8x slower on a busy 2-core machine (the threads wait on each other).
    On a quiet many-core machine, ``trainer.num_threads`` buys speed."""
    return cfg.trainer.num_threads or 1


def prepare_run_dir(run_dir: Path, cfg: Config, resume: bool) -> None:
    """Phase 1: make RUN_DIR and write its config.toml; refuse (one line, before anything starts) a
    path that cannot be a directory, a run without --resume, and a --resume whose config does not
    match the run's checkpoints (:func:`check_resume`).  On --resume of a run that has a
    config.toml, it is rewritten only once the checkpoint has loaded (:func:`write_config`)."""
    if (blocker := file_in_the_way(run_dir)) is not None:
        where = f"run dir {run_dir}" if blocker == run_dir else f"run dir {run_dir}: {blocker}"
        raise AgentrlError(f"{where} is a file, not a directory; choose another --run.dir or --run.name")
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise RunDirExists(
            f"{run_dir} already holds a run; pass --resume to continue it, or choose another --run.name / --run.dir"
        )
    if resume:
        check_resume(run_dir, cfg)
    # private: checkpoints hold the weights and optimizer state, episodes the tasks, and the
    # config any secrets in env.args (a run dir made elsewhere keeps its mode; the config is 0600)
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise AgentrlError(f"cannot create the run dir {run_dir}: {e.strerror or e}; "
                           "choose another --run.dir or --run.name") from None
    if not (resume and (run_dir / "config.toml").is_file()):
        write_config(run_dir, cfg)


def file_in_the_way(path: Path) -> Path | None:
    """``path`` itself or the nearest existing folder above it, when that is not a directory."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
        if p.is_symlink():  # a dangling link: mkdir cannot make a directory there either
            return p
    return None


# what a checkpoint's tensors were made for: resuming under other values cannot load them (or would
# silently train something else); trainer.world_size has its own check where the checkpoint is read.
# model.path is compared by the model it holds (its config.json), not by its spelling: a model moved
# or staged elsewhere resumes
SHAPES_CHECKPOINT = ("model.path", "trainer.lora_rank", "trainer.lora_alpha")
NOT_THE_MODEL = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"})


def _model_config(path: Any) -> dict[str, Any] | None:
    """The config.json of the model at ``path``, less what does not change the model; None where it
    cannot be read (a model not there any more: nothing to compare)."""
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {k: v for k, v in data.items() if k not in NOT_THE_MODEL} if isinstance(data, dict) else None


def check_resume(run_dir: Path, cfg: Config) -> None:
    """--resume: the settings that shape a checkpoint must be the ones the run's config.toml records
    (before config.toml is touched); one line naming each difference."""
    import tomllib

    from agentrl.trainer.checkpoint import latest_checkpoint

    saved_path = run_dir / "config.toml"
    if not saved_path.is_file() or latest_checkpoint(run_dir) is None:
        return  # nothing to resume from: the run starts at step 0 (resume_note says so)
    try:
        saved = tomllib.loads(saved_path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return  # unreadable: the checkpoint's own load (_restore) still refuses a mismatch in one line
    new = cfg.model_dump(mode="json")
    defaults = type(cfg)().model_dump(mode="json")

    def value(data: dict[str, Any], key: str) -> Any:
        section, name = key.split(".")
        return data.get(section, {}).get(name, defaults[section][name])

    def same(key: str, old: Any, now: Any) -> bool:
        if key == "model.path":  # the same model (its config), wherever it is now; unknowable: let the load decide
            old_model, new_model = _model_config(old), _model_config(now)
            return old == now or old_model is None or new_model is None or old_model == new_model
        return old == now

    diffs = []
    for key in SHAPES_CHECKPOINT:
        if key == "trainer.lora_alpha" and not value(saved, "trainer.lora_rank"):
            continue  # no adapters were trained: alpha shaped nothing
        old, now = value(saved, key), value(new, key)
        if not same(key, old, now):
            diffs.append((key, old, now))
    if diffs:
        was = ", ".join(f"{k}={json.dumps(o)}" for k, o, _ in diffs)
        now = ", ".join(f"{k}={json.dumps(n)}" for k, _, n in diffs)
        raise AgentrlError(
            f"--resume: {run_dir}'s checkpoints were trained with {was}, this config says {now}; resume with the "
            f"run's own config ({saved_path}) or choose another --run.name"
        )


def write_config(run_dir: Path, cfg: Config) -> None:
    """RUN_DIR/config.toml, mode 0600 (it can hold secrets in env.args)."""
    fd = os.open(run_dir / "config.toml", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(cfg.to_toml())


async def _run(cfg: Config, run_dir: Path, start_model: Path, *, resume: bool, threads: int, show: bool) -> None:
    _record_sigint()
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
        if resume:  # the checkpoint loaded under this config: the run dir now describes it (prepare_run_dir)
            write_config(run_dir, cfg)
        await _train_loop(cfg, run_dir, env, eval_tasks, engines, state, live, t_start, start_model)
    finally:
        live.close()
        try:
            if state is not None and hasattr(state.trainer, "close"):  # a trainer actor (before Ray may stop)
                await asyncio.to_thread(state.trainer.close)
        finally:
            try:
                await settle_cleanups()  # a cancelled held-out eval's, or a stop's: then close the env
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
    from agentrl.trainer.trainer import TINY_PARAMS, Trainer, default_lr, param_count

    if cfg.trainer.lr is None:  # one value for every rank and actor, chosen once from the model's size
        from agentrl.trainer.checkpoint import latest_checkpoint

        n = param_count(start_model)
        lr = default_lr(n, lora=cfg.trainer.lora_rank > 0)
        kind = "the tiny kind" if n < TINY_PARAMS else "pretrained" + (", LoRA" if cfg.trainer.lora_rank else "")
        if not (resume and latest_checkpoint(run_dir) is not None):  # a resumed optimizer keeps its own rate
            live.note(f"trainer.lr unset: {lr:g} for a {n / 1e6:.3g}M-parameter model ({kind}); set --trainer.lr "
                      "to choose")  # fmt: skip
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"lr": lr})})
    if cfg.cluster.trainer_actor:  # its own Ray actor(s); the same calls reach it (agentrl.distributed.trainer_actor)
        from agentrl.distributed.trainer_actor import start_trainer_actor

        ws = cfg.trainer.world_size
        live.note(f"placing {ws} trainer rank actors ..." if ws > 1 else "starting the trainer actor ...")
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
        try:
            trainer.load_state_dict(trainer_state)
        except (RuntimeError, KeyError, ValueError) as e:  # names or shapes that are not this model's
            mismatch = isinstance(e, KeyError) or any(
                k in str(e) for k in ("Missing key", "Unexpected key", "size mismatch", "Error(s) in loading"))
            if isinstance(e, AgentrlError) or not mismatch:  # out of memory, a bug: not the config's fault
                raise
            why = next((ln.strip().rstrip(":") for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise CheckpointError(
                f"--resume: {ckpt} does not match this run's config ({why[:160]}); resume with the run's own "
                f"config ({run_dir / 'config.toml'}) or choose another --run.name"
            ) from e
        state.sampler.load_state_dict(saved["sampler"])
        # episodes that were running become interrupted; their tasks are handed out again first
        state.sampler.requeue(state.buffer.load_state_dict(saved["buffer"]))
        state.start_step = saved["step"]
        offsets = saved.get("logs", {})
        live.note(f"resumed from {ckpt} at step {state.start_step} (its optimizer and lr schedule as saved)")
    if resume:  # everything written after the checkpoint is redone: cut the logs back to it
        for name in LOGS:
            path = run_dir / f"{name}.jsonl"
            if path.exists():
                os.truncate(path, min(offsets.get(name, 0), path.stat().st_size))
    return state


# ----------------------------------------------------------------------------- 6) the loop


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
    deadline: float | None = None,
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

    ``deadline`` (a ``time.perf_counter()`` value): the wall budget also ends a wait for data,
    which can last forever (every group filtered because every episode scored the same).

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
            timeout = None if deadline is None else max(0.0, deadline - t0)
            done, _ = await asyncio.wait({take, runner, *guards}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:  # the wall budget ran out while the trainer waited for data
                take.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await take
                break
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
        held_out = HeldOut(manager, eval_tasks, cfg.eval, cfg.rollout.max_tokens, record=logs.record_eval,
                           policy_kinds=cfg.buffer.failure_rewards)
        pusher = WeightPusher(state.trainer, engines, lora_push=cfg.trainer.lora_push)
        supervisor = Supervisor(engines, pusher, buffer, live, on_change=rollouts.on_engines)
        # 6b) the engines serve the trainer's weights, as its version; a baseline eval before any rollout competes
        await engines.align(pusher, state.start_step)
        if cfg.eval.every > 0 and state.start_step == 0:
            live.note(f"evaluating the warm-start model on {len(eval_tasks)} held-out tasks ...")
            live.note(await held_out.baseline(0))  # stops the run if every episode errored by no fault of the policy
        steps = RunSteps(cfg, run_dir, state.trainer, rollouts, engines, supervisor, held_out,
                         StepLog(manager, buffer, pusher, t_start), logs, live)  # fmt: skip
        # 6c) the loop: data, train, push, commit, after_step (rl_loop's numbered phases)
        watcher = asyncio.create_task(supervisor.watch())
        deadline = t_start + cfg.run.max_wall_s if cfg.run.max_wall_s else None
        try:
            next_step = await rl_loop(
                buffer, manager, start_step=state.start_step, steps=cfg.trainer.steps, train=steps.train,
                push=steps.push, on_step=steps.after_step, push_every=cfg.trainer.push_every,
                should_stop=steps.should_stop, guards=(watcher,), deadline=deadline,
            )  # fmt: skip
            if deadline is not None and not steps.out_of_time and next_step < cfg.trainer.steps:
                await steps.end_early(next_step)  # says why: errored episodes, or groups filtered
        except BufferStalled as e:
            raise TrainingStalled(
                f"training stalled at step {buffer.version}: {e} (checkpoints and logs so far are kept)"
            ) from None
        finally:
            watcher.cancel()
            logs.drain_ledger(buffer)
        held_out.cancel()
        # 7) finish
        await finish(cfg, run_dir, state.trainer, buffer, start_model, live, t_start, steps=next_step)
    finally:
        logs.close()
        if rollouts is not None:
            rollouts.close()


class TrainingStalled(AgentrlError):
    """The buffer stalled: the message names what happened and what to change (exit 1)."""

    exit_code = 1


# ----------------------------------------------------------------------------- 7) finish


async def finish(
    cfg: Config, run_dir: Path, trainer: Any, buffer: TrainingBuffer, start_model: Path, live: LiveProgress,
    t_start: float, *, steps: int,
) -> None:
    """RUN_DIR/final and summary.json: ``steps`` is how many the run took (trainer.steps is in config.toml)."""
    final_dir = run_dir / "final"
    await asyncio.to_thread(save_model, trainer, start_model, final_dir)
    summary = {"steps": steps, "version": buffer.version, "ledger": buffer.ledger.as_metrics(),
               "top_error": buffer.ledger.top_error(), "final_model": str(final_dir),
               "wall_s": time.perf_counter() - t_start}
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
