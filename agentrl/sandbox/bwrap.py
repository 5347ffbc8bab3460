"""Bubblewrap backend: a fresh set of namespaces per sandbox, no daemon.

Layout inside: the host's /usr read-only but without /usr/local (hidden by an empty
tmpfs), the /bin, /lib ... links, a few harmless /etc files, synthetic /etc/hosts,
/etc/passwd and /etc/group, a new /proc and minimal /dev, and three size- *and* inode-capped
tmpfs — /work (cwd, $HOME), /tmp, /dev/shm — mounted by the agent; everything else is absent
and the root is read-only.  New user, pid, net, ipc, uts (and cgroup) namespaces.  When the
host runs as root, bwrap itself runs as a host uid of the sandbox's own
(:mod:`agentrl.sandbox.uids`): nothing in the sandbox maps to root, and per-user kernel
counters (inotify, message queues, queued signals) are not shared with any other sandbox
or host process.  ``--die-with-parent`` ties the sandbox's life to this process, even
under SIGKILL.

Limits: a cgroup per sandbox (memory incl. tmpfs and shm, processes, CPU quota) wherever
this host delegates one (:mod:`agentrl.sandbox.cgroup`; ``agentrl sandbox doctor`` says);
rlimits per process always.  Network: none but the sandbox's own loopback, or with
``limits.network`` a user-mode NAT (slirp4netns) in the sandbox's own network namespace,
with the host's loopback unreachable.  See ``_agent.py`` for what each command gets.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
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

SANDBOX_UID = 65532  # inside; not the overflow id (65534), which unmapped owners show as
AGENT_PATH = "/.agentrl/agent.py"
_ETC = [
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime",
    "/etc/ssl", "/etc/ca-certificates", "/etc/nsswitch.conf", "/etc/mime.types",
    "/etc/bash.bashrc", "/etc/profile", "/etc/inputrc", "/etc/os-release", "/etc/debian_version",
]  # fmt: skip
HOSTS = "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
SLIRP_DNS = "10.0.2.3"
NS_GET_USERNS = 0xB701  # ioctl on a namespace fd: the user namespace that owns it
_STREAM_LIMIT = 256 << 20  # longest response line (a base64 file of MAX_FILE_BYTES fits)


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def slirp_path() -> str | None:
    return shutil.which("slirp4netns", path=DEFAULT_PATH)


def sandbox_python() -> str | None:
    """A python3 the sandbox can see (under the read-only /usr; /usr/local is hidden)."""
    for p in ("/usr/bin/python3", "/bin/python3"):
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
        self._cgroup: Any = None
        self._slirp: asyncio.subprocess.Process | None = None
        self._slirp_exit_w: int | None = None
        self._child_pid: int | None = None
        self._info_r: int | None = None

    def _init_request(self) -> dict[str, Any]:
        req = super()._init_request()
        req["own_proc"] = True  # bwrap's /proc is fully visible: each exec may mount its own
        return req

    def _drop(self) -> bool:
        return os.geteuid() == 0

    def _argv(self, fds: dict[str, int]) -> list[str]:
        bwrap, python = bwrap_path(), sandbox_python()
        if not bwrap:
            raise SandboxError("bwrap not found: install bubblewrap (apt-get install bubblewrap)")
        if not python:
            raise SandboxError("no python3 under /usr or /bin for the sandbox agent")
        a = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--unshare-net", "--die-with-parent", "--new-session", "--hostname", "sandbox",
             "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
             "--ro-bind", "/usr", "/usr"]  # fmt: skip
        if os.path.isdir("/usr/local"):  # site config, pip installs, secrets: not the sandbox's business
            a += ["--size", "4096", "--tmpfs", "/usr/local", "--remount-ro", "/usr/local"]
        for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(d):
                a += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                a += ["--ro-bind", d, d]
        for p in _ETC + sorted(glob.glob("/etc/python3*")):
            a += ["--ro-bind-try", p, p]
        for name, path in (("hosts", "/etc/hosts"), ("passwd", "/etc/passwd"), ("group", "/etc/group"),
                           ("resolv", "/etc/resolv.conf"), ("agent", AGENT_PATH)):  # fmt: skip
            if name in fds:
                a += ["--ro-bind-data", str(fds[name]), path]
        a += ["--proc", "/proc", "--dev", "/dev", "--dir", "/dev/shm", "--remount-ro", "/dev", "--dir", self.workdir, "--dir", "/tmp"]
        if "info" in fds:
            a += ["--info-fd", str(fds["info"])]
        a += ["--remount-ro", "/", "--chdir", "/"]
        a += ["--", python, "-I", "-S", AGENT_PATH, self.agent_mode]
        return a

    async def _start(self) -> None:
        if self.limits.network and not slirp_path():
            raise SandboxError(
                "network=True needs slirp4netns (apt-get install slirp4netns); refusing to share the host's network"
            )
        drop = self._drop()
        files = {
            "hosts": HOSTS,
            "passwd": f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{self.workdir}:/bin/sh\n",
            "group": f"sandbox:x:{SANDBOX_UID}:\n",
            "agent": AGENT_SOURCE,
        }
        if self.limits.network:
            files["resolv"] = f"nameserver {SLIRP_DNS}\n"
        fds: dict[str, int] = {}
        info_r = None
        try:
            for name, text in files.items():
                r, w = os.pipe()
                os.write(w, text.encode())
                os.close(w)
                fds[name] = r
            if self.limits.network:
                info_r, fds["info"] = os.pipe()
            kwargs: dict[str, Any] = {}
            if drop:  # root may pick any uid: one of the sandbox's own (per-user kernel counters)
                uid = self._lease_uid()
                kwargs.update(user=uid, group=uid, extra_groups=[])
            else:  # bwrap cannot change uid: sandboxes share ours (per-exec caps still hold)
                self.host_uid = os.getuid()
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *self._argv(fds),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    pass_fds=list(fds.values()),
                    cwd="/",
                    env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"},
                    start_new_session=True,  # a Ctrl-C to our process group is ours to handle
                    limit=_STREAM_LIMIT,
                    **kwargs,
                )
            except OSError as e:
                raise SandboxError(f"could not start bwrap: {e}") from e
        finally:
            for fd in fds.values():
                os.close(fd)
        self._stderr_task = asyncio.get_running_loop().create_task(self._read_stderr())
        self._info_r = info_r  # read once the sandbox answers (its namespaces are complete then)

    async def _start_network(self, info_r: int) -> None:
        """slirp4netns on the sandbox's own network namespace: outbound NAT, no host loopback."""
        loop = asyncio.get_running_loop()
        try:
            raw = await asyncio.wait_for(loop.run_in_executor(None, os.read, info_r, 4096), 20.0)
        finally:
            os.close(info_r)
        try:
            self._child_pid = int(json.loads(raw)["child-pid"])
        except (ValueError, KeyError) as e:
            raise SandboxError(f"bwrap reported no sandbox pid: {raw[:200]!r}") from e
        pid = self._child_pid
        # the user namespace that owns the sandbox's network namespace (with --uid bwrap nests
        # a second one for the process itself, which slirp4netns must not join)
        try:
            net_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                owner_fd = fcntl.ioctl(net_fd, NS_GET_USERNS)
            finally:
                os.close(net_fd)
        except OSError as e:
            raise SandboxError(f"cannot find the sandbox's network namespace: {e}") from e
        ready_r, ready_w = os.pipe()
        exit_r, self._slirp_exit_w = os.pipe()
        os.set_inheritable(self._slirp_exit_w, False)
        # The user-mode NAT parses the sandbox's packets: --enable-sandbox puts it in an empty
        # mount namespace without capabilities (it needs root only to open /dev/net/tun first)
        # and --enable-seccomp narrows its syscalls.
        kwargs: dict[str, Any] = {}
        try:
            self._slirp = await asyncio.create_subprocess_exec(
                slirp_path() or "slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
                "--enable-sandbox", "--enable-seccomp", f"--ready-fd={ready_w}", f"--exit-fd={exit_r}",
                f"--userns-path=/proc/self/fd/{owner_fd}", str(pid), "tap0",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
                pass_fds=[ready_w, exit_r, owner_fd], start_new_session=True, **kwargs,
            )  # fmt: skip
        except OSError as e:
            raise SandboxError(f"could not start slirp4netns: {e}") from e
        finally:
            os.close(ready_w)
            os.close(exit_r)
            os.close(owner_fd)
        try:
            ok = await asyncio.wait_for(loop.run_in_executor(None, os.read, ready_r, 1), 20.0)
        finally:
            os.close(ready_r)
        if ok != b"1":
            err = b""
            if self._slirp.stderr is not None:
                with contextlib.suppress(TimeoutError):
                    err = await asyncio.wait_for(self._slirp.stderr.read(2000), 2.0)
            raise SandboxError(f"slirp4netns failed to configure the sandbox network: {err.decode(errors='replace')}")

    async def _confine(self) -> None:
        """Once the agent answers: the cgroup, then the network (if asked for)."""
        await self._confine_cgroup()
        if self._info_r is not None:
            info_r, self._info_r = self._info_r, None
            await self._start_network(info_r)

    async def _confine_cgroup(self) -> None:
        """Move the sandbox's processes (bwrap's init and the agent; nothing else exists yet)
        into a cgroup of its own; every later fork inherits it."""
        from agentrl.sandbox.cgroup import SandboxCgroup, detect

        support = detect()
        if not support.version or self._proc is None:
            return
        try:
            self._cgroup = SandboxCgroup(support, self.id)
            lim = self.limits
            self._cgroup.limit(memory_bytes=lim.sandbox_memory_bytes(), pids=lim.pids + 4, cpus=lim.cpus)
            for pid in [self._proc.pid, *_descendants(self._proc.pid)]:
                self._cgroup.add(pid)
        except OSError as e:
            raise SandboxError(f"could not confine the sandbox in its cgroup: {e}") from e

    def _memory_cgroup(self) -> bool:
        return self._cgroup is not None

    def _oom_kills(self) -> int | None:
        return self._cgroup.oom_kills() if self._cgroup is not None else None

    async def _host_leftovers(self) -> list[str]:
        if self._cgroup is None or self._proc is None:
            return []
        infra = {self._proc.pid, *(_descendants(self._proc.pid)[:2])}  # bwrap, its init, the agent
        extra = [p for p in self._cgroup.procs() if p not in infra]
        return [f"{len(extra)} process(es) left in the sandbox's cgroup"] if extra else []

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
        if proc is not None:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()  # SIGKILL bwrap: --die-with-parent takes the namespace's init down
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10.0)
            if self._stderr_task:
                self._stderr_task.cancel()
            transport = getattr(proc, "_transport", None)
            if transport is not None:
                transport.close()  # now, not in __del__ after the loop has closed
        if self._info_r is not None:
            os.close(self._info_r)
            self._info_r = None
        await self._stop_network()
        if self._cgroup is not None:
            cg, self._cgroup = self._cgroup, None
            await asyncio.get_running_loop().run_in_executor(None, cg.remove)

    async def _stop_network(self) -> None:
        if self._slirp_exit_w is not None:
            os.close(self._slirp_exit_w)  # slirp4netns exits when this closes
            self._slirp_exit_w = None
        slirp = self._slirp
        if slirp is not None and slirp.returncode is None:
            try:
                await asyncio.wait_for(slirp.wait(), 2.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    slirp.kill()
                await slirp.wait()
        if slirp is not None:
            transport = getattr(slirp, "_transport", None)
            if transport is not None:
                transport.close()

    def kill_sync(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGKILL)
        if self._slirp is not None and self._slirp.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._slirp.pid, signal.SIGKILL)
        if self._cgroup is not None:
            self._cgroup.remove(timeout=2.0)
            self._cgroup = None


def _descendants(pid: int) -> list[int]:
    """Live processes below ``pid``, parents before children."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2 :].split()
        if fields[0] not in (b"Z", b"X"):
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in sorted(children.get(todo.pop(0), [])):
            out.append(c)
            todo.append(c)
    return out
