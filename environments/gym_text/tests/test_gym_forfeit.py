"""Refusing to play never scores better than playing: an episode that ends before the game
did (replies without an action, a reply cut off by the token limit) scores the preset's
worst return, not the return so far."""

import re

import pytest
from agentrl_env_gym_text import load_environment, toy_text_spec

from agentrl.envs.check import ScriptedClient
from agentrl.envs.gym import GymEnv
from agentrl.types import SamplingParams

SAMPLING = SamplingParams(max_tokens=64)
GAMES = ["frozenlake", "taxi", "blackjack"]


async def play(env, task, policy, sampling=SAMPLING):
    traj = await env.rollout(ScriptedClient(policy), task, sampling)
    await env.rubric.score(traj)
    assert traj.error is None, traj.error
    return traj


@pytest.mark.parametrize("game", GAMES)
async def test_refusing_scores_no_better_than_the_worst_legal_play(game):
    env = load_environment(game, num_tasks=8, num_eval_tasks=1)
    floor = env.reward_range[0]  # the preset's worst legal return
    for task in env.dataset():  # every constant-action policy stays at or above it
        legal = [await play(env, task, lambda p, a=a: f"<action>{a}</action>") for a in env.spec.actions]
        assert all(t.reward >= floor for t in legal)
        refused = await play(env, task, lambda p: "I'd rather not.")
        assert refused.metrics["invalid_actions"] == 3 and refused.metrics["forfeited"] == 1.0
        assert refused.reward == floor <= min(t.reward for t in legal)


async def test_blackjack_abstaining_on_a_weak_opening_costs_a_loss():
    """The review's repro: on 12-16 against a dealer's 7+, sticking averages about -0.58; three
    replies without an action scored 0 (better than any legal play)."""
    env = load_environment("blackjack", num_tasks=60, num_eval_tasks=1)
    weak = [t for t in env.dataset()
            if (m := re.search(r"sum to (\d+)\. The dealer shows (an ace|\d+)", t.prompt[-1].content))
            and 12 <= int(m[1]) <= 16 and (m[2] == "an ace" or int(m[2]) >= 7)]
    assert weak
    for task in weak:
        assert (await play(env, task, lambda p: "I pass.")).reward == -1.0


async def test_moving_then_refusing_scores_the_floor_not_the_return_so_far():
    env = load_environment("taxi", num_tasks=1, num_eval_tasks=1)
    replies = iter(["<action>north</action>"] * 2 + ["hmm"] * 3)
    traj = await play(env, env.dataset()[0], lambda p: next(replies))
    assert traj.metrics["env_steps"] == 2 and traj.reward == env.reward_range[0] == -400.0


@pytest.mark.parametrize(("limit", "stop"), [({"max_tokens": 8}, "length"), ({"max_total_tokens": 8}, "max_tokens")])
async def test_a_reply_cut_off_before_the_game_ended_is_a_forfeit(limit, stop):
    """Rambling past a token limit was another way to leave a losing hand at 0."""
    env = GymEnv(toy_text_spec("blackjack"), num_tasks=3, num_eval_tasks=1, max_total_tokens=limit.get("max_total_tokens"))
    sampling = SamplingParams(max_tokens=limit.get("max_tokens", 64))
    for task in env.dataset():
        traj = await play(env, task, lambda p: "let me think " * 50, sampling)
        assert traj.stop_reason == stop and traj.reward == -1.0 and traj.metrics["forfeited"] == 1.0


async def test_running_out_of_turns_while_playing_keeps_the_return():
    env = load_environment("taxi", num_tasks=1, num_eval_tasks=1, max_turns=5)
    traj = await play(env, env.dataset()[0], lambda p: "<action>north</action>")
    assert traj.stop_reason == "max_turns" and traj.reward == -5.0 and traj.metrics["forfeited"] == 0.0


async def test_invalid_reward_is_configurable():
    env = load_environment("taxi", num_tasks=1, num_eval_tasks=1, invalid_reward=-50.0)
    assert (await play(env, env.dataset()[0], lambda p: "hmm")).reward == -50.0


def test_an_env_without_a_known_worst_return_warns():
    with pytest.warns(UserWarning, match="invalid_reward="):
        GymEnv("CliffWalking-v1", actions=["up", "right", "down", "left"], num_tasks=1)
