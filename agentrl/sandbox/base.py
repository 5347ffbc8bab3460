"""The Sandbox contract, its limits and results, and the process-wide cleanup registry.

Every backend runs the same small agent (``_agent.py``) inside the sandbox; the host side
here owns the protocol, the limits and the bookkeeping that guarantees no sandbox outlives
its owner (normal close, cancellation, ``atexit``, SIGTERM; ``agentrl sandbox prune`` for
what a SIGKILL leaves behind).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import json
import os
import re
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agentrl.errors import AgentrlError
from agentrl.sandbox.live import register, unregister

# The agent runs as one script: part 1 (protocol, init, serving) ends by calling main(), so
# part 2 (running a command) and part 3 (processes, files, reset) are inserted before that call.
_AGENT_CORE, _AGENT_MAIN = (Path(__file__).parent / "_agent.py").read_text().rsplit('if __name__ == "__main__":', 1)
AGENT_SOURCE = (
    _AGENT_CORE
    + "".join((Path(__file__).parent / part).read_text() + "\n\n" for part in ("_agent_exec.py", "_agent_cleanup.py"))
    + 'if __name__ == "__main__":'
    + _AGENT_MAIN
)
LABEL = "agentrl.sandbox"  # docker label / temp-dir prefix marking what prune may remove
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_FILE_BYTES = 64 << 20
OOM_TOOK_THE_AGENT = ("agentrl: the sandbox ran out of memory and the kernel killed its agent with the command: "
                      "the command's output is lost, and so is the sandbox with its files\n")  # fmt: skip


class SandboxError(AgentrlError):
    """The sandbox itself failed (could not start, died, engine unreachable).

    Distinct from the user's code failing, which is an :class:`ExecResult` with a non-zero
    ``exit_code`` or a limit flag.  Pools retry creation on it; environments mark the
    episode errored.
    """

    error_kind = "sandbox"  # inside an episode: errored with this kind (agentrl.errors)


AGENT_RESERVE_BYTES = 48 << 20  # the agent, the per-exec init and the wrappers, in the sandbox cgroup
TMPFS_COUNT = 3  # /work, /tmp, /dev/shm


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox limits.  Each exec gets the wall timeout; the rest bind the sandbox.

    Where the host gives a cgroup (docker always; bwrap where a memory/pids cgroup is
    delegated, see ``agentrl sandbox doctor``) memory, processes and CPU are capped for the
    whole sandbox.  Elsewhere they fall back to per-process rlimits — see
    :meth:`worst_case_memory_bytes` for what that means.
    """

    timeout_s: float = 10.0
    """Default wall-clock limit per exec; on expiry every process of the exec is SIGKILLed."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU, then SIGKILL one second later."""
    memory_bytes: int = 512 << 20
    """Memory for the sandbox's processes.  With a memory cgroup: all of them together (plus
    room for the tmpfs files and the agent, see :meth:`sandbox_memory_bytes`; going over
    runs the OOM killer).  Without one: address space per process (RLIMIT_AS)."""
    pids: int = 64
    """Processes (and threads) alive at once: pids cgroup, else RLIMIT_NPROC."""
    output_bytes: int = 256 << 10
    """Bytes kept of each of stdout and stderr; the rest is drained and dropped (flagged)."""
    disk_bytes: int = 64 << 20
    """Size of each writable tmpfs (/work, /tmp, /dev/shm) and the largest file (RLIMIT_FSIZE)."""
    files: int = 8192
    """Files and directories per writable tmpfs (``nr_inodes``): bounds the kernel memory
    that millions of empty files would otherwise cost."""
    open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    cpus: float = 1.0
    """CPU bandwidth of the whole sandbox, in cores (cgroup cpu quota; 0 = unlimited)."""
    mqueue_bytes: int = 256 << 10
    """POSIX message-queue bytes per exec (RLIMIT_MSGQUEUE; a queue with the default
    attributes takes about 80 KiB).  Never above what the host gives the sandbox."""
    pending_signals: int = 1024
    """Queued signals per exec (RLIMIT_SIGPENDING)."""
    inotify_instances: int = 32
    """inotify instances per exec (``user.max_inotify_instances`` of the exec's own user
    namespace; applied where ``/proc/sys`` is writable: bwrap)."""
    inotify_watches: int = 8192
    """inotify watches per exec (``user.max_inotify_watches``, like ``inotify_instances``)."""
    network: bool = False
    """Outbound network: a network namespace of its own behind a user-mode NAT (bwrap:
    slirp4netns; docker: the engine's default network).  The host's loopback and abstract
    sockets stay unreachable.  Off: no interface but the sandbox's own loopback."""

    def rlimits(self, *, nproc: bool, address_space: bool = True) -> dict[str, int | None]:
        return {
            "RLIMIT_CPU": int(self.cpu_s),
            "RLIMIT_AS": int(self.memory_bytes) if address_space else None,
            "RLIMIT_FSIZE": int(self.disk_bytes),
            "RLIMIT_NOFILE": int(self.open_files),
            "RLIMIT_NPROC": int(self.pids) if nproc else None,
            "RLIMIT_CORE": 0,
            "RLIMIT_MSGQUEUE": int(self.mqueue_bytes),
            "RLIMIT_SIGPENDING": int(self.pending_signals),
        }

    def sandbox_memory_bytes(self) -> int:
        """The memory cgroup's cap: processes + the tmpfs files (they live in RAM) + the agent."""
        return int(self.memory_bytes) + TMPFS_COUNT * int(self.disk_bytes) + AGENT_RESERVE_BYTES

    def worst_case_memory_bytes(self) -> int:
        """Without a memory cgroup, what one sandbox can pin: every process at its address-space
        limit, plus memfds (each capped by RLIMIT_FSIZE, up to RLIMIT_NOFILE of them per
        process), plus full tmpfs.  SysV shm and POSIX queues die with each exec."""
        per_process = int(self.memory_bytes) + int(self.open_files) * int(self.disk_bytes)
        return int(self.pids) * per_process + TMPFS_COUNT * int(self.disk_bytes)

    def tmpfs(self, paths: list[str]) -> list[dict[str, int | str]]:
        modes = {"/tmp": 0o1777, "/dev/shm": 0o1777}
        return [{"path": p, "size": int(self.disk_bytes), "inodes": int(self.files), "mode": modes.get(p, 0o755)}
                for p in paths]  # fmt: skip

    def exec_sysctls(self) -> dict[str, int]:
        """Applied inside each exec's own namespaces where /proc/sys is writable (best effort;
        seccomp and the cgroup are the real guards)."""
        return {
            "user.max_user_namespaces": 0,
            "user.max_inotify_instances": int(self.inotify_instances),
            "user.max_inotify_watches": int(self.inotify_watches),
            "kernel.shmmax": int(self.disk_bytes),
            "kernel.shmall": max(1, int(self.disk_bytes) // 4096),
            "kernel.shmmni": 64,
            "kernel.msgmni": 32,
        }


@dataclass
class ExecResult:
    """What one command did.  A non-zero exit or a limit flag is data, not an exception.

    The flags come from kernel facts only — the exit signal, the CPU time the kernel
    accounted, the cgroup's OOM-kill counter, the agent's own deadline — never from what the
    command printed.
    """

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
    """The kernel's OOM killer killed a process of this exec (memory cgroup event), or the
    sandbox's agent during it (then the output is lost and the sandbox with it: ``alive`` is
    False).  Without a memory cgroup an allocation simply fails (e.g. Python's MemoryError) and
    this stays False."""
    cpu_exceeded: bool = False
    """The command died of the CPU-time limit's signal (SIGXCPU/SIGKILL, directly or as its
    shell reports it) and the kernel accounted at least ``cpu_s`` CPU seconds to it and the
    children it waited for."""
    signal: int | None = None
    """The signal that killed the main process (None when it exited)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.oom or self.cpu_exceeded)

    def as_text(self, limit: int | None = None) -> str:
        """Compact text for a tool reply: output, then any non-zero status or limit.

        Control characters (NUL, ESC, CR, C1, bidi overrides) are shown escaped (``\\x1b``), so
        a command cannot drive the terminal or log viewer of whoever reads the reply.
        """
        parts = [escape_controls(self.stdout)]
        if self.stderr:
            parts.append(escape_controls(self.stderr))
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


_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """Every control character but newline and tab, written out (``\\x1b``, ``\\u202e``)."""
    text = text.replace("\r\n", "\n")
    return _CONTROLS.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


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
    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes: ...
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
        self.info: dict[str, Any] = {}
        """What the agent reported at start (isolation mode, probe)."""
        self.host_uid: int | None = None
        """The host uid the sandbox's processes run as (their own, see
        :mod:`agentrl.sandbox.uids`, where the backend can give one; None: unknown)."""
        self._uid_lease: Any = None
        self._token = secrets.token_hex(16)  # every request carries it; the agent refuses others
        self._lock = asyncio.Lock()
        self._started = False
        self._broken: str | None = None
        self._oom_kills_when_broken: int | None = None  # the cgroup's counter as it broke (teardown removes it)
        self._agent_oom_killed = False  # the backend saw the agent itself die of the OOM killer (docker)
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

    async def _confine(self) -> None:
        """Hook: after the agent answered its first ping, before it is initialised (cgroups)."""

    def _init_request(self) -> dict[str, Any]:
        """What the agent sets up before serving (mounts, filter); backends add their parts."""
        from agentrl.sandbox.seccomp import SeccompUnavailable, filter_bpf

        try:
            bpf = filter_bpf()
        except (SeccompUnavailable, OSError) as e:
            raise SandboxError(f"no seccomp filter, refusing to start a sandbox: {e}") from e
        return {
            "tmpfs": self.limits.tmpfs([self.workdir, "/tmp", "/dev/shm"]),
            "seccomp": base64.b64encode(bpf).decode(),
            "sysctls": self.limits.exec_sysctls(),
            "fresh_net": not self.limits.network,
        }

    def _nproc_rlimit(self) -> bool:
        return True

    def _memory_cgroup(self) -> bool:
        """True when a memory cgroup caps the whole sandbox (then no per-process RLIMIT_AS)."""
        return False

    def _oom_kills(self) -> int | None:
        """Host-side OOM-kill counter of the sandbox's cgroup (None: the agent reports it)."""
        return None

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
            await self._confine()
            init = {"op": "init", "token": self._token, **self._init_request()}
            self.info = await self._call(init, timeout=60.0)
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
                self._release_uid()
                unregister(self)

    def _lease_uid(self) -> int:
        """A host uid of this sandbox's own, held until it is closed."""
        from agentrl.sandbox.uids import lease_uid

        if self._uid_lease is None:
            self._uid_lease = lease_uid()
        self.host_uid = self._uid_lease.uid
        return self.host_uid

    def _release_uid(self) -> None:
        """After the sandbox's processes are gone (a reused uid starts with nothing counted)."""
        lease, self._uid_lease = self._uid_lease, None
        if lease is not None:
            lease.release()

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
        req.setdefault("token", self._token)
        async with self._lock:
            try:
                resp = await asyncio.wait_for(self._request(req, timeout), timeout)
            except asyncio.CancelledError:
                await self._break("a request was cancelled mid-flight")
                raise
            except TimeoutError:
                await self._break(f"agent did not answer '{req['op']}' within {timeout:.1f}s")
                raise SandboxError(f"sandbox {self.id}: {self._broken}") from None
            except SandboxError as e:  # the transport lost the agent
                await self._break(str(e), agent_gone=True)
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
                await self._break(f"agent failed on '{req['op']}': {msg}")
                raise SandboxError(f"sandbox {self.id}: {self._broken}")
            exc_type = {"FileNotFoundError": FileNotFoundError, "IsADirectoryError": IsADirectoryError,
                        "PermissionError": PermissionError, "NotADirectoryError": NotADirectoryError,
                        "FileExistsError": FileExistsError}  # fmt: skip
            raise exc_type.get(kind, OSError)(no, msg, req.get("path"))
        return resp

    async def _break(self, why: str, *, agent_gone: bool = False) -> None:
        if self._broken is None:
            self._broken = why
            self._oom_kills_when_broken = self._oom_kills()
            if agent_gone:  # asked before teardown removes what would tell
                self._agent_oom_killed = await self._agent_died_of_oom()
        await asyncio.shield(self._stop())

    async def _agent_died_of_oom(self) -> bool:
        """Whether the OOM killer took the agent, for a backend without a host-side counter
        (:meth:`_oom_kills` None).  Called once, as the agent is found gone, before teardown."""
        return False

    def _relpath(self, path: str) -> str:
        """``path`` relative to the work dir; anything that could leave it is refused."""
        p = path
        if p.startswith("/"):
            root = self.workdir.rstrip("/") + "/"
            if not p.startswith(root):
                raise PermissionError(errno.EPERM, f"outside the sandbox's work dir {self.workdir}", path)
            p = p[len(root) :]
        parts = [c for c in p.split("/") if c not in ("", ".")]
        if not parts or ".." in parts or "\0" in p:
            raise PermissionError(errno.EPERM, "not a file path beneath the work dir", path)
        return "/".join(parts)

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
        if any("\x00" in a for a in argv) or any("\x00" in f"{k}{v}" for k, v in (env or {}).items()):
            # exec() cannot pass one: the agent's child died before the command, and "exit code 125" said nothing
            raise ValueError("the command contains a NUL byte (\\x00), which no process can take in an argument or "
                             "an environment variable; remove it (in code, write it as the escape '\\x00')")
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
            "limits": self.limits.rlimits(nproc=self._nproc_rlimit(), address_space=not self._memory_cgroup()),
            "output_bytes": self.limits.output_bytes,
        }
        oom0 = self._oom_kills()
        start = time.monotonic()
        intact = self._broken is None
        try:
            r = await self._call(req, timeout=timeout + self.grace_s)
        except SandboxError:
            # The OOM killer took the agent, not the command: a command may lower its own oom_score_adj
            # back to 0 and fill the cgroup with memory no process maps (memfds, files in tmpfs).  The
            # command ran out of memory all the same: its failure (oom), not an infrastructure error
            # the episode would be dropped for.  The sandbox is broken; a pool replaces it.
            broke = self._oom_kills_when_broken
            counted = oom0 is not None and broke is not None and broke > oom0
            if not intact or not (counted or self._agent_oom_killed):  # an OOM during this exec only
                raise
            return ExecResult(exit_code=128 + signal.SIGKILL, stdout="", stderr=OOM_TOOK_THE_AGENT, oom=True,
                              wall_s=time.monotonic() - start, signal=int(signal.SIGKILL))  # fmt: skip
        oom1 = self._oom_kills()
        oom_kills = oom1 - oom0 if oom0 is not None and oom1 is not None else r.get("oom_kills")
        sig = r.get("signal")
        timed_out = bool(r["timed_out"])
        oom = bool(oom_kills)
        cpu_limit = float(self.limits.cpu_s)
        # the CPU-limit signal (directly, or as a shell reports its child's: 128+N) counts only
        # when the kernel accounted the CPU time to match: `kill -XCPU $$` alone is not enough
        limit_signals = (signal.SIGXCPU, signal.SIGKILL)
        died_of_limit = sig in limit_signals or int(r["exit_code"]) in [128 + s for s in limit_signals]
        cpu_exceeded = (not timed_out and not oom and died_of_limit
                        and float(r.get("cpu_s") or 0.0) >= cpu_limit * 0.9)  # fmt: skip (rusage lags the tick-exact limit)
        return ExecResult(
            exit_code=int(r["exit_code"]),
            stdout=base64.b64decode(r["stdout"]).decode("utf-8", "replace"),
            stderr=base64.b64decode(r["stderr"]).decode("utf-8", "replace"),
            stdout_truncated=bool(r["stdout_truncated"]),
            stderr_truncated=bool(r["stderr_truncated"]),
            wall_s=float(r["wall_s"]),
            timed_out=timed_out,
            oom=oom,
            cpu_exceeded=cpu_exceeded,
            signal=sig,
        )

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Create or replace a regular file beneath ``workdir`` (parents created).

        ``path`` is relative to the work dir (or absolute inside it).  Symbolic links are
        never followed, only regular files are written, and nothing is truncated before
        those checks pass.
        """
        if isinstance(data, str):
            data = data.encode()
        req = {"op": "write", "base": self.workdir, "path": self._relpath(path),
               "data": base64.b64encode(data).decode()}  # fmt: skip
        await self._call(req, timeout=60.0)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """A regular file beneath ``workdir`` (no symlinks, FIFOs or devices).

        At most ``max_bytes`` (default and ceiling: 64 MiB); a larger file raises
        ``OSError(EFBIG)`` without being sent, so a caller reading model-written output can
        bound what it costs.
        """
        limit = MAX_FILE_BYTES if max_bytes is None else max(0, min(int(max_bytes), MAX_FILE_BYTES))
        req = {"op": "read", "base": self.workdir, "path": self._relpath(path), "max_bytes": limit}
        r = await self._call(req, 60.0)
        return base64.b64decode(r["data"])

    async def reset(self) -> None:
        """Make the sandbox as new for another episode, or raise :class:`SandboxError`.

        Kills leftover processes, removes everything in the writable dirs (fixing
        permissions first, at any depth), strips the extended attributes (``user.*``, ACLs)
        of the writable roots themselves and puts back their mode and times as mounted,
        then verifies: no file of the sandbox's user on any writable mount, no xattr and
        the original mode and times on every writable root, no SysV/POSIX IPC object, no
        process.  Anything left breaks the sandbox (a pool then destroys and replaces it;
        it is never reused).
        """
        r = await self._call({"op": "reset", "dirs": self._reset_dirs()}, timeout=60.0)
        left = list(r.get("left") or [])
        left += await self._host_leftovers()
        if not r.get("clean") or left:
            await self._break(f"reset could not clean the sandbox: {'; '.join(map(str, left))[:500]}")
            raise SandboxError(f"sandbox {self.id}: {self._broken}")

    async def _host_leftovers(self) -> list[str]:
        """Hook: what the host can see left behind (e.g. processes in the sandbox's cgroup)."""
        return []

    def _reset_dirs(self) -> list[str]:
        return [self.workdir, "/tmp", "/dev/shm"]


def encode_request(req: dict[str, Any]) -> bytes:
    return (json.dumps(req) + "\n").encode()
