"""`agentrl run`: one command from config to a trained model.

Phases (top to bottom in :func:`run_training`):

1. run dir: ``RUN_DIR/config.toml`` (resolved config); refuse to overwrite a previous
   run unless ``--resume``;
2. warm start: ``run_sft`` (builds the tiny model if needed; cached by hash);
3. engine: the embedded engine in a child process on the warm-start weights (or the
   ``inference.base_url`` endpoints), a PolicyClient per endpoint and a WeightSync;
4. state: trainer, staleness buffer, task sampler — restored from the last complete
   checkpoint on ``--resume`` (metrics/ledger rows after it are discarded, the engine
   gets the checkpoint's weights and version);
5. the async loop (:func:`agentrl.trainer.loop.rl_loop`): rollouts flow into the buffer,
   the trainer steps in a worker thread, weights are pushed live; per step one row in
   ``metrics.jsonl``, the fates of episodes in ``ledger.jsonl``, every finished episode
   in ``rollouts.jsonl``; held-out eval every ``eval.every`` steps (and before the first
   step, on the warm-start model); checkpoints every ``trainer.checkpoint_every`` steps;
6. finish: final eval, final checkpoint, ``RUN_DIR/final`` (HF model dir),
   ``summary.json`` with the ledger (episodes still running are in-flight-at-exit).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError


class RunDirExists(AgentrlError):
    """The run directory already holds a run and --resume was not given."""


def run_training(cfg: Any, resume: bool = False, *, progress: bool = True) -> Path:
    """Run async RL as configured; returns the run directory."""
    run_dir = cfg.run_dir
    _prepare_run_dir(run_dir, cfg, resume)
    threads = _threads(cfg)
    import torch

    torch.set_num_threads(threads)
    from agentrl.trainer.sft import run_sft

    start_model = run_sft(cfg, progress=progress)
    asyncio.run(_Run(cfg, run_dir, start_model, resume, threads, progress).main())
    return run_dir


def _threads(cfg: Any) -> int:
    if cfg.trainer.num_threads:
        return cfg.trainer.num_threads
    return max(1, (os.cpu_count() or 2) // 2)


def _prepare_run_dir(run_dir: Path, cfg: Any, resume: bool) -> None:
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise RunDirExists(
            f"{run_dir} already holds a run; pass --resume to continue it, or choose another --run.name / --run.dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())


class _Run:
    def __init__(self, cfg: Any, run_dir: Path, start_model: Path, resume: bool, threads: int, progress: bool):
        self.cfg, self.run_dir, self.start_model, self.resume = cfg, run_dir, start_model, resume
        self.threads, self.show = threads, progress
        self.engine = None
        self.eval_task: asyncio.Task | None = None
        self.pending_eval: dict[str, Any] | None = None

    async def main(self) -> None:
        try:
            await self._main()
        finally:
            if self.engine is not None:
                self.engine.stop()

    async def _main(self) -> None:
        from agentrl.buffer import AdaptiveStaleness, BufferStalled, StalenessBuffer
        from agentrl.inference.client import PolicyClient
        from agentrl.metrics import JSONLLogger, LiveProgress, truncate_jsonl
        from agentrl.plugins import load_environment
        from agentrl.rollout import RolloutManager, TaskSampler
        from agentrl.trainer.checkpoint import latest_checkpoint, load_checkpoint
        from agentrl.trainer.loop import rl_loop
        from agentrl.trainer.trainer import Trainer
        from agentrl.types import SamplingParams
        from agentrl.weights import make_weight_sync

        cfg, run_dir = self.cfg, self.run_dir
        t_start = time.perf_counter()
        self.progress = LiveProgress(cfg.trainer.steps, enabled=self.show)

        # -- environment and data
        env = load_environment(cfg.env.name, **cfg.env.args)
        train_tasks = list(env.dataset())
        eval_tasks = list(env.eval_dataset() or train_tasks)[: cfg.eval.num_tasks]

        # -- trainer, buffer, sampler (restored on --resume)
        trainer = Trainer(self.start_model, cfg.trainer, temperature=cfg.rollout.temperature, seed=cfg.run.seed)
        bc = cfg.buffer
        adaptive = AdaptiveStaleness(bc.min_staleness, bc.max_staleness_cap, bc.adaptive_idle_max, bc.adaptive_kl_max)
        buffer = StalenessBuffer(
            cfg.trainer.batch_groups, bc.max_staleness, filter_zero_variance=bc.filter_zero_variance,
            adaptive=adaptive if bc.adaptive else None, overprovision=bc.overprovision,
            stall_groups=bc.stall_groups,
        )
        sampler = TaskSampler(train_tasks, seed=cfg.run.seed)
        start_step = 0
        ckpt = latest_checkpoint(run_dir) if self.resume else None
        if ckpt is not None:
            trainer_state, state = await asyncio.to_thread(load_checkpoint, ckpt)
            trainer.load_state_dict(trainer_state)
            buffer.load_state_dict(state["buffer"])
            sampler.load_state_dict(state["sampler"])
            start_step = state["step"]
            for name in ("metrics.jsonl", "ledger.jsonl"):
                truncate_jsonl(run_dir / name, lambda r: r.get("step", -1) < start_step)
            self.progress.note(f"resumed from {ckpt} at step {start_step}")
        elif self.resume:
            self.progress.note(f"no complete checkpoint in {run_dir}; starting from step 0")
            for name in ("metrics.jsonl", "ledger.jsonl"):
                truncate_jsonl(run_dir / name, lambda r: False)

        # -- engines, clients, weight sync
        if cfg.inference.base_url:
            urls, model_name = list(cfg.inference.base_url), cfg.inference.model_name or self.start_model.name
        elif cfg.cluster.backend == "ray":  # embedded engines as Ray actors, one address each
            from agentrl.distributed.ray_backend import start_inference_actors

            self.progress.note(f"starting {cfg.cluster.num_inference} inference actor(s) on Ray ...")
            self.engine = await asyncio.to_thread(
                start_inference_actors, self.start_model, num_engines=cfg.cluster.num_inference,
                ray_address=cfg.cluster.ray_address, local_only=cfg.cluster.ray_address is None,
                max_batch_size=cfg.inference.max_batch_size, max_model_len=cfg.inference.max_model_len,
                device=cfg.inference.device, served_model_name=cfg.inference.model_name,
                env={"OMP_NUM_THREADS": str(self.threads)},
            )
            urls, model_name = self.engine.base_urls, cfg.inference.model_name or self.start_model.name
        else:
            from agentrl.inference.launcher import start_embedded_engine

            self.progress.note("starting the embedded engine ...")
            self.engine = await asyncio.to_thread(
                start_embedded_engine, self.start_model, port=cfg.inference.port,
                max_batch_size=cfg.inference.max_batch_size, max_model_len=cfg.inference.max_model_len,
                device=cfg.inference.device, served_model_name=cfg.inference.model_name,
                env={"OMP_NUM_THREADS": str(self.threads)},
            )
            urls, model_name = [self.engine.base_url], self.engine.model
        on_vllm = bool(cfg.inference.base_url) and cfg.inference.engine == "vllm"
        try:
            if on_vllm:  # vLLM's native NCCL weight-transfer routes (VLLM_SERVER_DEV_MODE=1)
                from agentrl.inference.vllm import VLLMWeightSync

                wsync = VLLMWeightSync(urls)
            else:
                wsync = make_weight_sync(urls, cfg.inference.weight_transport)
        except ValueError as e:
            raise AgentrlError(f"weight sync: {e}") from None
        # Render prompts in-process with the served model's own tokenizer (no /tokenize round
        # trips: they cost more CPU than the tiny model's decode step).
        tokenizer = None
        if (self.start_model / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.start_model)
        clients = [
            PolicyClient(
                u, model_name, timeout=cfg.inference.request_timeout_s, max_retries=cfg.inference.max_retries,
                tokenizer=tokenizer,
            )
            for u in urls
        ]

        def set_client_version(version: int) -> None:
            # vLLM reports no per-token versions: clients tag tokens with the version current
            # when each request started (never newer than the truth: the bound stays a bound)
            for c in clients:
                c.default_version = version

        # A LoRA run pushes only the adapter factors to engines that merge them (the embedded
        # engine); vLLM's weight routes take whole tensors, so it gets the merged matrices.
        # (Same-host shm on a CPU is the one place merged is faster: benchmarks/weight_push.py.)
        adapter_push = trainer.lora and not on_vllm and cfg.trainer.lora_push == "adapters"

        async def push_weights(version: int) -> float:
            if adapter_push:
                tensors = await asyncio.to_thread(trainer.adapter_tensors)
                return await wsync.push(tensors, version, lora=True)
            return await wsync.push(await asyncio.to_thread(trainer.named_tensors), version)

        set_client_version(start_step)
        if start_step > 0:  # the engine starts from the warm-start weights: bring it to the checkpoint
            await push_weights(start_step)

        # -- logs
        metrics = JSONLLogger(run_dir / "metrics.jsonl")
        ledger_log = JSONLLogger(run_dir / "ledger.jsonl")
        rollouts = JSONLLogger(run_dir / "rollouts.jsonl")

        finished_rewards: list[float] = []  # every finished episode since the last step (unfiltered)

        def on_trajectory(t) -> None:
            if not t.errored:
                finished_rewards.append(t.reward)
            rollouts.log({"version_min": t.min_version(), "trainer_version": buffer.version, **t.to_dict()})

        ro = cfg.rollout
        sampling = SamplingParams(max_tokens=ro.max_tokens, temperature=ro.temperature, top_p=ro.top_p)
        self.eval_sampling = SamplingParams(max_tokens=ro.max_tokens, temperature=cfg.eval.temperature)
        manager = RolloutManager(
            env, clients, buffer, sampler, sampling, group_size=ro.group_size, max_in_flight=ro.max_in_flight,
            requests_per_s=ro.requests_per_s, episode_timeout_s=ro.episode_timeout_s, max_turns=ro.max_turns,
            max_retries=0,  # PolicyClient already retries transient errors on every endpoint
            on_trajectory=on_trajectory,
        )
        self.manager, self.eval_tasks = manager, eval_tasks

        # -- baseline eval on the warm-start model, before any rollout competes with it
        if cfg.eval.every > 0 and start_step == 0:
            self.progress.note(f"evaluating the warm-start model on {len(eval_tasks)} held-out tasks ...")
            self.pending_eval = await self._evaluate(0)
            self.progress.note(f"warm start: eval_reward_mean {self.pending_eval['eval_reward_mean']:.3f}")

        # -- the loop
        t_loop = time.perf_counter()
        last = {"t": t_loop, "tokens": 0}

        async def train(batch):
            return await asyncio.to_thread(trainer.step, batch.groups)

        async def push(version: int) -> float:
            if self.eval_task is not None:  # eval runs on one fixed version: finish it first
                self.pending_eval = await self.eval_task
                self.eval_task = None
            seconds = await push_weights(version)
            set_client_version(version)
            return seconds

        async def on_step(rep) -> None:
            now = time.perf_counter()
            tokens = manager.sampled_tokens
            rewards = [t.reward for t in rep.batch.trajectories]
            st = rep.batch.staleness
            row: dict[str, Any] = {
                "step": rep.step,
                "version": rep.version,
                "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
                "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                # reward_mean is over the trained (non-filtered) groups; this one over everything sampled
                "rollout_reward_mean": statistics.fmean(finished_rewards) if finished_rewards else None,
                **buffer.ledger.as_metrics(),
                "staleness_mean": statistics.fmean(st) if st else 0.0,
                "staleness_max": max(st, default=0),
                "max_staleness": rep.batch.max_staleness,  # the bound this step's batch obeyed
                "max_staleness_next": buffer.max_staleness,  # adaptive mode may have moved it since
                **{k: rep.stats.get(k, 0.0) for k in
                   ("mismatch_kl", "masked_frac", "ess", "clip_frac", "grad_norm", "entropy", "loss", "lr")},
                "tokens_per_s": (tokens - last["tokens"]) / max(now - last["t"], 1e-9),
                "trainer_idle_frac": rep.wait_s / max(rep.step_wall_s, 1e-9),
                "train_s": rep.train_s,
                "weight_push_s": rep.push_s,
                "weight_push_mb": getattr(wsync, "last_stats", {}).get("bytes", 0.0) / 2**20,
                "buffer_ready": buffer.ready_groups,
                "rollouts_in_flight": manager.active_episodes,
                "groups_cancelled_stale": manager.groups_cancelled_stale,  # stopped mid-run: untrainable
                "wall_s": now - t_start,
                "rl_wall_s": now - t_loop,
            }
            if buffer.adaptive is not None:
                row["adaptive_reason"] = buffer.adaptive.last_reason
            last.update(t=now, tokens=tokens)
            finished_rewards.clear()
            out_of_time = bool(cfg.run.max_wall_s) and now - t_start > cfg.run.max_wall_s
            final = rep.version == cfg.trainer.steps or out_of_time
            self.stop_requested = out_of_time
            if cfg.eval.every > 0 and (final or rep.version % cfg.eval.every == 0):
                if final:  # rollouts stop after this step: evaluate the final weights right away
                    manager.stop()
                    self.pending_eval = await self._evaluate(rep.version)
                else:
                    self.eval_task = asyncio.create_task(self._evaluate(rep.version))
            if self.pending_eval is not None:
                row.update(self.pending_eval)
                self.pending_eval = None
            ledger_log.log({"step": rep.step, "trained": rep.trained_ids, **buffer.drain_fates()})
            metrics.log(row)
            self.progress.update(row)
            every = cfg.trainer.checkpoint_every
            if final or (every and rep.version % every == 0):
                await self._checkpoint(trainer, buffer, sampler, rep.version)

        self.stop_requested = False
        try:
            try:
                await rl_loop(
                    buffer, manager, start_step=start_step, steps=cfg.trainer.steps, train=train, push=push,
                    on_step=on_step, push_every=cfg.trainer.push_every,
                    should_stop=lambda: self.stop_requested,
                )
            except BufferStalled as e:
                raise AgentrlError(
                    f"training stalled at step {buffer.version}: {e}. The policy produced no learning signal: "
                    "strengthen the warm start (sft.steps / sft.target_reward) or lower trainer.lr; "
                    "checkpoints and logs so far are kept"
                ) from None
            if self.eval_task is not None:
                self.eval_task.cancel()
            # -- finish
            final_dir = run_dir / "final"
            await asyncio.to_thread(_save_final, trainer, self.start_model, final_dir)
            summary = {"steps": cfg.trainer.steps, "version": buffer.version, "ledger": buffer.ledger.as_metrics(),
                       "final_model": str(final_dir), "wall_s": time.perf_counter() - t_start}
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            lg = buffer.ledger
            self.progress.note(
                f"done: {lg.trained} episodes trained, {lg.stale} stale, {lg.filtered} filtered, "
                f"{lg.errored} errored, {lg.in_flight} in flight at exit (of {lg.started}); model: {final_dir}"
            )
        finally:
            self.progress.close()
            for log in (metrics, ledger_log, rollouts):
                log.close()
            await wsync.close()
            for c in clients:
                await c.close()

    async def _evaluate(self, version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        trajs = await self.manager.evaluate(self.eval_tasks, self.eval_sampling)
        ok = [t for t in trajs if not t.errored]
        return {
            "eval_reward_mean": sum(t.reward for t in ok) / len(trajs) if trajs else 0.0,  # errored = 0
            "eval_errored": len(trajs) - len(ok),
            "eval_version": version,
            "eval_s": time.perf_counter() - t0,
        }

    async def _checkpoint(self, trainer, buffer, sampler, version: int) -> None:
        from agentrl.trainer.checkpoint import save_checkpoint

        state = {"step": version, "buffer": buffer.state_dict(), "sampler": sampler.state_dict()}
        trainer_state = trainer.state_dict()
        await asyncio.to_thread(save_checkpoint, self.run_dir, version, trainer_state, state)


def _save_final(trainer, start_model: Path, out: Path) -> None:
    import shutil

    from transformers import AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.merged_model().save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(start_model).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
