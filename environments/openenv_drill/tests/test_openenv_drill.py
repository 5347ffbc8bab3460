"""The OpenEnv adapter on a real OpenEnv server (uvicorn child process, OpenEnv's own WebSocket
client): the episode loop, the rubric, the checker, server failures and `agentrl eval` on the
embedded engine."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openenv")

from agentrl.envs.check import ScriptedClient, check_environment  # noqa: E402
from agentrl.errors import AgentrlError  # noqa: E402
from agentrl.plugins import load_environment  # noqa: E402
from agentrl.rubrics import score_episodes  # noqa: E402
from agentrl.types import SamplingParams  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from agentrl_env_openenv_drill import _stop, start_server  # noqa: E402

SAMPLING = SamplingParams(max_tokens=16)


@pytest.fixture(scope="module")
def server():
    proc, url = start_server()
    yield proc, url
    _stop(proc)


def answer(prompt: str) -> str:
    a, b = re.findall(r"what is (\d+) \+ (\d+)\?", prompt)[-1]
    return str(int(a) + int(b))


async def test_right_answers_score_one_and_wrong_ones_zero(server):
    """Catches: the reset observation not becoming the prompt, the text not reaching the action's
    field, the server's done not ending the episode, step rewards not summed into the reward."""
    env = load_environment(str(HERE), url=server[1], num_tasks=4)
    tasks = list(env.dataset())
    right = [await env.rollout(ScriptedClient(answer), t, SAMPLING) for t in tasks]
    wrong = [await env.rollout(ScriptedClient(lambda p: "0"), t, SAMPLING) for t in tasks]
    await score_episodes(env.rubric, right + wrong)
    assert all(t.error is None and t.stop_reason == "done" for t in right + wrong), [t.error for t in right + wrong]
    assert [t.reward for t in right] == pytest.approx([1.0] * 4) and [t.reward for t in wrong] == [0.0] * 4
    assert all(len(t.turns) == 3 and t.metrics["openenv_steps"] == 3 for t in right)
    first = [m.content for m in right[0].messages if m.role == "user"]
    assert first[0].startswith("Answer 3 sums") and first[1].startswith("Correct. Question 2")
    assert len({t.messages[1].content for t in right}) == 4  # seeds give different sums


async def test_the_checker_passes(server):
    report = await check_environment(load_environment(str(HERE), url=server[1], num_tasks=6), num_episodes=2)
    assert report.ok, [f"{r.name}: {r.detail}" for r in report.failures()]


async def test_a_huge_number_is_a_wrong_answer_not_a_server_error(server):
    """int() refuses over 4300 digits: the policy must not turn a bad episode into an error
    (never trained on) by answering with a 5000-digit number."""
    env = load_environment(str(HERE), url=server[1], num_tasks=1)
    tr = await env.rollout(ScriptedClient(lambda p: "9" * 5000), env.dataset()[0], SamplingParams(max_tokens=20_000))
    await score_episodes(env.rubric, [tr])
    assert tr.error is None and tr.stop_reason == "done" and tr.reward == 0.0, tr.error
    assert tr.messages[3].content.startswith("Wrong: ")


@pytest.mark.slow
async def test_a_dead_server_errors_the_episode_not_the_run():
    """Catches: a WebSocket failure escaping the episode loop instead of becoming kind env."""
    proc, url = start_server()
    env = load_environment(str(HERE), url=url, num_tasks=2)
    _stop(proc)
    traj = await env.rollout(ScriptedClient(answer), env.dataset()[0], SAMPLING)
    assert traj.error_kind == "env" and url in traj.error and "connect" in traj.error, traj.error
    with pytest.raises(AgentrlError, match="OpenEnv server .* is unreachable"):
        load_environment(str(HERE), url=url)


@pytest.mark.slow
def test_agentrl_eval_on_the_embedded_engine(server, tmp_path):
    from agentrl.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", layers=1, hidden=32, heads=2)
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", str(HERE), "--model", str(model), "-n", "2", "-r", "2",
                        "--max-tokens", "8", "--out", str(out), "--env-args", json.dumps({"url": server[1], "num_tasks": 4})],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(x["env"] == "openenv-drill" and x["error"] is None for x in recs), recs
    # every question asked and answered through the server: 3 steps, whatever the tiny model said
    assert all(x["turns"] == 3 and x["metrics"]["openenv_steps"] == 3 for x in recs), recs
