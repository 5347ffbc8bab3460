"""examples/harness: a plain OpenAI-SDK calc agent trained unchanged (HarnessEnv), both forms;
and ``agentrl run`` on it end to end (eval, RL steps, the ledger, the viewer)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agentrl_cli import agentrl

from agentrl.envs import ScriptedClient
from agentrl.metrics import read_jsonl
from agentrl.plugins import load_environment
from agentrl.types import SamplingParams

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "harness"


def solver(prompt: str) -> str:
    """Calls the calculator on the question, then answers with its result."""
    if "<|im_start|>tool\n" in prompt:
        return "It is " + prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    a, op, b = re.findall(r"What is (\d+)([-+*])(\d+)\?", prompt)[-1]
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}})}\n</tool_call>'


@pytest.mark.parametrize("form", ["command", "agent"])
async def test_the_example_agent_solves_calc_through_the_gateway(form):
    env = load_environment(str(EXAMPLE), form=form, num_train=8, num_eval=4)
    try:
        tasks = list(env.eval_dataset())[:2]
        for task in tasks:
            traj = await env.rollout(ScriptedClient(solver), task, SamplingParams(max_tokens=200))
            await env.rubric.score(traj)
            assert traj.error is None, traj.error
            assert traj.reward == 1.0 and traj.state["result"] == f"It is {task.answer}"
            assert len(traj.turns) == 2 and len(traj.sequences) == 1 and traj.metrics["template_breaks"] == 0
    finally:
        await env.close()


@pytest.mark.slow
def test_agentrl_run_trains_the_example_and_the_ledger_adds_up(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    overrides = {
        "run.dir": run_dir, "model.path": tiny_model, "sft.enabled": "false", "env.name": EXAMPLE,
        "env.args.form": "agent", "env.args.num_train": 64, "env.args.num_eval": 4, "rollout.group_size": 2,
        "rollout.max_in_flight": 8, "rollout.max_tokens": 16, "rollout.max_turns": 2, "trainer.batch_groups": 2,
        "trainer.steps": 2, "buffer.filter_zero_variance": "false", "eval.every": 1, "eval.num_tasks": 2,
        "trainer.checkpoint_every": 0, "trainer.num_threads": 1, "inference.max_batch_size": 8,
    }  # fmt: skip
    out = agentrl("run", *[f"--{k}={v}" for k, v in overrides.items()], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    last = rows[-1]
    fates = ("trained", "stale", "filtered", "errored", "interrupted", "skipped", "in_flight")
    assert sum(last[f"ledger/{k}"] for k in fates) == last["ledger/started"] and last["ledger/trained"] == 8
    episodes = list(read_jsonl(run_dir / "rollouts.jsonl"))
    assert episodes and all(e["turns"] for e in episodes)  # every call recorded on its episode
    trained = {r["id"] for r in read_jsonl(run_dir / "ledger.jsonl") if r["fate"] == "trained"}
    for e in episodes:
        if e["id"] in trained:
            assert sum(sum(s["loss_mask"]) for s in e["sequences"]) == sum(len(t["completion_ids"]) for t in e["turns"])
    view = agentrl("view", run_dir)
    assert view.returncode == 0 and "trained 8" in view.stdout
    from agentrl.viewer.data import RunView

    shown = RunView(run_dir).episode(episodes[-1]["id"])  # the viewer's episode page: every call a turn
    assert shown is not None and len(shown["turns"]) == len(episodes[-1]["turns"]) >= 1
    assert len(shown["sequences"]) == len(episodes[-1]["sequences"])


@pytest.mark.slow
def test_ctrl_c_then_resume_continues_a_harness_run(tiny_model, tmp_path):
    """``agentrl run`` on the example (in-process form), Ctrl-C after a checkpoint (episodes in
    flight through the gateway), then ``--resume``: the run continues from the checkpoint, no
    step twice, no episode trained twice, every episode of both processes with one fate."""
    run_dir, n_steps = tmp_path / "run", 8
    overrides = {
        "run.dir": run_dir, "model.path": tiny_model, "sft.enabled": "false", "env.name": EXAMPLE,
        "env.args.form": "agent", "env.args.num_train": 64, "env.args.num_eval": 4, "rollout.group_size": 2,
        "rollout.max_in_flight": 8, "rollout.max_tokens": 16, "rollout.max_turns": 2, "trainer.batch_groups": 2,
        "trainer.steps": n_steps, "buffer.filter_zero_variance": "false", "eval.every": 0,
        "trainer.checkpoint_every": 2, "trainer.num_threads": 1, "inference.max_batch_size": 8,
    }  # fmt: skip
    args = ["run", *[f"--{k}={v}" for k, v in overrides.items()]]
    log = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", *args], stdout=subprocess.DEVNULL, stderr=log,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").exists():
                break
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the run's foreground group
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 130, err[-3000:]
    assert "run the same command with --resume" in err, err[-3000:]
    before = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert before and max(before) < n_steps - 1, before

    res = agentrl(*args, "--resume", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr, res.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(n_steps))  # continues; no step twice
    records = read_jsonl(run_dir / "ledger.jsonl")
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))  # one fate per episode across both processes
    trained = [r["id"] for r in records if r["fate"] == "trained"]
    assert len(trained) == n_steps * 2 * 2
    last = rows[-1]
    fates = ("trained", "stale", "filtered", "errored", "interrupted", "skipped", "in_flight")
    assert sum(last[f"ledger/{k}"] for k in fates) == last["ledger/started"]
    episodes = {e["id"]: e for e in read_jsonl(run_dir / "rollouts.jsonl")}
    for eid in trained:  # every trained episode went through the program's calls, token-exactly
        e = episodes[eid]
        assert e["turns"] and sum(sum(s["loss_mask"]) for s in e["sequences"]) == sum(
            len(t["completion_ids"]) for t in e["turns"])


def test_the_side_by_side_config_is_the_quickstarts_but_for_the_env():
    """examples/harness/harness.toml and examples/quickstart.toml must stay comparable."""
    from agentrl.config import load_config

    root = EXAMPLE.parents[1]
    harness, native = (load_config([root / f]).model_dump() for f in ("examples/harness/harness.toml",
                                                                       "examples/quickstart.toml"))  # fmt: skip
    assert harness["env"]["name"] == "examples/harness" and harness["env"]["args"].pop("form") == "agent"
    for config in (harness, native):
        config["run"].pop("name"), config["env"].pop("name")
    assert harness == native


async def test_the_example_passes_the_environment_checklist():
    from agentrl.envs import check_environment

    env = load_environment(str(EXAMPLE), form="agent", num_train=8, num_eval=4)
    try:
        report = await check_environment(env, num_episodes=2)
    finally:
        await env.close()
    assert report.ok, report.failures()
