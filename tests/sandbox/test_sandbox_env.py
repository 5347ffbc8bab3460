"""SandboxEnv: bash/python tools in a per-episode sandbox, driven by a scripted policy."""

from __future__ import annotations

import json

import pytest

from agentrl.envs.check import ScriptedClient
from agentrl.envs.sandbox_env import SandboxEnv
from agentrl.rubrics import Rubric
from agentrl.sandbox.base import live_sandboxes
from agentrl.types import SamplingParams


def call(name: str, **args) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def scripted(*texts: str) -> ScriptedClient:
    def policy(prompt: str) -> str:
        return texts[min(prompt.count("<|im_start|>assistant") - 1, len(texts) - 1)]

    return ScriptedClient(policy)


def make_env(backend: str, limits, **kw) -> SandboxEnv:
    return SandboxEnv(dataset=["go"], rubric=Rubric([lambda completion: 1.0]), sandbox_backend=backend,
                      sandbox_limits=limits, max_turns=5, **kw)  # fmt: skip


async def rollout(env: SandboxEnv, *texts: str):
    return await env.rollout(scripted(*texts), next(iter(env.dataset())), SamplingParams(max_tokens=2000))


async def test_tools_share_the_episode_sandbox(isolating_backend, limits):
    env = make_env(isolating_backend, limits)
    names = {s["function"]["name"] for s in env.tool_schemas()}
    assert names == {"bash", "python"}
    t = await rollout(env, call("bash", command="echo from-bash > note.txt && id -u"),
                      call("python", code="print(open('note.txt').read().strip() + ' via python')"),
                      call("bash", command="sleep 30"), "done")  # fmt: skip
    assert t.error is None, t.error
    tool_out = [m.content for m in t.messages if m.role == "tool"]
    assert tool_out[0].strip() != "0"  # not root inside
    assert tool_out[1] == "from-bash via python\n"
    assert "[timed out" in tool_out[2]
    assert t.metrics["sandbox_execs"] == 3 and t.metrics["sandbox_timeouts"] == 1
    await env.close()
    assert live_sandboxes() == []


async def test_episodes_do_not_see_each_other(isolating_backend, limits):
    env = make_env(isolating_backend, limits, max_sandboxes=1)  # forces reuse of one sandbox
    await rollout(env, call("bash", command="echo secret > left.txt"), "done")
    t = await rollout(env, call("bash", command="ls -A; echo end"), "done")
    assert [m.content for m in t.messages if m.role == "tool"] == ["end\n"]
    assert env.pool().stats.reused == 1
    await env.close()


async def test_a_dead_sandbox_marks_the_episode_errored(limits):
    from agentrl.sandbox import why_unavailable

    if why_unavailable("bwrap"):
        pytest.skip("bwrap unavailable")

    class Dying(SandboxEnv):
        async def setup_sandbox(self, sandbox, state):
            sandbox.kill_sync()  # the sandbox dies under the episode: infrastructure, not the model

    env = Dying(dataset=["go"], rubric=Rubric([lambda completion: 1.0]), sandbox_backend="bwrap",
                sandbox_limits=limits)  # fmt: skip
    t = await rollout(env, call("bash", command="echo hi"), "done")
    assert t.stop_reason == "error" and "SandboxError" in t.error
    await env.close()
    assert live_sandboxes() == []
