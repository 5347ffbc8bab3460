"""SandboxEnv: bash/python tools in a per-episode sandbox, driven by a scripted policy."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agentrl.envs.check import ScriptedClient
from agentrl.envs.sandbox_env import SandboxEnv
from agentrl.rubrics import Rubric
from agentrl.sandbox.live import live_sandboxes
from agentrl.types import SamplingParams


def call(name: str, **args) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def scripted(*texts: str) -> ScriptedClient:
    def policy(prompt: str) -> str:
        return texts[min(prompt.count("<|im_start|>assistant") - 1, len(texts) - 1)]

    return ScriptedClient(policy)


# test_hostile.py's attack: back to oom_score_adj 0, then memory no process maps (memfds)
OOM_THE_AGENT = ("import os\nopen('/proc/self/oom_score_adj', 'w').write('0')\n"
                 "fds = [os.memfd_create('x')]\nchunk = b'x' * (4 << 20)\nwhile True:\n"
                 "    try: os.write(fds[-1], chunk)\n    except OSError: fds.append(os.memfd_create('x'))")  # fmt: skip


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


async def test_an_oom_that_takes_the_sandbox_goes_on_in_a_fresh_one(limits):
    """A command that makes the OOM killer take the sandbox's agent (``test_hostile.py``'s attack)
    ended the episode as errored (kind sandbox: dropped from its group, so an escape from a wrong
    answer).  It is the command's OOM, tool output the model reads, and the episode goes on in a
    fresh sandbox prepared by ``setup_sandbox`` again."""
    from agentrl.sandbox import why_unavailable
    from agentrl.sandbox.cgroup import detect

    if why_unavailable("bwrap") or not detect().version:
        pytest.skip("needs bwrap with a memory cgroup (see sandbox doctor)")
    prepared = []

    class Prepared(SandboxEnv):
        async def setup_sandbox(self, sandbox, state):
            prepared.append(sandbox.id)
            await sandbox.write_file("task.txt", "the task's file")

    env = Prepared(dataset=["go"], rubric=Rubric([lambda completion: 1.0]), sandbox_backend="bwrap",
                   sandbox_limits=dataclasses.replace(limits, timeout_s=20.0, cpu_s=10), max_turns=5)  # fmt: skip
    try:
        t = await rollout(env, call("bash", command="echo mine > mine.txt"), call("python", code=OOM_THE_AGENT),
                          call("bash", command="ls; echo end"), "done")  # fmt: skip
        assert t.error is None, (t.error_kind, t.error)
        out = [m.content for m in t.messages if m.role == "tool"]
        assert "[killed: out of memory]" in out[1], out[1]
        if "replaced by a fresh one" not in out[1]:
            pytest.skip("the OOM killer took the command, not the agent, on this kernel: nothing to replace")
        assert out[2] == "task.txt\nend\n", out[2]  # set up again; what the episode wrote is gone
        assert t.metrics["sandbox_replaced"] == 1 and len(prepared) == 2 and prepared[0] != prepared[1]
    finally:
        await env.close()
    assert live_sandboxes() == []
