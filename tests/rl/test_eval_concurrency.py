"""``eval.concurrency`` bounds the held-out episodes in flight (it was fixed at 64; issue 23)."""

from __future__ import annotations

import asyncio

from agentrl.buffer import StalenessBuffer
from agentrl.config import EvalConfig
from agentrl.envs.check import ScriptedClient
from agentrl.plugins import load_environment
from agentrl.recipes.rl_steps import HeldOut
from agentrl.rollout import RolloutManager, TaskSampler
from agentrl.types import SamplingParams


class HeldAtTheEndpoint(ScriptedClient):
    """Every model call waits at a gate the test opens; counts the calls waiting there."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting, self.peak, self.gate = 0, 0, asyncio.Event()
        self.passes = lambda prompt_ids: False  # calls that need not wait at the gate

    async def complete(self, prompt_ids, sampling, n=1):
        if self.passes(prompt_ids):
            return await super().complete(prompt_ids, sampling, n)
        self.waiting += 1
        self.peak = max(self.peak, self.waiting)
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1
        return await super().complete(prompt_ids, sampling, n)


async def test_eval_concurrency_bounds_the_held_out_episodes_in_flight():
    env = load_environment("calc", num_train=20, num_eval=20)
    client = HeldAtTheEndpoint()
    tasks = list(env.eval_dataset())
    manager = RolloutManager(env, client, StalenessBuffer(1, 1), TaskSampler(list(env.dataset()), seed=0),
                             SamplingParams(max_tokens=8))
    held_out = HeldOut(manager, tasks, EvalConfig(concurrency=3), max_tokens=8)
    run = asyncio.create_task(held_out.evaluate(0))
    while client.waiting < 3 and not run.done():
        await asyncio.sleep(0)
    for _ in range(200):  # rounds of the event loop in which more episodes would have reached the gate
        await asyncio.sleep(0)
    assert client.waiting == 3, client.waiting
    client.gate.set()
    result = await run
    assert client.peak == 3 and result["eval/errored"] == 0


async def test_agentrl_eval_leaves_no_episode_running_when_it_fails(tmp_path):
    """`agentrl eval` gathered with plain asyncio.gather: when one group failed, it returned while
    the other episodes still ran, and closed the results file, env and client under them."""
    from agentrl.envs.check import decode
    from agentrl.recipes.eval import evaluate

    env = load_environment("calc", num_train=20, num_eval=20)
    first = env.eval_dataset()[0].prompt[-1].content
    client = HeldAtTheEndpoint()
    client.passes = lambda prompt_ids: first in decode(prompt_ids)  # only the first task's episodes go through

    def progress(done: int) -> None:
        raise RuntimeError("the progress display broke")

    run = asyncio.create_task(evaluate(env, client, model="m", out_dir=tmp_path, num_tasks=8, rollouts=2,
                                       concurrency=16, sampling=SamplingParams(max_tokens=8), on_episode=progress))
    try:
        await run
    except RuntimeError:
        pass
    assert client.waiting == 0, f"{client.waiting} episodes still running after the eval returned"
