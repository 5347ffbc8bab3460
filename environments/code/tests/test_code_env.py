"""Code environment: scripted replies through real sandboxes."""

from __future__ import annotations

import json

import pytest
from agentrl_env_code import PROBLEMS, load_environment

from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.sandbox import why_unavailable
from agentrl.sandbox.live import live_sandboxes
from agentrl.types import SamplingParams


@pytest.fixture(scope="module")
def backend():
    for b in ("bwrap", "docker"):
        if why_unavailable(b) is None:
            return b
    pytest.skip("no isolating sandbox backend (bwrap or docker) here")


def scripted(*texts: str) -> ScriptedClient:
    def policy(prompt: str) -> str:
        return texts[min(prompt.count("<|im_start|>assistant") - 1, len(texts) - 1)]

    return ScriptedClient(policy)


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


async def episode(env, task, *texts):
    t = await env.rollout(scripted(*texts), task, SamplingParams(max_tokens=4000))
    await env.rubric.score(t)
    return t


def test_reference_solutions_define_their_entry_points_and_tests_are_seeded():
    assert len({p.name for p in PROBLEMS}) == len(PROBLEMS)
    a, b = load_environment(num_train=40, num_eval=10), load_environment(num_train=40, num_eval=10)
    assert [t.info for t in a.dataset()] == [t.info for t in b.dataset()]
    assert all(len(t.info["tests"]) == 8 for t in a.dataset())
    json.dumps([t.info for t in a.dataset()])  # tests must be JSON (they travel to the sandbox)


async def test_tool_use_then_correct_answer_scores_one(backend):
    env = load_environment(num_train=20, sandbox_backend=backend, timeout_s=5)
    task = next(t for t in env.dataset() if t.info["entry_point"] == "is_palindrome")
    assert "is_palindrome" not in {t.info["entry_point"] for t in env.eval_dataset()}
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(\'abba\'[::-1])"}}\n</tool_call>'
    t = await episode(env, task, call, fenced(task.answer))
    assert t.error is None and t.reward == 1.0
    assert [m.content for m in t.messages if m.role == "tool"] == ["abba\n"]
    await env.close()
    assert live_sandboxes() == []


async def test_a_nul_byte_in_a_tool_call_says_why_it_cannot_run(backend):
    """exec() refuses a NUL inside an argument; the model read only '[exit code 125]'."""
    env = load_environment(num_train=20, sandbox_backend=backend, timeout_s=5)
    task = next(t for t in env.dataset() if t.info["entry_point"] == "add")
    for name, arg in (("bash", {"command": "echo hi\x00there"}), ("python", {"code": "print('a\x00b')"})):
        call = "<tool_call>\n" + json.dumps({"name": name, "arguments": arg}) + "\n</tool_call>"
        t = await episode(env, task, call, fenced(task.answer))
        assert t.error is None and t.reward == 1.0, t.error
        [reply] = [m.content for m in t.messages if m.role == "tool"]
        assert reply.startswith("Error: ") and "contains a NUL byte (\\x00), which no process can take" in reply, reply
    await env.close()


async def test_wrong_and_hostile_answers_score_zero_without_errors(backend):
    env = load_environment(num_train=20, sandbox_backend=backend, timeout_s=2)
    task = next(t for t in env.dataset() if t.info["entry_point"] == "add")
    for reply in (fenced("def add(a, b):\n    return a - b"), "no code at all",
                  fenced("def add(a, b):\n    while True: pass"),
                  fenced("import os\nos.system('kill -9 -1')\nprint('[{\"ok\": true}]')")):  # fmt: skip
        t = await episode(env, task, reply)
        assert t.error is None and t.reward == 0.0, (reply, t.error, t.reward)
    await env.close()


async def test_contract_checklist_passes(backend):
    env = load_environment(num_train=30, sandbox_backend=backend)
    report = await check_environment(env)
    assert report.ok, report.failures()
    await env.close()


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    assert "code" in {ep.name for ep in entry_points(group="agentrl.environments")}
