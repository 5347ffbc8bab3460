"""An environment as a service: any installed environment's hooks over HTTP (aiohttp).

``agentrl env serve NAME --port P`` runs :func:`serve`; a run or ``agentrl eval`` that names
``http://host:P`` instead of an environment gets a :class:`agentrl.envs.remote.RemoteEnvironment`,
which drives these routes from the one episode loop (``agentrl.episode``).  The model is never
called from here: the server holds each episode's :class:`State` and runs the env's own
``setup``/``parse_assistant``/``step``/``done``/``cleanup`` and rubric on it.

    GET  /health                     {"status": "ok", "env", "version", "open": episodes in progress}
    GET  /info                       name, version, limits (max_turns, ...), tool schemas, task counts
    GET  /tasks?split=train|eval&offset=&limit=   {"tasks": [Task dicts], "total": n | null}
    POST /reset  {"task"}            setup: {"episode_id", "messages", "metrics", "done"}
    POST /step   {"episode_id", "assistant", "parse", "turn"}
                                     {"assistant" (as parsed), "reply", "done", "metrics"}
    POST /close  {"episode_id"}      cleanup (idempotent): {"metrics"}
    POST /score  {"episodes": [{"episode_id", "trajectory"}]}   one group, scored together:
                                     {"scores": [{"reward", "metrics", "error", "error_kind"}]}
    POST /demonstrations {"n", "seed"}  {"conversations": [[messages]]}
    POST /reference  {"task", "messages"}   the env's reference policy's next turn: {"message"}

A hook that raises answers 200 with ``{"error", "error_kind"}`` (the boundary it crossed, as
in a local episode); a request the server cannot act on (unknown episode, bad JSON) answers
4xx with ``{"error"}``.  Closed episodes keep their state for scoring until scored or until
``keep_closed`` newer ones push them out.  An open episode nobody touched for
``idle_timeout_s`` (its client died) is expired: cleaned up, forgotten, counted in ``/health``
(``expired``); a later call naming it answers 404 saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict
from typing import Any

from aiohttp import web

from agentrl.envs.base import Environment, State
from agentrl.episode import error_text
from agentrl.errors import error_kind_of
from agentrl.types import Message, Task, Trajectory, messages_to_dicts

PROTOCOL = 1
MAX_TASK_PAGE = 1000


class _Episodes:
    """Open episodes by id, and closed ones kept (bounded) until they are scored."""

    def __init__(self, keep_closed: int, idle_timeout_s: float | None) -> None:
        self.open: dict[str, State] = {}
        self.closed: OrderedDict[str, State] = OrderedDict()
        self.keep_closed = keep_closed
        self.idle_timeout_s = idle_timeout_s
        self.touched: dict[str, float] = {}  # open episode id -> monotonic time of its last call
        self.expired: OrderedDict[str, None] = OrderedDict()  # recent expired ids (for the 404 message)
        self.num_expired = 0
        self._ids = itertools.count()

    def add(self, state: State) -> str:
        eid = f"ep{next(self._ids)}"
        self.open[eid] = state
        self.touched[eid] = time.monotonic()
        return eid

    def get_open(self, eid: str) -> State:
        if eid not in self.open:
            why = f"expired after {self.idle_timeout_s:g}s idle" if eid in self.expired else "closed, or the server restarted"
            raise web.HTTPNotFound(text=_json_error(f"no open episode {eid!r} ({why})"))
        self.touched[eid] = time.monotonic()
        return self.open[eid]

    def idle(self, now: float) -> list[str]:
        """Open episodes untouched for longer than the idle timeout."""
        if self.idle_timeout_s is None:
            return []
        return [eid for eid, t in self.touched.items() if now - t > self.idle_timeout_s]

    def expire(self, eid: str) -> State | None:
        state = self.open.pop(eid, None)
        self.touched.pop(eid, None)
        if state is not None:
            self.num_expired += 1
            self.expired[eid] = None
            while len(self.expired) > self.keep_closed:
                self.expired.popitem(last=False)
        return state

    def close(self, eid: str) -> State | None:
        self.touched.pop(eid, None)
        state = self.open.pop(eid, None)
        if state is not None:
            self.closed[eid] = state
            while len(self.closed) > self.keep_closed:
                self.closed.popitem(last=False)
        return state


def _json_error(message: str) -> str:
    import json

    return json.dumps({"error": message})


async def _body(request: web.Request, *keys: str) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise web.HTTPBadRequest(text=_json_error(f"request body is not JSON: {e}"), content_type="application/json") from e
    missing = [k for k in keys if not isinstance(body, dict) or k not in body]
    if missing:
        raise web.HTTPBadRequest(text=_json_error(f"request body lacks {missing}"), content_type="application/json")
    return body


def _failed(e: BaseException) -> web.Response:
    return web.json_response({"error": error_text(e), "error_kind": error_kind_of(e)})


def _tasks(env: Environment, split: str) -> list[Task] | None:
    if split == "train":
        return list(env.dataset())
    if split == "eval":
        held = env.eval_dataset()
        return None if held is None else list(held)
    raise web.HTTPBadRequest(text=_json_error(f"split must be 'train' or 'eval', not {split!r}"))


def _info(env: Environment, cache: dict[str, list[Task] | None]) -> dict[str, Any]:
    """What a client needs to run the env like a local one: limits, tools, rubric, task counts."""
    for split in ("train", "eval"):
        if split not in cache:
            try:
                cache[split] = _tasks(env, split)
            except NotImplementedError:
                cache[split] = None
    return {
        "protocol": PROTOCOL, "name": env.name, "version": str(env.version), "max_turns": env.max_turns,
        "max_total_tokens": env.max_total_tokens, "max_seq_len": env.max_seq_len, "timeout_s": env.timeout_s,
        "on_length": env.on_length, "reward_range": env.reward_range, "max_reward": env.max_reward,
        "tools": env.tool_schemas(), "system_prompt": getattr(env, "system_prompt", None),
        "rubric": [{"name": f.name, "weight": f.weight} for f in getattr(env.rubric, "funcs", [])],
        "num_tasks": {k: (None if v is None else len(v)) for k, v in cache.items()},
        "reference_policy": env.reference_policy() is not None,
    }  # fmt: skip


async def _reap(env: Environment, episodes: _Episodes) -> None:
    """Expire idle open episodes (their client died): run the env's cleanup, count them."""
    assert episodes.idle_timeout_s is not None
    period = min(max(episodes.idle_timeout_s / 4, 0.05), 5.0)
    while True:
        await asyncio.sleep(period)
        for eid in episodes.idle(time.monotonic()):
            state = episodes.expire(eid)
            if state is not None:
                with contextlib.suppress(Exception):  # a failing cleanup must not stop the reaper
                    await asyncio.shield(env.cleanup(state))


def make_app(env: Environment, *, keep_closed: int = 4096, idle_timeout_s: float | None = 600.0) -> web.Application:
    """The aiohttp application serving ``env`` (routes in the module docstring).

    ``idle_timeout_s``: an open episode with no call for this long is expired (None: never)."""
    episodes = _Episodes(keep_closed, idle_timeout_s)
    cache: dict[str, list[Task] | None] = {}
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(_: web.Request) -> web.Response:
        return web.json_response({
            "status": "ok", "env": env.name, "version": str(env.version), "open": len(episodes.open),
            "expired": episodes.num_expired,
        })  # fmt: skip

    @routes.get("/info")
    async def info(_: web.Request) -> web.Response:
        return web.json_response(_info(env, cache))

    @routes.get("/tasks")
    async def tasks(request: web.Request) -> web.Response:
        split = request.query.get("split", "train")
        try:
            offset, limit = int(request.query.get("offset", 0)), int(request.query.get("limit", MAX_TASK_PAGE))
        except ValueError as e:
            raise web.HTTPBadRequest(text=_json_error(f"offset and limit must be integers: {e}")) from e
        if split not in cache:
            cache[split] = _tasks(env, split)
        rows = cache[split]
        if rows is None:
            return web.json_response({"tasks": [], "total": None})
        page = rows[offset : offset + min(max(limit, 0), MAX_TASK_PAGE)]
        return web.json_response({"tasks": [t.to_dict() for t in page], "total": len(rows)})

    @routes.post("/reset")
    async def reset(request: web.Request) -> web.Response:
        body = await _body(request, "task")
        try:
            state = await env.setup(Task.from_dict(body["task"]))
        except Exception as e:
            return _failed(e)
        eid = episodes.add(state)
        return web.json_response(
            {"episode_id": eid, "messages": messages_to_dicts(state.messages), "metrics": state.metrics, "done": state.done}
        )

    @routes.post("/step")
    async def step(request: web.Request) -> web.Response:
        body = await _body(request, "episode_id", "assistant")
        state = episodes.get_open(body["episode_id"])
        state.turn = int(body.get("turn", state.turn + 1))
        try:
            sent = Message.from_dict(body["assistant"])
            assistant = env.parse_assistant(sent.content, state) if body.get("parse") else sent
            state.messages.append(assistant)
            reply = list(await env.step(state, assistant))
            state.messages.extend(reply)
            done = env.done(state)
        except Exception as e:
            return _failed(e)
        return web.json_response({
            "assistant": assistant.to_dict(), "reply": messages_to_dicts(reply), "done": bool(done),
            "metrics": state.metrics,
        })  # fmt: skip

    @routes.post("/close")
    async def close(request: web.Request) -> web.Response:
        body = await _body(request, "episode_id")
        state = episodes.close(body["episode_id"])
        if state is None:  # already closed: cleanup is idempotent
            kept = episodes.closed.get(body["episode_id"])
            return web.json_response({"metrics": kept.metrics if kept is not None else {}})
        try:
            await asyncio.shield(env.cleanup(state))
        except Exception as e:
            return _failed(e)
        return web.json_response({"metrics": state.metrics})

    @routes.post("/score")
    async def score(request: web.Request) -> web.Response:
        body = await _body(request, "episodes")
        return web.json_response({"scores": await _score(env, episodes, body["episodes"])})

    @routes.post("/demonstrations")
    async def demonstrations(request: web.Request) -> web.Response:
        body = await _body(request, "n")
        try:
            convs = env.demonstrations(int(body["n"]), int(body.get("seed", 0)))
        except Exception as e:
            return _failed(e)
        return web.json_response({"conversations": [messages_to_dicts(c) for c in convs]})

    _reference_route(routes, env)
    app = web.Application(client_max_size=64 * 2**20)
    app.add_routes(routes)
    if idle_timeout_s is not None:
        app.cleanup_ctx.append(lambda _: _reaper(env, episodes))
    return app


async def _reaper(env: Environment, episodes: _Episodes) -> Any:
    """The idle reaper's lifetime is the app's (an aiohttp cleanup context)."""
    task = asyncio.create_task(_reap(env, episodes))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _reference_route(routes: web.RouteTableDef, env: Environment) -> None:
    """``POST /reference``: the env's reference policy plays one turn (``agentrl env test URL``)."""

    @routes.post("/reference")
    async def reference(request: web.Request) -> web.Response:
        body = await _body(request, "task", "messages")
        policy = env.reference_policy()
        if policy is None:
            return web.json_response({"error": f"{env.name} has no reference policy", "error_kind": "env"})
        try:
            msg = policy(Task.from_dict(body["task"]), [Message.from_dict(m) for m in body["messages"]])
        except Exception as e:
            return _failed(e)
        return web.json_response({"message": msg.to_dict()})


async def _score(env: Environment, episodes: _Episodes, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Score one group with the env's rubric, each episode on the state the server kept."""
    from agentrl.rubrics import score_episodes

    trajs: list[Trajectory] = []
    for item in items:
        traj = Trajectory.from_dict(item["trajectory"])
        eid = item.get("episode_id")
        state = episodes.closed.pop(eid, None) or episodes.open.get(eid)
        if state is None:
            traj.error, traj.error_kind = f"env server has no state for episode {eid!r} (evicted or restarted)", "env"
        else:
            traj.messages = state.messages  # the server's own messages: parsed tool calls, env objects
        traj.state = state
        trajs.append(traj)
    await score_episodes(env.rubric, trajs)
    return [{"reward": t.reward, "metrics": t.metrics, "error": t.error, "error_kind": t.error_kind} for t in trajs]


async def serve(
    env: Environment, *, host: str = "127.0.0.1", port: int = 8765, on_ready: Any = None, idle_timeout_s: float | None = 600.0
) -> None:
    """Serve ``env`` until cancelled (``agentrl env serve``); ``on_ready(url)`` once listening."""
    from agentrl.errors import AgentrlError

    runner = web.AppRunner(make_app(env, idle_timeout_s=idle_timeout_s), access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            raise AgentrlError(f"cannot serve on {host}:{port}: {e.strerror or e}") from e
        if on_ready is not None:
            on_ready(f"http://{host}:{port}")
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


__all__ = ["PROTOCOL", "make_app", "serve"]
