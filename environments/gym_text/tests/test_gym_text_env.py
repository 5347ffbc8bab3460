"""gym-text package: found by entry point and by path, passes the contract checker per game,
and round-trips back into gymnasium."""

import dataclasses
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from agentrl.envs.as_gym import register_gymnasium
from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.envs.gym import GymEnv
from agentrl.errors import AgentrlError
from agentrl.plugins import load_environment
from agentrl.types import SamplingParams

PACKAGE_DIR = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("game", ["frozenlake", "taxi", "blackjack"])
async def test_each_game_passes_the_contract_checker(game):
    env = load_environment("gym-text", game=game, num_tasks=8, num_eval_tasks=4)
    assert isinstance(env, GymEnv) and env.name == f"gym-text-{game}"
    report = await check_environment(env, num_episodes=3)
    assert report.ok, report.failures()


async def test_loads_from_the_package_directory_with_pyproject_defaults():
    env = load_environment(str(PACKAGE_DIR), num_tasks=3)
    assert env.spec.env_id == "FrozenLake-v1"  # load_environment's default game
    assert len(list(env.dataset())) == 3


async def test_gym_kwargs_reach_gymnasium():
    env = load_environment("gym-text", game="frozenlake", num_tasks=30, gym_kwargs={"is_slippery": True})
    # slippery ice: the same move from the same start does not always go the same way
    task = next(iter(env.dataset()))
    ends = set()
    for seed in range(12):
        reseeded = dataclasses.replace(task, info={**task.info, "seed": seed})
        traj = await env.rollout(
            ScriptedClient(lambda p: "<action>right</action>"), reseeded, SamplingParams(max_tokens=32), max_turns=1
        )
        ends.add(traj.messages[-1].content.splitlines()[-2])
    assert len(ends) > 1


def test_unknown_game_is_a_one_line_error():
    with pytest.raises(AgentrlError, match="unknown game"):
        load_environment("gym-text", game="chess")


def test_registered_gymnasium_env_passes_check_env():
    env_id = register_gymnasium("gym-text", {"game": "taxi", "num_tasks": 5})
    assert env_id == "agentrl/gym-text-v0"
    env = gymnasium.make(env_id, disable_env_checker=True)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert "Taxi (T)" in obs
    obs, reward, terminated, truncated, _ = env.step("<action>north</action>")
    assert "Reward: -1" in obs and not truncated
    env.close()
