"""A single-player TextArena game as an agentrl environment (the ``textarena`` package, unchanged).

One episode is one game: ``textarena.make(game)`` reset with the task's seed, the game's
observation is the first user message (after the task's system prompt), every model turn is
passed to ``env.step`` as the player's action, and the part of the next observation the game
appended (its feedback) is the env's reply.  When the game says done, ``env.close()`` gives the
player's reward, which the rubric returns; the game's reason (win, invalid move, turn limit)
lands in the episode's metrics as ``invalid_move``.  A move the game cannot even process (it
raises ``ValueError``/``AssertionError``, e.g. ``int()`` of 5000 digits) ends the episode as an
invalid move scoring ``-1``, textarena's own invalid-move penalty.  Multi-player games need
opponents and are refused.

Tasks are distinct games: seeds whose game (first observation, game state, the game's own
attributes) is already taken are skipped, so held-out tasks are games the training set lacks;
a game with fewer variants than asked for (GuessTheNumber has 20 secrets) splits what there
is, with a warning when ``num_tasks`` was set (unset: up to 200 training games, no warning).
Each episode plays with its own ``random`` state: textarena seeds the process-wide ``random``
in reset and some games draw from it during play (Bandit's payouts, Minesweeper's mines).
"""

from __future__ import annotations

import math
import random
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agentrl.envs import Environment
from agentrl.envs.base import State
from agentrl.errors import ConfigError
from agentrl.rubrics import Rubric
from agentrl.types import Message, Task

# textarena's invalid-move penalty (set_invalid_move's default; Bandit and Secretary use it):
# a move that crashes the game must never score above one the game rejects
CRASH_REWARD = -1.0
_PATIENCE = 200  # seeds in a row without a new game before a game's variants count as exhausted
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def game_reward(state: State) -> float:
    """The player's reward from the game's own ``close()`` (0 if the game never ended)."""
    return float(state.get("game_reward", 0.0))


def _inner(game: Any) -> Any:
    while hasattr(game, "env"):  # textarena's wrappers keep the game in .env
        game = game.env
    return game


def _canon(x: Any, depth: int = 0) -> Any:
    """A comparable, order-independent form of a game's state (dicts, sets, plain objects)."""
    if depth > 8:
        return type(x).__name__
    if isinstance(x, dict):
        return sorted(((repr(k), _canon(v, depth + 1)) for k, v in x.items()), key=lambda kv: kv[0])
    if isinstance(x, list | tuple):
        return [_canon(v, depth + 1) for v in x]
    if isinstance(x, set | frozenset):
        return sorted(repr(v) for v in x)
    if hasattr(x, "__dict__") and not callable(x) and not isinstance(x, random.Random):
        return [type(x).__name__, _canon(vars(x), depth + 1)]  # RushHour's vehicles
    return repr(x)


def game_key(game: Any) -> str:
    """What tells one game from another at reset: the first observation, the game's state and
    its own attributes (GuessTheNumber's secret is in its state, ThreeCardMonte's ball only in
    an attribute).  Call it on a fresh game: reading the observation consumes it."""
    inner = _inner(game)
    attrs = {k: v for k, v in vars(inner).items() if k != "state"}
    key = repr((str(game.get_observation()[1]), _canon(inner.state.game_state), _canon(attrs)))
    return _ADDRESS.sub("", key)  # object addresses differ between makes, the games do not


@contextmanager
def _own_random(state: State) -> Iterator[None]:
    """Run the block with the episode's ``random`` state in place of the process's, and keep
    what the block drew.  Callers never await inside it, so on one event loop no other episode
    runs in between and no lock is needed."""
    outer = random.getstate()
    random.setstate(state["random"])
    try:
        yield
    finally:
        state["random"] = random.getstate()
        random.setstate(outer)


class TextArenaEnv(Environment):
    """Any single-player TextArena game; see the module docstring."""

    version = "0.2.0"
    max_reward = None  # game-dependent

    def __init__(self, game: str = "GuessTheNumber-v0", num_tasks: int | None = None, max_turns: int = 24,
                 **kwargs: Any) -> None:
        import textarena

        self.game = game
        self._make = textarena.make
        self.asked = num_tasks is not None  # a number the user chose: falling short of it is worth a warning
        self.num_tasks = 200 if num_tasks is None else num_tasks
        self.num_eval_tasks = max(self.num_tasks // 10, 1)
        try:  # an unknown or multi-player game fails here, once
            first, _ = self._start(0)
        except AssertionError as e:  # textarena asserts the player count in reset
            raise ConfigError(f"textarena game {game!r} is not single-player ({e}); only single-player games are supported") from e
        if not isinstance(_inner(first).state, textarena.SinglePlayerState):  # some take 1 player without asking
            raise ConfigError(f"textarena game {game!r} is multi-player; only single-player games are supported")
        self._splits: tuple[list[Task], list[Task]] | None = None
        super().__init__(rubric=Rubric([game_reward]), max_turns=max_turns, name="textarena", **kwargs)

    def _start(self, seed: int) -> tuple[Any, Any]:
        """A fresh game for ``seed`` and the ``random`` state it plays on; the process's own
        ``random`` is left as it was (reset reseeds it, Countdown draws its numbers at make)."""
        outer = random.getstate()
        try:
            random.seed(seed)
            game = self._make(self.game)
            game.reset(num_players=1, seed=seed)
            return game, random.getstate()
        finally:
            random.setstate(outer)

    # ------------------------------------------------------------------ data

    def _distinct_seeds(self, want: int) -> tuple[list[int], int]:
        """Seeds of up to ``want`` distinct games from seed 0 on, and how many seeds were tried."""
        seeds: list[int] = []
        keys: set[str] = set()
        seed = misses = 0
        while len(seeds) < want and misses < _PATIENCE:
            key = game_key(self._start(seed)[0])
            if key in keys:
                misses += 1
            else:
                keys.add(key)
                seeds.append(seed)
                misses = 0
            seed += 1
        return seeds, seed

    def _split(self) -> tuple[list[Task], list[Task]]:
        if self._splits is None:
            want = self.num_tasks + self.num_eval_tasks
            seeds, tried = self._distinct_seeds(want)
            if len(seeds) == 1 and tried > 1:
                # every seed starts alike: games can only differ by what they draw during play
                # (Minesweeper places its mines on the first move), which no key sees at reset
                warnings.warn(f"every seed of {self.game} starts the same game; its tasks differ only if it draws "
                              "at random during play, so held-out tasks may repeat training games", stacklevel=3)  # fmt: skip
                seeds = list(range(want))
            n_eval = self.num_eval_tasks
            if len(seeds) < want:
                n_eval = math.ceil(len(seeds) * self.num_eval_tasks / want) if len(seeds) > 1 else 0
            if len(seeds) < want and self.asked:
                warnings.warn(f"{self.game} has only {len(seeds)} distinct games in {tried} seeds, not the "
                              f"{self.num_tasks} training + {self.num_eval_tasks} held-out asked for: using "
                              f"{len(seeds) - n_eval} + {n_eval}", stacklevel=3)  # fmt: skip
            n_train = min(self.num_tasks, len(seeds) - n_eval)
            tasks = [self._task(s) for s in seeds[: n_train + n_eval]]
            self._splits = tasks[:n_train], tasks[n_train:]
        return self._splits

    def _task(self, seed: int) -> Task:
        prompt = [Message("user", f"{self.game} (seed {seed})")]  # setup puts the game's observation here
        if self.system_prompt:
            prompt.insert(0, Message("system", self.system_prompt))
        return Task(prompt, info={"game": self.game, "seed": seed})

    def dataset(self) -> list[Task]:
        return self._split()[0]

    def eval_dataset(self) -> list[Task] | None:
        return self._split()[1] or None  # None: no game left to hold out, evaluate on dataset()

    # ------------------------------------------------------------------ episode hooks

    async def setup(self, task: Task) -> State:
        game, rng = self._start(int(task.info["seed"]))
        _, observation = game.get_observation()
        state = State(task, game=game, seen=observation, random=rng)
        system = [m for m in task.prompt if m.role == "system"]
        state["messages"] = [*system, Message("user", str(observation).strip())]
        return state

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        game = state["game"]
        with _own_random(state):
            try:
                done, _ = game.step(assistant_msg.content)
            except (ValueError, AssertionError):
                # the game choked on the move itself (int() of 5000 digits, an assert on its
                # shape): a wrong move to train on, not an environment failure to drop
                state["game_reward"] = CRASH_REWARD
                state.metrics["invalid_move"] = 1.0
                state.done = True
                return []
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


def load_environment(game: str = "GuessTheNumber-v0", num_tasks: int | None = None, **kwargs: Any) -> TextArenaEnv:
    return TextArenaEnv(game=game, num_tasks=num_tasks, **kwargs)
