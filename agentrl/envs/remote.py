"""A served environment used like a local one: ``env.name = "http://host:port"``.

:class:`RemoteEnvironment` is an :class:`~agentrl.envs.base.Environment` whose hooks call an
``agentrl env serve`` server (routes: ``agentrl.envs.serve``), so the one episode loop
(``agentrl.episode``), the rollout, the ledger and ``agentrl eval`` run it unchanged.  The
model is called from this side; the server holds each episode's state, runs the env's
``setup``/``step``/``cleanup``, parses the model's turns with the env's own
``parse_assistant`` (tool calls) and scores groups with the env's rubric.

Limits, tool schemas and tasks are read once, when the environment is built.  A hook error
on the server comes back with its error kind (``tool``, ``sandbox``, ``env``...); a server
that cannot be reached errors the episode with kind ``env`` naming the URL.

Every request carries ``Authorization: Bearer $AGENTRL_API_KEY`` when that is set (or
``api_key=``); an episode is opened by task id (the server's own task) and every later call
carries the ``episode_secret`` the server returned, kept in the episode's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from agentrl.auth import KEY_ENV, auth_headers, client_key
from agentrl.envs.base import Environment, State
from agentrl.episode import outlive
from agentrl.errors import AgentrlError, EpisodeFailure
from agentrl.rubrics import Rubric
from agentrl.rubrics.rubric import RewardFn
from agentrl.types import Message, Task, Trajectory

PROTOCOL = 2  # agentrl.envs.serve.PROTOCOL
_KINDS: dict[str, type[EpisodeFailure]] = {}


def is_env_url(name: str) -> bool:
    """True when an environment name is a served environment's URL."""
    return name.startswith(("http://", "https://"))


def remote_failure(kind: str, message: str) -> EpisodeFailure:
    """An exception carrying the server-side error kind (the loop records it on the episode)."""
    cls = _KINDS.get(kind)
    if cls is None:
        cls = _KINDS[kind] = type(f"Remote{kind.title().replace('_', '')}Error", (EpisodeFailure,), {"error_kind": kind})
    return cls(message)


@dataclass
class _Unparsed(Message):
    """An assistant turn as raw text: the server parses it with the env's ``parse_assistant``."""


def _refused_key(url: str, sent: bool) -> str:
    if sent:
        return f"environment server {url} refused the API key: set {KEY_ENV} to the key it was started with"
    return f"environment server {url} requires an API key: set {KEY_ENV} to the key it was started with"


def _said(body: bytes | str) -> str:
    """What an error answer says: its ``error`` (a string, or an OpenAI-style ``{"message"}``)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return str(body[:300])
    if isinstance(error, dict):
        error = error.get("message")
    return str(error)[:1000]


def _get_json(url: str, timeout_s: float, key: str | None = None) -> Any:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers(key)), timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise AgentrlError(_refused_key(url, key is not None)) from e
        raise AgentrlError(f"environment server {url} answered HTTP {e.code}: {_said(e.read())}") from e
    except (OSError, ValueError) as e:
        raise AgentrlError(f"environment server {url} is unreachable: {e} (start it with `agentrl env serve NAME`)") from e


class RemoteEnvironment(Environment):
    """An environment served at ``url`` (``agentrl env serve``); see the module docstring."""

    def __init__(
        self, url: str, *, timeout_s: float = 60.0, connect_timeout_s: float = 10.0, api_key: str | None = None
    ) -> None:
        """``timeout_s``: the limit of one request to the server (not the episode's wall limit,
        which comes from the served env).  ``api_key``: default ``$AGENTRL_API_KEY``."""
        self.url = url.rstrip("/")
        self.request_timeout_s = timeout_s
        self.api_key = api_key or client_key()
        info = _get_json(f"{self.url}/info", connect_timeout_s, self.api_key)
        if info.get("protocol") != PROTOCOL:
            raise AgentrlError(f"environment server {self.url} speaks protocol {info.get('protocol')!r}, not {PROTOCOL}")
        super().__init__(
            rubric=RemoteRubric(self, info.get("rubric") or []), max_turns=info["max_turns"], max_total_tokens=info["max_total_tokens"],
            max_seq_len=info["max_seq_len"], timeout_s=info["timeout_s"], on_length=info["on_length"],
            name=info["name"], version=info["version"],
        )  # fmt: skip
        self.system_prompt = info.get("system_prompt")
        self.reward_range = tuple(info["reward_range"]) if info.get("reward_range") else None
        self.max_reward = info.get("max_reward")
        self._tools = info.get("tools")
        self._has_reference = bool(info.get("reference_policy"))
        self._train = self._fetch_tasks("train", connect_timeout_s)
        self._eval = self._fetch_tasks("eval", connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def _fetch_tasks(self, split: str, timeout_s: float) -> list[Task] | None:
        tasks: list[Task] = []
        while True:
            page = _get_json(f"{self.url}/tasks?split={split}&offset={len(tasks)}", timeout_s, self.api_key)
            if page["total"] is None:
                return None
            tasks.extend(Task.from_dict(t) for t in page["tasks"])
            if len(tasks) >= page["total"] or not page["tasks"]:
                return tasks

    def __reduce__(self) -> tuple[Any, ...]:  # pickles as its URL and key (a Ray actor reconnects)
        return (_reconnect, (self.url, self.api_key), {"request_timeout_s": self.request_timeout_s})

    # ------------------------------------------------------------------ transport

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
                connector=aiohttp.TCPConnector(limit=0), headers=auth_headers(self.api_key),
            )
            self._session_loop = loop
        return self._session

    async def call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``route``; a hook error raises with its server-side kind."""
        url = f"{self.url}/{route}"
        try:
            async with self._client().post(url, json=body) as r:
                text = await r.text()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise remote_failure("env", f"environment server {url} failed: {type(e).__name__}: {e}") from e
        try:
            out = json.loads(text)
        except ValueError:
            out = {"error": text[:300]}
        if status == 401:
            raise remote_failure("env", _refused_key(url, self.api_key is not None))
        if status != 200:
            raise remote_failure("env", f"environment server {url} answered HTTP {status}: {_said(text)}")
        if "error" in out:
            raise remote_failure(out.get("error_kind") or "env", out["error"])
        return out

    async def aclose(self) -> None:
        """Close the HTTP session of the current event loop (optional; idempotent)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()

    async def close(self) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ hooks

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self._tools

    async def setup(self, task: Task) -> State:
        reset = outlive(self.call("reset", {"task_id": task.id}))
        try:
            out = await asyncio.shield(reset)
        except asyncio.CancelledError:  # the server opens the episode all the same: close it once it answers
            outlive(self._close_opened(reset))
            raise
        state = State(task, episode_id=out["episode_id"], episode_secret=out["episode_secret"])
        state["messages"] = [Message.from_dict(m) for m in out["messages"]]
        state.metrics.update(out["metrics"])
        state.done = out["done"]
        return state

    async def _close_opened(self, reset: asyncio.Future) -> None:
        with contextlib.suppress(Exception):  # best effort: the server's idle timeout reaps what this misses
            out = await reset
            await self.call("close", {"episode_id": out["episode_id"], "episode_secret": out["episode_secret"]})

    def parse_assistant(self, text: str, state: State) -> Message:
        return _Unparsed("assistant", text)

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        body = {
            "episode_id": state["episode_id"], "episode_secret": state.get("episode_secret"),
            "assistant": assistant_msg.to_dict(),
            "parse": isinstance(assistant_msg, _Unparsed), "turn": state.turn,
        }  # fmt: skip
        out = await self.call("step", body)
        parsed = Message.from_dict(out["assistant"])
        if state.messages and state.messages[-1] is assistant_msg:
            state.messages[-1] = parsed  # the conversation holds the turn as the env parsed it
        state.metrics.update(out["metrics"])
        state.done = out["done"]
        return [Message.from_dict(m) for m in out["reply"]]

    def done(self, state: State) -> bool:
        return state.done

    async def cleanup(self, state: State) -> None:
        if state.get("closed"):
            return
        state["closed"] = True
        out = await self.call("close", {"episode_id": state["episode_id"], "episode_secret": state.get("episode_secret")})
        state.metrics.update(out["metrics"])

    def _post_sync(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.url}/{route}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **auth_headers(self.api_key)},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise AgentrlError(_refused_key(self.url, self.api_key is not None)) from e
            raise AgentrlError(f"environment server {self.url}/{route} answered HTTP {e.code}: {_said(e.read())}") from e

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        out = self._post_sync("demonstrations", {"n": n, "seed": seed})
        if "error" in out:
            raise NotImplementedError(f"environment server {self.url}: {out['error']}")
        return [[Message.from_dict(m) for m in conv] for conv in out["conversations"]]

    def reference_policy(self) -> Callable[[Task, list[Message]], Message] | None:
        """The served env's reference policy, played on the server one turn at a time (None if it has none)."""
        if not self._has_reference:
            return None

        def policy(task: Task, conversation: list[Message]) -> Message:
            out = self._post_sync("reference", {"task_id": task.id, "messages": [m.to_dict() for m in conversation]})
            if "error" in out:
                raise remote_failure(out.get("error_kind") or "env", out["error"])
            return Message.from_dict(out["message"])

        return policy


def check_room(url: str, episodes: int, what: str, *, one_client: bool, api_key: str | None = None) -> str | None:
    """Whether the server at ``url`` lets a run hold ``episodes`` open at once (``what``: whose they
    are, naming the settings that size them).  Raises :class:`AgentrlError` naming the flag to raise
    when they cannot fit: more than its ``--max-open``, or than its ``--max-open-per-client`` where
    they count as one client (``one_client``, or the server counts this machine as its one
    ``loopback`` client).  Returns a warning when they might not (clients on several machines count
    apart), else None."""
    info = _get_json(f"{url.rstrip('/')}/info", 10.0, api_key or client_key())
    total, per_client = info.get("max_open"), info.get("max_open_per_client")  # absent: an older server
    run = f"this run holds up to {episodes} ({what})"
    if isinstance(total, int) and episodes > total:
        raise AgentrlError(f"environment server {url} holds at most {total} open episodes (its --max-open) and {run}: "
                           f"restart `agentrl env serve` with --max-open {episodes} or more, or lower those settings")
    if not isinstance(per_client, int) or episodes <= per_client:
        return None
    fix = f"restart `agentrl env serve` with --max-open-per-client {episodes} or more, or lower those settings"
    said = f"environment server {url} lets one client hold {per_client} open episodes (its --max-open-per-client) and {run}"
    if info.get("client") == "loopback":
        raise AgentrlError(f"{said}, and every loopback address is one client there: {fix}")
    if one_client:
        raise AgentrlError(f"{said}: {fix}")
    return f"warning: {said}; rollout workers on one machine count as one client there: if they share one, {fix}"


def _reconnect(url: str, api_key: str | None) -> RemoteEnvironment:
    return RemoteEnvironment(url, api_key=api_key)


def _served() -> float:
    raise RuntimeError("a served rubric function runs on the environment server, not here")


class RemoteRubric(Rubric):
    """The served env's rubric: a group is scored on the server, on the states it kept."""

    def __init__(self, env: RemoteEnvironment, funcs: list[dict[str, Any]]) -> None:
        """``funcs``: the served rubric's function names and weights (for display and the checker)."""
        super().__init__()
        self.env = env
        self.funcs = [RewardFn(_served, float(f["weight"]), f["name"], (), False, False) for f in funcs]

    async def score_group(self, trajectories: Sequence[Trajectory]) -> None:
        live = [t for t in trajectories if t.error is None]
        for t in trajectories:
            if t.error is not None:
                t.reward = 0.0
        if not live:
            return
        states = [getattr(t, "state", None) or {} for t in live]
        items = [{"episode_id": s.get("episode_id"), "episode_secret": s.get("episode_secret"), "trajectory": t.to_dict()}
                 for s, t in zip(states, live, strict=True)]  # fmt: skip
        out = await self.env.call("score", {"episodes": items})
        for t, s in zip(live, out["scores"], strict=True):
            t.metrics.update(s["metrics"])
            t.reward = s["reward"]
            if s["error"] is not None:
                t.error, t.error_kind, t.reward = s["error"], s["error_kind"] or "rubric", 0.0
                t.stop_reason = t.stop_reason or "error"


__all__ = ["RemoteEnvironment", "RemoteRubric", "check_room", "is_env_url", "remote_failure"]
