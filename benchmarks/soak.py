"""Soak: 1,000 concurrent multi-turn episodes for minutes, then count what was left behind.

The real orchestrator stack — RolloutManager (admission, groups) → ToolEnv (the token-exact
multi-turn loop, tool-call parsing, tools, one of them in a sandbox) → PolicyClient (HTTP,
retries, prompts rendered locally with the tiny model's tokenizer) → rubric → StalenessBuffer —
runs against a fast stand-in OpenAI endpoint: a real HTTP server (uvicorn) on loopback, in a
thread of this process with its own event loop.  It answers ``/v1/completions`` after
``--latency-ms`` with token ids, logprobs and the current weight version: a tool call on turns
1–2 (every ``--sandbox-every``-th task's first call is a ``shell`` command run in a pooled
sandbox), a final answer on turn 3.  A stand-in trainer takes each batch and bumps the weight
version at once, so admission never stops.

Reports episodes/s, peak RSS and RSS over time; and, after everything was stopped and closed
(episodes still running at the end are cancelled, as when a run stops), what leaked compared
with a baseline taken after a warm-up: file descriptors (``/proc/self/fd``), asyncio tasks,
Python threads, live sandboxes (``agentrl.sandbox.live.live_sandboxes``) and child processes
(``/proc``).  Last line: JSON.

    python benchmarks/soak.py [--seconds 180 --concurrency 1000 --latency-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import resource
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------- stand-in endpoint


class StandIn:
    """A minimal OpenAI completions server on loopback, served from a thread (``with StandIn(...)``)."""

    def __init__(self, latency_s: float) -> None:
        from agentrl.tiny_model import build_tokenizer

        self.latency_s = latency_s
        self.version = 0  # the weight version tokens are tagged with (moved by the stand-in trainer)
        self.requests = 0
        tok = build_tokenizer()
        self.tok = tok
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        calls = [
            '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>',
            '<tool_call>\n{"name": "shell", "arguments": {"command": "echo 42"}}\n</tool_call>',
            '<tool_call>\n{"name": "add", "arguments": {"a": 42, "b": 8}}\n</tool_call>',
            "The answer is 50",
        ]
        self.replies = [tok.encode(r, add_special_tokens=False) + [im_end] for r in calls]
        self.texts = [tok.decode(ids, skip_special_tokens=True) for ids in self.replies]
        self.tool_header = tok.encode("<|im_start|>tool", add_special_tokens=False)
        self.sandbox_marker = tok.encode("[sandbox]", add_special_tokens=False)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def reply_index(self, prompt: list[int]) -> int:
        """Turn 1: add (or shell for a [sandbox] task), turn 2: add, turn 3: the answer."""
        tools = _count(prompt, self.tool_header)
        if tools == 0:
            return 1 if _count(prompt, self.sandbox_marker) else 0
        return 2 if tools == 1 else 3

    async def app(self, scope: dict, receive: Any, send: Any) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"].endswith("/completions"):
            self.requests += 1
            req = json.loads(body)
            await asyncio.sleep(self.latency_s)
            k = self.reply_index(req["prompt"])
            ids = self.replies[k]
            out: dict[str, Any] = {
                "id": "cmpl-soak", "object": "text_completion", "created": 0, "model": req.get("model", "m"),
                "choices": [{"index": 0, "text": self.texts[k], "finish_reason": "stop", "token_ids": ids,
                             "token_versions": [self.version] * len(ids),
                             "logprobs": {"token_logprobs": [-0.1] * len(ids), "tokens": [], "top_logprobs": None,
                                          "text_offset": []}}],
                "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": len(ids),
                          "total_tokens": len(req["prompt"]) + len(ids)},
            }  # fmt: skip
        elif scope["path"] == "/v1/models":
            out = {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}
        else:
            out = {"status": "ok"}
        data = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    def __enter__(self) -> StandIn:
        import uvicorn

        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                backlog=4096, lifespan="off", interface="asgi3")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="stand-in", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the stand-in endpoint did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        assert self._thread is not None
        self._thread.join(timeout=30)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def _count(seq: list[int], pattern: list[int]) -> int:
    n, k, first = 0, len(pattern), pattern[0]
    for i, t in enumerate(seq):
        if t == first and seq[i : i + k] == pattern:
            n += 1
    return n


# ----------------------------------------------------------------------------- the environment


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


def answer_is_50(completion: Any) -> float:
    return float("50" in str(completion))


def make_env(n_tasks: int, sandbox_every: int, backend: str) -> Any:
    """A 3-turn ToolEnv: ``add`` in process, ``shell`` in a sandbox from a small shared pool."""
    from agentrl.envs import ToolEnv
    from agentrl.rubrics import Rubric
    from agentrl.sandbox import SandboxLimits, SandboxPool

    class SoakEnv(ToolEnv):
        pool: SandboxPool | None = None
        sandbox_execs = 0

        async def shell(self, command: str) -> str:
            """Run a shell command in a sandbox.

            Args:
                command: the bash command line
            """
            if self.pool is None:
                self.pool = SandboxPool(backend, SandboxLimits(timeout_s=10), max_live=8)
            async with self.pool.acquire() as sb:
                out = (await sb.exec(["bash", "-c", command])).as_text(200)
            self.sandbox_execs += 1
            return out

        async def close(self) -> None:
            if self.pool is not None:
                await self.pool.close()
                self.pool = None

    env = SoakEnv(tools=[add], rubric=Rubric([answer_is_50]), max_turns=3, show_tools=True,
                  dataset=[f"What is 12+30+8? (#{i}){' [sandbox]' if sandbox_every and i % sandbox_every == 0 else ''}"
                           for i in range(n_tasks)])  # fmt: skip
    env.add_tool(env.shell)
    return env


def sandbox_backend() -> str:
    """bwrap or docker when the host has one, else the (unisolated) local backend: the soak only
    runs ``echo`` in it."""
    from agentrl.sandbox import SandboxError, resolve_backend

    try:
        return resolve_backend("auto")
    except SandboxError:
        return "local"


# ----------------------------------------------------------------------------- what a process holds


@dataclass
class Holdings:
    """What this process holds at one instant (compared before and after the soak)."""

    fds: dict[int, str] = field(default_factory=dict)
    threads: list[str] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    sandboxes: list[str] = field(default_factory=list)

    @classmethod
    def now(cls) -> Holdings:
        from agentrl.sandbox.live import live_sandboxes

        return cls(open_fds(), sorted(t.name for t in threading.enumerate()), child_pids(),
                   sorted(sb.id for sb in live_sandboxes()))

    def leaked_since(self, before: Holdings) -> dict[str, list]:
        return {
            "fds": [f"{fd} -> {describe_socket(target)}" for fd, target in sorted(self.fds.items())
                    if before.fds.get(fd) != target],
            "threads": [t for t in self.threads if t not in before.threads or self.threads.count(t) > before.threads.count(t)],
            "children": [p for p in self.children if p not in before.children],
            "sandboxes": [s for s in self.sandboxes if s not in before.sandboxes],
        }


def open_fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the fd listdir itself used, closed by now
            continue
    return out


def describe_socket(target: str) -> str:
    """``socket:[inode]`` with its TCP ends and state where it is a TCP socket (a leaked one then
    says whose it is: the stand-in's side listens on its port, the client's side connects to it)."""
    inode = target.removeprefix("socket:[").rstrip("]")
    states = {"01": "ESTABLISHED", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "0A": "LISTEN"}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[9] == inode:
                local, peer = (f":{int(c.rsplit(':', 1)[1], 16)}" for c in cols[1:3])
                return f"{target} tcp {local} -> {peer} {states.get(cols[3], cols[3])}"
    return target


def child_pids() -> list[int]:
    """Every descendant of this process (zombies included: an unreaped child is a leak too)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [os.getpid()]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return sorted(found)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- the soak


@dataclass
class SoakResult:
    seconds: float
    episodes: int  # finished, scored and handed to the buffer
    errored: int
    peak_in_flight: int
    steps: int  # batches the stand-in trainer took
    model_calls: int
    sandbox_execs: int
    leaked_tasks: list[str]
    rss_samples_mb: list[float]
    errors: list[str]
    unhandled: list[str]

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / max(self.seconds, 1e-9)


async def soak(stand_in: StandIn, seconds: float, *, concurrency: int = 1000, group_size: int = 8,
               sandbox_every: int = 50, backend: str = "local", sample_every_s: float = 5.0) -> SoakResult:
    """Keep ``concurrency`` episodes in flight for ``seconds``; then stop and close everything."""
    from agentrl.buffer import StalenessBuffer
    from agentrl.inference.client import PolicyClient
    from agentrl.rollout import RolloutManager, TaskSampler
    from agentrl.types import SamplingParams

    tasks_before = asyncio.all_tasks()
    unhandled: list[str] = []  # "Task exception was never retrieved", "Unclosed client session", ...
    asyncio.get_running_loop().set_exception_handler(
        lambda loop, ctx: unhandled.append(f"{ctx.get('message')}: {ctx.get('exception')!r} {ctx.get('future', '')}"[:300])
    )
    env = make_env(4 * concurrency // group_size, sandbox_every, backend)
    client = PolicyClient(stand_in.base_url, "stand-in", tokenizer=stand_in.tok)
    groups = -(-concurrency // group_size)
    batch_groups = -(-groups // 2)  # η = 1 admits (η + 1)·B groups: every slot can be in flight
    buffer = StalenessBuffer(batch_groups, 1, filter_zero_variance=False)
    errors: list[str] = []
    manager = RolloutManager(
        env, client, buffer, TaskSampler(list(env.dataset()), seed=0), SamplingParams(max_tokens=64),
        group_size=group_size, max_in_flight=concurrency, episode_timeout_s=max(60.0, seconds),
        on_trajectory=lambda t: t.error and len(errors) < 5 and errors.append(f"{t.error_kind}: {t.error}"),
    )
    steps = 0

    async def trainer() -> None:  # takes each batch at once and moves the weight version
        nonlocal steps
        while True:
            batch = await buffer.take()
            steps += 1
            stand_in.version = batch.version + 1
            buffer.commit_step(batch.version + 1)

    t0 = time.perf_counter()
    runner = asyncio.create_task(manager.run(), name="soak-rollouts")
    training = asyncio.create_task(trainer(), name="soak-trainer")
    peak, samples, next_sample = 0, [rss_mb()], t0 + sample_every_s
    try:
        while (now := time.perf_counter()) - t0 < seconds:
            await asyncio.sleep(0.05)
            peak = max(peak, manager.active_episodes)
            if runner.done():
                runner.result()  # surfaces the manager's exception
            if now >= next_sample:
                samples.append(rss_mb())
                next_sample += sample_every_s
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop()  # cancels the episodes still running, as a stopping run does
        await asyncio.gather(runner, return_exceptions=True)
        training.cancel()
        await asyncio.gather(training, return_exceptions=True)
        await env.close()
        await client.close()
    samples.append(rss_mb())
    for _ in range(5):  # let cancelled callbacks and closing transports finish
        await asyncio.sleep(0.05)
    leaked = [t.get_name() + ": " + repr(t.get_coro()) for t in asyncio.all_tasks() - tasks_before]
    gc.collect()  # unretrieved task exceptions and unclosed sessions report when collected
    return SoakResult(
        seconds=elapsed, episodes=manager.episodes_finished, errored=buffer.ledger.errored, peak_in_flight=peak,
        steps=steps, model_calls=stand_in.requests, sandbox_execs=_sandbox_execs(env), leaked_tasks=leaked,
        rss_samples_mb=[round(x, 1) for x in samples], errors=errors, unhandled=unhandled,
    )


def _sandbox_execs(env: Any) -> int:
    return getattr(env, "sandbox_execs", 0)


@contextlib.contextmanager
def resource_warnings() -> Iterator[list[str]]:
    """The ``ResourceWarning``s raised inside (after a last collection), one line each.

    A file or socket that only the garbage collector closed was leaked all the same: whoever
    opened it never closed it, and under load the fds pile up until the collector runs.  The
    message names the object (a socket's ports); the place is where it was collected.  Other
    warnings are shown when the block ends.  The capture is process-wide (``warnings`` state):
    the soak's threads are caught too, and nothing else may swap the filters meanwhile.
    """
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)  # recorded, even where -W would raise them
        try:
            yield found
        finally:
            gc.collect()
    for w in caught:
        if issubclass(w.category, ResourceWarning):
            found.append(f"{w.filename}:{w.lineno}: {w.message}"[:300])
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def run_soak(seconds: float, *, concurrency: int = 1000, latency_ms: float = 5.0, sandbox_every: int = 50,
             warmup_s: float = 3.0, settle_s: float = 10.0) -> dict[str, Any]:
    """Warm up, take the baseline, soak, stop everything, and compare (what a test asserts on)."""
    backend = sandbox_backend() if sandbox_every else "local"
    with StandIn(latency_ms / 1000) as stand_in:  # warm-up: imports, first connections, lazy globals
        asyncio.run(soak(stand_in, warmup_s, concurrency=min(64, concurrency), sandbox_every=sandbox_every and 2,
                         backend=backend))
    gc.collect()  # garbage from before (ours or a caller's) closes its fds now, not mid-soak under a reused number
    before = Holdings.now()
    rss_before = rss_mb()
    with resource_warnings() as unclosed:
        with StandIn(latency_ms / 1000) as stand_in:
            result = asyncio.run(soak(stand_in, seconds, concurrency=concurrency, sandbox_every=sandbox_every,
                                      backend=backend))
        leaked = Holdings.now().leaked_since(before)
        deadline = time.monotonic() + settle_s  # server-side sockets and reaped children may trail a moment
        while any(leaked.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            gc.collect()  # frees what only a cycle held; what it had to close is counted in resource_warnings
            leaked = Holdings.now().leaked_since(before)
    leaked["tasks"] = result.leaked_tasks
    leaked["unhandled"] = result.unhandled
    leaked["resource_warnings"] = unclosed
    return {
        "benchmark": "soak", "seconds": round(result.seconds, 1), "concurrency": concurrency,
        "latency_ms": latency_ms, "sandbox_backend": backend, "episodes": result.episodes,
        "episodes_per_s": round(result.episodes_per_s, 1), "peak_in_flight": result.peak_in_flight,
        "errored": result.errored, "steps": result.steps, "model_calls": result.model_calls,
        "sandbox_execs": result.sandbox_execs,
        "peak_rss_mb": round(peak_rss_mb(), 1), "rss_before_mb": round(rss_before, 1),
        "rss_samples_mb": result.rss_samples_mb, "leaked": leaked, "errors": result.errors,
        "cores": os.cpu_count(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=180.0, help="soak length (default 3 minutes)")
    p.add_argument("--concurrency", type=int, default=1000, help="episodes in flight")
    p.add_argument("--latency-ms", type=float, default=5.0, help="stand-in latency per model call")
    p.add_argument("--sandbox-every", type=int, default=50, help="every N-th task runs a shell tool in a sandbox (0 = none)")
    args = p.parse_args()
    out = run_soak(args.seconds, concurrency=args.concurrency, latency_ms=args.latency_ms,
                   sandbox_every=args.sandbox_every)
    leaks = {k: len(v) for k, v in out["leaked"].items()}
    print(f"soak: {out['concurrency']} concurrent 3-turn tool episodes for {out['seconds']:.0f} s against a "
          f"stand-in endpoint ({out['latency_ms']:g} ms per call, in-process HTTP on loopback)")
    print(f"  episodes/s          {out['episodes_per_s']:8.1f}   ({out['episodes']} episodes, {out['model_calls']} "
          f"model calls, peak in flight {out['peak_in_flight']}, {out['errored']} errored)")
    print(f"  sandbox             {out['sandbox_execs']} shell calls on {out['sandbox_backend']}")
    print(f"  peak RSS            {out['peak_rss_mb']:8.1f} MB (before the soak {out['rss_before_mb']:.1f} MB; "
          f"during it {', '.join(f'{x:.0f}' for x in out['rss_samples_mb'])})")
    print(f"  leaked              {leaks}")
    if out["errors"]:
        print(f"  first errors        {out['errors'][:2]}")
    print(json.dumps({**out, "leaked": leaks}))


if __name__ == "__main__":
    main()
