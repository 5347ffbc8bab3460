"""Bubblewrap backend: a fresh set of namespaces per sandbox, no daemon, no cgroups.

Layout inside: the host's /usr (and the /bin, /lib ... links or dirs) read-only, a few
harmless /etc files, synthetic /etc/passwd, a new /proc and minimal /dev, and three
size-capped tmpfs mounts — /work (cwd, $HOME), /tmp, /dev/shm; everything else is
absent and the root is read-only.  New user, pid, net, ipc, uts (and cgroup) namespaces:
no network but loopback unless ``limits.network``, no view of host processes.  When the
host runs as root, bwrap itself runs as ``nobody`` so that the per-user process limit is
enforced (the kernel exempts root from RLIMIT_NPROC) and nothing in the sandbox maps to
root.  ``--die-with-parent`` ties the sandbox's life to this process, even under SIGKILL.

Limits are rlimits applied by the agent to each command (see ``SandboxLimits``); without
a memory cgroup the memory limit is per process (address space), which together with the
process limit bounds the total.
"""

from __future__ import annotations

import asyncio
import collections
import glob
import json
import os
import shutil
import signal
from typing import Any

from agentrl.sandbox.base import (
    AGENT_SOURCE,
    DEFAULT_PATH,
    AgentSandbox,
    SandboxError,
    SandboxLimits,
    encode_request,
)

NOBODY = 65534
AGENT_PATH = "/.agentrl/agent.py"
_ETC = [
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime",
    "/etc/ssl", "/etc/ca-certificates", "/etc/nsswitch.conf", "/etc/hosts", "/etc/mime.types",
    "/etc/bash.bashrc", "/etc/profile", "/etc/inputrc", "/etc/os-release", "/etc/debian_version",
]  # fmt: skip
_STREAM_LIMIT = 256 << 20  # longest response line (a base64 file of MAX_FILE_BYTES fits)


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def sandbox_python() -> str | None:
    """A python3 the sandbox can see (under the read-only /usr or /bin)."""
    for p in ("/usr/bin/python3", "/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(p):
            return p
    return None


class BwrapSandbox(AgentSandbox):
    """One bwrap process (and its namespaces) per sandbox; the agent is its pid 2."""

    backend = "bwrap"

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        super().__init__(limits)
        self._proc: asyncio.subprocess.Process | None = None
        self._stderr_tail: collections.deque[bytes] = collections.deque(maxlen=32)
        self._stderr_task: asyncio.Task[None] | None = None

    def _argv(self, passwd_fd: int, group_fd: int, agent_fd: int) -> list[str]:
        bwrap, python = bwrap_path(), sandbox_python()
        if not bwrap:
            raise SandboxError("bwrap not found: install bubblewrap (apt-get install bubblewrap)")
        if not python:
            raise SandboxError("no python3 under /usr or /bin for the sandbox agent")
        size = str(self.limits.disk_bytes)
        a = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.limits.network:
            a.append("--unshare-net")
        a += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(d):
                a += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                a += ["--ro-bind", d, d]
        for p in _ETC + sorted(glob.glob("/etc/python3*")):
            a += ["--ro-bind-try", p, p]
        if self.limits.network:
            a += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        a += ["--ro-bind-data", str(passwd_fd), "/etc/passwd", "--ro-bind-data", str(group_fd), "/etc/group"]
        a += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        a += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", self.workdir]
        a += ["--ro-bind-data", str(agent_fd), AGENT_PATH]
        a += ["--remount-ro", "/", "--chdir", self.workdir]
        a += ["--", python, "-I", "-S", AGENT_PATH, self.agent_mode]
        return a

    async def _start(self) -> None:
        uid = os.getuid()
        drop = os.geteuid() == 0
        inner = NOBODY if drop else uid
        gid = NOBODY if drop else os.getgid()
        files = {
            "passwd": f"sandbox:x:{inner}:{gid}:sandbox:{self.workdir}:/bin/sh\n",
            "group": f"sandbox:x:{gid}:\n",
            "agent": AGENT_SOURCE,
        }
        fds = []
        try:
            for text in files.values():
                r, w = os.pipe()
                os.write(w, text.encode())
                os.close(w)
                fds.append(r)
            kwargs: dict[str, Any] = {}
            if drop:
                kwargs.update(user=NOBODY, group=NOBODY, extra_groups=[])
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *self._argv(*fds),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    pass_fds=fds,
                    cwd="/",
                    env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"},
                    start_new_session=True,  # a Ctrl-C to our process group is ours to handle
                    limit=_STREAM_LIMIT,
                    **kwargs,
                )
            except OSError as e:
                raise SandboxError(f"could not start bwrap: {e}") from e
        finally:
            for fd in fds:
                os.close(fd)
        self._stderr_task = asyncio.get_running_loop().create_task(self._read_stderr())

    async def _read_stderr(self) -> None:
        assert self._proc and self._proc.stderr
        while line := await self._proc.stderr.readline():
            self._stderr_tail.append(line)

    def _why_dead(self) -> str:
        tail = b"".join(self._stderr_tail).decode("utf-8", "replace").strip()
        return f"sandbox {self.id} died: bwrap exited ({self._proc.returncode if self._proc else '?'}): {tail[-500:] or 'no message'}"

    async def _request(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise SandboxError("sandbox not started")
        try:
            proc.stdin.write(encode_request(req))
            await proc.stdin.drain()
            line = await proc.stdout.readline()
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:
            await asyncio.sleep(0.05)  # let stderr catch the reason
            raise SandboxError(self._why_dead())
        return json.loads(line)

    async def _stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            try:
                proc.kill()  # SIGKILL bwrap: --die-with-parent takes the namespace's init down
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except TimeoutError:
            pass
        if self._stderr_task:
            self._stderr_task.cancel()
        transport = getattr(proc, "_transport", None)
        if transport is not None:
            transport.close()  # now, not in __del__ after the loop has closed

    def kill_sync(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            try:
                os.kill(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
