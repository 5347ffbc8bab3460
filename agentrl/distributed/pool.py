"""The driver's side of ``cluster.rollout_workers = N``: the RL recipe's buffer, sampler and rollout
manager, backed by the buffer actor and N rollout worker actors (:mod:`agentrl.distributed.roles`);
each implements the local class's protocol (:mod:`agentrl.protocols`).

:func:`start_rollout_workers` moves the recipe's (possibly resumed) buffer and sampler into one
buffer actor and starts the workers; it returns a :class:`WorkerPool` that ``rl_loop``,
``StepLog``, ``HeldOut`` and ``checkpoint`` use in place of the local ``RolloutManager``, with
:class:`RemoteBuffer` / :class:`RemoteSampler` in place of the local buffer and sampler:

* the trainer takes batches from the actor (``take``), commits steps there, and the per-step
  ledger check runs there against the episodes every worker reports running;
* step metrics read the actor (ledger, ready groups, η) and the workers' counters;
* finished episodes reach ``rollouts.jsonl`` through the actor (drained once per step);
* held-out evaluation runs in the driver on its own client (one fixed version, outside the ledger).

A worker actor that dies is restarted by Ray (``cluster.max_restarts``); :meth:`WorkerPool.run`
starts its loop again and the actor re-queues the dead instance's groups.  A worker that stops
for any other reason ends the run with its error.  Engines: the driver's supervisor tells the
buffer actor (:meth:`WorkerPool.set_engines`) when an engine is down (no worker gets a lease
until it is back) and where a restarted engine now serves; every worker's client follows it
at its next reply from the actor.
"""

from __future__ import annotations

import asyncio
import functools
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from agentrl.auth import key_files
from agentrl.buffer import Batch, StalenessBuffer
from agentrl.distributed.roles import buffer_actor, rollout_worker
from agentrl.rollout import TaskSampler, evaluate_tasks, worker_share
from agentrl.types import SamplingParams, Task, Trajectory

RESTART_WAIT_S = 120.0  # how long a dead worker may take to come back before the run ends


def _client(urls: list[str], model: str, tokenizer_dir: str | None, **kwargs: Any) -> Any:
    """A worker's PolicyClient; renders prompts locally when the tokenizer is on this node."""
    from agentrl.inference import PolicyClient

    tok = tokenizer_dir if tokenizer_dir and (Path(tokenizer_dir) / "tokenizer_config.json").is_file() else None
    return PolicyClient(urls, model, tokenizer=tok, **kwargs)


def _future(ref: Any) -> asyncio.Future:
    return asyncio.wrap_future(ref.future())


class RemoteLedger:
    """The buffer actor's ledger seen from the driver: counts and metrics from a fresh copy."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def check(self, held: set[str]) -> None:
        """``held``: the episodes the workers report running (the actor checks them and what it holds)."""
        ray.get(self.actor.check_ledger.remote(held))

    def drain_records(self) -> list[dict[str, Any]]:
        return ray.get(self.actor.drain_records.remote())

    def as_metrics(self) -> dict[str, Any]:
        return ray.get(self.actor.ledger.remote()).as_metrics()

    def top_error(self) -> str | None:
        return ray.get(self.actor.ledger.remote()).top_error()

    def __getattr__(self, name: str) -> Any:  # counts: trained, stale, in_flight, ...
        return getattr(ray.get(self.actor.ledger.remote()), name)


class RemoteBuffer:
    """What the recipe calls on its buffer, answered by the buffer actor."""

    def __init__(self, actor: Any) -> None:
        self.actor, self.ledger = actor, RemoteLedger(actor)

    async def take(self) -> Batch:
        return await self.actor.take.remote()

    def commit_step(self, new_version: int, skipped: dict[str, str] | None = None) -> list[str]:
        return ray.get(self.actor.commit_step.remote(new_version, skipped))

    def skip_step(self, reason: str, skipped: dict[str, str] | None = None) -> list[str]:
        return ray.get(self.actor.skip_step.remote(reason, skipped))

    def close_out(self, reason: str) -> dict[str, int]:
        return ray.get(self.actor.close_out.remote(reason))

    def adapt(self, trainer_idle_frac: float, mismatch_kl: float) -> int:
        return ray.get(self.actor.adapt.remote(trainer_idle_frac, mismatch_kl))

    def held_ids(self) -> set[str]:
        """Empty: the actor compares what it holds with the ledger itself (``ledger.check``)."""
        return set()

    def _view(self) -> dict[str, Any]:
        return ray.get(self.actor.view.remote())

    version = property(lambda self: self._view()["version"])
    max_staleness = property(lambda self: self._view()["max_staleness"])
    ready_groups = property(lambda self: self._view()["ready"])

    @property
    def adaptive(self) -> Any:
        reason = self._view()["adaptive_reason"]
        return None if reason is None else types.SimpleNamespace(last_reason=reason)

    def state_dict(self) -> dict[str, Any]:
        return ray.get(self.actor.state_dicts.remote())[0]


class RemoteSampler:
    """The one task sampler, in the buffer actor (checkpointed from there)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def state_dict(self) -> dict[str, Any]:
        return ray.get(self.actor.state_dicts.remote())[1]


class WorkerPool:
    """N rollout worker actors, used by the recipe where local mode uses one RolloutManager."""

    def __init__(self, actor: Any, workers: list[Any], env: Any, client: Any, *, episode_timeout_s: float,
                 max_turns: int | None) -> None:  # fmt: skip
        self.actor, self.workers, self.env, self.client = actor, workers, env, client
        self.buffer, self.sampler = RemoteBuffer(actor), RemoteSampler(actor)
        self.episode_timeout_s, self.max_turns = episode_timeout_s, max_turns
        self.restarts = 0
        self.counters: list[dict[str, Any]] = [{} for _ in workers]
        self._stopping = False

    # ------------------------------------------------------------------ the rollout loop

    async def run(self) -> None:
        """Run every worker until :meth:`stop`; a dead worker's loop is started again once Ray
        has restarted it; any other failure of a worker ends the run with its error."""
        runs = {_future(w.run.remote()): i for i, w in enumerate(self.workers)}
        try:
            while runs:
                done, _ = await asyncio.wait(runs, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = runs.pop(fut)
                    try:
                        self.counters[i] = fut.result()
                    except ray.exceptions.RayActorError:  # died: Ray restarts it (cluster.max_restarts)
                        if self._stopping:
                            continue
                        await self._wait_restarted(i)
                        self.restarts += 1
                        runs[_future(self.workers[i].run.remote())] = i
                        continue
                    if not self._stopping:
                        raise RuntimeError(f"rollout worker w{i} stopped unexpectedly")
        finally:
            if runs:
                self.stop()
                await asyncio.gather(*runs, return_exceptions=True)

    async def _wait_restarted(self, i: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESTART_WAIT_S
        while True:
            try:
                await self.workers[i].pid.remote()
                return
            except ray.exceptions.RayActorError as e:
                if loop.time() > deadline or not isinstance(e, ray.exceptions.ActorUnavailableError):
                    raise RuntimeError(f"rollout worker w{i} died and was not restarted: {e}") from None
                await asyncio.sleep(0.2)

    async def set_engines(self, urls: list[str], down: bool) -> None:
        """The engines' current addresses, and whether one is down (from the driver's supervisor)."""
        await self.actor.set_engines.remote(list(urls), down)

    def stop(self) -> None:
        self._stopping = True
        for w in self.workers:
            w.stop.remote()

    def running_episode_ids(self) -> set[str]:
        """Episodes every worker runs (the actor started them, the worker has not settled them);
        also refreshes the counters the step row reads.  A restarting worker reports none."""
        for i, w in enumerate(self.workers):
            try:
                self.counters[i] = ray.get(w.counters.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self.counters[i] = {**self.counters[i], "running_ids": []}
        return {e for c in self.counters for e in c.get("running_ids", ())}

    def _sum(self, key: str) -> int:
        return sum(c.get(key, 0) for c in self.counters)

    active_episodes = property(lambda self: self._sum("active"))
    sampled_tokens = property(lambda self: self._sum("sampled_tokens"))
    groups_cancelled_stale = property(lambda self: self._sum("groups_cancelled_stale"))

    def drain_rollouts(self) -> list[dict[str, Any]]:
        return ray.get(self.actor.drain_rollouts.remote())

    def metrics(self) -> dict[str, Any]:
        """``rollout/worker_restarts`` and each worker's groups delivered (``rollout/groups/wN``)."""
        stats = ray.get(self.actor.stats.remote())
        return {"rollout/worker_restarts": self.restarts,
                **{f"rollout/groups/{w}": n for w, n in sorted(stats["groups_by_worker"].items())}}  # fmt: skip

    # ------------------------------------------------------------------ held-out evaluation (driver)

    async def evaluate(self, tasks: Sequence[Task], sampling: SamplingParams, concurrency: int = 64) -> list[Trajectory]:
        return await evaluate_tasks(self.env, self.client, tasks, sampling, concurrency=concurrency,
                                    timeout_s=self.episode_timeout_s, max_turns=self.max_turns)  # fmt: skip

    def close(self) -> None:
        for a in [*self.workers, self.actor]:
            ray.kill(a, no_restart=True)


def start_rollout_workers(
    cfg: Any, env: Any, client: Any, buffer: StalenessBuffer, sampler: TaskSampler, tokenizer_dir: Path | None
) -> WorkerPool:
    """Move ``buffer`` and ``sampler`` into the buffer actor and start ``cluster.rollout_workers``
    workers, each with ``rollout.max_in_flight / N`` episodes in flight (at least one group)."""
    cc, ro, ic = cfg.cluster, cfg.rollout, cfg.inference
    n = cc.rollout_workers
    actor = buffer_actor(buffer, sampler, num_cpus=0)
    make_client = functools.partial(
        _client, list(client.base_urls), client.model, str(tokenizer_dir) if tokenizer_dir else None,
        timeout=ic.request_timeout_s, max_retries=ic.max_retries, requests_per_s=ro.requests_per_s / n,
        cache_salt=client.cache_salt, api_key=client.api_key,
    )  # fmt: skip
    share = worker_share(ro.max_in_flight, n, ro.group_size)
    workers = [
        rollout_worker(f"w{i}", actor, cfg.env.name, dict(cfg.env.args), make_client, ro.sampling(),
                       group_size=ro.group_size, max_in_flight=share, episode_timeout_s=ro.episode_timeout_s,
                       max_turns=ro.max_turns, num_cpus=cc.worker_cpus, max_restarts=cc.max_restarts,
                       key_files=tuple(str(p) for p in key_files()[0]))
        for i in range(n)
    ]  # fmt: skip
    return WorkerPool(actor, workers, env, client, episode_timeout_s=ro.episode_timeout_s, max_turns=ro.max_turns)


__all__ = ["RemoteBuffer", "RemoteLedger", "RemoteSampler", "WorkerPool", "start_rollout_workers"]
