"""GymEnv (gymnasium → agentrl) on the toy-text envs, and as_gymnasium (agentrl → gymnasium)."""

import warnings

import gymnasium
import pytest
from agentrl_env_gym_text import toy_text_spec
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.envs.as_gym import TextGymEnv, UnicodeText, as_gymnasium
from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.envs.gym import GymEnv as _GymEnv
from agentrl.envs.gym import ansi_to_text, parse_action
from agentrl.errors import AgentrlError
from agentrl.types import SamplingParams


def GymEnv(name, **kw):  # noqa: N802 (reads like the class)
    """GymEnv on a toy-text preset by name, or any gymnasium id with actions."""
    return _GymEnv(name if "actions" in kw else toy_text_spec(name), **kw)


FROZEN = ("left", "down", "right", "up")
SAMPLING = SamplingParams(max_tokens=64)


# ----------------------------------------------------------------------------- parsing and rendering


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<action>right</action>", 2),
        ("I think <action> UP </action>", 3),
        ("<action>left</action> no wait <action>down</action>", 1),
        ("<action>2</action>", 2),
        ("down", 1),
        ("Down.", 1),
        ("I should not go left; I will go right", 2),
        ("<action>go right please</action>", 2),
        ("downward leftish", None),
        ("<action>jump</action>", None),
        ("", None),
        ("<action>7</action>", None),
    ],
)
def test_parse_action(text, expected):
    assert parse_action(text, FROZEN) == expected


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parse_action_never_raises(text):
    got = parse_action(text, FROZEN)
    assert got is None or 0 <= got < len(FROZEN)


def test_ansi_highlight_is_kept_as_brackets():
    frame = "\n\x1b[41mS\x1b[0mFFF\nFHFH\n"
    assert ansi_to_text(frame) == "[S]FFF\nFHFH"


# ----------------------------------------------------------------------------- GymEnv on toy text


def task_replay(env: GymEnv):
    """A scripted policy that plays each task's own planned demonstration."""
    demos = {d[1].content: [m.content for m in d if m.role == "assistant"] for d in env.demonstrations(len(list(env.dataset())))}

    def policy(prompt: str) -> str:
        for opening, moves in demos.items():
            if opening in prompt:
                return moves[min(prompt.count("<|im_start|>assistant") - 1, len(moves) - 1)]
        raise AssertionError("no demonstration for this task")

    return policy


@pytest.mark.parametrize("name", ["frozenlake", "taxi", "blackjack"])
async def test_toy_text_passes_the_contract_checker(name):
    env = GymEnv(name, num_tasks=6, num_eval_tasks=3)
    report = await check_environment(env, num_episodes=3)
    assert report.ok, report.failures()
    train = {t.prompt[1].content for t in env.dataset()}
    assert not train & {t.prompt[1].content for t in env.eval_dataset()}


@pytest.mark.parametrize(("name", "solved_reward"), [("frozenlake", 1.0), ("taxi", None)])
async def test_planned_play_solves_deterministic_envs(name, solved_reward):
    env = GymEnv(name, num_tasks=4)
    client = ScriptedClient(task_replay(env))
    for task in env.dataset():
        traj = await env.rollout(client, task, SAMPLING)
        await env.rubric.score(traj)
        assert traj.error is None and traj.stop_reason == "done"
        assert traj.metrics["solved"] == 1.0 and traj.metrics["invalid_actions"] == 0
        if solved_reward is not None:
            assert traj.reward == solved_reward
        else:  # taxi: +20 for the drop-off minus one per move
            assert traj.reward == 20 - (traj.metrics["env_steps"] - 1)
        assert "The episode is over" in traj.messages[-1].content


async def test_blackjack_episode_ends_with_the_game():
    env = GymEnv("blackjack", num_tasks=5)
    client = ScriptedClient(lambda prompt: "<action>stick</action>")
    for task in env.dataset():
        traj = await env.rollout(client, task, SAMPLING)
        await env.rubric.score(traj)
        assert traj.stop_reason == "done" and len(traj.turns) == 1
        assert traj.reward in (-1.0, 0.0, 1.0, 1.5)


async def test_unparseable_replies_get_feedback_and_are_counted():
    env = GymEnv("frozenlake", num_tasks=1, max_invalid_actions=3)
    traj = await env.rollout(ScriptedClient(lambda p: "hmm, let me think"), next(iter(env.dataset())), SAMPLING)
    await env.rubric.score(traj)
    assert traj.error is None and traj.stop_reason == "done"
    assert traj.metrics["invalid_actions"] == 3 and traj.metrics["env_steps"] == 0 and traj.reward == 0.0
    feedback = [m.content for m in traj.messages if m.role == "user"][1]
    assert "could not find an action" in feedback and "left, down, right, up" in feedback


async def test_falling_in_a_hole_scores_zero():
    env = GymEnv("frozenlake", num_tasks=20)
    # pick a task whose map has a hole right below the start
    task = next(t for t in env.dataset() if t.prompt[1].content.splitlines()[1][0] == "H")
    traj = await env.rollout(ScriptedClient(lambda p: "<action>down</action>"), task, SAMPLING)
    await env.rubric.score(traj)
    assert traj.stop_reason == "done" and traj.reward == 0.0 and traj.metrics["solved"] == 0.0


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(AgentrlError, match="taxi"):
        toy_text_spec("CartPole-v1")
    with pytest.raises(AgentrlError, match="actions="):
        _GymEnv("CartPole-v1")


async def test_any_gymnasium_id_with_named_actions_uses_the_ansi_render():
    env = GymEnv("CliffWalking-v1", actions=["up", "right", "down", "left"], num_tasks=1, max_turns=3,
                 invalid_reward=-300.0)  # worst: the cliff (-100) on every turn
    task = next(iter(env.dataset()))
    assert task.prompt[1].content.splitlines()[-1].startswith("x  C")  # agent x at the bottom left
    traj = await env.rollout(ScriptedClient(lambda p: "<action>up</action>"), task, SAMPLING)
    assert traj.error is None and traj.metrics["env_steps"] == 3 and traj.stop_reason == "max_turns"
    assert traj.messages[-1].content.splitlines()[0].startswith("x  o")  # moved up three rows, rendered


# ----------------------------------------------------------------------------- as_gymnasium


def test_as_gymnasium_passes_check_env():
    genv = as_gymnasium(GymEnv("frozenlake", num_tasks=5))
    assert isinstance(genv.observation_space, gymnasium.spaces.Text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # check_env reports problems as warnings too
        check_env(genv, skip_render_check=True)
    genv.close()


def test_as_gymnasium_plays_a_solved_episode_for_the_final_reward():
    env = GymEnv("frozenlake", num_tasks=3)
    demo = env.demonstrations(1)[0]
    genv = as_gymnasium(env, render_mode="ansi")
    obs, info = genv.reset(seed=0, options={"task_index": 0})
    assert demo[1].content in obs and info["task_index"] == 0
    moves = [m.content for m in demo if m.role == "assistant"]
    rewards, terminated = [], False
    for move in moves:
        obs, reward, terminated, truncated, info = genv.step(move)
        rewards.append(reward)
        assert not truncated
    assert terminated and rewards[-1] == 1.0 and sum(rewards[:-1]) == 0.0
    assert info["metrics"]["solved"] == 1.0 and info["error"] is None
    genv.close()


def test_as_gymnasium_truncates_at_max_turns_and_needs_reset():
    genv = as_gymnasium(GymEnv("frozenlake", num_tasks=2), max_turns=2)
    genv.reset(seed=1)
    assert genv.step("nonsense")[3] is False
    obs, reward, terminated, truncated, info = genv.step("nonsense")
    assert truncated and not terminated and reward == 0.0 and "metrics" in info
    with pytest.raises(gymnasium.error.ResetNeeded):
        genv.step("<action>up</action>")
    genv.close()


async def test_as_gymnasium_works_inside_a_running_event_loop():
    genv = as_gymnasium(GymEnv("blackjack", num_tasks=2))
    obs, _ = genv.reset(seed=3)
    assert "Your cards sum to" in obs
    *_, terminated, _, _ = genv.step("<action>stick</action>")
    assert terminated
    genv.close()


def test_unicode_text_space_accepts_any_characters():
    space = UnicodeText(10)
    assert space.contains("héllo ✓\n") and not space.contains("x" * 11) and not space.contains(3)
    assert space.contains(space.sample())


def test_text_gym_env_rejects_unknown_render_mode():
    with pytest.raises(AgentrlError):
        TextGymEnv(GymEnv("blackjack", num_tasks=1), render_mode="rgb_array")


def test_a_tool_environment_through_gymnasium_reads_tool_calls_from_the_action_text():
    from agentrl.plugins import load_environment
    from agentrl.tool_format import format_assistant_text
    from agentrl.types import ToolCall

    genv = as_gymnasium(load_environment("calc", num_train=20))
    check_env(genv, skip_render_check=True)
    obs, _ = genv.reset(seed=0, options={"task_index": 0})
    question = obs.rsplit("What is ", 1)[1].split("?")[0]
    call = format_assistant_text("", [ToolCall("calculator", f'{{"expression": "{question}"}}')])
    obs, reward, terminated, truncated, _ = genv.step(call)
    assert obs.startswith("tool") and not terminated and reward == 0.0
    value = obs.split(":", 1)[1].strip()
    obs, reward, terminated, truncated, info = genv.step(f"The answer is {value}.")
    assert terminated and reward == 1.0 and info["error"] is None
    genv.close()


def test_every_installed_environment_can_be_made_through_gymnasium():
    from agentrl.envs.as_gym import register_all_gymnasium

    ids = register_all_gymnasium()
    assert "agentrl/guess-v0" in ids and "agentrl/gym-text-v0" in ids
    assert register_all_gymnasium() == ids  # idempotent
    env = gymnasium.make("agentrl/guess-v0", env_args={"num_train": 5, "num_eval": 5})
    obs, _ = env.reset(seed=0)
    assert "Make your first guess." in obs
    env.close()


@pytest.mark.timeout(60)  # a stall guard: linear takes milliseconds, the old regex about 10 minutes here
def test_parse_action_reads_a_reply_full_of_unclosed_tags_in_linear_time():
    """The regex ``<action>(.*?)</action>`` rescanned to the end from every unclosed tag: a reply
    of 30,000 of them held the event loop for about 30 s, this one for minutes."""
    assert parse_action("<action>" * 150_000 + "<action>right</action>", FROZEN) == FROZEN.index("right")
