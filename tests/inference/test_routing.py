"""Routing across engines (PolicyClient): least outstanding requests, a group's episodes on one
engine for every turn, groups spread over engines; against real HTTP servers."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from aiohttp import web
from testkit import serve_app

from agentrl.envs.base import Environment
from agentrl.inference import PolicyClient
from agentrl.rollout import run_group
from agentrl.types import Message, SamplingParams, Task


class Engine:
    """An OpenAI-ish server on a free port: ``/tokenize`` returns ``[task number]`` so every
    completion request names its task; ``hold`` makes completions wait until set."""

    def __init__(self, arrivals: asyncio.Queue | None = None) -> None:
        self.tasks: list[int] = []  # first prompt token of every completion served
        self.hold: asyncio.Event | None = None
        self.arrivals = arrivals  # each completion request puts this engine on it as it arrives

    async def __aenter__(self) -> Engine:
        async def tokenize(request: web.Request) -> web.Response:
            body = await request.json()
            first = next(m["content"] for m in body["messages"] if m["role"] == "user")
            return web.json_response({"tokens": [int(first.removeprefix("task ")), 1, 2]})

        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            self.tasks.append(body["prompt"][0])
            if self.arrivals is not None:
                self.arrivals.put_nowait(self)
            if self.hold is not None:
                await self.hold.wait()
            await asyncio.sleep(0.01)
            return web.json_response({"id": "c", "object": "text_completion", "model": "m", "choices": [
                {"index": 0, "text": "x", "finish_reason": "stop", "token_ids": [7, 8],
                 "logprobs": {"token_logprobs": [-0.5, -0.5]}, "token_versions": [0, 0]}]})  # fmt: skip

        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/v1/completions", completions)
        self.runner, port = await serve_app(app)
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


class ThreeTurns(Environment):
    async def step(self, state, assistant_msg):
        return [Message("user", "again")]


async def test_a_busy_engine_gets_no_new_requests_until_it_frees_up():
    """Least outstanding: while engine A holds a request, every new one goes to B (round robin
    alone would send half of them to A)."""
    arrivals: asyncio.Queue = asyncio.Queue()
    async with Engine(arrivals) as a, Engine(arrivals) as b, PolicyClient([a.url, b.url], "m", max_retries=0) as pc:
        a.hold = asyncio.Event()
        b.hold = None
        stuck = []
        for _ in range(10):
            call = asyncio.create_task(pc.complete([1], SamplingParams()))
            served_by = await asyncio.wait_for(arrivals.get(), 30)  # the request reached an engine
            if served_by is b:
                await call  # B answers; the next request sees A still holding one
            else:
                stuck.append(call)
        assert len(a.tasks) == 1 and len(b.tasks) == 9 and len(stuck) == 1 and not stuck[0].done()
        a.hold.set()
        await asyncio.gather(*stuck)
        assert [ep.in_flight for ep in pc.endpoints] == [0, 0]


async def test_each_group_runs_every_turn_on_one_engine_and_groups_spread():
    """4 groups × 4 episodes × 3 turns over 2 engines: every completion of a group lands on the
    engine its group was pinned to (prefix cache), and the groups split 2/2 (least loaded)."""
    env = ThreeTurns(max_turns=3)
    async with Engine() as a, Engine() as b, PolicyClient([a.url, b.url], "m", max_retries=0) as pc:
        tasks = [Task([Message("user", f"task {i}")]) for i in range(4)]
        groups = await asyncio.gather(*(run_group(env, pc, t, SamplingParams(max_tokens=4), 4) for t in tasks))
        assert all(t.error is None and len(t.turns) == 3 for g in groups for t in g)
        served: dict[int, set[int]] = defaultdict(set)
        for engine, name in ((a, "a"), (b, "b")):
            for task in engine.tasks:
                served[task].add(name)
        assert all(len(engines) == 1 for engines in served.values()), dict(served)  # a group never split
        assert sorted(len(set(e.tasks)) for e in (a, b)) == [2, 2]  # groups spread over engines
        assert len(a.tasks) + len(b.tasks) == 4 * 4 * 3
        assert all(ep.pinned == 0 and ep.in_flight == 0 for ep in pc.endpoints)
