"""The sharded trainer's ranks placed by Ray (cluster.trainer_actor with trainer.world_size = 2), on a real local Ray
cluster: CPU bundles, gloo, the tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from agentrl_cli import agentrl  # noqa: E402
from benchmark_module import load_benchmark  # noqa: E402

from agentrl.errors import TrainerDied  # noqa: E402

pytestmark = pytest.mark.slow


def _ray_ranks(model, cfg, sampling, seed=0, run_dir=None):
    from agentrl.distributed.trainer_ranks import RayRanks, RemoteShardedTrainer

    ranks = RayRanks(model, cfg, sampling, seed, cpus=0.5, gpus=0, threads=1)
    return RemoteShardedTrainer(ranks, model, cfg, run_dir, started_ray=False)


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # the test's own cluster, ended after it
    try:
        yield
    finally:
        ray.shutdown()


def test_ray_ranks_take_the_one_process_step_and_resume_from_their_shards(small_model, tmp_path, local_ray):
    # the same step as the one-process trainer (global weights over ranks, not per-rank means); a checkpoint written
    # from the rank actors' shards (no shared files) resumes into fresh rank actors at the very next step
    from agentrl.config import TrainerConfig
    from agentrl.trainer.checkpoint import SHARDED, latest_checkpoint, load_checkpoint, save_checkpoint
    from agentrl.types import SamplingParams

    parity = load_benchmark("trainer_parity")
    case = parity.run_case(small_model, "icepop", False, world=2, steps=2,
                           start=lambda cfg, sampling, seed: _ray_ranks(small_model, cfg, sampling, seed))  # fmt: skip
    assert case["max_param_moved"] > 1e-3  # the steps did train
    assert case["max_stat_diff"] < 1e-5, case
    assert case["max_param_diff"] < 2e-5, case

    batch = parity.fixed_batch(0, 512)
    cfg = TrainerConfig(device="cpu", world_size=2, lr=1e-3, warmup_steps=2, steps=4)
    first = _ray_ranks(small_model, cfg, SamplingParams(), run_dir=tmp_path)
    try:
        first.step(batch)
        ckpt = save_checkpoint(tmp_path, 1, first.write_state, {"step": 1})
        expected = first.step(batch), first.named_tensors()
    finally:
        first.close()
    shards = sorted(p.name for p in (ckpt / SHARDED).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "rank_0.pt", "rank_1.pt"], shards
    second = _ray_ranks(small_model, cfg, SamplingParams(), seed=1, run_dir=tmp_path)
    try:
        second.load_state_dict(load_checkpoint(latest_checkpoint(tmp_path))[0])
        got = second.step(batch), second.named_tensors()
    finally:
        second.close()
    assert got[0]["lr"] == expected[0]["lr"] and abs(got[0]["loss"] - expected[0]["loss"]) < 1e-7
    assert max(float((got[1][k] - v).abs().max()) for k, v in expected[1].items()) < 1e-7


def test_a_killed_rank_actor_ends_the_call_with_one_line(small_model, tmp_path, local_ray):
    # a push that reaches no engine is rank 0's WeightSyncError (the supervisor's to handle), not a lost rank: the ranks
    # step on; a rank actor killed with SIGKILL ends the next call at once, naming that rank, every rank actor gone
    from testkit import free_port

    from agentrl.config import TrainerConfig
    from agentrl.errors import WeightSyncError
    from agentrl.types import SamplingParams

    batch = load_benchmark("trainer_parity").fixed_batch(0, 512)
    cfg = TrainerConfig(device="cpu", world_size=2, collective_timeout_s=120)
    trainer = _ray_ranks(small_model, cfg, SamplingParams(), run_dir=tmp_path)
    try:
        nowhere = [f"http://127.0.0.1:{free_port()}"]
        with pytest.raises(WeightSyncError, match="reached no engine"):
            asyncio.run(trainer.push_weights(1, nowhere, [], {"transport": "http", "timeout": 5.0, "api_key": "k"}, False))
        trainer.step(batch)
        assert os.getpid() not in trainer.pids and len(set(trainer.pids)) == 2  # two actor processes
        os.kill(trainer.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TrainerDied) as e:
            trainer.step(batch)
        assert time.monotonic() - t0 < 60  # not the 120 s collective timeout: the death is seen directly
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("trainer rank 1 of 2 died") and "newest checkpoint: none yet" in msg
    finally:
        trainer.close()
    with pytest.raises(ValueError):  # every rank actor is gone
        ray.get_actor(f"agentrl-trainer-rank0-{os.getpid()}")


def test_agentrl_run_with_two_ray_placed_ranks_trains_checkpoints_and_pushes(small_model, tmp_path):
    # the real command line: the trainer as 2 rank actors, an engine actor; the run trains, every rank's shards land in
    # the driver's checkpoint, rank 0 pushes every step (the engine serves the trainer's last version)
    from agentrl.metrics import read_jsonl

    run_dir = tmp_path / "run"
    over = {
        "run.dir": run_dir, "model.path": small_model, "sft.enabled": "false", "env.name": "calc",
        "cluster.backend": "ray", "cluster.num_inference": 1, "cluster.engine_cpus": 0.25,
        "cluster.trainer_actor": "true", "cluster.trainer_cpus": 0.5, "trainer.world_size": 2,
        "rollout.group_size": 4, "rollout.max_in_flight": 8, "rollout.max_tokens": 16, "rollout.max_turns": 2,
        "trainer.batch_groups": 2, "trainer.steps": 3, "buffer.filter_zero_variance": "false",
        "eval.every": 0, "trainer.checkpoint_every": 2, "inference.max_batch_size": 8, "trainer.num_threads": 1,
    }  # fmt: skip
    r = agentrl("run", *[f"--{k}={v}" for k, v in over.items()], timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    last = rows[-1]
    assert last["ledger/trained"] == 3 * 2 * 4
    assert last["engine/0/version"] == 3 and last["weights/push_mb"] > 0  # pushed by rank 0, every step
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert ckpts, "no checkpoint"
    shards = sorted(p.name for p in (ckpts[-1] / "trainer").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"] and not (ckpts[-1] / "trainer.pt").exists()
    assert (run_dir / "final" / "model.safetensors").is_file()


def _status_bytes(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture
def exact_rss_ray():
    # every allocation over 64 KiB its own mapping, returned on free (glibc's default threshold grows, and freed
    # tensors then stay in the heap): the rank actors' resident size follows the bytes they hold
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"MALLOC_MMAP_THRESHOLD_": "65536"}})  # fmt: skip
    try:
        yield
    finally:
        ray.shutdown()


def test_rank_zero_pushes_each_bucket_as_it_is_gathered(tmp_path, exact_rss_ray):
    # rank 0 pushes to a real engine over HTTP while the ranks gather: its peak resident memory during a push (the
    # kernel's high-water mark of its process, reset just before) grows by far less than the model's size (measured:
    # 6-23 MiB for an 81 MiB model). It used to collect every bucket, then pack them into one buffer: two full
    # copies (105 MiB more on a second push, the packing buffer being kept). The engine serves the pushed version.
    from agentrl.config import TrainerConfig
    from agentrl.inference import start_embedded_engine
    from agentrl.tiny_model import build_tiny_model
    from agentrl.types import SamplingParams

    key = "arl-rank-push-test-key"
    model = build_tiny_model(tmp_path / "model", layers=8, hidden=512, heads=8, intermediate=1024)
    engine = start_embedded_engine(model, max_batch_size=2, max_model_len=64, device="cpu",
                                   env={"OMP_NUM_THREADS": "1", "AGENTRL_API_KEY": key})  # fmt: skip
    cfg = TrainerConfig(device="cpu", world_size=2, push_bucket_mb=1.0)
    trainer = _ray_ranks(model, cfg, SamplingParams(), run_dir=tmp_path)
    try:
        model_bytes = (model / "model.safetensors").stat().st_size
        assert model_bytes > 80 * 2**20, model_bytes
        rank0 = trainer.pids[0]
        args = {"transport": "http", "bucket_mb": 1.0, "timeout": 300.0, "api_key": key}
        asyncio.run(trainer.push_weights(1, [engine.base_url], [], args, False))  # what a first push sets up stays
        with open(f"/proc/{rank0}/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the current resident size
        before = _status_bytes(rank0, "VmRSS")
        asyncio.run(trainer.push_weights(2, [engine.base_url], [], args, False))
        grown = _status_bytes(rank0, "VmHWM") - before
        print(f"rank 0's peak resident size grew {grown / 2**20:.1f} MiB during a push of {model_bytes / 2**20:.1f} MiB")
        assert grown < model_bytes / 2, (grown, model_bytes, trainer.last_push)
        assert trainer.last_push["engines_ok"] == 1 and trainer.last_push["bytes"] >= model_bytes
        import httpx

        from agentrl.auth import auth_headers

        assert httpx.get(engine.root_url + "/get_weight_version", headers=auth_headers(key)).json()["weight_version"] == 2
    finally:
        trainer.close()
        engine.stop()
