"""The gymnasium bridge, both ways.

``GymEnv``: a gymnasium environment whose observations can be written as text, played by a
language model as an agentrl multi-turn environment.  Each task is one seeded episode; the
model names an action in its reply (``<action>right</action>``, or just the action's name);
the env replies with the next observation.  A reply that names no action gets a feedback
message and counts in ``metrics["invalid_actions"]``; after ``max_invalid_actions`` of
them the episode ends.  Reward: the episode's return (sum of gymnasium rewards).  Presets
for gymnasium's toy-text FrozenLake, Taxi and Blackjack are in :data:`TOY_TEXT`.

``as_gymnasium(env)``: any agentrl environment as a ``gymnasium.Env`` whose observations
and actions are text: ``reset`` starts a task (chosen by the seeded RNG, or
``options={"task_index": i}``) and returns its prompt; ``step(text)`` is one model turn and
returns the env's reply; the rubric's reward arrives on the final step.
``register_gymnasium(name)`` registers an installed agentrl environment as
``agentrl/<name>-v0`` for ``gymnasium.make``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import string
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium
from gymnasium import spaces

from agentrl.envs.base import Environment, State
from agentrl.envs.multiturn import MultiTurnEnv
from agentrl.errors import AgentrlError
from agentrl.rubrics import Rubric
from agentrl.types import Message, Task, Trajectory, Turn

__all__ = [
    "GymEnv",
    "GymTextSpec",
    "TOY_TEXT",
    "toy_text_spec",
    "parse_action",
    "ansi_to_text",
    "render_ansi",
    "as_gymnasium",
    "register_gymnasium",
    "register_all_gymnasium",
    "UnicodeText",
    "TextGymEnv",
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


# ----------------------------------------------------------------------------- action parsing

_ACTION_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)


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

    tagged = _ACTION_TAG.findall(text)
    if tagged:
        found = lookup(tagged[-1])
        return found if found is not None else _last_named(tagged[-1], names)
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


def episode_return(state: State) -> float:
    """Sum of the gymnasium rewards collected in the episode."""
    return float(state.get("return", 0.0))


def solved(state: State) -> float:
    """1.0 if the episode terminated (not truncated) on a positive final reward."""
    return 1.0 if state.get("terminated") and state.get("last_reward", 0.0) > 0 else 0.0


class GymEnv(MultiTurnEnv):
    """A text-observable gymnasium environment as an agentrl multi-turn environment.

    ``env`` is a :class:`GymTextSpec`, a toy-text name/alias (``"taxi"``), or any gymnasium
    id (then ``actions`` must name its discrete actions and observations default to the
    ``ansi`` render).  Tasks are seeds ``seed .. seed+num_tasks-1`` (eval: a disjoint range).
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
            rubric = Rubric([episode_return, solved], weights=[1.0, 0.0])
        super().__init__(rubric=rubric, **kwargs)
        if spec.return_range is not None:
            self.reward_range = spec.return_range(self.max_turns)
        self.num_tasks, self.num_eval_tasks, self.seed = num_tasks, num_eval_tasks, seed
        self.max_invalid_actions = max_invalid_actions
        self._tasks: dict[str, list[Task]] = {}

    @staticmethod
    def _resolve(env: str | GymTextSpec, actions: Sequence[str] | None, instructions: str | None) -> GymTextSpec:
        if isinstance(env, GymTextSpec):
            return env
        if actions is None:
            return toy_text_spec(env)
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
        state["return"] = 0.0
        state.metrics.update(invalid_actions=0.0, env_steps=0.0)
        return state

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        action = parse_action(assistant_msg.content, self.spec.actions)
        if action is None:
            state.count("invalid_actions")
            if state.metrics["invalid_actions"] >= self.max_invalid_actions:
                state.done = True
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


# ----------------------------------------------------------------------------- as_gymnasium


class UnicodeText(spaces.Text):
    """``gymnasium.spaces.Text`` holding any Unicode string up to ``max_length`` characters.

    ``Text`` only admits characters from its charset; an agentrl conversation can contain
    any character, so membership checks only type and length.  ``sample()`` still draws from
    printable ASCII.
    """

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None) -> None:
        super().__init__(max_length, min_length=min_length, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnicodeText) and (other.min_length, other.max_length) == (
            self.min_length,
            self.max_length,
        )


class _LoopThread:
    """A private event loop on a daemon thread, so sync gymnasium calls can drive async env
    hooks from anywhere (including code already running inside an event loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agentrl-gym-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


def _as_text(messages: Sequence[Message]) -> str:
    parts = []
    for m in messages:
        who = f"{m.role} ({m.name})" if m.name else m.role
        body = m.content
        if m.tool_calls:
            calls = "\n".join(f"<tool_call>{tc.name} {tc.arguments}</tool_call>" for tc in m.tool_calls)
            body = f"{body}\n{calls}".strip()
        parts.append(f"{who}: {body}")
    return "\n\n".join(parts)


class TextGymEnv(gymnasium.Env[str, str]):
    """An agentrl :class:`Environment` as a ``gymnasium.Env`` with text observations/actions.

    Observation: the task prompt on ``reset``, then the env's reply messages, rendered as
    ``role: content`` blocks.  Action: the assistant's reply text (the env's own
    ``parse_assistant`` reads tool calls from it).  Reward: 0 until the episode ends, then the
    rubric's reward; ``info`` carries the rubric's metrics and any error.  ``terminated``:
    the env said done; ``truncated``: ``max_turns`` reached.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(
        self,
        env: Environment,
        *,
        split: str = "train",
        max_length: int = 100_000,
        max_turns: int | None = None,
        render_mode: str | None = None,
    ) -> None:
        if render_mode not in (None, "ansi"):
            raise AgentrlError(f"render_mode must be None or 'ansi', not {render_mode!r}")
        self.env = env
        self.split = split
        self.max_turns = max_turns or env.max_turns
        self.render_mode = render_mode
        self.observation_space = UnicodeText(max_length)
        self.action_space = UnicodeText(max_length)
        self._tasks: list[Task] | None = None
        self._state: State | None = None
        self._loop: _LoopThread | None = None

    def _run(self, coro: Any) -> Any:
        if self._loop is None:
            self._loop = _LoopThread()
        return self._loop.run(coro)

    def tasks(self) -> list[Task]:
        if self._tasks is None:
            source = self.env.eval_dataset() if self.split == "eval" else None
            self._tasks = list(source if source is not None else self.env.dataset())
            if not self._tasks:
                raise AgentrlError(f"environment {self.env.name!r} has an empty {self.split} dataset")
        return self._tasks

    def _clip(self, text: str) -> str:
        return text[: self.observation_space.max_length]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._end_episode()
        tasks = self.tasks()
        index = (options or {}).get("task_index")
        if index is None:
            index = int(self.np_random.integers(len(tasks)))
        task = tasks[int(index) % len(tasks)]
        self._state = self._run(self.env.setup(task))
        return self._clip(_as_text(self._state.messages)), {"task_id": task.id, "task_index": int(index)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        state = self._state
        if state is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        try:
            message = self.env.parse_assistant(str(action), state)
            state.messages.append(message)
            state.turn += 1
            reply = list(self._run(self.env.step(state, message)))
        except Exception:
            self._end_episode()  # release the episode's resources; the caller must reset
            raise
        state.messages.extend(reply)
        terminated = bool(self.env.done(state))
        truncated = not terminated and state.turn >= self.max_turns
        reward, info = 0.0, {"turn": state.turn}
        if terminated or truncated:
            traj = self._score(state, "done" if terminated else "max_turns")
            reward = traj.reward
            info.update(metrics=dict(traj.metrics), error=traj.error)
            self._end_episode()
        return self._clip(_as_text(reply)), float(reward), terminated, truncated, info

    def _score(self, state: State, stop_reason: str) -> Trajectory:
        traj = Trajectory(
            task=state.task,
            messages=list(state.messages),
            turns=[Turn(0, [], m.content) for m in state.messages[len(state.task.prompt):] if m.role == "assistant"],
            metrics=dict(state.metrics),
            stop_reason=stop_reason,
            env_name=self.env.name,
            env_version=str(self.env.version),
        )
        traj.state = state  # rubric functions may ask for it, as after a rollout
        self._run(self.env.rubric.score(traj))
        return traj

    def _end_episode(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            self._run(self.env.cleanup(state))

    def render(self) -> str | None:
        if self.render_mode == "ansi" and self._state is not None:
            return _as_text(self._state.messages)
        return None

    def close(self) -> None:
        if self._loop is not None:
            self._end_episode()
            self._loop.close()
            self._loop = None
        super().close()


def as_gymnasium(env: Environment, **kwargs: Any) -> TextGymEnv:
    """``env`` as a ``gymnasium.Env`` with text spaces (see :class:`TextGymEnv` for kwargs)."""
    return TextGymEnv(env, **kwargs)


def _make_registered(name: str, env_args: dict[str, Any] | None = None, **kwargs: Any) -> TextGymEnv:
    from agentrl.plugins import load_environment

    return TextGymEnv(load_environment(name, **(env_args or {})), **kwargs)


def register_gymnasium(
    name: str,
    env_args: dict[str, Any] | None = None,
    *,
    version: int = 0,
    max_episode_steps: int | None = None,
    **kwargs: Any,
) -> str:
    """Register the agentrl environment ``name`` (installed name or package path) with
    gymnasium as ``agentrl/<name>-v<version>``; returns the id for ``gymnasium.make``."""
    slug = re.sub(r"[^\w.-]+", "-", str(name).rstrip("/").split("/")[-1]).strip("-") or "env"
    env_id = f"agentrl/{slug}-v{version}"
    gymnasium.register(
        id=env_id,
        entry_point=_make_registered,
        kwargs={"name": name, "env_args": env_args, **kwargs},
        max_episode_steps=max_episode_steps,
    )
    return env_id


def register_all_gymnasium() -> list[str]:
    """Register every installed agentrl environment (``agentrl/<name>-v0``); returns the ids.

    Cheap: reads entry-point names only; an environment is imported when it is made.
    """
    from agentrl.plugins import ENV_GROUP, installed

    ids = []
    for plugin in installed(ENV_GROUP):
        env_id = f"agentrl/{plugin.name}-v0"
        if env_id not in gymnasium.registry:
            register_gymnasium(plugin.name)
        ids.append(env_id)
    return ids
