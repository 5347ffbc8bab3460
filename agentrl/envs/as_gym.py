"""agentrl → gymnasium: any agentrl environment as a ``gymnasium.Env`` with text spaces.

``as_gymnasium(env)``: ``reset`` starts a task (chosen by the seeded RNG, or
``options={"task_index": i}``) and returns its prompt; ``step(text)`` is one model turn and
returns the env's reply; the rubric's reward arrives on the final step.  The episode runs
through the same loop as every other episode (:func:`agentrl.episode.run_episode`), driven
by a policy client whose replies are the ``step`` actions, so stop reasons, ``max_turns``,
error kinds and cleanup behave exactly as in training.
``register_gymnasium(name)`` registers an installed agentrl environment as
``agentrl/<name>-v0`` for ``gymnasium.make``.
"""

from __future__ import annotations

import asyncio
import re
import string
import threading
from collections.abc import Sequence
from typing import Any

import gymnasium
from gymnasium import spaces

from agentrl.envs.base import Environment
from agentrl.episode import run_episode
from agentrl.errors import AgentrlError
from agentrl.rubrics import score_episodes
from agentrl.types import Completion, Message, SamplingParams, Task, Trajectory

__all__ = ["TextGymEnv", "UnicodeText", "as_gymnasium", "register_all_gymnasium", "register_gymnasium"]


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


class _StepClient:
    """The policy of a bridged episode: each model call hands the conversation to
    gymnasium and waits for the next ``step`` action."""

    def __init__(self) -> None:
        self.prompts: asyncio.Queue[list[Message]] = asyncio.Queue()
        self.actions: asyncio.Queue[str] = asyncio.Queue()

    async def chat(self, messages: list[dict], sampling: SamplingParams, tools=None, n: int = 1) -> list[Completion]:
        await self.prompts.put([Message.from_dict(m) for m in messages])
        return [Completion(text=await self.actions.get(), finish_reason="stop")]


class _Bridged:
    """One running episode seen from gymnasium's side."""

    def __init__(self, env: Environment, task: Task, max_turns: int) -> None:
        self.client = _StepClient()
        self.episode = asyncio.ensure_future(
            run_episode(env, self.client, task, SamplingParams(max_tokens=1 << 20), max_turns=max_turns,
                        token_exact=False)
        )
        self.seen = 0  # messages already returned as observations (or sent as actions)
        self.turns = 0

    async def next(self, rubric: Any) -> tuple[list[Message], Trajectory | None]:
        """New messages since the last observation, and the scored trajectory if the episode ended."""
        prompt = asyncio.ensure_future(self.client.prompts.get())
        await asyncio.wait({prompt, self.episode}, return_when=asyncio.FIRST_COMPLETED)
        if prompt.done():
            messages = prompt.result()
            new, self.seen = messages[self.seen :], len(messages) + 1  # +1: the coming action
            return new, None
        prompt.cancel()
        traj = self.episode.result()
        await score_episodes(rubric, [traj])
        return traj.messages[self.seen :], traj


class TextGymEnv(gymnasium.Env[str, str]):
    """An agentrl :class:`Environment` as a ``gymnasium.Env`` with text observations/actions.

    Observation: the task prompt on ``reset``, then the env's reply messages, rendered as
    ``role: content`` blocks.  Action: the assistant's reply text (the env's own
    ``parse_assistant`` reads tool calls from it).  Reward: 0 until the episode ends, then the
    rubric's reward; ``info`` carries the rubric's metrics and any error.  ``terminated``:
    the episode ended on its own; ``truncated``: ``max_turns`` reached.
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
        self._episode: _Bridged | None = None
        self._transcript: list[Message] = []
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

        async def start() -> tuple[list[Message], Trajectory | None]:
            self._episode = _Bridged(self.env, task, self.max_turns)
            return await self._episode.next(self.env.rubric)

        messages, traj = self._run(start())
        self._transcript = list(messages)
        if traj is not None:  # ended before the model's first turn (setup failed)
            self._episode = None
            raise AgentrlError(f"episode of task {task.id!r} ended before the first turn: {traj.error}")
        return self._clip(_as_text(messages)), {"task_id": task.id, "task_index": int(index)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        episode = self._episode
        if episode is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")

        async def act() -> tuple[list[Message], Trajectory | None]:
            await episode.client.actions.put(str(action))
            return await episode.next(self.env.rubric)

        reply, traj = self._run(act())
        self._transcript += [Message("assistant", str(action)), *reply]
        episode.turns += 1
        info: dict[str, Any] = {"turn": episode.turns}
        if traj is None:
            return self._clip(_as_text(reply)), 0.0, False, False, info
        self._episode = None
        truncated = traj.stop_reason == "max_turns"
        info.update(metrics=dict(traj.metrics), error=traj.error, stop_reason=traj.stop_reason)
        return self._clip(_as_text(reply)), float(traj.reward), not truncated, truncated, info

    def _end_episode(self) -> None:
        episode, self._episode = self._episode, None
        if episode is not None and not episode.episode.done():

            async def stop() -> None:
                episode.episode.cancel()
                await asyncio.gather(episode.episode, return_exceptions=True)  # cleanup runs

            self._run(stop())

    def render(self) -> str | None:
        if self.render_mode == "ansi" and self._transcript:
            return _as_text(self._transcript)
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
        if env_id in ids:  # a name two distributions register: one id (making it names both)
            continue
        if env_id not in gymnasium.registry:
            register_gymnasium(plugin.name)
        ids.append(env_id)
    return ids
