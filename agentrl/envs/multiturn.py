"""The two simplest environment shapes.

``SingleTurnEnv``: one model turn, then score.  ``MultiTurnEnv``: the author writes
``step`` (the env's reply to each model turn) and ends the episode by setting
``state.done = True`` or by overriding ``done``.
"""

from __future__ import annotations

from agentrl.envs.base import Environment, State
from agentrl.types import Message


class SingleTurnEnv(Environment):
    """Question in, one answer out, scored by the rubric."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("max_turns", 1)
        super().__init__(**kwargs)

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        state.done = True
        return []


class MultiTurnEnv(Environment):
    """Override :meth:`step` to answer each model turn; set ``state.done`` to finish."""

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        raise NotImplementedError(f"{type(self).__name__} must implement step(state, assistant_msg)")
