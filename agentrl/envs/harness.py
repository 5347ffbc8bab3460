"""HarnessEnv: train an existing agent program unchanged.

    env = HarnessEnv(command=["python", "my_agent.py"], dataset=rows, rubric=Rubric([correct]))
    env = HarnessEnv(agent=my_agent, dataset=rows, rubric=Rubric([correct]))

    async def my_agent(client: openai.AsyncOpenAI, task: dict) -> str: ...
    def correct(result, answer) -> float: ...

Per episode the program talks to an episode-scoped OpenAI-compatible endpoint
(:mod:`agentrl.gateway`): every call is rendered with the model's template, sampled by the
run's policy and recorded token-exactly, so the episode trains like any other.

**Command form.**  ``command`` runs with agentrl's own environment (minus the run's
``AGENTRL_API_KEY``) plus ``OPENAI_BASE_URL`` (ending in ``/v1``), ``OPENAI_API_KEY`` (the
episode's key) and ``AGENTRL_TASK`` (JSON ``{"id", "prompt", "info"}``: never the answer, and of
``task.info`` only the keys named in ``task_info``, none by default: a dataset's other columns
land in ``info``, tests and solutions included, and a program the model steers could print its
environment), in a session of its own, stdin closed.  Its final answer is the last non-empty
line of its stdout.  After it exits (or at ``timeout_s``) every process still in its session is
killed, before the program itself is reaped: until then its pid, the session's number, can be
no other process's.

**Isolation.**  Programs of one run share a user, and a process can read the environment
of any process of its user (``/proc/<pid>/environ``): one episode's program could take
another's ``OPENAI_API_KEY`` and ``OPENAI_BASE_URL`` and call into that episode (its calls
would train as the other episode's).  So with ``isolate="pid"`` (the default ``"auto"``
where bubblewrap works) each program runs in a pid namespace of its own with its own
``/proc`` (``bwrap --unshare-pid``; same files, network and user): it sees only its own
processes, and the whole namespace dies with its first process, ``setsid`` or not; its
``/dev/shm`` is its own (the engines' weight segments live there).  It is not a sandbox: the
program keeps the user's files (the run directory, checkpoints included), so run programs you
would run as that user; model-written code belongs in a sandboxed env.
``isolate="none"`` runs it plainly (the sweep above misses a program that calls ``setsid``);
a key is always bound to its episode's path, so a program's own key opens no other episode.

**In-process form.**  ``agent(client, task)`` gets an ``openai.AsyncOpenAI`` bound to the
episode's endpoint and the same task dict; its return value is the answer.

Reward functions get the answer as ``result`` (besides ``completion``, ``messages``,
``answer``, ``state``, ...).  Failures are the episode's, with the program's stderr tail, and
whose they are decides whether the episode trains (``agentrl.buffer``: a policy failure stays
in its group with reward 0, infrastructure leaves it), so the policy cannot escape a wrong
answer by making its program fail:

- ``timeout_s`` passed after the program's first model call: kind ``timeout`` (the policy's:
  it can make a program loop); before any call, kind ``env`` (a program stuck on its own).
  Where the episode's wall limit comes first, the program's time ends :data:`KILL_MARGIN_S`
  before it, so that the same rule, not the episode loop's blanket ``timeout``, decides.
- a non-zero exit (in-process: an exception) after the program's first model call: most
  agent programs crash on a malformed tool call (or on a reply the model drew out past the
  program's own client timeout), so with ``failed_exit="failure"`` (the default) it is kind
  ``program``, the policy's failure; ``failed_exit="error"`` makes it kind ``env`` (for a
  program that handles any model output itself, so that a crash is its own bug).  Before the
  first call nothing the model wrote can be why: kind ``env``, always.
- an exit without one model call, or (exit 0) without one model reply (every call refused
  or failed, the errors swallowed): kind ``env``; it has nothing to train on.

When a call failed at the endpoint first, the episode carries that failure (kind
``endpoint``) instead.  ``max_turns`` caps the model calls of one episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import warnings
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from agentrl.auth import KEY_ENV, key_files
from agentrl.envs.base import Environment, State
from agentrl.episode import error_text
from agentrl.errors import EpisodeError, EpisodeFailure, EpisodeTimeout, ProgramFailed
from agentrl.gateway import Gateway, Session
from agentrl.types import Message, Task, json_default, messages_to_dicts

STDOUT_KEEP = 64 << 10  # bytes of stdout kept (the answer is its last line)
STDERR_KEEP = 300  # characters of stderr quoted in an error
# a program whose time ends with the episode's wall limit is stopped this much earlier: its kill,
# reap and the error that names it must finish before the episode's limit cuts them short
KILL_MARGIN_S = 1.5

Agent = Callable[[Any, dict[str, Any]], Awaitable[Any]]
# never in a program's environment: the run's key (weight pushes), Ray's token (code on the cluster)
_SECRET_ENV = frozenset({KEY_ENV, "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"})
Isolate = Literal["auto", "pid", "none"]
FailedExit = Literal["failure", "error"]
# the host's files as they are, but a /proc and a /dev/shm of its own: the engines' weight
# segments live in /dev/shm (same uid: a program could have rewritten the live policy); and no
# key files (``mask_keys``: with the run's key a program could push weights over HTTP instead)
PID_NAMESPACE = ["--dev-bind", "/", "/", "--proc", "/proc", "--tmpfs", "/dev/shm", "--unshare-pid", "--die-with-parent"]
_isolation: dict[str, str | None] = {}  # "pid" -> None when bwrap gives a pid namespace here, else why not


def mask_keys() -> list[str]:
    """bwrap arguments that hide every key file this process wrote (an empty file in its place)
    and the user's key directory (an empty one) from the program."""
    files, dirs = key_files()
    return [*(a for f in files for a in ("--ro-bind", "/dev/null", str(f))), *(a for d in dirs for a in ("--tmpfs", str(d)))]


class UnisolatedHarnessWarning(UserWarning):
    """HarnessEnv programs run without a pid namespace: one can read another's key."""


def why_no_pid_namespace() -> str | None:
    """None when ``bwrap --unshare-pid`` works on this host, else why not (probed once)."""
    if "pid" not in _isolation:
        import subprocess

        bwrap = shutil.which("bwrap")
        if bwrap is None:
            _isolation["pid"] = "bwrap is not installed (apt-get install bubblewrap)"
        else:
            try:
                p = subprocess.run([bwrap, *PID_NAMESPACE, "--", "/bin/true"], capture_output=True, timeout=20)
                why = None if p.returncode == 0 else p.stderr.decode(errors="replace").strip()[:200] or f"exit {p.returncode}"
            except (OSError, subprocess.SubprocessError) as e:
                why = str(e)
            _isolation["pid"] = None if why is None else f"bwrap cannot make a pid namespace here: {why}"
    return _isolation["pid"]


def task_view(task: Task, info_keys: Sequence[str] = ()) -> dict[str, Any]:
    """What the program sees of a task (``AGENTRL_TASK``): id, prompt messages, and of ``info``
    only ``info_keys``; never the answer."""
    return {"id": task.id, "prompt": messages_to_dicts(task.prompt),
            "info": {k: task.info[k] for k in info_keys if k in task.info}}  # fmt: skip


class HarnessEnv(Environment):
    """An agent program (a command, or an async function) as an environment (module docstring)."""

    name = "harness"

    def __init__(
        self,
        command: Sequence[str] | None = None,
        *,
        agent: Agent | None = None,
        timeout_s: float = 300.0,
        cwd: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        max_turns: int = 32,
        isolate: Isolate = "auto",
        task_info: Sequence[str] | None = (),
        failed_exit: FailedExit = "failure",
        **kwargs: Any,
    ) -> None:
        """``command``: argv of the program; or ``agent``: ``async def agent(client, task) -> str``.
        ``timeout_s``: the program's wall limit (then it is killed; the episode errors with kind
        ``timeout`` once the program had called the model, else ``env``).  ``cwd``/``env``: its
        working directory and extra environment variables.  ``isolate``: ``"pid"`` runs each
        program in a pid namespace of its own (bwrap; an error where that does not work),
        ``"auto"`` does so where it works (else warns), ``"none"`` never.  ``task_info``: the
        keys of ``task.info`` the program sees in its task (default none: the rest may hold the
        tests or the solution).  ``failed_exit``: a non-zero exit (an exception) after the first model
        call is the policy's failure, kind ``program`` (``"failure"``, default), or
        infrastructure, kind ``env`` (``"error"``) (module docstring)."""
        if (command is None) == (agent is None):
            raise ValueError("HarnessEnv needs exactly one of command=[...] or agent=async_fn")
        if command is not None and (isinstance(command, str) or not command):
            raise ValueError(f"command must be a non-empty argv list, e.g. ['python', 'agent.py'], not {command!r}")
        if isolate not in ("auto", "pid", "none"):
            raise ValueError(f"isolate must be 'auto', 'pid' or 'none', not {isolate!r}")
        if failed_exit not in ("failure", "error"):
            raise ValueError(f"failed_exit must be 'failure' (the policy's, kind program) or 'error' (kind env), "
                             f"not {failed_exit!r}")  # fmt: skip
        task_info = () if task_info is None else task_info
        if isinstance(task_info, str):
            raise ValueError(f"task_info must be a list of info keys, e.g. [{task_info!r}], not a string")
        super().__init__(max_turns=max_turns, **kwargs)
        self.command = [str(c) for c in command] if command is not None else None
        self.isolate = isolate
        self.task_info = tuple(str(k) for k in task_info)
        self.failed_exit = failed_exit
        self._warned = False
        self.agent = agent
        self.program_timeout_s = float(timeout_s)
        self.cwd = str(cwd) if cwd is not None else None
        self.extra_env = dict(env or {})
        self.gateway = Gateway()
        self._http: tuple[asyncio.AbstractEventLoop, Any] | None = None
        self._platform: Any = None  # the openai SDK's platform headers, found once

    @property
    def program(self) -> str:
        """The program in words, for errors."""
        if self.command is not None:
            return " ".join(self.command)[:80]
        return getattr(self.agent, "__qualname__", repr(self.agent))

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        raise EpisodeError("HarnessEnv episodes are driven by the program (run_program), not by step()")

    async def close(self) -> None:
        http, self._http = self._http, None
        if http is not None and http[0] is asyncio.get_running_loop():
            await http[1].aclose()
        await self.gateway.close()
        await super().close()

    def _http_client(self) -> Any:
        """The in-process agents' HTTP client (one per loop): its transport hands each request
        to the gateway in this process (:meth:`Gateway.call`), no loopback TCP, no HTTP parsing
        on either side; and one client, not one per episode (a fresh SDK client builds a TLS
        context each time: ~0.2 s, 5x a two-call episode)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop:
            import openai

            self._http = (loop, openai.DefaultAsyncHttpxClient(timeout=self.program_timeout_s,
                                                                transport=gateway_transport(self.gateway)))  # fmt: skip
        return self._http[1]

    # ------------------------------------------------------------------ one episode

    async def run_program(self, state: State, session: Session) -> str:
        """Run the program against the episode's gateway session; returns its final answer."""
        task = task_view(state.task, self.task_info)
        if self.agent is not None:
            return await self._run_agent(task, session)
        return await self._run_command(task, session)

    async def _run_agent(self, task: dict[str, Any], session: Session) -> str:
        import openai

        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.key, max_retries=0,
                                    http_client=self._http_client())  # fmt: skip
        if getattr(client, "_platform", 0) is None and self._platform is not None:
            # the SDK finds its platform headers in a worker thread on a client's first request: a
            # thread hop per episode, which queued behind the default executor under load
            client._platform = self._platform
        seconds, limit = self._time_of(session)
        wall = asyncio.timeout(seconds)
        try:
            async with wall:
                result = await self.agent(client, task)  # type: ignore[misc]
        except TimeoutError as e:
            if wall.expired():
                raise self._timed_out(session, "agent", None, limit) from None
            raise self._failed(session, f"the agent {self.program} raised {error_text(e)}") from e
        except EpisodeFailure:
            raise
        except (Exception, SystemExit) as e:  # sys.exit() in an agent ends its episode, never the run
            raise self._failed(session, f"the agent {self.program} raised {error_text(e)}") from e
        except asyncio.CancelledError as e:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this episode is being cancelled
            # the agent's own (it awaited a task it had cancelled): its bug, not the episode's end
            raise self._failed(session, f"the agent {self.program} raised CancelledError of its own") from e
        self._platform = self._platform or getattr(client, "_platform", None)
        self._check_replied(session, "agent", "returned without calling the model", None)
        return "" if result is None else str(result)

    def _time_of(self, session: Session) -> tuple[float, str]:
        """The program's time, and its name in words: ``timeout_s``, or what the episode's wall limit
        leaves of it (less :data:`KILL_MARGIN_S`) where that ends first, so that this env, which can
        tell a program's own hang from the policy's, is the one that stops it."""
        own = self.program_timeout_s
        if session.deadline is None:
            return own, f"timeout_s={own:g}s"
        left = session.deadline - asyncio.get_running_loop().time() - KILL_MARGIN_S
        if left >= own:
            return own, f"timeout_s={own:g}s"
        return max(left, 0.0), (f"the {max(left, 0.0):.3g}s its episode's wall limit left it (rollout.episode_timeout_s "
                                f"or the env's timeout_s, shorter than HarnessEnv timeout_s={own:g}s)")  # fmt: skip

    def _timed_out(self, session: Session, kind: str, stderr: str | None, limit: str) -> EpisodeFailure:
        """Its time passed: the policy's failure once the model was called (it can make a
        program loop forever, or wait forever on its own output); before, the program's own hang."""
        tail = "" if stderr is None else f" (its processes were killed); stderr: {stderr}"
        words = f"the {kind} {self.program} did not finish within {limit}"
        if _model_was_at_work(session):
            return EpisodeTimeout(f"{words} after {session.calls} model call(s){tail}")
        return EpisodeError(f"{words}, before calling the model{tail}")

    def _failed(self, session: Session, words: str, stderr: str | None = None) -> EpisodeError:
        """A non-zero exit or an exception: the policy's failure (kind ``program``) when the model may
        be why (it had been called: a reply can crash a program, and so can one the model drew out
        past the program's own client timeout) and ``failed_exit="failure"``, else the program's (``env``)."""
        tail = "" if stderr is None else f"; stderr: {stderr}"
        if _model_was_at_work(session) and self.failed_exit == "failure":
            return ProgramFailed(f"{words} after {session.calls} model call(s), counted as the policy's failure "
                                 f"(HarnessEnv(failed_exit='error') if it never fails on the model's output){tail}")  # fmt: skip
        return EpisodeError(f"{words}{tail}")

    def _check_replied(self, session: Session, kind: str, never: str, stderr: str | None) -> None:
        """A program that ended well but got no model reply has nothing to train on: the episode
        errors (as the endpoint's failure when that was why: the episode loop swaps it in)."""
        if session.turns:
            return
        tail = "" if stderr is None else f"; stderr: {stderr}"
        if session.calls == 0 and not session.refusals:
            raise EpisodeError(f"the {kind} {self.program} {never}{tail}")
        if not session.refusals:  # accepted, then it ended before the reply (it swallowed its client's timeout)
            raise EpisodeError(f"the {kind} {self.program} got no model reply: its {session.calls} call(s) got no "
                               f"reply before it exited{tail}")  # fmt: skip
        raise EpisodeError(f"the {kind} {self.program} got no model reply: its {session.refusals} call(s) were "
                           f"refused (first: {session.first_refusal}){tail}")  # fmt: skip

    async def _launcher(self) -> list[str]:
        """What the command runs under: bwrap's pid namespace, or nothing (``isolate``)."""
        if self.isolate == "none":
            return []
        why = why_no_pid_namespace() if "pid" in _isolation else await asyncio.to_thread(why_no_pid_namespace)
        if why is None:
            return [shutil.which("bwrap") or "bwrap", *PID_NAMESPACE, *mask_keys(), "--"]
        if self.isolate == "pid":
            raise EpisodeError(f"HarnessEnv(isolate='pid'): {why}; install bubblewrap, or pass isolate='none'")
        if not self._warned:
            self._warned = True
            warnings.warn(f"HarnessEnv programs run without a pid namespace ({why}): a program can read other "
                          "episodes' keys from /proc; run only programs you trust", UnisolatedHarnessWarning,
                          stacklevel=2)  # fmt: skip
        return []

    async def _run_command(self, task: dict[str, Any], session: Session) -> str:
        assert self.command is not None
        launcher = await self._launcher()
        env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}  # the run's keys stay with the run
        env.update(self.extra_env)
        env.update(OPENAI_BASE_URL=session.base_url, OPENAI_API_KEY=session.key,
                   AGENTRL_TASK=json.dumps(task, default=json_default))  # fmt: skip
        try:
            # not asyncio's subprocess: its child watcher reaps the program the moment it exits, and a
            # reaped program's pid (its session's number) is free for another process before the sweep
            proc = subprocess.Popen([*launcher, *self.command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, cwd=self.cwd, start_new_session=True)  # fmt: skip
        except OSError as e:
            raise EpisodeError(f"cannot start the program {self.program}: {error_text(e)} (check command= and cwd=)") from None
        exited = _exit_of(proc.pid)
        out, err = bytearray(), bytearray()
        readers = [asyncio.ensure_future(_drain_pipe(proc.stdout, out, STDOUT_KEEP)),
                   asyncio.ensure_future(_drain_pipe(proc.stderr, err, STDOUT_KEEP))]  # fmt: skip
        seconds, limit = self._time_of(session)
        wall = asyncio.timeout(seconds)
        timed_out = False
        try:
            async with wall:
                await asyncio.shield(exited)
        except TimeoutError:
            timed_out = True
        finally:
            kill_session(proc.pid)  # what it left behind, or all of it at the timeout: before the reap
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(exited), 5)
            _reap(proc, exited)
            done, pending = await asyncio.wait(readers, timeout=5)
            for r in pending:
                r.cancel()
        tail = _tail(err)
        if timed_out:
            raise self._timed_out(session, "program", tail, limit)
        code = proc.returncode
        if code != 0:
            raise self._failed(session, f"the program {self.program} {exit_words(code, bool(launcher))}", tail)
        self._check_replied(session, "program", "exited without calling the model at OPENAI_BASE_URL", tail)
        return last_line(out.decode(errors="replace"))


def gateway_transport(gateway: Gateway) -> Any:
    """An httpx transport (of the httpx the ``openai`` SDK is built on) that serves requests
    with ``gateway.call``: the agent's URL and key stay the episode's, only the hop is gone."""
    import importlib

    import openai

    httpx = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])

    class GatewayTransport(httpx.AsyncBaseTransport):  # type: ignore[name-defined,misc]
        async def handle_async_request(self, request: Any) -> Any:
            body = await request.aread()
            # the client's read timeout (``client.with_options(timeout=30)``) as over HTTP: the call
            # is cancelled (it records nothing) and the SDK sees its own timeout error
            read_s = (request.extensions.get("timeout") or {}).get("read")
            try:
                async with asyncio.timeout(read_s):
                    status, content_type, data = await gateway.call(request.method, request.url.path,
                                                                    request.headers.get("authorization"), body)  # fmt: skip
            except TimeoutError:
                raise httpx.ReadTimeout(f"no reply within the client's read timeout of {read_s:g}s",
                                        request=request) from None  # fmt: skip
            return httpx.Response(status, headers={"content-type": content_type}, content=data, request=request)

    return GatewayTransport()


def exit_words(code: int, namespaced: bool) -> str:
    """How a program ended, in words.  Only a negative return code is a signal for certain: under
    bwrap a child killed by signal N exits 128 + N, as does a program calling ``exit(128 + N)``,
    so such a code is named both ways (a code past the signal numbers is the program's own)."""
    if code < 0:
        return f"was killed by signal {_signal_name(-code)}"
    words = f"exited with code {code}"
    if namespaced and 128 < code <= 128 + signal.SIGRTMAX:
        words += f" (or was killed by signal {_signal_name(code - 128)}: its pid namespace reports both alike)"
    return words


def _signal_name(n: int) -> str:
    try:
        return f"{n} ({signal.Signals(n).name})"
    except ValueError:
        return str(n)


def last_line(text: str) -> str:
    """The last non-empty line of ``text`` (stripped), or ``""``."""
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def _model_was_at_work(session: Session) -> bool:
    """Whether the model may be why a program failed: it replied, or a call was admitted and not
    refused (one still sampling when the program gave up on it counts; a request the gateway
    refused, the program's own bad one, does not)."""
    return bool(session.turns) or session.calls > session.admitted_refusals


def _tail(err: bytes) -> str:
    text = " ⏎ ".join(line for line in err.decode(errors="replace").splitlines() if line.strip())
    return ("…" + text[-STDERR_KEEP:]) if len(text) > STDERR_KEEP else (text or "(empty)")


async def _drain_pipe(pipe: Any, keep: bytearray, limit: int) -> None:
    """Read a pipe to its end, keeping its last ``limit`` bytes (a chatty program cannot fill memory)."""
    if pipe is None:
        return
    stream = asyncio.StreamReader(limit=1 << 16)
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stream), pipe)
    try:
        while chunk := await stream.read(1 << 16):
            keep.extend(chunk)
            if len(keep) > limit:
                del keep[: len(keep) - limit]
    finally:
        transport.close()


def _exit_of(pid: int) -> asyncio.Future[None]:
    """Done when our child ``pid`` has exited.  It is not reaped: a zombie keeps its pid, so its
    session's and group's number cannot be another process's until :func:`_reap`."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): ask the kernel, without reaping, every 20 ms
        async def poll() -> None:
            with contextlib.suppress(ChildProcessError):  # reaped behind our back: gone all the same
                while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    await asyncio.sleep(0.02)

        return asyncio.ensure_future(poll())
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:  # a pidfd polls readable once its process has exited
        loop.remove_reader(fd)
        os.close(fd)
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    return exited


def _reap(proc: subprocess.Popen, exited: asyncio.Future[None]) -> None:
    """Collect the program's exit status (after :func:`kill_session`); one that outlived its SIGKILL
    (stuck in the kernel) is collected when it does exit."""
    if exited.done():
        proc.wait()
    else:
        exited.add_done_callback(lambda _: proc.poll())


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (the program started it with itself as leader),
    its orphans included: they keep the session id when the leader is gone.  Call it before the
    leader is reaped: a reaped leader's pid, once its orphans are gone too, may be reused by a
    new session's leader (another episode's program), whose group and session share the number."""
    for _ in range(5):  # again while it was forking during the sweep
        found = [pid for pid in _session_members(sid) if pid != os.getpid()]
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not found:
            return


def _session_members(sid: int) -> list[int]:
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp session ...
        if len(fields) > 3 and fields[0] != "Z" and (int(fields[2]) == sid or int(fields[3]) == sid):
            members.append(int(entry.name))
    return members


__all__ = ["HarnessEnv", "UnisolatedHarnessWarning", "kill_session", "last_line", "task_view", "why_no_pid_namespace"]
