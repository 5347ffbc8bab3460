"""Rubric: arguments by name, weights, metrics, group functions, errors as episode data."""

import asyncio
import math

from agentrl.rubrics import Rubric, RubricGroup
from agentrl.types import Message, Task, Trajectory


def traj(reply: str, answer="4", error=None) -> Trajectory:
    task = Task([Message("user", "2+2?")], answer=answer, info={"level": 3})
    return Trajectory(task=task, messages=[*task.prompt, Message("assistant", reply)], error=error)


async def test_arguments_by_name_weights_and_metrics():
    seen = {}

    def correct(completion, answer):
        return completion.strip() == answer  # bools count as 0/1

    async def length(completion) -> float:
        await asyncio.sleep(0)
        return len(completion)

    def everything(prompt, messages, task, info, state, trajectory, turns, metrics):
        seen.update(prompt=prompt, info=info, n=len(messages), t=trajectory, turns=turns)
        return 0.5

    rubric = Rubric([correct, length, everything], weights=[1.0, 0.0, 2.0])
    t = traj("4")
    await rubric.score_group([t])
    assert t.reward == 1.0 + 2 * 0.5 and t.error is None
    assert t.metrics == {"correct": 1.0, "length": 1.0, "everything": 0.5}
    assert seen["prompt"][0].content == "2+2?" and seen["info"] == {"level": 3} and seen["n"] == 2 and seen["t"] is t


async def test_group_level_function_scores_the_whole_group():
    def unique(completions) -> list[float]:
        return [1.0 / completions.count(c) for c in completions]

    rubric = Rubric([unique])
    ts = [traj("a"), traj("a"), traj("b")]
    await rubric.score_group(ts)
    assert [t.reward for t in ts] == [0.5, 0.5, 1.0]


async def test_bad_rewards_mark_only_that_episode_errored():
    def picky(completion):
        if completion == "raise":
            raise KeyError("boom")
        return {"nan": math.nan, "inf": math.inf, "str": "1"}.get(completion, 1.0)

    ts = [traj("ok"), traj("raise"), traj("nan"), traj("inf"), traj("str")]
    await Rubric([picky]).score_group(ts)
    assert ts[0].reward == 1.0 and ts[0].error is None
    assert "raised KeyError" in ts[1].error
    assert all("not a finite number" in t.error and t.reward == 0.0 for t in ts[2:])


async def test_already_errored_episodes_are_not_scored_and_unknown_args_are_errors():
    calls = []
    rubric = Rubric([lambda completion: calls.append(completion) or 1.0])
    ts = [traj("x", error="EndpointError: down"), traj("y")]
    await rubric.score_group(ts)
    assert calls == ["y"] and ts[0].reward == 0.0 and ts[0].error == "EndpointError: down"
    t = traj("z")
    await Rubric([lambda nonsense: 1.0]).score_group([t])
    assert "unknown argument" in t.error


async def test_rubric_group_sums_and_context_objects():
    class Oracle:
        def check(self, completion):
            return completion == "4"

    a = Rubric([lambda oracle, completion: float(oracle.check(completion))], context={"oracle": Oracle()})
    b = Rubric([lambda completion: 0.25], weights=[2.0])
    b.funcs[0].name = "quarter"
    t = traj("4")
    await RubricGroup([a, b]).score_group([t])
    assert t.reward == 1.0 + 0.5 and t.metrics["quarter"] == 0.25


async def test_timeout_marks_error():
    async def slow(completion):
        await asyncio.sleep(5)
        return 1.0

    t = traj("4")
    await Rubric([slow], timeout_s=0.05).score_group([t])
    assert "slow" in t.error and "TimeoutError" in t.error


async def test_a_slow_sync_reward_function_warns_once_naming_itself(recwarn):
    """A sync reward function runs on the loop every rollout shares: a slow one stalls them all."""
    import time

    def slow(completion):
        time.sleep(0.6)
        return 1.0

    def quick(completion):
        return 1.0

    rubric = Rubric([slow, quick])
    for _ in range(2):
        await rubric.score_group([traj("4"), traj("5")])
    held = [w for w in recwarn.list if issubclass(w.category, RuntimeWarning)]
    assert len(held) == 1 and str(held[0].message).startswith("reward function 'slow' held the event loop for 0.")
    assert "make it async" in str(held[0].message)
