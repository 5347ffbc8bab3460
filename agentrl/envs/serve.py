"""An environment as a service: any installed environment's hooks over HTTP (aiohttp).

``agentrl env serve NAME --port P`` runs :func:`serve`; a run or ``agentrl eval`` that names
``http://host:P`` instead of an environment gets a :class:`agentrl.envs.remote.RemoteEnvironment`,
which drives these routes from the one episode loop (``agentrl.episode``).  The model is never
called from here: the server holds each episode's :class:`State` and runs the env's own
``setup``/``parse_assistant``/``step``/``done``/``cleanup`` and rubric on it.

    GET  /health                     {"status": "ok", "env", "version", "open", "expired"}
    GET  /info                       name, version, limits (max_turns, ...), tool schemas, task counts, the
                                     open-episode caps and the client the caller counts as
    GET  /tasks?split=train|eval&offset=&limit=   {"tasks": [Task dicts], "total": n | null}
    POST /reset  {"task_id"}         setup: {"episode_id", "episode_secret", "messages", "metrics", "done"}
    POST /step   {"episode_id", "episode_secret", "assistant", "parse", "turn"}
                                     {"assistant" (as parsed), "reply", "done", "metrics"}
    POST /close  {"episode_id", "episode_secret"}   cleanup (idempotent): {"metrics"}
    POST /score  {"episodes": [{"episode_id", "episode_secret", "trajectory"}]}   one group, scored
                                     together: {"scores": [{"reward", "metrics", "error", "error_kind"}]}
    POST /demonstrations {"n", "seed"}  {"conversations": [[messages]]}
    POST /reference  {"task_id", "messages"}   the env's reference policy's next turn: {"message"}

The rules (README: "Env server hygiene"), each against an attack a review found:

- **Keys.** With ``--api-key`` / ``AGENTRL_API_KEY`` every route but ``/health`` needs
  ``Authorization: Bearer KEY`` (:mod:`agentrl.auth`; constant-time).  Without one the server
  is open to whoever reaches its port, so binding anything but loopback prints a warning.
- **Episodes belong to their opener.**  Ids are random (``secrets``), and every later call
  must carry the ``episode_secret`` ``/reset`` returned: no client steps, closes or scores
  another's episode (ids were ``ep0, ep1...``).
- **Tasks come from the server's own dataset.**  A client names a task by id (from
  ``/tasks``); the answer and info the rubric sees are the server's, never the client's.
  With ``private_tasks`` a client sees only ids and prompts (an eval it cannot look up), and
  ``/reference`` and ``/demonstrations`` are refused (both play tasks to their answers), and an
  episode takes no step once done or past the env's ``max_turns`` (the client's own loop enforces
  them otherwise: a run may set a larger ``rollout.max_turns``).
- **Bounded.**  At most ``max_open`` episodes open at once and ``max_open_per_client`` per
  client (:func:`client_of`: all loopback is one client, IPv6 counts by /64; the next
  ``/reset`` answers 429 naming the flag to raise, before ``setup`` takes a sandbox; ``agentrl run``
  refuses to start when its rollouts and held-out evaluation would not fit); an open
  episode nobody touched for ``idle_timeout_s`` (its client died) is expired: cleaned up,
  forgotten, counted in ``/health``; a later call naming it answers 404 saying so.

A hook that raises answers 200 with ``{"error", "error_kind"}`` (the boundary it crossed, as
in a local episode); a request the server cannot act on (unknown episode, bad JSON) answers
4xx with ``{"error"}``.  Closed episodes keep their state for scoring until scored or until
``keep_closed`` newer ones push them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agentrl import auth
from agentrl.envs.base import Environment, State
from agentrl.episode import error_text
from agentrl.errors import error_kind_of
from agentrl.guard import AiohttpDoor
from agentrl.types import Message, Task, Trajectory, messages_to_dicts

PROTOCOL = 2  # 2: tasks named by id, episodes carry a secret
MAX_TASK_PAGE = 1000
MAX_DEMONSTRATIONS = 10_000
PRIVATE_REFUSAL = ("this server runs with --private-tasks: {what} would show clients the answers it hides; "
                   "serve without --private-tasks to offer it")  # fmt: skip


@dataclass
class _Episode:
    state: State
    secret: str
    client: str  # the opener's address: what the per-client cap counts
    touched: float  # monotonic time of its last call
    steps: int = 0  # /step calls taken


class _Episodes:
    """Open episodes by id (each with its opener's secret), and closed ones kept (bounded)
    until they are scored; the caps on open episodes, total and per client."""

    def __init__(self, keep_closed: int, idle_timeout_s: float | None, max_open: int, max_open_per_client: int) -> None:
        self.open: dict[str, _Episode] = {}
        self.closed: OrderedDict[str, _Episode] = OrderedDict()
        self.keep_closed = keep_closed
        self.idle_timeout_s = idle_timeout_s
        self.max_open, self.max_open_per_client = max_open, max_open_per_client
        self.held: Counter[str] = Counter()  # open + opening episodes per client address
        self.expired: OrderedDict[str, None] = OrderedDict()  # recent expired ids (for the 404 message)
        self.num_expired = 0

    def reserve(self, client: str) -> None:
        """Hold a slot for an episode about to open (before ``setup`` runs: a refused episode
        never takes a sandbox); 429 naming the limit when full."""
        if sum(self.held.values()) >= self.max_open:
            raise _refuse(web.HTTPTooManyRequests, f"the server holds {self.max_open} open episodes (its --max-open): "
                          "close finished episodes, or raise --max-open")  # fmt: skip
        if self.held[client] >= self.max_open_per_client:
            shared = (" (every loopback address is this one client: all of this machine's rollout workers and "
                      "evaluations share it)") if client == "loopback" else ""  # fmt: skip
            raise _refuse(web.HTTPTooManyRequests, f"client {client} holds {self.max_open_per_client} open episodes, the "
                          f"server's --max-open-per-client{shared}: restart `agentrl env serve` with --max-open-per-client "
                          "at least a run's rollout.max_in_flight + eval.concurrency, or lower those")  # fmt: skip
        self.held[client] += 1

    def release(self, client: str) -> None:
        self.held[client] -= 1
        if self.held[client] <= 0:
            del self.held[client]

    def add(self, state: State, client: str) -> tuple[str, str]:
        """Open a reserved episode: (its id, its secret)."""
        eid, secret = f"ep-{secrets.token_urlsafe(12)}", secrets.token_urlsafe(24)
        self.open[eid] = _Episode(state, secret, client, time.monotonic())
        return eid, secret

    def get_open(self, eid: Any, secret: Any) -> State:
        return self.entry(eid, secret).state

    def entry(self, eid: Any, secret: Any) -> _Episode:
        """The open episode ``eid`` (touched now); 404 when not open, 403 for a wrong secret."""
        ep = self.open.get(eid) if isinstance(eid, str) else None
        if ep is None:
            why = f"expired after {self.idle_timeout_s:g}s idle" if eid in self.expired else "closed, or the server restarted"
            raise _refuse(web.HTTPNotFound, f"no open episode {eid!r} ({why})")
        _check_secret(eid, ep, secret)
        ep.touched = time.monotonic()
        return ep

    def idle(self, now: float) -> list[str]:
        """Open episodes untouched for longer than the idle timeout."""
        if self.idle_timeout_s is None:
            return []
        return [eid for eid, ep in self.open.items() if now - ep.touched > self.idle_timeout_s]

    def expire(self, eid: str) -> State | None:
        ep = self.open.pop(eid, None)
        if ep is None:
            return None
        self.release(ep.client)
        self.num_expired += 1
        self.expired[eid] = None
        while len(self.expired) > self.keep_closed:
            self.expired.popitem(last=False)
        return ep.state

    def close(self, eid: Any, secret: Any) -> tuple[State, bool]:
        """(the episode's state, whether it was open until now); 404/403 as :meth:`get_open`."""
        ep = self.open.get(eid) if isinstance(eid, str) else None
        if ep is None:  # already closed: cleanup is idempotent
            kept = self.closed.get(eid) if isinstance(eid, str) else None
            if kept is None:
                return self.get_open(eid, secret), False  # raises the 404 naming why
            _check_secret(eid, kept, secret)
            return kept.state, False
        _check_secret(eid, ep, secret)
        del self.open[eid]
        self.release(ep.client)
        self.closed[eid] = ep
        while len(self.closed) > self.keep_closed:
            self.closed.popitem(last=False)
        return ep.state, True

    def take_for_scoring(self, eid: Any, secret: Any) -> tuple[State | None, str | None]:
        """(the state to score, None) or (None, why not); a closed episode is forgotten once scored."""
        ep = (self.closed.get(eid) or self.open.get(eid)) if isinstance(eid, str) else None
        if ep is None:
            return None, f"env server has no state for episode {eid!r} (evicted or restarted)"
        if not _secret_ok(ep, secret):
            return None, f"episode {eid!r} was opened by another client (wrong episode_secret)"
        self.closed.pop(eid, None)
        return ep.state, None


def _secret_ok(ep: _Episode, secret: Any) -> bool:
    return isinstance(secret, str) and auth.matches(ep.secret, secret)


def _check_secret(eid: str, ep: _Episode, secret: Any) -> None:
    if not _secret_ok(ep, secret):
        raise _refuse(web.HTTPForbidden, f"episode {eid!r} was opened by another client (wrong episode_secret)")


def _refuse(cls: type[web.HTTPException], message: str) -> web.HTTPException:
    return cls(text=_json_error(message), content_type="application/json")


def _json_error(message: str) -> str:
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


class _Tasks:
    """The server's own tasks, by split and by id: the only tasks its episodes run."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.splits: dict[str, list[Task] | None] = {}
        self._by_id: dict[str, Task] | None = None

    def split(self, name: str) -> list[Task] | None:
        if name not in ("train", "eval"):
            raise _refuse(web.HTTPBadRequest, f"split must be 'train' or 'eval', not {name!r}")
        if name not in self.splits:
            try:
                rows = self.env.dataset() if name == "train" else self.env.eval_dataset()
            except NotImplementedError:
                rows = None
            self.splits[name] = None if rows is None else list(rows)
        return self.splits[name]

    def by_id(self, task_id: Any) -> Task:
        """The task named ``task_id``; 404 for a task the server does not hold (a client cannot
        bring its own task, answer or info: that would let it choose its own reward)."""
        if self._by_id is None:
            self._by_id = {t.id: t for name in ("train", "eval") for t in self.split(name) or []}
        task = self._by_id.get(task_id) if isinstance(task_id, str) else None
        if task is None:
            raise _refuse(web.HTTPNotFound, f"no task {task_id!r} on this server: a served environment runs only its own "
                          "tasks; name one by its id from GET /tasks")  # fmt: skip
        return task


def _info(env: Environment, tasks: _Tasks) -> dict[str, Any]:
    """What a client needs to run the env like a local one: limits, tools, rubric, task counts."""
    counts = {name: (None if (rows := tasks.split(name)) is None else len(rows)) for name in ("train", "eval")}
    return {
        "protocol": PROTOCOL, "name": env.name, "version": str(env.version), "max_turns": env.max_turns,
        "max_total_tokens": env.max_total_tokens, "max_seq_len": env.max_seq_len, "timeout_s": env.timeout_s,
        "on_length": env.on_length, "reward_range": env.reward_range, "max_reward": env.max_reward,
        "tools": env.tool_schemas(), "system_prompt": getattr(env, "system_prompt", None),
        "rubric": [{"name": f.name, "weight": f.weight} for f in getattr(env.rubric, "funcs", [])],
        "num_tasks": counts, "reference_policy": env.reference_policy() is not None,
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


def _key_middleware(key: str) -> Any:
    """Every route but ``/health`` needs ``Authorization: Bearer KEY`` (constant-time check)."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/health" and not auth.matches(key, auth.bearer(request.headers.get("Authorization"))):
            refused = web.json_response(
                {"error": f"missing or wrong API key: send 'Authorization: Bearer KEY' (clients read {auth.KEY_ENV})"},
                status=401, headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip
            refused.force_close()  # its body unread: the connection goes with the answer
            return refused
        return await handler(request)

    return check


def make_app(
    env: Environment, *, keep_closed: int = 4096, idle_timeout_s: float | None = 600.0, api_key: str | None = None,
    max_open: int = 1024, max_open_per_client: int = 512, private_tasks: bool = False, door: AiohttpDoor | None = None,
) -> web.Application:  # fmt: skip
    """The aiohttp application serving ``env`` (routes and rules in the module docstring).

    ``door``: where requests may come from and the connection rules (default: loopback names
    and IP literals; :class:`agentrl.guard.AiohttpDoor`).

    ``idle_timeout_s``: an open episode with no call for this long is expired (None: never).
    ``api_key``: required on every route but ``/health`` (None: open).  ``max_open`` /
    ``max_open_per_client``: open episodes at once, in all and per client address.
    ``private_tasks``: ``/tasks`` shows each task's id and prompt only (no answer, no info)."""
    episodes = _Episodes(keep_closed, idle_timeout_s, max_open, max_open_per_client)
    tasks = _Tasks(env)
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(_: web.Request) -> web.Response:
        return web.json_response({
            "status": "ok", "env": env.name, "version": str(env.version), "open": len(episodes.open),
            "expired": episodes.num_expired,
        })  # fmt: skip

    @routes.get("/info")
    async def info(request: web.Request) -> web.Response:
        shown = _info(env, tasks)
        if private_tasks:  # the reference route is refused (it would play the hidden tasks)
            shown["reference_policy"] = False
        # the caps, and the client the caller counts as: a run checks it fits before it starts
        limits = {"max_open": max_open, "max_open_per_client": max_open_per_client, "client": client_of(request.remote)}
        return web.json_response({**shown, "private_tasks": private_tasks, **limits})

    @routes.get("/tasks")
    async def task_page(request: web.Request) -> web.Response:
        try:
            offset, limit = int(request.query.get("offset", 0)), int(request.query.get("limit", MAX_TASK_PAGE))
        except ValueError as e:
            raise _refuse(web.HTTPBadRequest, f"offset and limit must be integers: {e}") from e
        rows = tasks.split(request.query.get("split", "train"))
        if rows is None:
            return web.json_response({"tasks": [], "total": None})
        page = rows[max(offset, 0) : max(offset, 0) + min(max(limit, 0), MAX_TASK_PAGE)]
        shown = [t.to_dict() for t in page]
        if private_tasks:  # what the model is shown, nothing the rubric compares to
            shown = [{"id": d["id"], "prompt": d["prompt"]} for d in shown]
        return web.json_response({"tasks": shown, "total": len(rows)})

    @routes.post("/reset")
    async def reset(request: web.Request) -> web.Response:
        body = await _body(request, "task_id")
        task = tasks.by_id(body["task_id"])
        client = client_of(request.remote)
        episodes.reserve(client)
        try:
            state = await env.setup(task)
        except Exception as e:
            episodes.release(client)
            return _failed(e)
        except BaseException:  # cancelled (the client went away): the slot is not kept
            episodes.release(client)
            raise
        eid, secret = episodes.add(state, client)
        return web.json_response({
            "episode_id": eid, "episode_secret": secret, "messages": messages_to_dicts(state.messages),
            "metrics": state.metrics, "done": state.done,
        })  # fmt: skip

    @routes.post("/step")
    async def step(request: web.Request) -> web.Response:
        body = await _body(request, "episode_id", "assistant")
        ep = episodes.entry(body["episode_id"], body.get("episode_secret"))
        state = ep.state
        if private_tasks:  # a client that may not see the answers may not play past the env's limits either
            if state.done:
                raise _refuse(web.HTTPConflict, "the episode is done: a server with --private-tasks takes no more steps")
            if env.max_turns and ep.steps >= env.max_turns:
                raise _refuse(web.HTTPConflict, f"the episode took the env's max_turns={env.max_turns} steps: a server "
                              "with --private-tasks takes no more")  # fmt: skip
        ep.steps += 1
        try:
            turn = int(body.get("turn", state.turn + 1))
        except (TypeError, ValueError) as e:
            raise _refuse(web.HTTPBadRequest, f"turn must be an integer: {e}") from e
        if turn < state.turn:
            raise _refuse(web.HTTPBadRequest, f"turn {turn} is before the episode's turn {state.turn} (turns only count up)")
        state.turn = turn
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
        state, was_open = episodes.close(body["episode_id"], body.get("episode_secret"))
        if was_open:
            try:
                await asyncio.shield(env.cleanup(state))
            except Exception as e:
                return _failed(e)
        return web.json_response({"metrics": state.metrics})

    @routes.post("/score")
    async def score(request: web.Request) -> web.Response:
        body = await _body(request, "episodes")
        if not isinstance(body["episodes"], list) or not all(isinstance(i, dict) for i in body["episodes"]):
            raise _refuse(web.HTTPBadRequest, "episodes must be a list of {episode_id, episode_secret, trajectory}")
        return web.json_response({"scores": await _score(env, episodes, body["episodes"])})

    @routes.post("/demonstrations")
    async def demonstrations(request: web.Request) -> web.Response:
        body = await _body(request, "n")
        try:
            n, seed = int(body["n"]), int(body.get("seed", 0))
        except (TypeError, ValueError) as e:
            raise _refuse(web.HTTPBadRequest, f"n and seed must be integers: {e}") from e
        if private_tasks:  # demonstrations play tasks to their answers
            return web.json_response({"error": PRIVATE_REFUSAL.format(what="demonstrations"), "error_kind": "env"})
        if not 0 <= n <= MAX_DEMONSTRATIONS:
            raise _refuse(web.HTTPBadRequest, f"n must be in [0, {MAX_DEMONSTRATIONS}], not {n}")
        try:
            convs = env.demonstrations(n, seed)
        except Exception as e:
            return _failed(e)
        return web.json_response({"conversations": [messages_to_dicts(c) for c in convs]})

    _reference_route(routes, env, tasks, private_tasks)
    door = door or AiohttpDoor()
    middlewares = [door.middleware, *([_key_middleware(api_key)] if api_key else [])]
    app = web.Application(client_max_size=64 * 2**20, middlewares=middlewares)
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


def _reference_route(routes: web.RouteTableDef, env: Environment, tasks: _Tasks, private_tasks: bool) -> None:
    """``POST /reference``: the env's reference policy plays one turn (``agentrl env test URL``);
    refused with private tasks (the policy solves the task: its turns show what /tasks hides)."""

    @routes.post("/reference")
    async def reference(request: web.Request) -> web.Response:
        body = await _body(request, "task_id", "messages")
        task = tasks.by_id(body["task_id"])
        if private_tasks:
            raise _refuse(web.HTTPForbidden, PRIVATE_REFUSAL.format(what="the reference policy"))
        policy = env.reference_policy()
        if policy is None:
            return web.json_response({"error": f"{env.name} has no reference policy", "error_kind": "env"})
        try:
            msg = policy(task, [Message.from_dict(m) for m in body["messages"]])
        except Exception as e:
            return _failed(e)
        return web.json_response({"message": msg.to_dict()})


async def _score(env: Environment, episodes: _Episodes, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Score one group with the env's rubric, each episode on the state the server kept: its
    messages and its task (the answer the rubric compares to is the server's, not the client's)."""
    from agentrl.rubrics import score_episodes

    trajs: list[Trajectory] = []
    for i, item in enumerate(items):  # all read before any state is taken: a 400 loses none
        try:
            trajs.append(Trajectory.from_dict(item["trajectory"]))
        except Exception as e:  # the client's malformed input: a 400 naming it, not a 500
            raise _refuse(web.HTTPBadRequest, f"episodes[{i}].trajectory is not a trajectory: {error_text(e)}") from e
    for traj, item in zip(trajs, items, strict=True):
        state, why = episodes.take_for_scoring(item.get("episode_id"), item.get("episode_secret"))
        if state is None:
            traj.error, traj.error_kind = why, "env"
        else:
            traj.task = state.task
            traj.messages = state.messages  # the server's own messages: parsed tool calls, env objects
        traj.state = state
    await score_episodes(env.rubric, trajs)
    return [{"reward": t.reward, "metrics": t.metrics, "error": t.error, "error_kind": t.error_kind} for t in trajs]


def client_of(address: str | None) -> str:
    """The client an address counts as for ``max_open_per_client``: every loopback address
    (127.0.0.0/8, ::1 and their IPv4-mapped forms) is one client, ``loopback``: they are all
    this machine, and 127.0.0.2..255 cost nothing to bind.  An IPv4-mapped address counts as
    its IPv4 address, any other IPv6 address by its /64 (the block one host is given)."""
    try:
        ip = ipaddress.ip_address((address or "").split("%", 1)[0])
    except ValueError:
        return address or "?"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, keyed: bool) -> str | None:
    """The warning for binding ``host`` (None on loopback)."""
    if is_loopback(host):
        return None
    if keyed:
        return (f"warning: the env server listens on {host}, beyond this machine; every route but /health needs "
                "the API key, but episodes run tools (and sandbox commands) for whoever holds it")  # fmt: skip
    return (f"warning: the env server listens on {host} with NO API key: anyone who reaches this port can open "
            f"episodes and run the env's tools (and sandbox commands); set --api-key or {auth.KEY_ENV}, or bind "
            "127.0.0.1")  # fmt: skip


async def serve(
    env: Environment, *, host: str = "127.0.0.1", port: int = 8765, on_ready: Any = None,
    idle_timeout_s: float | None = 600.0, api_key: str | None = None, max_open: int = 1024,
    max_open_per_client: int = 512, private_tasks: bool = False, door: AiohttpDoor | None = None,
) -> None:  # fmt: skip
    """Serve ``env`` until cancelled (``agentrl env serve``); ``on_ready(url)`` once listening."""
    from agentrl.errors import AgentrlError

    door = door or AiohttpDoor()
    app = make_app(env, idle_timeout_s=idle_timeout_s, api_key=api_key, max_open=max_open,
                   max_open_per_client=max_open_per_client, private_tasks=private_tasks, door=door)  # fmt: skip
    runner = web.AppRunner(app, access_log=None, lingering_time=0)  # a refused body is not read on
    await runner.setup()
    server = None
    try:
        try:
            server = await door.listen(runner, host, port)
        except OSError as e:
            raise AgentrlError(f"cannot serve on {host}:{port}: {e.strerror or e}") from e
        if on_ready is not None:
            on_ready(f"http://{host}:{port}")
        await asyncio.Event().wait()
    finally:
        if server is not None:
            server.close()
        await runner.cleanup()
        await env.close()


__all__ = ["PROTOCOL", "exposure_warning", "is_loopback", "make_app", "serve"]
