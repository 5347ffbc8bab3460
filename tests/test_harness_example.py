"""examples/harness: a plain OpenAI-SDK calc agent trained unchanged (HarnessEnv), both forms;
and ``agentrl run`` on it end to end (eval, RL steps, the ledger, the viewer)."""

from __future__ import annotations

import json
import re
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


async def test_the_example_passes_the_environment_checklist():
    from agentrl.envs import check_environment

    env = load_environment(str(EXAMPLE), form="agent", num_train=8, num_eval=4)
    try:
        report = await check_environment(env, num_episodes=2)
    finally:
        await env.close()
    assert report.ok, report.failures()
