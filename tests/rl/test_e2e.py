"""End to end on the real engine and the real calc environment (tiny model, few steps)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import cmdline, descendants

from agentrl.config import load_config
from agentrl.metrics import read_jsonl
from agentrl.recipes.rl import train as run_training

pytestmark = pytest.mark.slow


def _overrides(model: Path, run_dir: Path, **extra) -> list[str]:
    base = {
        "run.dir": str(run_dir), "model.path": str(model), "sft.enabled": "false", "env.name": "calc",
        "rollout.group_size": "4", "rollout.max_in_flight": "16", "rollout.max_tokens": "24",
        "rollout.max_turns": "2", "trainer.batch_groups": "2", "buffer.filter_zero_variance": "false",
        "eval.every": "0", "trainer.checkpoint_every": "0", "trainer.num_threads": "1", "inference.max_batch_size": "16",
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"--{k}={v}" for k, v in base.items()]


def _trained_staleness(run_dir: Path) -> list[int]:
    """For every trained token: (trainer version that trained it) − (version that sampled it)."""
    episodes = {r["id"]: r for r in read_jsonl(run_dir / "rollouts.jsonl")}
    out = []
    for rec in read_jsonl(run_dir / "ledger.jsonl"):
        if rec["fate"] == "trained":
            for seq in episodes[rec["id"]]["sequences"]:
                out += [rec["step"] - v for v, m in zip(seq["versions"], seq["loss_mask"], strict=True) if m]
    return out


def _trained_ids(run_dir: Path) -> list[str]:
    return [r["id"] for r in read_jsonl(run_dir / "ledger.jsonl") if r["fate"] == "trained"]


def _ledger_adds_up(row: dict) -> None:
    fates = sum(row[f"ledger/{k}"] for k in ("trained", "stale", "filtered", "errored", "interrupted", "skipped", "in_flight"))
    assert fates == row["ledger/started"]
    assert row["ledger/in_flight"] >= 0


@pytest.mark.parametrize("eta", [1, 0])
def test_staleness_is_a_bound_and_the_ledger_adds_up(tiny_model, tmp_path, eta):
    run_dir = tmp_path / f"eta{eta}"
    cfg = load_config([], _overrides(tiny_model, run_dir, **{"trainer.steps": 5, "buffer.max_staleness": eta}))
    run_training(cfg, progress=False)
    staleness = _trained_staleness(run_dir)
    assert staleness, "nothing was trained"
    assert max(staleness) <= eta and min(staleness) >= 0
    if eta == 0:  # synchronous: every trained token came from the weights being trained
        assert set(staleness) == {0}
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(5))
    assert all(r["buffer/staleness_max"] <= eta for r in rows)
    assert {r["train/lr"] for r in rows} == {1e-4}  # trainer.lr unset: the tiny model's rate
    _ledger_adds_up(rows[-1])
    trained = _trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == rows[-1]["ledger/trained"] == 5 * 2 * 4
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ledger"]["ledger/trained"] == rows[-1]["ledger/trained"]
    view = subprocess.run([sys.executable, "-m", "agentrl.cli", "view", str(run_dir)], capture_output=True, text=True)
    assert view.returncode == 0 and "steps 5" in view.stdout and "trained 40" in view.stdout


def test_two_local_engines_share_the_episodes_and_follow_every_push(tiny_model, tmp_path):
    run_dir = tmp_path / "two"
    cfg = load_config([], _overrides(tiny_model, run_dir, **{"trainer.steps": 4, "cluster.num_inference": 2}))
    run_training(cfg, progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(4))
    last = rows[-1]
    assert "engine/2/requests" not in last
    for i in (0, 1):  # a second engine that was started but never sampled from, or never pushed to, fails here
        assert last[f"engine/{i}/requests"] > 0 and last[f"engine/{i}/generated_tokens"] > 0, last
        assert last[f"engine/{i}/version"] == last["version"], last
    _ledger_adds_up(last)


def test_sigkill_then_resume_continues_without_retraining(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    # enough steps that the poll below sees checkpoint 2 long before the run could finish
    # (a tiny-model step takes well under a second: with 8 steps the run sometimes ended first)
    n_steps = 40
    args = _overrides(tiny_model, run_dir, **{"trainer.steps": n_steps, "trainer.checkpoint_every": 2})
    cmd = [sys.executable, "-m", "agentrl.cli", "run", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
            if steps and max(steps) >= 2 and (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").exists():
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its engine, no chance to clean up
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    before = read_jsonl(run_dir / "metrics.jsonl")
    assert before and max(r["step"] for r in before) < n_steps - 1

    res = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(n_steps))  # continues; no step twice
    trained = _trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == n_steps * 2 * 4  # no episode trained twice
    _ledger_adds_up(rows[-1])
    # across both processes every episode id has exactly one ledger record (interrupted ones
    # included), and no rollout written after the checkpoint by the killed process survives
    records = read_jsonl(run_dir / "ledger.jsonl")
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))
    assert any(r["fate"] == "interrupted" for r in records)
    rollout_ids = [r["id"] for r in read_jsonl(run_dir / "rollouts.jsonl")]
    assert len(rollout_ids) == len(set(rollout_ids))
    fated = set(ids)
    in_flight_at_exit = rows[-1]["ledger/in_flight"]
    assert len([i for i in rollout_ids if i not in fated]) <= in_flight_at_exit

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_existing_run_dir_needs_resume(tiny_model, tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    res = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "run", *_overrides(tiny_model, run_dir)], capture_output=True, text=True
    )
    assert res.returncode == 2 and "--resume" in res.stderr and "Traceback" not in res.stderr


def test_lora_run_pushes_only_adapters(tiny_model, tmp_path):
    run_dir = tmp_path / "lora"
    cfg = load_config([], _overrides(tiny_model, run_dir, **{"trainer.steps": 3, "trainer.lora_rank": 4}))
    run_training(cfg, progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    full_mb = sum(f.stat().st_size for f in tiny_model.glob("*.safetensors")) / 2**20
    assert all(0 < r["weights/push_mb"] < full_mb / 3 for r in rows), (full_mb, [r["weights/push_mb"] for r in rows])
    staleness = _trained_staleness(run_dir)
    assert staleness and max(staleness) <= 1  # the engine kept up with the adapter pushes


def test_an_engine_killed_mid_run_is_restarted_and_the_run_completes(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    args = _overrides(tiny_model, run_dir, **{"trainer.steps": 12, "inference.max_retries": 1,
                                               "inference.request_timeout_s": 5})
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "run", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if len(read_jsonl(run_dir / "metrics.jsonl")) >= 2:
                break
            time.sleep(0.05)
        engines = [c for c in descendants(proc.pid) if "agentrl.inference.server" in cmdline(c)]
        assert len(engines) == 1, engines
        os.kill(engines[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "restarting it" in err.decode()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(12)) and rows[-1]["engine/restarts"] == 1
    _ledger_adds_up(rows[-1])
    records = read_jsonl(run_dir / "ledger.jsonl")
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))  # every episode reached one fate, once
    errored = [r for r in records if r["fate"] == "errored"]
    assert all(r["kind"] == "endpoint" for r in errored)  # the killed engine's episodes, named


def test_a_one_step_run_keeps_the_warm_start_eval_and_the_final_one(tiny_model, tmp_path):
    """On a 1-step run the final held-out eval overwrote the warm start's (version 0) before the
    step's row was written: metrics.jsonl had one eval, of version 1."""
    run_dir = tmp_path / "one"
    over = {"trainer.steps": 1, "eval.every": 1, "eval.num_tasks": 4}
    run_training(load_config([], _overrides(tiny_model, run_dir, **over)), progress=False)
    (row,) = read_jsonl(run_dir / "metrics.jsonl")
    evals = {k: v for k, v in row.items() if k.startswith("eval/")}
    assert sorted(v for k, v in evals.items() if k.endswith("/version")) == [0, 1], evals  # warm start, final
    assert (row["eval/earlier/version"], row["eval/version"]) == (0, 1), evals
    episodes = read_jsonl(run_dir / "eval_rollouts.jsonl")  # what each eval's reward was computed from
    for prefix, version in (("eval/earlier/", 0), ("eval/", 1)):
        rewards = [0.0 if e["error"] else e["reward"] for e in episodes if e["eval_version"] == version]
        assert len(rewards) == 4 and row[f"{prefix}reward_mean"] == pytest.approx(sum(rewards) / 4)
    view = subprocess.run([sys.executable, "-m", "agentrl.cli", "view", str(run_dir)], capture_output=True, text=True)
    assert view.returncode == 0 and "v0:" in view.stdout and "v1:" in view.stdout, view.stdout


def test_the_wall_budget_ends_a_run_that_never_gets_a_batch(tiny_model, tmp_path):
    """An untrained model scores 0 on every episode; with filter_zero_variance every group is
    dropped, so no step ever came and the wall budget (checked after a step) was never read: the
    run waited forever.  It must end at run.max_wall_s, say why, and settle every episode."""
    run_dir = tmp_path / "never"
    over = {"buffer.filter_zero_variance": "true", "buffer.stall_groups": 0, "run.max_wall_s": 20,
            "trainer.steps": 50}  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "agentrl.cli", "run", *_overrides(tiny_model, run_dir, **over)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout + run.stderr
    assert "run.max_wall_s (20s) ran out while the trainer waited for a batch at step 0" in out, out[-2000:]
    assert not (run_dir / "metrics.jsonl").exists() or read_jsonl(run_dir / "metrics.jsonl") == []
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    assert ledger["ledger/filtered"] > 0 and ledger["ledger/trained"] == 0 and ledger["ledger/in_flight"] == 0, ledger


FADING_ENV = """\
from agentrl.envs import SingleTurnEnv
from agentrl.rubrics import Rubric

_first: dict[str, bool] = {}


def fading(prompt) -> float:
    # the first two training tasks' groups each get one rewarded episode (variance: trainable);
    # every other group, and the held-out tasks, score 0 (filtered): then no batch ever comes
    text = str(prompt)
    if "Held out" in text or (text not in _first and len(_first) >= 2):
        return 0.0
    first = text not in _first
    _first[text] = True
    return float(first)


def load_environment():
    return SingleTurnEnv(dataset=[f"Say something #{i}" for i in range(50)],
                         eval_dataset=[f"Held out #{i}" for i in range(8)], rubric=Rubric([fading]))
"""


@pytest.mark.parametrize("push_every", [1, 3])  # 3: two steps, and the final weights (version 2) never pushed
def test_a_wall_budget_that_ends_a_wait_still_evaluates_and_checkpoints_the_final_weights(tiny_model, tmp_path, push_every):
    """A run that learns well filters more and more all-correct groups, so the wall budget often runs
    out while the trainer waits for a batch.  The last step's row did not know it was the last:
    the final weights were saved with no held-out eval of them and no checkpoint (a --resume
    retrained the steps since the previous one)."""
    env = tmp_path / "fading_env"
    env.mkdir()
    (env / "fading_env_mod.py").write_text(FADING_ENV)
    (env / "pyproject.toml").write_text('[project]\nname = "fading-env"\nversion = "0"\n'
                                        '[project.entry-points."agentrl.environments"]\nfading-env = "fading_env_mod:load_environment"\n')
    run_dir = tmp_path / "fading"
    over = {"env.name": env, "buffer.filter_zero_variance": "true", "buffer.stall_groups": 0, "run.max_wall_s": 40,
            "trainer.steps": 100, "eval.every": 1000, "eval.num_tasks": 4, "rollout.max_turns": 1,
            "trainer.push_every": push_every, "trainer.batch_groups": 1, "buffer.max_staleness": 2}  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "agentrl.cli", "run", *_overrides(tiny_model, run_dir, **over)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout + run.stderr
    version = json.loads((run_dir / "summary.json").read_text())["version"]
    assert version == 2 and f"ran out while the trainer waited for a batch at step {version}" in out, out[-2000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[0]["eval/version"] == 0  # the warm start's
    assert rows[-1]["eval/version"] == version and rows[-1]["step"] == version - 1, rows[-1]
    assert rows[-1]["time/rl_wall_s"] >= rows[-2]["time/rl_wall_s"] and rows[-1]["ledger/trained"] > 0, rows[-1]
    assert f"final weights (version {version}): eval/reward_mean" in out
    final = [e for e in read_jsonl(run_dir / "eval_rollouts.jsonl") if e["eval_version"] == version]
    served = {v for e in final for seq in e["sequences"] for v, m in zip(seq["versions"], seq["loss_mask"], strict=True) if m}
    assert len(final) == 4 and served == {version}, served  # the engines sampled the final weights, not older ones
    assert (run_dir / "checkpoints" / f"step_{version:08d}").is_dir(), sorted(os.listdir(run_dir / "checkpoints"))
    view = subprocess.run([sys.executable, "-m", "agentrl.cli", "view", str(run_dir)], capture_output=True, text=True)
    assert view.returncode == 0 and f"v{version}:" in view.stdout, view.stdout
