"""An OpenEnv environment server, written against the ``openenv`` package alone (no agentrl).

Arithmetic drill: a reset draws ``QUESTIONS`` sums from the seed; the observation asks one at a
time; each step's action is the player's answer (free text, its last integer counts; one over 12
digits is wrong, not an error); a right answer earns ``1/QUESTIONS``; the episode is done after
the last question.  Run it with

    uvicorn openenv_drill_server:app --port 8000
"""

from __future__ import annotations

import random
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

QUESTIONS = 3
# the sums are below 200: a longer "number" is junk, and int() refuses more than 4300 digits
_MAX_DIGITS = 12


class DrillAction(Action):
    answer: str = Field(..., description="the answer to the current question")


class DrillObservation(Observation):
    text: str = Field(default="", description="feedback on the last answer and the next question")


class DrillEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._sums: list[tuple[int, int]] = []

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> DrillObservation:
        rng = random.Random(seed)
        self._sums = [(rng.randint(2, 99), rng.randint(2, 99)) for _ in range(QUESTIONS)]
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return DrillObservation(text=f"Answer {QUESTIONS} sums, one per turn. {self._question(0)}", reward=0.0)

    def _question(self, i: int) -> str:
        a, b = self._sums[i]
        return f"Question {i + 1}: what is {a} + {b}?"

    def step(self, action: DrillAction, timeout_s: float | None = None, **kwargs: Any) -> DrillObservation:  # type: ignore[override]
        i = self._state.step_count
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.answer)
        last = numbers[-1] if numbers else ""
        right = 0 < len(last.lstrip("-")) <= _MAX_DIGITS and int(last) == sum(self._sums[i])
        feedback = "Correct." if right else f"Wrong: {sum(self._sums[i])}."
        done = i + 1 >= QUESTIONS
        text = feedback if done else f"{feedback} {self._question(i + 1)}"
        return DrillObservation(text=text, done=done, reward=(1.0 / QUESTIONS) if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(DrillEnvironment, DrillAction, DrillObservation, max_concurrent_envs=256)
