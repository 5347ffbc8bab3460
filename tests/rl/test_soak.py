"""Soak: 1,000 concurrent episodes on the real stack, stopped mid-flight, leave nothing behind
(file descriptors, asyncio tasks, threads, sandboxes, child processes, unhandled loop errors).

The soak found that a stopped group's sibling episodes (and a cancelled tool call) kept running
after the manager returned and the client and sandboxes were closed; the two tests after it
pin those down deterministically."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from benchmark_module import load_benchmark

from agentrl.buffer import StalenessBuffer
from agentrl.envs import SingleTurnEnv, ToolEnv
from agentrl.envs.check import ScriptedClient
from agentrl.rollout import RolloutManager, TaskSampler
from agentrl.rubrics import Rubric
from agentrl.types import Message, SamplingParams, Task

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_1000_episode_soak_leaks_nothing():
    # in a fresh process: what earlier tests left in this one (threads, sockets of garbage closed
    # mid-soak and their numbers reused) is not the soak's to answer for
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import soak; "
            "print(json.dumps(soak.run_soak(15, concurrency=1000, latency_ms=5, sandbox_every=5, warmup_s=3, settle_s=5)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["peak_in_flight"] == 1000
    assert out["episodes"] > 0 and out["sandbox_execs"] > 0 and out["errored"] == 0, out["errors"]
    assert out["leaked"] == {"fds": [], "threads": [], "children": [], "sandboxes": [], "tasks": [], "unhandled": [],
                             "resource_warnings": []}


def test_the_soak_counts_a_socket_only_the_garbage_collector_closed():
    resource_warnings = load_benchmark("soak").resource_warnings
    gc.collect()  # earlier tests' garbage (an unclosed event loop) must not be collected in the window
    with resource_warnings() as found:
        sock = socket.socket()
        del sock  # dropped open: only the collector closes it
    assert len(found) == 1 and "unclosed" in found[0] and "socket" in found[0], found
    with resource_warnings() as found:
        sock = socket.socket()
        sock.close()
        del sock
    assert found == []
    with pytest.warns(RuntimeWarning, match="still shown"), resource_warnings() as found:
        warnings.warn("still shown", RuntimeWarning, stacklevel=1)  # not swallowed by the capture
    assert found == []


class _Slow(ScriptedClient):
    """Every model call takes a minute: episodes are mid-call when the manager stops."""

    async def complete(self, prompt_ids, sampling, n=1):
        await asyncio.sleep(60)
        return await super().complete(prompt_ids, sampling, n)


async def test_a_stopped_manager_returns_only_after_every_episode_finished():
    class SlowCleanup(SingleTurnEnv):
        started = cleaned = 0

        async def setup(self, task):
            self.started += 1
            state = await super().setup(task)
            state["slow"] = self.started % 2 == 0
            return state

        async def cleanup(self, state):
            if state["slow"]:  # releasing a sandbox, say
                await asyncio.sleep(0.3)
            self.cleaned += 1

    env = SlowCleanup(dataset=[f"q{i}" for i in range(8)], rubric=Rubric([lambda completion: 1.0]))
    buffer = StalenessBuffer(batch_groups=4, max_staleness=1)
    manager = RolloutManager(env, _Slow(), buffer, TaskSampler(list(env.dataset())), SamplingParams(),
                             group_size=4, max_in_flight=16)
    runner = asyncio.create_task(manager.run())
    while env.started < 16:  # every episode is in its model call
        await asyncio.sleep(0)
    manager.stop()
    await runner
    # plain gather let the group end with its first cancelled episode: the slow siblings were
    # still cleaning up (then touching a closed client or sandbox pool) after run() returned
    assert env.cleaned == env.started == 16
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_tool_call_never_outlives_its_episode_even_when_cancelled_twice():
    started, cleaning, finished = asyncio.Event(), asyncio.Event(), []

    async def slow_tool(x: int) -> int:
        """A tool that needs a moment to clean up when cancelled.

        Args:
            x: anything
        """
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            cleaning.set()
            await asyncio.sleep(0.2)  # e.g. killing the command in its sandbox
            finished.append(x)
        return x

    env = ToolEnv(tools=[slow_tool], rubric=Rubric([lambda completion: 1.0]))
    client = ScriptedClient(lambda p: '<tool_call>\n{"name": "slow_tool", "arguments": {"x": 1}}\n</tool_call>')
    episode = asyncio.create_task(env.rollout(client, Task([Message("user", "go")]), SamplingParams(max_tokens=200)))
    await asyncio.wait_for(started.wait(), 30)  # the tool runs (else the test would prove nothing)
    episode.cancel()
    await asyncio.wait_for(cleaning.wait(), 30)
    episode.cancel()  # a second cancellation while the first is being handled (a stop during a wall limit, ...)
    with pytest.raises(asyncio.CancelledError):
        await episode
    # with asyncio.wait_for the second cancel abandoned the tool's task, still running on its own
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert finished == []  # its cleanup was cut by the second cancel, inside the episode's own task
