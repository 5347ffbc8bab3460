"""gymnasium → agentrl: a gymnasium environment played by a language model.

``GymEnv``: a gymnasium environment whose observations can be written as text, played as
an agentrl multi-turn environment.  Each task is one seeded episode; the model names an
action in its reply (``<action>right</action>``, or just the action's name); the env
replies with the next observation.  A reply that names no action gets a feedback message
and counts in ``metrics["invalid_actions"]``; after ``max_invalid_actions`` of them the
episode ends.  Reward: the episode's return (sum of gymnasium rewards), except that an
episode which ends before the game did (too many replies without an action, a reply cut off
by a token limit) is a forfeit and scores ``invalid_reward``: by default the lower bound of
``reward_range``, so refusing to play never scores better than the worst legal play.
Running out of turns or of context is not a forfeit: the return so far stands.  Presets for
gymnasium's toy-text FrozenLake, Taxi and Blackjack live in the ``gym_text`` environment
package (``environments/gym_text``).  The other direction (any agentrl environment as a
``gymnasium.Env``) is :mod:`agentrl.envs.as_gym`.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium

from agentrl.envs.base import State
from agentrl.envs.multiturn import MultiTurnEnv
from agentrl.errors import AgentrlError
from agentrl.rubrics import Rubric, tagged
from agentrl.types import Message, Task, Trajectory

__all__ = [
    "GymEnv", "GymTextSpec", "parse_action", "ansi_to_text", "render_ansi", "episode_return", "solved", "forfeited",
]

# ----------------------------------------------------------------------------- text rendering

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HIGHLIGHT = re.compile(r"\x1b\[(?:4\d|10\d)(?:;[0-9]+)*m(.*?)\x1b\[0m", re.DOTALL)


def ansi_to_text(frame: str) -> str:
    """A terminal frame as plain text: background-highlighted cells become ``[x]``, colours go.

    gymnasium's ``ansi`` renders mark the agent with a background colour, which plain
    stripping would lose.
    """
    frame = _HIGHLIGHT.sub(lambda m: f"[{_ANSI.sub('', m.group(1))}]", frame)
    return _ANSI.sub("", frame).strip("\n")


def render_ansi(env: gymnasium.Env, obs: Any) -> str:
    """Default observation text: the env's ``ansi`` render, else ``str(obs)``."""
    if env.render_mode == "ansi":
        frame = env.render()
        if isinstance(frame, str):
            return ansi_to_text(frame)
    return f"Observation: {obs}"


_ACTION_FORMAT = "Reply with exactly one action inside <action></action> tags, for example <action>{example}</action>."


@dataclass(frozen=True)
class GymTextSpec:
    """How one gymnasium environment is played in text.

    ``actions`` names the discrete actions (index = gymnasium action).  ``describe`` turns an
    observation into text (it may read the env, e.g. its map).  ``task_kwargs(seed)`` gives
    per-task ``gymnasium.make`` kwargs (JSON-able; stored on the task) so tasks differ in more
    than the reset seed.
    """

    env_id: str
    actions: tuple[str, ...]
    instructions: str
    describe: Callable[[gymnasium.Env, Any], str] = render_ansi
    make_kwargs: dict[str, Any] = field(default_factory=dict)
    task_kwargs: Callable[[int], dict[str, Any]] | None = None
    max_turns: int = 30
    return_range: Callable[[int], tuple[float, float]] | None = None  # max_turns -> bounds

    def system_prompt(self) -> str:
        names = ", ".join(self.actions)
        return f"{self.instructions}\nActions: {names}.\n" + _ACTION_FORMAT.format(example=self.actions[0])


# ----------------------------------------------------------------------------- action parsing

def parse_action(text: str, actions: Sequence[str]) -> int | None:
    """The action index a reply names, or ``None`` if it names none.  Never raises.

    Order: the last ``<action>...</action>`` block (a name or an index); without tags, the
    whole reply if it is one name or index, else the last action name written as a word.
    """
    names = [a.casefold() for a in actions]

    def lookup(word: str) -> int | None:
        word = word.strip().strip(".!'\"`*").strip().casefold()
        if word in names:
            return names.index(word)
        if re.fullmatch(r"[0-9]{1,3}", word) and int(word) < len(names):
            return int(word)
        return None

    blocks = tagged(text, "action")  # linear: a reply full of unclosed tags must not stall the loop
    if blocks:
        found = lookup(blocks[-1])
        return found if found is not None else _last_named(blocks[-1], names)
    found = lookup(text)
    return found if found is not None else _last_named(text, names)


def _last_named(text: str, names: list[str]) -> int | None:
    best, best_pos = None, -1
    folded = text.casefold()
    for i, name in enumerate(names):
        for m in re.finditer(rf"(?<![\w-]){re.escape(name)}(?![\w-])", folded):
            if m.start() > best_pos:
                best, best_pos = i, m.start()
    return best


# ----------------------------------------------------------------------------- GymEnv

_INVALID = "I could not find an action in your reply. Valid actions: {names}. " + _ACTION_FORMAT


def forfeited(state: State, trajectory: Trajectory | None = None) -> float:
    """1.0 if the episode ended before the game did because of the policy's replies: too many
    without an action, or (from the trajectory) a reply cut off at ``max_tokens`` or the env's
    sampled-token budget.  Running out of turns or of context is not a forfeit."""
    if state.get("forfeit"):
        return 1.0
    if state.get("terminated") or state.get("truncated") or trajectory is None:
        return 0.0
    # "length" / "max_tokens" count only sampled tokens: rambling is a way to quit a losing game.
    # "prompt_too_long" also counts the env's observations, which a long legal game can fill.
    return 1.0 if trajectory.stop_reason in ("length", "max_tokens") else 0.0


def episode_return(state: State, trajectory: Trajectory | None = None) -> float:
    """Sum of the gymnasium rewards collected in the episode; a forfeit (:func:`forfeited`)
    scores ``state["invalid_reward"]`` instead, when the env set one."""
    floor = state.get("invalid_reward")
    if floor is not None and forfeited(state, trajectory):
        return float(floor)
    return float(state.get("return", 0.0))


def solved(state: State) -> float:
    """1.0 if the episode terminated (not truncated) on a positive final reward."""
    return 1.0 if state.get("terminated") and state.get("last_reward", 0.0) > 0 else 0.0


class GymEnv(MultiTurnEnv):
    """A text-observable gymnasium environment as an agentrl multi-turn environment.

    ``env`` is a :class:`GymTextSpec`, or any gymnasium id with ``actions`` naming its
    discrete actions (observations then default to the ``ansi`` render).  Tasks are seeds
    ``seed .. seed+num_tasks-1`` (eval: a disjoint range).  ``invalid_reward``: what a
    forfeit scores (module docstring); default the lower bound of ``reward_range`` (the
    spec's ``return_range``), which must be no better than the worst legal return.  An env
    with neither keeps the return so far, with a warning: pass its worst return.
    gymnasium calls run inline: toy-text steps take microseconds.
    """

    def __init__(
        self,
        env: str | GymTextSpec,
        *,
        actions: Sequence[str] | None = None,
        instructions: str | None = None,
        describe: Callable[[gymnasium.Env, Any], str] | None = None,
        make_kwargs: dict[str, Any] | None = None,
        num_tasks: int = 200,
        num_eval_tasks: int = 50,
        seed: int = 0,
        max_invalid_actions: int = 3,
        invalid_reward: float | None = None,
        rubric: Rubric | None = None,
        **kwargs: Any,
    ) -> None:
        spec = self._resolve(env, actions, instructions)
        if describe is not None or make_kwargs is not None:
            spec = dataclasses.replace(
                spec, describe=describe or spec.describe, make_kwargs={**spec.make_kwargs, **(make_kwargs or {})}
            )
        self.spec = spec
        kwargs.setdefault("max_turns", spec.max_turns)
        kwargs.setdefault("system_prompt", spec.system_prompt())
        kwargs.setdefault("name", "gym-" + spec.env_id.split("/")[-1].lower())
        if rubric is None:
            rubric = Rubric([episode_return, solved, forfeited], weights=[1.0, 0.0, 0.0])
        super().__init__(rubric=rubric, **kwargs)
        if spec.return_range is not None:
            self.reward_range = spec.return_range(self.max_turns)
        if invalid_reward is None and self.reward_range is not None:
            invalid_reward = self.reward_range[0]
        if invalid_reward is None:
            warnings.warn(
                f"GymEnv({spec.env_id!r}) knows no worst return, so a forfeit keeps its return so far and "
                "refusing to play may pay; pass invalid_reward= (the env's worst return)",
                stacklevel=2,
            )
        self.invalid_reward = invalid_reward
        self.num_tasks, self.num_eval_tasks, self.seed = num_tasks, num_eval_tasks, seed
        self.max_invalid_actions = max_invalid_actions
        self._tasks: dict[str, list[Task]] = {}

    @staticmethod
    def _resolve(env: str | GymTextSpec, actions: Sequence[str] | None, instructions: str | None) -> GymTextSpec:
        if isinstance(env, GymTextSpec):
            return env
        if actions is None:
            raise AgentrlError(
                f"GymEnv({env!r}) needs actions= naming its discrete actions, or a GymTextSpec; "
                "toy-text presets (frozenlake, taxi, blackjack) are in the gym_text environment"
            )
        return GymTextSpec(env_id=env, actions=tuple(actions), instructions=instructions or f"You play {env}.")

    # ------------------------------------------------------------------ data

    def _make(self, info: dict[str, Any]) -> gymnasium.Env:
        kwargs = {**self.spec.make_kwargs, **info.get("make_kwargs", {})}
        render_mode = "ansi" if self.spec.describe is render_ansi else None
        try:
            return gymnasium.make(self.spec.env_id, render_mode=render_mode, **kwargs)
        except gymnasium.error.Error as e:
            raise AgentrlError(f"cannot make gymnasium env {self.spec.env_id!r}: {e}") from e

    def _tasks_from(self, seeds: Iterable[int], n: int, exclude: set[str]) -> list[Task]:
        """Up to ``n`` tasks with distinct opening observations, none of them in ``exclude``.

        Small envs repeat start states (Blackjack has ~280), so seeds whose opening is
        already taken are skipped: a prompt is one task, and held-out means unseen.
        """
        tasks: list[Task] = []
        shared: gymnasium.Env | None = None  # one env serves every seed unless maps differ per task
        try:
            for seed in seeds:
                if len(tasks) >= n:
                    break
                info: dict[str, Any] = {"env_id": self.spec.env_id, "seed": seed}
                if self.spec.task_kwargs is not None:
                    info["make_kwargs"] = self.spec.task_kwargs(seed)
                    env = self._make(info)
                else:
                    env = shared = shared or self._make(info)
                try:
                    obs, _ = env.reset(seed=seed)
                    first = self.spec.describe(env, obs)
                finally:
                    if env is not shared:
                        env.close()
                if first in exclude:
                    continue
                exclude.add(first)
                prompt = [Message("system", self.system_prompt or ""), Message("user", first)]
                tasks.append(Task(prompt=prompt, info=info, id=f"{self.name}-{seed}"))
        finally:
            if shared is not None:
                shared.close()
        return tasks

    def _splits(self) -> dict[str, list[Task]]:
        if not self._tasks:
            taken: set[str] = set()
            scan = 50  # seeds tried per wanted task before giving up on more distinct openings
            self._tasks["train"] = self._tasks_from(range(self.seed, self.seed + scan * self.num_tasks), self.num_tasks, taken)
            # eval seeds start far from the training seeds and skip every training opening
            start = self.seed + 1_000_000
            self._tasks["eval"] = self._tasks_from(range(start, start + scan * self.num_eval_tasks), self.num_eval_tasks, taken)
        return self._tasks

    def dataset(self) -> Iterable[Task]:
        return self._splits()["train"]

    def eval_dataset(self) -> Iterable[Task] | None:
        return self._splits()["eval"]

    # ------------------------------------------------------------------ episode hooks

    async def setup(self, task: Task) -> State:
        state = State(task)
        env = self._make(task.info)
        obs, _ = env.reset(seed=int(task.info["seed"]))
        state.update(gym=env, obs=obs, terminated=False, truncated=False, last_reward=0.0)
        state.update({"return": 0.0, "forfeit": False, "invalid_reward": self.invalid_reward})
        state.metrics.update(invalid_actions=0.0, env_steps=0.0)
        return state

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        action = parse_action(assistant_msg.content, self.spec.actions)
        if action is None:
            state.count("invalid_actions")
            if state.metrics["invalid_actions"] >= self.max_invalid_actions:
                state.done = state["forfeit"] = True
                return [Message("user", "Too many replies without a valid action; the episode is over.")]
            names = ", ".join(self.spec.actions)
            return [Message("user", _INVALID.format(names=names, example=self.spec.actions[0]))]
        env: gymnasium.Env = state["gym"]
        obs, reward, terminated, truncated, _ = env.step(action)
        state.count("env_steps")
        state["return"] += float(reward)
        state.update(obs=obs, last_reward=float(reward), terminated=bool(terminated), truncated=bool(truncated))
        text = f"{self.spec.describe(env, obs)}\nReward: {float(reward):g}."
        if terminated or truncated:
            state.done = True
            text += f"\nThe episode is over. Total reward: {state['return']:g}."
        return [Message("user", text)]

    async def cleanup(self, state: State) -> None:
        env = state.pop("gym", None)
        if env is not None:
            env.close()

    # ------------------------------------------------------------------ demonstrations

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """Solved episodes from a planner: shortest path for deterministic envs (FrozenLake
        without slipping, Taxi), 'hit below 17' for Blackjack."""
        demos: list[list[Message]] = []
        for task in list(self.dataset())[seed:]:
            if len(demos) >= n:
                break
            demo = self._demonstrate(task)
            if demo is not None:
                demos.append(demo)
        return demos

    def _demonstrate(self, task: Task) -> list[Message] | None:
        env = self._make(task.info)
        try:
            obs, _ = env.reset(seed=int(task.info["seed"]))
            plan = _shortest_plan(env.unwrapped, int(obs)) if hasattr(env.unwrapped, "P") else None
            messages = list(task.prompt)
            for _ in range(self.max_turns):
                if plan is not None:
                    if not plan:
                        return None
                    action = plan.pop(0)
                elif self.spec.env_id.startswith("Blackjack"):
                    action = 1 if int(obs[0]) < 17 else 0
                else:
                    return None
                messages.append(Message("assistant", f"<action>{self.spec.actions[action]}</action>"))
                obs, reward, terminated, truncated, _ = env.step(action)
                if terminated or truncated:
                    return messages
                messages.append(Message("user", f"{self.spec.describe(env, obs)}\nReward: {float(reward):g}."))
            return None
        finally:
            env.close()


def _shortest_plan(model: Any, start: int) -> list[int] | None:
    """Breadth-first search over a toy-text transition table ``P[s][a] = [(p, s2, r, done)]``
    to the nearest terminal state with positive reward; None if transitions are random."""
    P = model.P
    parents: dict[int, tuple[int, int] | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt: list[int] = []
        for s in frontier:
            for a, outcomes in P[s].items():
                if len(outcomes) != 1:
                    return None
                _, s2, r, done = outcomes[0]
                if done and r > 0:
                    plan = [a]
                    while parents[s] is not None:
                        s, a_prev = parents[s]
                        plan.append(a_prev)
                    return plan[::-1]
                if not done and s2 not in parents:
                    parents[s2] = (s, a)
                    nxt.append(s2)
        frontier = nxt
    return None
