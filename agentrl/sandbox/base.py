"""The Sandbox contract, its limits and results, and the process-wide cleanup registry.

Every backend runs the same small agent (``_agent.py``) inside the sandbox; the host side
here owns the protocol, the limits and the bookkeeping that guarantees no sandbox outlives
its owner (normal close, cancellation, ``atexit``, SIGTERM; ``agentrl sandbox prune`` for
what a SIGKILL leaves behind).
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import json
import os
import secrets
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agentrl.errors import AgentrlError

AGENT_SOURCE = (Path(__file__).parent / "_agent.py").read_text()
LABEL = "agentrl.sandbox"  # docker label / temp-dir prefix marking what prune may remove
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_FILE_BYTES = 64 << 20


class SandboxError(AgentrlError):
    """The sandbox itself failed (could not start, died, engine unreachable).

    Distinct from the user's code failing, which is an :class:`ExecResult` with a non-zero
    ``exit_code`` or a limit flag.  Pools retry creation on it; environments mark the
    episode errored.
    """


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox limits.  Each exec gets the wall timeout; the rest bind every process."""

    timeout_s: float = 10.0
    """Default wall-clock limit per exec; on expiry every process of the exec is SIGKILLed."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU, then SIGKILL one second later."""
    memory_bytes: int = 512 << 20
    """Address space per process (RLIMIT_AS); docker also caps the whole container (cgroup)."""
    pids: int = 64
    """Processes alive at once (RLIMIT_NPROC in the sandbox's user namespace; docker: pids cgroup)."""
    output_bytes: int = 256 << 10
    """Bytes kept of each of stdout and stderr; the rest is drained and dropped (flagged)."""
    disk_bytes: int = 64 << 20
    """Size of each writable tmpfs (/work, /tmp, /dev/shm) and the largest file (RLIMIT_FSIZE)."""
    open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    network: bool = False
    """Give the sandbox the host's network.  Off: no interface but loopback."""

    def rlimits(self, *, nproc: bool) -> dict[str, int | None]:
        return {
            "RLIMIT_CPU": int(self.cpu_s),
            "RLIMIT_AS": int(self.memory_bytes),
            "RLIMIT_FSIZE": int(self.disk_bytes),
            "RLIMIT_NOFILE": int(self.open_files),
            # +2: the sandbox's init and the agent share the uid and count against it
            "RLIMIT_NPROC": int(self.pids) + 2 if nproc else None,
            "RLIMIT_CORE": 0,
        }


@dataclass
class ExecResult:
    """What one command did.  A non-zero exit or a limit flag is data, not an exception."""

    exit_code: int
    """Process exit status; 128+N when killed by signal N (a shell's convention)."""
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    timed_out: bool = False
    """The wall-clock timeout expired and every process of the exec was killed."""
    oom: bool = False
    """An allocation failed against the memory limit (or the OOM killer fired under docker)."""
    cpu_exceeded: bool = False
    """The CPU-seconds limit killed the command."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.oom or self.cpu_exceeded)

    def as_text(self, limit: int | None = None) -> str:
        """Compact text for a tool reply: output, then any non-zero status or limit."""
        parts = [self.stdout]
        if self.stderr:
            parts.append(self.stderr)
        text = "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts)
        if limit is not None and len(text) > limit:
            text = text[:limit] + "\n[... output truncated]\n"
        elif self.stdout_truncated or self.stderr_truncated:
            text += "[... output truncated]\n"
        if self.timed_out:
            text += f"[timed out after {self.wall_s:.1f}s]\n"
        elif self.cpu_exceeded:
            text += "[killed: CPU time limit]\n"
        elif self.oom:
            text += "[killed: out of memory]\n"
        elif self.exit_code != 0:
            text += f"[exit code {self.exit_code}]\n"
        return text


@runtime_checkable
class Sandbox(Protocol):
    """An isolated machine for one episode: run commands, move files, then close."""

    backend: str
    workdir: str
    limits: SandboxLimits

    async def start(self) -> None: ...
    async def exec(
        self,
        cmd: str | list[str],
        *,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult: ...
    async def write_file(self, path: str, data: bytes | str) -> None: ...
    async def read_file(self, path: str) -> bytes: ...
    async def reset(self) -> None: ...
    async def close(self) -> None: ...
    async def __aenter__(self) -> Sandbox: ...
    async def __aexit__(self, *exc: object) -> None: ...


# ----------------------------------------------------------------------------- shared host side


class AgentSandbox:
    """Host half of the agent protocol; backends supply transport, start and kill.

    Requests are serialised per sandbox (one exec at a time: a timeout kills *every* user
    process in it).  A transport failure or a cancelled request leaves the agent in an
    unknown state, so the sandbox is killed and later calls raise :class:`SandboxError`.
    """

    backend = "?"
    workdir = "/work"
    agent_mode = "serve"
    grace_s = 10.0  # host-side wait beyond the exec timeout before declaring the agent dead

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.id = f"agentrl-{os.getpid()}-{secrets.token_hex(4)}"
        self._lock = asyncio.Lock()
        self._started = False
        self._broken: str | None = None
        self._closed = False
        self._close_lock = asyncio.Lock()
        register(self)  # before the first await: a cancelled start is still cleaned up

    # --- backend hooks
    async def _start(self) -> None:
        raise NotImplementedError

    async def _request(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        raise NotImplementedError

    async def _stop(self) -> None:
        """Tear everything down (idempotent, never raises)."""
        raise NotImplementedError

    def kill_sync(self) -> None:
        """Last-resort synchronous teardown for atexit/signal handlers."""
        raise NotImplementedError

    def _nproc_rlimit(self) -> bool:
        return True

    def _base_env(self) -> dict[str, str]:
        return {
            "PATH": DEFAULT_PATH,
            "HOME": self.workdir,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    # --- lifecycle
    async def start(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self._started:
            return
        try:
            await self._start()
            await self._call({"op": "ping"}, timeout=30.0)
        except BaseException:
            await self.close()
            raise
        self._started = True

    async def close(self) -> None:
        async with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                await asyncio.shield(self._stop())
            finally:
                unregister(self)

    async def __aenter__(self) -> AgentSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def alive(self) -> bool:
        return self._started and not self._closed and self._broken is None

    # --- protocol
    async def _call(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self._broken:
            raise SandboxError(f"sandbox {self.id} is broken: {self._broken}")
        req["id"] = secrets.token_hex(8)
        async with self._lock:
            try:
                resp = await asyncio.wait_for(self._request(req, timeout), timeout)
            except asyncio.CancelledError:
                await self._break("a request was cancelled mid-flight")
                raise
            except TimeoutError:
                await self._break(f"agent did not answer '{req['op']}' within {timeout:.1f}s")
                raise SandboxError(f"sandbox {self.id}: {self._broken}") from None
            except SandboxError as e:
                await self._break(str(e))
                raise
            except Exception as e:  # transport failure of any kind is the sandbox's
                await self._break(f"{type(e).__name__}: {e}")
                raise SandboxError(f"sandbox {self.id}: {self._broken}") from e
        if resp.get("id") != req["id"]:
            await self._break("response id mismatch (protocol desync)")
            raise SandboxError(f"sandbox {self.id}: {self._broken}")
        if not resp.get("ok"):
            kind, msg, no = resp.get("kind"), resp.get("error", "?"), resp.get("errno", 0)
            if kind == "AgentError":
                raise SandboxError(f"sandbox agent failed on '{req['op']}': {msg}")
            exc_type = {"FileNotFoundError": FileNotFoundError, "IsADirectoryError": IsADirectoryError,
                        "PermissionError": PermissionError, "NotADirectoryError": NotADirectoryError}
            raise exc_type.get(kind, OSError)(no, msg, req.get("path"))
        return resp

    async def _break(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
        await asyncio.shield(self._stop())

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"

    # --- public API
    async def exec(
        self,
        cmd: str | list[str],
        *,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``) and return what it did."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        if not argv:
            raise ValueError("empty command")
        if isinstance(stdin, str):
            stdin = stdin.encode()
        timeout = self.limits.timeout_s if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        req = {
            "op": "exec",
            "argv": argv,
            "stdin": base64.b64encode(stdin).decode() if stdin else "",
            "timeout": timeout,
            "cwd": self.workdir,
            "env": {**self._base_env(), **(env or {})},
            "limits": self.limits.rlimits(nproc=self._nproc_rlimit()),
            "output_bytes": self.limits.output_bytes,
        }
        r = await self._call(req, timeout=timeout + self.grace_s)
        return ExecResult(
            exit_code=int(r["exit_code"]),
            stdout=base64.b64decode(r["stdout"]).decode("utf-8", "replace"),
            stderr=base64.b64decode(r["stderr"]).decode("utf-8", "replace"),
            stdout_truncated=bool(r["stdout_truncated"]),
            stderr_truncated=bool(r["stderr_truncated"]),
            wall_s=float(r["wall_s"]),
            timed_out=bool(r["timed_out"]),
            oom=bool(r["oom"]),
            cpu_exceeded=bool(r["cpu_exceeded"]),
        )

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Create or replace a file (parents created); relative paths are under ``workdir``."""
        if isinstance(data, str):
            data = data.encode()
        req = {"op": "write", "path": self._path(path), "data": base64.b64encode(data).decode()}
        await self._call(req, timeout=60.0)

    async def read_file(self, path: str) -> bytes:
        """Whole file contents (at most 64 MiB); relative paths are under ``workdir``."""
        r = await self._call({"op": "read", "path": self._path(path), "max_bytes": MAX_FILE_BYTES}, 60.0)
        return base64.b64decode(r["data"])

    async def reset(self) -> None:
        """Kill leftover processes and empty the writable dirs, for reuse by another episode."""
        await self._call({"op": "reset", "dirs": self._reset_dirs()}, timeout=60.0)

    def _reset_dirs(self) -> list[str]:
        return [self.workdir, "/tmp", "/dev/shm"]


def encode_request(req: dict[str, Any]) -> bytes:
    return (json.dumps(req) + "\n").encode()


# ----------------------------------------------------------------------------- cleanup registry

_LIVE: dict[str, AgentSandbox] = {}
_LIVE_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def register(sb: AgentSandbox) -> None:
    with _LIVE_LOCK:
        _LIVE[sb.id] = sb


def unregister(sb: AgentSandbox) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(sb.id, None)


def live_sandboxes() -> list[AgentSandbox]:
    with _LIVE_LOCK:
        return list(_LIVE.values())


def kill_all_sync() -> None:
    """Synchronously destroy every sandbox this process still holds (atexit / signals)."""
    for sb in live_sandboxes():
        try:
            sb.kill_sync()
        except Exception:
            pass
        unregister(sb)


def install_cleanup_hooks() -> None:
    """atexit + SIGTERM/SIGHUP handlers that destroy live sandboxes, then die as before.

    SIGINT needs nothing extra: it raises KeyboardInterrupt, the async context managers
    unwind, and atexit catches the rest.  Handlers are chained, never replaced silently,
    and only installed from the main thread.
    """
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    _HOOKS_INSTALLED = True
    atexit.register(kill_all_sync)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN:
            continue

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            kill_all_sync()
            if callable(previous):
                previous(signum, frame)
            else:  # SIG_DFL: die by the same signal, as if we had never been here
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
