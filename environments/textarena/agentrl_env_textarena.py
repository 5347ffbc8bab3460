"""A single-player TextArena game as an agentrl environment (the ``textarena`` package, unchanged).

One episode is one game: ``textarena.make(game)`` reset with the task's seed, the game's
observation is the first user message, every model turn is passed to ``env.step`` as the
player's action, and the part of the next observation the game appended (its feedback) is
the env's reply.  When the game says done, ``env.close()`` gives the player's reward, which
the rubric returns; the game's reason (win, invalid move, turn limit) lands in the episode's
metrics as ``invalid_move``.  Multi-player games need opponents and are refused.
"""

from __future__ import annotations

from typing import Any

from agentrl.envs import Environment
from agentrl.envs.base import State
from agentrl.rubrics import Rubric
from agentrl.types import Message, Task


def game_reward(state: State) -> float:
    """The player's reward from the game's own ``close()`` (0 if the game never ended)."""
    return float(state.get("game_reward", 0.0))


class TextArenaEnv(Environment):
    """Any single-player TextArena game; see the module docstring."""

    version = "0.1.0"
    max_reward = None  # game-dependent

    def __init__(self, game: str = "GuessTheNumber-v0", num_tasks: int = 200, max_turns: int = 24, **kwargs: Any) -> None:
        import textarena

        self.game = game
        self._make = textarena.make
        self._make(game).reset(num_players=1, seed=0)  # an unknown or multi-player game fails here, once
        tasks = [Task([Message("user", f"{game} (seed {i})")], info={"game": game, "seed": i}) for i in range(num_tasks)]
        held = [Task([Message("user", f"{game} (seed {i})")], info={"game": game, "seed": i})
                for i in range(10_000, 10_000 + max(num_tasks // 10, 1))]  # fmt: skip
        super().__init__(dataset=tasks, eval_dataset=held, rubric=Rubric([game_reward]), max_turns=max_turns,
                         name="textarena", **kwargs)  # fmt: skip

    async def setup(self, task: Task) -> State:
        game = self._make(task.info["game"])
        game.reset(num_players=1, seed=int(task.info["seed"]))
        _, observation = game.get_observation()
        state = State(task, game=game, seen=observation)
        state["messages"] = [Message("user", str(observation).strip())]
        return state

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        game = state["game"]
        done, _ = game.step(assistant_msg.content)
        if done:
            rewards, info = game.close()
            state["game_reward"] = float(rewards.get(0, 0.0))
            state.metrics["invalid_move"] = float(bool(info.get(0, {}).get("invalid_move", False)))
            state.done = True
            return []
        _, observation = game.get_observation()
        new = str(observation)[len(state["seen"]):] if str(observation).startswith(state["seen"]) else str(observation)
        state["seen"] = observation
        return [Message("user", new.strip() or "(no feedback)")]


def load_environment(game: str = "GuessTheNumber-v0", num_tasks: int = 200, **kwargs: Any) -> TextArenaEnv:
    return TextArenaEnv(game=game, num_tasks=num_tasks, **kwargs)
