"""Every Ray role at once, on a real local Ray cluster: 2 engine actors, the trainer as an actor,
2 rollout workers around one buffer actor; an engine killed mid-run, and a trainer killed mid-run."""

import os
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from agentrl.config import load_config  # noqa: E402
from agentrl.metrics import read_jsonl  # noqa: E402

pytestmark = pytest.mark.slow
FATES = ("trained", "stale", "filtered", "errored", "interrupted", "skipped")


def _config(model, run_dir, steps: int, **extra):
    over = {
        "run.dir": run_dir, "model.path": model, "sft.enabled": "false", "env.name": "calc",
        "cluster.backend": "ray", "cluster.num_inference": 2, "cluster.engine_cpus": 0.25,
        "cluster.trainer_actor": "true", "cluster.trainer_cpus": 0.5,
        "cluster.rollout_workers": 2, "cluster.worker_cpus": 0.25,
        "rollout.group_size": 4, "rollout.max_in_flight": 16, "rollout.max_tokens": 16, "rollout.max_turns": 2,
        "trainer.batch_groups": 2, "trainer.steps": steps, "buffer.filter_zero_variance": "false",
        "eval.every": 0, "trainer.checkpoint_every": 2, "inference.max_batch_size": 16, "trainer.num_threads": 1,
        **extra,
    }  # fmt: skip
    return load_config([], [f"--{k}={v}" for k, v in over.items()])


def _after_step(run_dir, n: int, timeout_s: float = 300) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"the run did not reach step {n} within {timeout_s:g}s")


def _groups():
    """One scored group with made-up μ; every trajectory carries env state that cannot be pickled."""
    from agentrl.types import Group, Message, Task, TokenSequence, Trajectory

    def traj(prompt, completion, reward):
        s = TokenSequence()
        s.extend_forced(prompt)
        s.extend_sampled(completion, [-1.0] * len(completion), [0] * len(completion))
        t = Trajectory(task=Task(prompt=[Message("user", "q")]), sequences=[s], reward=reward)
        t.state = threading.Lock()  # what an env keeps there: sandboxes, sockets
        return t

    g = Group(task=Task(prompt=[Message("user", "q")]),
              trajectories=[traj([1, 5, 6], [40, 41, 42], 1.0), traj([1, 5, 6], [50, 51, 52], 0.0),
                            traj([1, 5], [40, 41], 1.0), traj([1, 5, 6, 7], [50], 0.0)])  # fmt: skip
    g.assign_advantages()
    return [g]


def test_remote_trainer_steps_saves_and_restores_like_the_local_trainer(tmp_path, small_model):
    """RemoteTrainer against the local Trainer on the same groups.  Catches: env state shipped to
    the actor (the unpicklable lock fails the step), a step that differs from the local one, a
    checkpoint left on the trainer's device, a restore into a fresh actor that drops the weights
    or the optimizer moments (the next step diverges), a final model that is not the weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.distributed.trainer_actor import start_trainer_actor
    from agentrl.trainer.trainer import Trainer

    torch.set_num_threads(1)
    model = small_model
    cfg = load_config([], [f"--model.path={model}", "--cluster.backend=ray", "--cluster.trainer_actor=true",
                           "--cluster.trainer_cpus=0.5", "--trainer.lr=5e-3", "--trainer.loss.name=ppo"])  # fmt: skip
    local = Trainer(model, cfg.trainer, cfg.rollout.sampling(), seed=cfg.run.seed)
    ray.init(include_dashboard=False, log_to_driver=False)  # the test's: neither trainer owns it
    remote = start_trainer_actor(cfg, model, tmp_path, 1, name="agentrl-test-trainer-a")
    fresh = None
    try:
        got, want = remote.step(_groups()), local.step(_groups())
        assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6) for k in want)
        state = remote.state_dict()
        assert all(v.device.type == "cpu" for v in state["model"].values())
        for k, v in local.state_dict()["model"].items():
            torch.testing.assert_close(state["model"][k], v, rtol=1e-4, atol=1e-6)
        fresh = start_trainer_actor(cfg, model, tmp_path, 1, name="agentrl-test-trainer-b")
        fresh.load_state_dict(state)
        a, b = remote.step(_groups()), fresh.step(_groups())  # the second step uses Adam's moments
        assert a == b
        after_a, after_b = remote.state_dict()["model"], fresh.state_dict()["model"]
        assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)
        assert any(not torch.equal(after_a[k], state["model"][k]) for k in after_a)  # the step moved them
        remote.merged_model().save_pretrained(tmp_path / "final")
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict()
        assert all(torch.equal(saved[k], after_a[k]) for k in saved)
    finally:
        remote.close()
        if fresh is not None:
            fresh.close()
        ray.shutdown()


def test_trainer_actor_rollout_workers_and_a_killed_engine(tmp_path, small_model):
    """The issue's combined run.  Catches: the trainer still in the driver (no actor, or the same
    pid), weights pushed from nowhere (engines stay at version 0), workers' clients left on a
    restarted engine's old address (engine 0 serves nothing after its restart: eval is off, so
    only the workers can reach it), episodes lost across workers or at the kill (the ledger does
    not add up), the restart not counted, the run not shutting its cluster down."""
    from agentrl.distributed.ray_backend import engine_actor_name
    from agentrl.distributed.trainer_actor import trainer_actor_name
    from agentrl.recipes.rl import train

    model = small_model
    run_dir = tmp_path / "run"
    seen: dict[str, object] = {}

    def watch_then_kill_engine() -> None:
        _after_step(run_dir, 1)
        trainer = ray.get_actor(trainer_actor_name())
        seen["trainer_pid"] = ray.get(trainer.info.remote())["pid"]
        ray.kill(ray.get_actor(engine_actor_name(0)), no_restart=False)  # Ray restarts it
        seen["killed_at_step"] = len((run_dir / "metrics.jsonl").read_text().splitlines())

    killer = threading.Thread(target=watch_then_kill_engine, daemon=True)
    killer.start()
    train(_config(model, run_dir, steps=8), progress=False)
    killer.join(timeout=5)
    assert "killed_at_step" in seen, "the run ended before the engine could be killed"
    assert seen["trainer_pid"] != os.getpid()  # the optimizer ran in the trainer actor's process
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = rows[-1]
    assert [r["step"] for r in rows] == list(range(8))
    assert seen["killed_at_step"] < 8  # the kill happened mid-run
    assert last["engine/restarts"] >= 1
    assert last["ledger/trained"] == 8 * 2 * 4
    assert last["ledger/started"] == sum(last[f"ledger/{f}"] for f in FATES) + last["ledger/in_flight"]
    records = read_jsonl(run_dir / "ledger.jsonl")  # the per-episode fates, written by the buffer actor
    assert sum(1 for r in records if r["fate"] == "trained") == last["ledger/trained"]
    assert last["rollout/groups/w0"] > 0 and last["rollout/groups/w1"] > 0
    # both engines at the trainer's last version, and the restarted one served the workers
    assert last["engine/0/version"] == last["engine/1/version"] == 8
    assert last["engine/0/generated_tokens"] > 0 and last["engine/1/generated_tokens"] > 0
    assert last["weights/push_mb"] > 0  # the actor reported its push
    assert (run_dir / "final" / "model.safetensors").is_file()  # the final model came back from the actor
    assert not ray.is_initialized()


def test_trainer_actor_death_ends_the_run_with_a_checkpoint_to_resume(tmp_path, small_model):
    """Kill the trainer actor after step 3: the run ends with TrainerDied naming the newest checkpoint, and
    ``--resume`` finishes the run from there, rollout workers included.  Catches: a dead trainer
    that hangs the run or is silently restarted from the start model, a message without the
    checkpoint, a resume that cannot restore into a fresh actor or a new buffer actor (episodes
    counted twice or lost: the trained count is off)."""
    from agentrl.distributed.trainer_actor import TrainerDied, trainer_actor_name
    from agentrl.recipes.rl import train
    from agentrl.trainer.checkpoint import latest_checkpoint

    model = small_model
    run_dir = tmp_path / "run"
    cfg = _config(model, run_dir, steps=6, **{"cluster.num_inference": 1})  # with 2 rollout workers

    def kill_trainer() -> None:
        _after_step(run_dir, 3)
        ray.kill(ray.get_actor(trainer_actor_name()), no_restart=True)

    killer = threading.Thread(target=kill_trainer, daemon=True)
    killer.start()
    with pytest.raises(TrainerDied, match=r"^the trainer actor died during .*; resume from ") as died:
        train(cfg, progress=False)
    killer.join(timeout=5)
    assert not ray.is_initialized()
    done = len(read_jsonl(run_dir / "metrics.jsonl"))
    assert 3 <= done < 6  # ended at the kill, not at the last step
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and f"resume from {ckpt} " in str(died.value)  # the newest checkpoint, by name
    train(cfg, resume=True, progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))  # cut back to the checkpoint, then the rest again
    assert rows[-1]["ledger/trained"] == 6 * 2 * 4
