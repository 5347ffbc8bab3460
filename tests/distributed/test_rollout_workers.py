"""Rollout workers on a real local Ray cluster: two RolloutManagers (one event loop each) share
one buffer actor; engines are real embedded engines as Ray actors; the trainer side (take →
commit) runs in the driver without an optimizer: after each step the engines are told the new
version (``/update_weight_version``, same weights), so the staleness bound is live."""

import asyncio
import functools
import json
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")

from agentrl.buffer import StalenessBuffer  # noqa: E402
from agentrl.distributed.ray_backend import start_inference_actors  # noqa: E402
from agentrl.distributed.roles import buffer_actor, rollout_worker  # noqa: E402
from agentrl.inference import PolicyClient  # noqa: E402
from agentrl.plugins import load_environment  # noqa: E402
from agentrl.rollout import TaskSampler  # noqa: E402
from agentrl.types import SamplingParams  # noqa: E402
from agentrl.weights.manifest import signature  # noqa: E402

pytestmark = pytest.mark.slow
G, B, STEPS = 4, 2, 6


async def _counters(worker) -> dict:
    for _ in range(600):  # a restarting actor answers once Ray has brought it back
        try:
            return await worker.counters.remote()
        except ray.exceptions.ActorUnavailableError:
            await asyncio.sleep(0.1)
    raise AssertionError("a rollout worker did not come back within 60s")


async def _running_ids(workers) -> set[str]:
    return {e for w in workers for e in (await _counters(w))["running_ids"]}


async def _reported_in(actor, n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(await actor.workers.remote()) < n:
        assert time.monotonic() < deadline, "the rollout workers did not report in"
        await asyncio.sleep(0.05)


async def _a_worker_running_a_group(actor, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        owners = sorted(set((await actor.owners.remote()).values()))
        if owners:
            return int(owners[0][1:])
        await asyncio.sleep(0.05)
    raise AssertionError("no worker ran a group")


def test_two_rollout_workers_share_one_buffer_and_a_dead_one_is_restarted(tmp_path, small_model):
    """Catches: admission not global (more groups running than (η+1)·B), a worker's groups
    missing from the ledger (check fails), a worker that never contributes (leases hoarded by
    one), a dead worker's groups lost (ledger live set ≠ held) or not re-run (no interrupted)."""
    model = small_model
    pool = start_inference_actors(model, num_engines=2, num_cpus_per_engine=0.25, max_batch_size=16, max_model_len=1024)
    try:
        env = load_environment("calc", num_train=40)
        buffer = StalenessBuffer(B, 1, filter_zero_variance=False, min_valid_episodes=1, stall_groups=40)
        actor = buffer_actor(buffer, TaskSampler(list(env.dataset()), seed=0))
        client = functools.partial(PolicyClient, pool.base_urls, model.name, api_key=pool.api_key)
        sampling = SamplingParams(max_tokens=12, temperature=1.0)
        workers = [rollout_worker(f"w{i}", actor, "calc", {"num_train": 40}, client, sampling, group_size=G,
                                  max_in_flight=16, max_turns=2, max_restarts=1) for i in range(2)]  # fmt: skip
        stats, counters, killed = asyncio.run(_drive(actor, workers, pool.base_urls, pool.api_key))
    finally:
        pool.stop()
    ledger = stats["ledger"]
    assert ledger["ledger/trained"] == STEPS * B * G  # every trained episode counted once, across workers
    assert set(stats["groups_by_worker"]) == {"w0", "w1"} and all(n > 0 for n in stats["groups_by_worker"].values())
    assert stats["worker_restarts"] == 1 and ledger["ledger/interrupted"] >= G  # the dead worker's group(s)
    assert counters[killed]["requeued"] >= 1 and counters[1 - killed]["requeued"] == 0  # the restarted one reported in
    assert stats["leased"] == 0  # stopped workers gave their unused leases back


def _tag_version(urls: list[str], version: int, key: str) -> None:
    for url in urls:
        root = url.removesuffix("/v1")
        body = {"weight_version": version, "signature": signature(key, "version", str(version))}  # pushes are signed
        req = urllib.request.Request(f"{root}/update_weight_version", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # fmt: skip
        urllib.request.urlopen(req, timeout=30).close()


async def _drive(actor, workers, urls, key):
    runs = [w.run.remote() for w in workers]
    await _reported_in(actor, len(workers))
    max_running, killed = 0, -1
    for step in range(STEPS):
        batch = await asyncio.wait_for(asyncio.wrap_future(actor.take.remote().future()), 180)
        assert len(batch.groups) == B and all(len(g.trajectories) == G for g in batch.groups)
        await asyncio.to_thread(_tag_version, urls, step + 1, key)
        await actor.commit_step.remote(step + 1)
        await actor.check_ledger.remote(await _running_ids(workers))  # raises if the counts disagree
        max_running = max(max_running, (await actor.stats.remote())["ledger"]["ledger/in_flight"] // G)
        if step == 1:  # kill a worker while it runs a group; Ray restarts it, we start its loop again
            killed = await _a_worker_running_a_group(actor)
            ray.kill(workers[killed], no_restart=False)
            with pytest.raises(ray.exceptions.RayActorError):
                await runs[killed]
            await _counters(workers[killed])  # back (restarted by Ray): start its loop again
            runs[killed] = workers[killed].run.remote()
    assert max_running <= (1 + 1) * B  # (η+1)·B committed at most, though each worker alone could run 4
    for w in workers:
        await w.stop.remote()
    counters = [await r for r in runs]
    stats = await actor.stats.remote()
    await actor.check_ledger.remote(set())  # abandoned at stop: still held, still live
    return stats, counters, killed


def test_agentrl_run_with_two_rollout_workers(tmp_path, small_model):
    """`cluster.rollout_workers = 2`: the quickstart-shaped run on 2 engine actors and 2 rollout
    worker actors around one buffer actor; the trainer in the driver takes its batches there.

    Catches: a worker that never delivers (rollout/groups/wN missing or 0, no rollouts from it),
    batches or commits that do not reach the actor (wrong trained count), a ledger that does not
    add up across workers, an engine that served nothing, the workers not shut down (Ray still up)."""
    from agentrl.config import load_config
    from agentrl.metrics import read_jsonl
    from agentrl.recipes.rl import train as run_training

    model = small_model
    run_dir = tmp_path / "run"
    over = {
        "run.dir": run_dir, "model.path": model, "sft.enabled": "false", "env.name": "calc",
        "cluster.backend": "ray", "cluster.num_inference": 2, "cluster.engine_cpus": 0.25,
        "cluster.rollout_workers": 2, "cluster.worker_cpus": 0.25,
        "rollout.group_size": 4, "rollout.max_in_flight": 16, "rollout.max_tokens": 16, "rollout.max_turns": 2,
        "trainer.batch_groups": 2, "trainer.steps": 4, "buffer.filter_zero_variance": "false",
        "eval.every": 2, "eval.num_tasks": 4, "trainer.checkpoint_every": 2, "inference.max_batch_size": 16,
        "trainer.num_threads": 1,
    }  # fmt: skip
    run_training(load_config([], [f"--{k}={v}" for k, v in over.items()]), progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = rows[-1]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert last["ledger/trained"] == 4 * 2 * 4
    fates = sum(last[f"ledger/{f}"] for f in ("trained", "stale", "filtered", "errored", "interrupted", "skipped"))
    assert last["ledger/started"] == fates + last["ledger/in_flight"]
    assert last["rollout/groups/w0"] > 0 and last["rollout/groups/w1"] > 0  # both workers delivered
    workers = {r["worker"] for r in read_jsonl(run_dir / "rollouts.jsonl")}
    assert workers == {"w0", "w1"}
    assert last["engine/0/requests"] > 0 and last["engine/1/requests"] > 0
    assert "eval/reward_mean" in last  # held-out eval ran in the driver
    records = read_jsonl(run_dir / "ledger.jsonl")
    assert sum(1 for r in records if r["fate"] == "trained") == 4 * 2 * 4  # per-episode records from the actor
    assert not ray.is_initialized()
