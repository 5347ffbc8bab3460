"""The rollout loop: token exactness, stop reasons, errors as data, cleanup always runs."""

import asyncio

import pytest

from agentrl.envs import MultiTurnEnv, SingleTurnEnv, State, ToolEnv
from agentrl.envs.check import IM_END, ScriptedClient, encode, render_chatml
from agentrl.errors import ContextLengthExceeded
from agentrl.rubrics import Rubric
from agentrl.types import Message, SamplingParams, Task, messages_to_dicts


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


def two_turn_policy(prompt: str) -> str:
    if "<|im_start|>tool" in prompt:
        return "The answer is 7."
    return '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


def make_tool_env(**kw):
    return ToolEnv(tools=[add], dataset=["What is 3+4?"], rubric=Rubric([lambda completion, answer: 1.0]), **kw)


async def test_tool_episode_is_token_exact():
    env = make_tool_env()
    client = ScriptedClient(two_turn_policy)
    traj = await env.rollout(client, next(iter(env.dataset())), SamplingParams(max_tokens=200))
    assert traj.error is None and traj.stop_reason == "done"
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[2].content == "7" and traj.messages[2].tool_call_id == traj.messages[1].tool_calls[0].id
    assert len(traj.sequences) == 1 and traj.metrics["template_breaks"] == 0
    seq = traj.sequences[0]
    # the whole sequence equals a fresh rendering of the conversation (this template is prefix-stable)
    rendered = encode(render_chatml(messages_to_dicts(traj.messages), env.tool_schemas(), False))
    assert seq.token_ids == rendered[:-1]  # minus the trailing "\n" glue after the last <|im_end|>
    # every model call saw exactly the tokens accumulated so far
    assert client.prompts[1] == seq.token_ids[: len(client.prompts[1])]
    # sampled tokens carry mask 1, μ and version; forced ones mask 0
    sampled = [t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m]
    assert sampled == traj.turns[0].completion_ids + traj.turns[1].completion_ids
    assert sampled.count(IM_END) == 2
    assert all(v == 0 for v, m in zip(seq.versions, seq.loss_mask, strict=True) if m)
    assert all(lp == 0.0 and v == -1 for lp, v, m in zip(seq.logprobs, seq.versions, seq.loss_mask, strict=True) if not m)
    assert traj.metrics["tool_calls"] == 1 and traj.metrics["turns"] == 2


class Guess(MultiTurnEnv):
    async def setup(self, task):
        state = State(task)
        state["secret"] = 5
        self.cleaned = getattr(self, "cleaned", 0)
        return state

    async def step(self, state, msg):
        if msg.content.strip() == str(state["secret"]):
            state.done = True
            return [Message("user", "correct")]
        if msg.content == "boom":
            raise RuntimeError("env exploded")
        return [Message("user", "wrong")]

    async def cleanup(self, state):
        self.cleaned += 1


async def test_template_break_starts_a_new_sequence_and_counts():
    env = Guess(dataset=["guess"], max_turns=2)
    client = ScriptedClient(lambda p: "<think>hmm</think>4", strip_old_thinking=True)
    traj = await env.rollout(client, next(iter(env.dataset())))
    assert traj.error is None and traj.stop_reason == "max_turns"
    assert traj.metrics["template_breaks"] == 1 and len(traj.sequences) == 2
    assert traj.num_sampled_tokens == sum(len(t.completion_ids) for t in traj.turns)
    # the second sample starts from the template's own rendering, which dropped the old thinking
    assert client.prompts[1] == traj.sequences[1].token_ids[: len(client.prompts[1])]
    assert "hmm" not in render_chatml(messages_to_dicts(traj.messages[:3]), None, True, strip_old=True)


@pytest.mark.parametrize(
    ("reply", "kwargs", "stop", "error", "kind"),
    [
        ("5", {}, "done", None, None),
        ("4", {"max_turns": 3}, "max_turns", None, None),
        ("4", {"max_total_tokens": 5, "max_turns": 10}, "max_tokens", None, None),
        ("4" * 50, {}, "length", None, None),
        ("boom", {}, "error", "RuntimeError: env exploded", "env"),
    ],
)
async def test_stop_reasons(reply, kwargs, stop, error, kind):
    env = Guess(dataset=["guess"], **kwargs)
    traj = await env.rollout(ScriptedClient(lambda p: reply), next(iter(env.dataset())), SamplingParams(max_tokens=20))
    assert (traj.stop_reason, traj.error, traj.error_kind) == (stop, error, kind)
    assert env.cleaned == 1
    if stop == "max_turns":
        assert len(traj.turns) == 3


async def test_a_cut_off_turn_ends_the_episode_or_continues_it_per_env():
    replies = iter(["4" * 50, "5"])
    env = Guess(dataset=["guess"], max_turns=4)
    traj = await env.rollout(ScriptedClient(lambda p: next(replies)), next(iter(env.dataset())), SamplingParams(max_tokens=20))
    assert traj.stop_reason == "length" and len(traj.turns) == 1

    replies = iter(["4" * 50, "5"])
    env = Guess(dataset=["guess"], max_turns=4, on_length="continue")
    client = ScriptedClient(lambda p: next(replies))
    traj = await env.rollout(client, next(iter(env.dataset())), SamplingParams(max_tokens=20))
    assert traj.error is None and traj.stop_reason == "done" and len(traj.turns) == 2
    assert traj.messages[2].content == "wrong"  # the env answered the cut-off turn
    # the cut-off turn has no end-of-turn token: the next prompt is a fresh sample, counted
    assert traj.metrics["length_continues"] == 1 and len(traj.sequences) == 2
    assert client.prompts[1] == traj.sequences[1].token_ids[: len(client.prompts[1])]
    with pytest.raises(ValueError, match="on_length"):
        Guess(dataset=["guess"], on_length="retry")


async def test_prompt_too_long_from_max_seq_len_and_from_the_endpoint():
    env = Guess(dataset=["guess"], max_seq_len=40, max_turns=50)
    traj = await env.rollout(ScriptedClient(lambda p: "4"), next(iter(env.dataset())))
    assert traj.stop_reason == "prompt_too_long" and traj.error is None

    class Full(ScriptedClient):
        """Fits the first prompt only."""

        async def complete(self, prompt_ids, sampling, n=1):
            if len(self.prompts) >= 1:
                raise ContextLengthExceeded("prompt is 5000 tokens")
            return await super().complete(prompt_ids, sampling, n)

    traj = await Guess(dataset=["guess"]).rollout(Full(lambda p: "4"), next(iter(env.dataset())))
    assert traj.stop_reason == "prompt_too_long" and traj.error is None and len(traj.turns) == 1

    class Never(ScriptedClient):
        async def complete(self, prompt_ids, sampling, n=1):
            raise ContextLengthExceeded("prompt is 5000 tokens")

    # nothing sampled: the task itself does not fit, an error of its own kind
    traj = await Guess(dataset=["guess"]).rollout(Never(), next(iter(env.dataset())))
    assert traj.stop_reason == "error" and traj.error_kind == "context_length" and "5000 tokens" in traj.error


async def test_the_wall_limit_errors_the_episode_keeps_what_happened_and_cleans_up():
    class Slow(Guess):
        async def step(self, state, msg):
            await asyncio.sleep(10)
            return []

    env = Slow(dataset=["guess"], timeout_s=0.2)
    traj = await env.rollout(ScriptedClient(lambda p: "4"), next(iter(env.dataset())))
    assert traj.stop_reason == "error" and traj.error_kind == "timeout" and "wall limit of 0.2s" in traj.error
    assert len(traj.turns) == 1 and traj.messages[-1].role == "assistant" and env.cleaned == 1
    # an explicit limit wins over the env's own
    traj = await Slow(dataset=["guess"]).rollout(ScriptedClient(lambda p: "4"), next(iter(env.dataset())), timeout_s=0.1)
    assert traj.error_kind == "timeout" and "0.1s" in traj.error


async def test_a_timeout_error_raised_by_env_code_is_the_envs_error_not_the_wall_limit():
    class Raises(Guess):
        async def step(self, state, msg):
            raise TimeoutError("database did not answer")

    traj = await Raises(dataset=["guess"], timeout_s=30).rollout(ScriptedClient(lambda p: "4"), Task([Message("user", "g")]))
    assert traj.error_kind == "env" and traj.error == "TimeoutError: database did not answer"


async def test_endpoint_failure_and_setup_failure_are_errors_not_exceptions():
    env = Guess(dataset=["guess"])
    traj = await env.rollout(ScriptedClient(fail=True), next(iter(env.dataset())))
    assert traj.stop_reason == "error" and "endpoint is down" in traj.error and env.cleaned == 1
    assert traj.error_kind == "endpoint"

    class BadSetup(Guess):
        async def setup(self, task):
            raise OSError("no sandbox")

    traj = await BadSetup(dataset=["g"]).rollout(ScriptedClient(), Task([Message("user", "g")]))
    assert traj.error == "OSError: no sandbox" and traj.error_kind == "env"


async def test_cleanup_failure_marks_error_and_is_not_raised():
    class BadCleanup(Guess):
        async def cleanup(self, state):
            raise RuntimeError("leak")

    traj = await BadCleanup(dataset=["g"]).rollout(ScriptedClient(lambda p: "5"), Task([Message("user", "g")]))
    assert traj.stop_reason == "error" and "cleanup failed" in traj.error


async def test_single_turn_env_and_system_prompt():
    env = SingleTurnEnv(dataset=[{"question": "2+2?", "answer": "4"}], system_prompt="Be brief.",
                        rubric=Rubric([lambda completion, answer: float(completion == answer)]))
    task = next(iter(env.dataset()))
    assert [m.role for m in task.prompt] == ["system", "user"] and task.answer == "4"
    traj = await env.rollout(ScriptedClient(lambda p: "4"), task)
    await env.rubric.score_group([traj])
    assert traj.stop_reason == "done" and traj.reward == 1.0 and len(traj.turns) == 1
    assert traj.env_name == "env" and traj.completion[0].content == "4"


async def test_extra_dataset_keys_reach_the_rubric_through_task_info():
    rows = [{"question": "2+2?", "answer": "4", "difficulty": 3, "tests": ["a"], "info": {"source": "x"}, "id": "t1"},
            {"prompt": [{"role": "user", "content": "3+3?"}], "question": "kept too", "info": {"difficulty": 9}}]
    seen = []

    def harder_counts_more(completion, answer, info) -> float:
        seen.append(info)
        return float(completion == answer) * info["difficulty"]

    env = SingleTurnEnv(dataset=rows, rubric=Rubric([harder_counts_more]))
    first, second = env.dataset()
    assert first.info == {"difficulty": 3, "tests": ["a"], "source": "x"} and first.id == "t1"
    assert second.info == {"question": "kept too", "difficulty": 9}  # the row's own info wins a clash
    traj = await env.rollout(ScriptedClient(lambda p: "4"), first)
    await env.rubric.score_group([traj])
    assert traj.reward == 3.0 and seen[0]["tests"] == ["a"]
    assert Task.from_dict(first.to_dict()).info == first.info  # and survive the rollout record
    with pytest.raises(ValueError, match="'info' must be a dict"):
        SingleTurnEnv(dataset=[{"question": "q", "info": 3}])


async def test_cancellation_still_cleans_up():
    class Hang(Guess):
        async def step(self, state, msg):
            await asyncio.sleep(10)

    env = Hang(dataset=["g"])
    task = asyncio.create_task(env.rollout(ScriptedClient(lambda p: "4"), Task([Message("user", "g")])))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert env.cleaned == 1


async def test_an_episode_record_is_asdict_and_shares_nothing_with_the_episode():
    import dataclasses

    env = ToolEnv(tools=[add], rubric=Rubric([lambda completion: 1.0]), max_turns=3)
    client = ScriptedClient(lambda p: '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    traj = await env.rollout(client, Task([Message("user", "go")], answer=3, info={"k": [1]}), SamplingParams(max_tokens=200))
    traj.metrics["nested"] = {"a": [1.0]}  # type: ignore[assignment]  (env code puts what it likes here)
    assert len(traj.turns) == 3 and traj.sequences[0].num_sampled > 0
    # the published meaning, computed independently: asdict with the task and messages in wire form
    want = dataclasses.asdict(traj)
    want["task"], want["messages"] = traj.task.to_dict(), messages_to_dicts(traj.messages)
    got = traj.to_dict()
    assert got == want and list(got) == list(want)
    got["sequences"][0]["token_ids"].append(-1)
    got["turns"][0]["versions"].append(-1)
    got["metrics"]["nested"]["a"].append(2.0)
    got["task"]["info"]["k"].append(2)  # the task is shared by the group's episodes
    assert traj.to_dict() == want and traj.task.info == {"k": [1]}


class Replies(Guess):
    """A step() that returns whatever the test sets (a user's natural mistakes among them)."""

    reply: object = None

    async def step(self, state, msg):
        state.done = True
        return self.reply


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (None, "Replies.step() must return a list of Message; it returned NoneType"),
        ("Correct!", "Replies.step() must return a list of Message; it returned str"),
        ({"role": "user", "content": "Correct!"}, "Replies.step() must return a list of Message; it returned dict"),
        ([Message("user", "ok"), 7], "Replies.step() returned int at [1]; it must return a list of Message"),
        ([{"content": "no role"}], "Replies.step() returned a dict at [0] that is not a chat message"),
        ([{"role": "user", "content": ["part"]}], "Replies.step() returned a dict at [0] that is not a chat message"),
        ([Message("user", None)], "Replies.step() returned a Message at [0] with role 'user' and content of type NoneType"),
    ],
)
async def test_a_step_that_returns_no_list_of_messages_is_the_envs_error_naming_step(reply, error):
    env = Replies(dataset=["g"])
    env.reply = reply
    traj = await env.rollout(ScriptedClient(lambda p: "5"), Task([Message("user", "g")]))
    assert traj.stop_reason == "error" and traj.error_kind == "env", traj.error
    assert traj.error.startswith(f"EpisodeError: {error}"), traj.error
    assert env.cleaned == 1  # the episode's resources are still released
    assert traj.to_dict()["messages"][-1]["role"] == "assistant"  # the record still serializes


async def test_a_step_that_returns_openai_style_dicts_gets_messages():
    env = Replies(dataset=["g"])
    env.reply = ({"role": "tool", "content": "7", "tool_call_id": "c1"},)  # any iterable of chat messages
    traj = await env.rollout(ScriptedClient(lambda p: "5"), Task([Message("user", "g")]))
    assert traj.error is None and traj.stop_reason == "done"
    assert traj.messages[-1] == Message("tool", "7", tool_call_id="c1")
    assert traj.to_dict()["messages"][-1] == {"role": "tool", "content": "7", "tool_call_id": "c1"}


async def test_a_setup_that_returns_no_state_is_the_envs_error_naming_setup():
    class NoState(Guess):
        async def setup(self, task):
            return {"messages": task.prompt}  # a plain dict has no .messages

    traj = await NoState(dataset=["g"]).rollout(ScriptedClient(lambda p: "5"), Task([Message("user", "g")]))
    assert traj.error_kind == "env" and traj.error.startswith(
        "EpisodeError: NoState.setup() must return a State (State(task)); it returned dict"), traj.error

    class DictPrompt(Guess):
        async def setup(self, task):
            state = await super().setup(task)
            state.messages.insert(0, {"role": "system", "content": "Be brief."})
            return state

    traj = await DictPrompt(dataset=["g"]).rollout(ScriptedClient(lambda p: "5"), Task([Message("user", "g")]))
    assert traj.error is None and traj.messages[0] == Message("system", "Be brief.")


async def test_a_setup_that_already_ended_the_episode_asks_the_model_nothing():
    """An OpenEnv reset can answer done: the model's turn would act on a finished game."""
    class EndsAtReset(Guess):
        async def setup(self, task):
            state = await super().setup(task)
            state.done = True
            return state

    client = ScriptedClient(lambda p: "5")
    traj = await EndsAtReset(dataset=["g"]).rollout(client, Task([Message("user", "g")]))
    assert traj.error_kind == "env" and "EndsAtReset.setup() set state.done" in traj.error, traj.error
    assert client.prompts == [] and traj.turns == []
