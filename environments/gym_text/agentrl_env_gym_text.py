"""gymnasium's toy-text games as an agentrl multi-turn environment (see README.md)."""

from __future__ import annotations

from typing import Any

import gymnasium

from agentrl.envs import GymEnv
from agentrl.envs.gym import GymTextSpec
from agentrl.errors import AgentrlError

GAMES = ("frozenlake", "taxi", "blackjack")

# ----------------------------------------------------------------------------- the presets

def _frozen_lake_text(env: gymnasium.Env, obs: Any) -> str:
    lake = env.unwrapped
    rows = [[c.decode() for c in row] for row in lake.desc]
    row, col = divmod(int(obs), lake.ncol)
    rows[row][col] = "*"
    grid = "\n".join("".join(r) for r in rows)
    return f"{grid}\nYou (*) are at row {row + 1}, column {col + 1}."


_TAXI_STOPS = "RGYB"


def _taxi_text(env: gymnasium.Env, obs: Any) -> str:
    taxi = env.unwrapped
    row, col, passenger, dest = taxi.decode(int(obs))
    rows = [[c.decode() for c in r] for r in taxi.desc]
    rows[1 + row][2 * col + 1] = "T"
    grid = "\n".join("".join(r) for r in rows)
    where = "in the taxi" if passenger == 4 else f"waiting at {_TAXI_STOPS[passenger]}"
    return (
        f"{grid}\nTaxi (T) at row {row + 1}, column {col + 1}. "
        f"Passenger: {where}. Destination: {_TAXI_STOPS[dest]}."
    )


def _blackjack_text(env: gymnasium.Env, obs: Any) -> str:
    player, dealer, usable_ace = (int(x) for x in obs)
    dealer_card = "an ace" if dealer == 1 else str(dealer)
    ace = " (including an ace counted as 11)" if usable_ace else ""
    return f"Your cards sum to {player}{ace}. The dealer shows {dealer_card}."


def _random_lake(seed: int) -> dict[str, Any]:
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    return {"desc": generate_random_map(size=4, seed=seed)}


TOY_TEXT: dict[str, GymTextSpec] = {
    "FrozenLake-v1": GymTextSpec(
        env_id="FrozenLake-v1",
        actions=("left", "down", "right", "up"),
        instructions=(
            "You walk on a frozen lake drawn as a grid: S start, F frozen (safe), H hole, G goal, "
            "* is you. Reach G without stepping into a hole. Each move goes one square; moving "
            "into the edge leaves you in place. Reward 1 for reaching the goal, else 0."
        ),
        describe=_frozen_lake_text,
        make_kwargs={"is_slippery": False},
        task_kwargs=_random_lake,
        max_turns=20,
        return_range=lambda turns: (0.0, 1.0),
    ),
    "Taxi-v4": GymTextSpec(
        env_id="Taxi-v4",
        actions=("south", "north", "east", "west", "pickup", "dropoff"),
        instructions=(
            "You drive a taxi (T) on a 5x5 grid drawn with walls '|' (':' is passable). Row 1 is "
            "the top (north), column 1 the left (west). Drive to the passenger, pick them up, "
            "drive to the destination stop (R, G, Y or B) and drop them off. Each move costs 1, "
            "a wrong pickup/dropoff costs 10, a successful dropoff earns 20."
        ),
        describe=_taxi_text,
        max_turns=40,
        return_range=lambda turns: (-10.0 * turns, 20.0),
    ),
    "Blackjack-v1": GymTextSpec(
        env_id="Blackjack-v1",
        actions=("stick", "hit"),
        instructions=(
            "You play blackjack against a dealer. Get a card sum closer to 21 than the dealer "
            "without going over. 'hit' draws a card; 'stick' stops and lets the dealer play. "
            "Win +1, draw 0, lose -1."
        ),
        describe=_blackjack_text,
        max_turns=10,
        return_range=lambda turns: (-1.0, 1.5),
    ),
}
TOY_TEXT_ALIASES = {"frozenlake": "FrozenLake-v1", "frozen_lake": "FrozenLake-v1", "taxi": "Taxi-v4", "blackjack": "Blackjack-v1"}


def toy_text_spec(name: str) -> GymTextSpec:
    """The built-in spec for ``name`` (a gymnasium id or an alias like ``"taxi"``)."""
    key = TOY_TEXT_ALIASES.get(name.lower().replace("-", "_"), name)
    if key not in TOY_TEXT:
        known = sorted({*TOY_TEXT, *TOY_TEXT_ALIASES})
        raise AgentrlError(f"no text preset for gymnasium env {name!r}; known: {', '.join(known)}")
    return TOY_TEXT[key]


# ----------------------------------------------------------------------------- the plugin


def load_environment(
    game: str = "frozenlake",
    num_tasks: int = 200,
    num_eval_tasks: int = 50,
    seed: int = 0,
    max_turns: int | None = None,
    max_invalid_actions: int = 3,
    invalid_reward: float | None = None,
    gym_kwargs: dict[str, Any] | None = None,
    system_prompt: str | None = None,
) -> GymEnv:
    """One of :data:`GAMES` (or a gymnasium id such as ``"Taxi-v4"``) as a text game.

    ``gym_kwargs`` go to ``gymnasium.make`` (e.g. ``{"is_slippery": true}`` for FrozenLake).
    ``invalid_reward``: what an episode that ends before the game did scores (too many replies
    without an action, a cut-off reply); default the game's worst return (0 / -10*max_turns /
    -1), so refusing to play never beats playing.
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
        invalid_reward=invalid_reward,
        name=f"gym-text-{spec.env_id.split('-')[0].lower()}",
        version="0.1.0",
        **kwargs,
    )
