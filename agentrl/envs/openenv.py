"""An OpenEnv environment server (the ``openenv`` package) as an agentrl environment, unchanged.

OpenEnv serves a Gym-shaped environment (``reset``/``step`` on typed pydantic actions and
observations) over a WebSocket session per client (``/ws``; one session is one environment
instance on the server).  :class:`OpenEnvEnvironment` maps that onto the agentrl contract:

    task                  a reset: ``seed`` (and ``task.info["reset"]`` as extra reset kwargs)
    setup                 open a session (OpenEnv's own ``GenericEnvClient``), ``reset``; the
                          observation, as text, is the first user message
    step                  the model's text becomes the action, ``step``; the next observation is
                          the reply; the server's ``done`` ends the episode
    rubric                the sum (or the last) of the rewards the server attached to observations
    cleanup               close the session (idempotent)

Text ↔ typed values: ``action_from_text(text) -> dict`` (default: the action schema's one
required string field gets the whole text) and ``observation_to_text(obs) -> str`` (default:
the observation's one string field, else its JSON).  Both defaults are read from the server's
``/schema`` once, when the environment is built.  A server that cannot be reached or that
answers with an error errors the episode (kind ``env``) naming the URL; the run goes on.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Literal

from agentrl.envs.base import Environment, State
from agentrl.errors import AgentrlError, EpisodeFailure
from agentrl.rubrics import Rubric
from agentrl.types import Message, Task

_RESERVED = {"done", "reward", "metadata"}  # Observation fields OpenEnv sends outside the observation


class OpenEnvError(EpisodeFailure):
    """The OpenEnv server failed inside an episode (unreachable, closed the session, answered an error)."""

    error_kind = "env"


def openenv_reward(state: State) -> float:
    """The episode's reward from the server: the sum (or the last, per ``reward``) of the step rewards."""
    rewards = state.get("rewards", [])
    if not rewards:
        return 0.0
    return float(rewards[-1] if state.get("reward_mode") == "last" else sum(rewards))


def read_schema(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The server's ``/schema`` (action, observation, state JSON schemas); a one-line error if unreachable."""
    try:
        with urllib.request.urlopen(f"{url}/schema", timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AgentrlError(f"OpenEnv server {url} answered HTTP {e.code} on /schema: is it an OpenEnv server?") from e
    except (OSError, ValueError) as e:
        raise AgentrlError(f"OpenEnv server {url} is unreachable: {e} (start it, e.g. `uvicorn my_env.server.app:app`)") from e


def _string_fields(schema: dict[str, Any], *, required_only: bool) -> list[str]:
    props = schema.get("properties", {})
    names = schema.get("required", []) if required_only else list(props)
    return [n for n in names if n not in _RESERVED and props.get(n, {}).get("type") == "string"]


def default_action_from_text(schema: dict[str, Any]) -> Callable[[str], dict[str, Any]]:
    """The whole text into the action's one required string field (else: pass ``action_from_text``)."""
    fields = _string_fields(schema, required_only=True) or _string_fields(schema, required_only=False)
    if len(fields) != 1:
        raise AgentrlError(
            f"OpenEnv action {schema.get('title', '?')} has string fields {fields}, not exactly one: "
            "pass action_from_text=(text -> action dict)"
        )
    field = fields[0]
    return lambda text: {field: text}


def default_observation_to_text(schema: dict[str, Any]) -> Callable[[dict[str, Any]], str]:
    """The observation's one string field, else the whole observation as JSON."""
    fields = _string_fields(schema, required_only=False)
    if len(fields) == 1:
        field = fields[0]
        return lambda obs: str(obs.get(field, ""))
    return lambda obs: json.dumps(obs, sort_keys=True)


class OpenEnvEnvironment(Environment):
    """An OpenEnv server at ``url`` as an agentrl environment; see the module docstring."""

    max_reward = None  # server-dependent; an example that knows its best score sets it

    def __init__(
        self,
        url: str,
        *,
        num_tasks: int = 100,
        num_eval_tasks: int = 10,
        action_from_text: Callable[[str], dict[str, Any]] | None = None,
        observation_to_text: Callable[[dict[str, Any]], str] | None = None,
        reward: Literal["sum", "last"] = "sum",
        reset_args: dict[str, Any] | None = None,
        max_turns: int = 16,
        message_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        name: str = "openenv",
        **kwargs: Any,
    ) -> None:
        """``num_tasks`` train resets (seeds 0..n-1) and ``num_eval_tasks`` held-out ones (seeds
        from 10 000); ``reset_args``: extra keyword arguments of every ``reset``;
        ``message_timeout_s``: the limit of one reset/step on the server."""
        if reward not in ("sum", "last"):
            raise ValueError(f"reward must be 'sum' or 'last', not {reward!r}")
        self.url = url.rstrip("/")
        schema = read_schema(self.url, connect_timeout_s)
        self.action_from_text = action_from_text or default_action_from_text(schema.get("action", {}))
        self.observation_to_text = observation_to_text or default_observation_to_text(schema.get("observation", {}))
        self.reward_mode = reward
        self.reset_args = dict(reset_args or {})
        self.message_timeout_s = message_timeout_s
        self.connect_timeout_s = connect_timeout_s

        def seeds(start: int, n: int) -> list[Task]:
            return [Task([Message("user", f"(OpenEnv reset, seed {s})")], info={"seed": s}) for s in range(start, start + n)]

        super().__init__(dataset=seeds(0, num_tasks), eval_dataset=seeds(10_000, num_eval_tasks),
                         rubric=Rubric([openenv_reward]), max_turns=max_turns, name=name, **kwargs)  # fmt: skip

    def _client(self) -> Any:
        from openenv.core.generic_client import GenericEnvClient

        return GenericEnvClient(
            base_url=self.url, connect_timeout_s=self.connect_timeout_s, message_timeout_s=self.message_timeout_s
        )

    async def _call(self, what: str, coro: Any) -> Any:
        try:
            return await coro
        except Exception as e:  # connection refused/closed, timeout, or the server's error message
            raise OpenEnvError(f"OpenEnv server {self.url} failed on {what}: {type(e).__name__}: {e}") from e

    async def setup(self, task: Task) -> State:
        client = self._client()
        state = State(task, client=client, rewards=[], reward_mode=self.reward_mode)
        reset_kwargs = {**self.reset_args, **task.info.get("reset", {})}
        if "seed" in task.info:
            reset_kwargs.setdefault("seed", int(task.info["seed"]))
        try:
            await self._call("connect", client.connect())
            result = await self._call("reset", client.reset(**reset_kwargs))
        except OpenEnvError:
            await client.close()  # the loop cleans up only after a setup that returned
            raise
        state["messages"] = [*(m for m in task.prompt if m.role == "system"),
                             Message("user", self.observation_to_text(result.observation))]  # fmt: skip
        state.done = bool(result.done)
        return state

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        action = self.action_from_text(assistant_msg.content)
        result = await self._call("step", state["client"].step(action))
        state["rewards"].append(float(result.reward or 0.0))
        state.count("openenv_steps")
        if result.done:
            state.done = True
            return []
        return [Message("user", self.observation_to_text(result.observation))]

    async def cleanup(self, state: State) -> None:
        client = state.get("client")
        if client is not None:
            state["client"] = None
            await client.close()  # best effort on the server side; idempotent here


__all__ = ["OpenEnvEnvironment", "OpenEnvError", "openenv_reward", "read_schema"]
