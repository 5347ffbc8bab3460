"""The checker (`agentrl env test`) fails environments whose faults would look like policy mistakes."""

from agentrl.envs import ToolEnv, check_environment
from agentrl.plugins import load_environment
from agentrl.rubrics import Rubric
from agentrl.types import Message, ToolCall


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up
    """
    raise KeyError(key)  # broken on every call



def ok(completion) -> float:
    return 1.0


class Broken(ToolEnv):
    def demonstrations(self, n, seed=0):
        out = []
        for i in range(n):
            key = "ab"[i % 2]
            call = ToolCall("lookup", f'{{"key": "{key}"}}')
            out.append([Message("user", f"find {key}"), Message("assistant", "", tool_calls=[call]),
                        Message("tool", "x", tool_call_id=call.id), Message("assistant", "done")])
        return out


async def test_a_tool_that_raises_on_every_call_fails_the_check_by_name():
    env = Broken(tools=[lookup], dataset=["find a", "find b"], rubric=Rubric([ok]))
    report = await check_environment(env, num_episodes=2)
    tools = next(r for r in report.results if r.name == "tools")
    assert not tools.ok and "always raised: lookup (KeyError: 'a')" in tools.detail and "lookup raised 2/2" in tools.detail
    assert not report.ok


async def test_all_errored_episodes_fail_the_rewards_and_episodes_checks():
    def nan(completion) -> float:
        return float("nan")

    env = ToolEnv(tools=[], dataset=["q"], rubric=Rubric([nan]))
    report = await check_environment(env, num_episodes=1)
    by = {r.name: r for r in report.results}
    assert not by["rewards"].ok and "all errored" in by["rewards"].detail
    assert not by["episodes_run"].ok and "(rubric)" in by["episodes_run"].detail


async def test_the_reference_policy_must_reach_the_max_reward():
    env = load_environment("calc", num_train=20)
    report = await check_environment(env, num_episodes=3)
    ref = next(r for r in report.results if r.name == "reference_solution")
    assert ref.ok, ref.detail

    class Wrong(type(env)):
        def reference_policy(self):
            return lambda task, conversation: Message("assistant", "0")

    report = await check_environment(Wrong(num_train=20), num_episodes=3)
    ref = next(r for r in report.results if r.name == "reference_solution")
    assert not ref.ok and "max 1" in ref.detail


async def test_the_endpoint_failure_check_wants_an_endpoint_error():
    env = load_environment("calc", num_train=20)
    report = await check_environment(env, num_episodes=1)
    line = next(r for r in report.results if r.name == "endpoint_failure")
    assert line.ok and "kind endpoint" in line.detail


async def test_demonstrations_are_replayed_on_their_tasks_anywhere_in_a_large_dataset():
    """calc draws its demonstrations from 20,000 tasks; the check read only the first 1,000 and
    said "4 conversations, 0 start with a dataset task's prompt": no demonstration was replayed."""
    env = load_environment("calc", show_tools=True)
    assert len(env.dataset()) == 20_000
    report = await check_environment(env, num_episodes=3)
    by = {r.name: r for r in report.results}
    assert by["demonstrations"].ok, by["demonstrations"].detail
    assert "4 conversations, 4 replayed on their dataset tasks (rewards [1.0, 1.0, 1.0, 1.0])" in by["demonstrations"].detail
    # the scripted episodes run on the demonstrations' tasks, so they solve them
    assert by["rewards"].detail == "rewards [1.0, 1.0, 1.0]", by["rewards"].detail
    assert report.ok, report.failures()


async def test_a_demonstration_whose_replay_hits_an_env_fault_fails_the_check():
    """Broken's demonstrations call a tool that always raises, on tasks of their own."""
    env = Broken(tools=[lookup], dataset=["find a", "find b"], rubric=Rubric([ok]))
    report = await check_environment(env, num_episodes=2)
    demos = next(r for r in report.results if r.name == "demonstrations")
    assert demos.ok  # a tool that raises is the model's business to read: errored episodes are env faults only
    assert "4 replayed on their dataset tasks" in demos.detail

    class Faulty(Broken):
        async def setup(self, task):
            if task.prompt[-1].content == "find b":
                raise RuntimeError("no b today")
            return await super().setup(task)

    report = await check_environment(Faulty(tools=[lookup], dataset=["find a", "find b"], rubric=Rubric([ok])),
                                     num_episodes=2)  # fmt: skip
    demos = next(r for r in report.results if r.name == "demonstrations")
    assert not demos.ok and "a replay errored (env)" in demos.detail and "no b today" in demos.detail, demos.detail


async def test_demonstrations_of_no_dataset_task_are_counted_as_never_replayed():
    class Stray(Broken):
        def demonstrations(self, n, seed=0):
            return [[Message("user", "not a task"), Message("assistant", "done")], *super().demonstrations(n - 1)]

    report = await check_environment(Stray(tools=[lookup], dataset=["find a", "find b"], rubric=Rubric([ok])),
                                     num_episodes=1)  # fmt: skip
    demos = next(r for r in report.results if r.name == "demonstrations")
    assert "3 replayed on their dataset tasks" in demos.detail
    assert "1 start with no dataset task's prompt (never replayed)" in demos.detail
