"""gymnasium's toy-text games as an agentrl multi-turn environment (see README.md)."""

from __future__ import annotations

from typing import Any

from agentrl.envs.gym import TOY_TEXT, TOY_TEXT_ALIASES, GymEnv, toy_text_spec

GAMES = ("frozenlake", "taxi", "blackjack")


def load_environment(
    game: str = "frozenlake",
    num_tasks: int = 200,
    num_eval_tasks: int = 50,
    seed: int = 0,
    max_turns: int | None = None,
    max_invalid_actions: int = 3,
    gym_kwargs: dict[str, Any] | None = None,
    system_prompt: str | None = None,
) -> GymEnv:
    """One of :data:`GAMES` (or a gymnasium id such as ``"Taxi-v4"``) as a text game.

    ``gym_kwargs`` go to ``gymnasium.make`` (e.g. ``{"is_slippery": true}`` for FrozenLake).
    """
    if game.lower() not in GAMES and game not in TOY_TEXT and game.lower() not in TOY_TEXT_ALIASES:
        raise ValueError(f"unknown game {game!r}; choose one of {', '.join(GAMES)}")
    spec = toy_text_spec(game)
    kwargs: dict[str, Any] = {}
    if max_turns is not None:
        kwargs["max_turns"] = max_turns
    if system_prompt is not None:
        kwargs["system_prompt"] = system_prompt
    return GymEnv(
        spec,
        make_kwargs=gym_kwargs,
        num_tasks=num_tasks,
        num_eval_tasks=num_eval_tasks,
        seed=seed,
        max_invalid_actions=max_invalid_actions,
        name=f"gym-text-{spec.env_id.split('-')[0].lower()}",
        version="0.1.0",
        **kwargs,
    )
