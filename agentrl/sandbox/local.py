"""Local backend — FOR DEVELOPMENT ONLY.  NOT A SECURITY BOUNDARY.

Commands run as ordinary host processes of the current user, in a private temp directory,
with the same rlimits and output caps as the real backends.  They can read and write
anything the user can, reach the network, and a child that calls ``setsid`` escapes the
cleanup.  Use it to develop an environment on a machine without bubblewrap or Docker; train
on model-written code only with ``bwrap`` or ``docker``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import warnings
from typing import Any

from agentrl.sandbox.base import AGENT_SOURCE, DEFAULT_PATH, LABEL, SandboxError, SandboxLimits
from agentrl.sandbox.bwrap import _STREAM_LIMIT, BwrapSandbox

TEMP_PREFIX = f"{LABEL}-"  # prune removes <tmp>/agentrl.sandbox-<pid>-* of dead pids


class UnsafeSandboxWarning(UserWarning):
    """A sandbox that does not isolate anything was created."""


WARNING = (
    "agentrl: the 'local' sandbox backend is NOT a security boundary: commands run as your user "
    "on this host, with your files, network, processes and no seccomp or namespaces. Use it only "
    "to develop an environment; train on model-written code with backend 'bwrap' or 'docker'."
)


class LocalSandbox(BwrapSandbox):
    """The agent as a plain child process; workdir is a temp dir removed on close."""

    backend = "local"
    agent_mode = "serve-local"

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        warnings.warn(WARNING, UnsafeSandboxWarning, stacklevel=3)
        super().__init__(limits)
        self._dir = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
        self.workdir = os.path.join(self._dir, "work")
        self._tmp = os.path.join(self._dir, "tmp")
        os.mkdir(self.workdir)
        os.mkdir(self._tmp)

    def _nproc_rlimit(self) -> bool:
        return False  # would count every process of the host user, not the sandbox's

    def _base_env(self) -> dict[str, str]:
        env = super()._base_env()
        env["TMPDIR"] = self._tmp
        return env

    def _init_request(self) -> dict[str, Any]:
        return {}  # nothing to set up: the local backend has no namespaces to build

    async def _confine(self) -> None:
        return None

    def _reset_dirs(self) -> list[str]:
        return [self.workdir, self._tmp]

    async def _start(self) -> None:
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-c", AGENT_SOURCE, self.agent_mode,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.workdir,
                env={"PATH": os.environ.get("PATH", DEFAULT_PATH), "LANG": "C.UTF-8"},
                start_new_session=True,
                limit=_STREAM_LIMIT,
            )  # fmt: skip
        except OSError as e:
            raise SandboxError(f"could not start the local agent: {e}") from e
        self._stderr_task = asyncio.get_running_loop().create_task(self._read_stderr())

    def _kill_command_sessions(self) -> None:
        """Kill a command still running (cancelled exec): its session is led by the agent's child."""
        if self._proc is None or self._proc.returncode is not None:
            return
        procs = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat", "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                fields = data[data.rfind(b")") + 2 :].split()
                procs.append((int(name), int(fields[1]), int(fields[3])))  # pid, ppid, sid
        sessions = {pid for pid, ppid, _ in procs if ppid == self._proc.pid}
        for pid, _, sid in procs:
            if sid in sessions:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    async def _stop(self) -> None:
        self._kill_command_sessions()
        await super()._stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def kill_sync(self) -> None:
        self._kill_command_sessions()
        super().kill_sync()
        shutil.rmtree(self._dir, ignore_errors=True)
