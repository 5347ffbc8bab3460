"""Docker backend: one container per sandbox, through the Docker Engine API at $DOCKER_HOST.

Works with Docker and with podman's Docker-compatible service (what CI runs, see
``.ci/docker-engine``).  The container: read-only root, ``network_mode="none"`` (podman
ignores ``network_disabled``), all capabilities dropped, no-new-privileges, a uid of its own
(leased from :mod:`agentrl.sandbox.uids` on this host, so that per-user kernel counters
are not shared with other containers; with a remote engine, leases only coordinate the
sandboxes this host starts), and
the engine's cgroup limits for the whole container: memory (swap off; tmpfs counts), pids,
CPU quota.  The engine's seccomp profile applies to everything, and each command gets ours
on top (filters stack).

Speed: pid 1 of the container *is* the agent (the same one bwrap runs), and the host talks
to it over one attached stdin/stdout stream for the container's whole life, so an exec is
one message each way — no runtime process per exec.  Inside, the agent builds the same
world as under bwrap (its own user + mount namespace, inode-capped tmpfs over /work, /tmp,
/dev/shm; /run, /var/tmp and /sys hidden; a synthetic /etc/hosts without the host's
entries), and every command runs in its own user + pid + IPC namespaces with the filter.

Every container carries the ``agentrl.sandbox`` label and its owner (host, pid, process
start time) so that ``agentrl sandbox prune`` can remove the ones a killed run left.
Podman quirks honoured here: OOM shows as exit 137 with ``OOMKilled`` false; a container
that failed to start is left behind (removed explicitly); no registry (the image must be
local — ``.ci/docker-engine`` builds ``local/base:latest``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import json
import os
import socket
import struct
import threading
from typing import Any

from agentrl.sandbox.base import (
    AGENT_SOURCE,
    LABEL,
    AgentSandbox,
    SandboxError,
    SandboxLimits,
    encode_request,
)

DEFAULT_IMAGE = "local/base:latest"
AGENT_DIR = "/.agentrl"
HOSTS = "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
_STDOUT, _STDERR = 1, 2  # stream ids in the attach protocol's frame headers
_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()
# The SDK is synchronous: its calls run here, sized for many concurrent sandboxes (the
# event loop's default executor has only cpu+4 threads).
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=128, thread_name_prefix="agentrl-docker")


def docker_host() -> str | None:
    return os.environ.get("DOCKER_HOST") or (
        "unix:///var/run/docker.sock" if os.path.exists("/var/run/docker.sock") else None
    )


def client() -> Any:
    """A shared DockerClient for $DOCKER_HOST; SandboxError when no engine answers."""
    host = docker_host()
    if not host:
        raise SandboxError("no Docker engine: DOCKER_HOST is unset (CI: eval \"$(.ci/docker-engine)\")")
    with _clients_lock:
        if host not in _clients:
            import docker

            try:
                c = docker.DockerClient(base_url=host, max_pool_size=128, timeout=120)
                c.ping()
            except Exception as e:
                raise SandboxError(f"no Docker engine answers at DOCKER_HOST={host}: {e}") from e
            _clients[host] = c
        return _clients[host]


def _killed_by_sigkill(cid: str) -> bool:
    """The container's pid 1 (the agent) was OOM-killed.  Docker says so (``OOMKilled``); podman
    reports false for an OOM kill, so there a SIGKILL (exit 137) that agentrl did not send (it asks
    before its own teardown) counts: a command cannot signal the agent (it runs in a pid namespace
    below), so only the kernel or the engine's owner can.  Waits up to 2 s for the exit to show."""
    try:
        client().api.wait(cid, timeout=2)
        state = client().api.inspect_container(cid)["State"]
    except Exception:  # still running, gone, or the engine unreachable: not known to be an OOM kill
        return False
    if state.get("Status") != "exited" or state.get("ExitCode") != 137:
        return False
    return bool(state.get("OOMKilled")) or _is_podman()


@functools.cache
def _is_podman() -> bool:
    try:
        return any("podman" in str(c.get("Name", "")).lower() for c in client().version().get("Components", []))
    except Exception:
        return False


def process_start_time(pid: int) -> str:
    """Kernel start time of a process (clock ticks since boot); '' when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rfind(b")") + 2 :].split()[19].decode()
    except (OSError, IndexError):
        return ""


def owner_label() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{process_start_time(pid)}"


class DockerSandbox(AgentSandbox):
    """A container per sandbox; its pid 1 is the agent, spoken to over the attach stream."""

    backend = "docker"
    grace_s = 30.0  # engine round trips under load are slower than a local pipe

    def __init__(self, limits: SandboxLimits | None = None, *, image: str | None = None) -> None:
        super().__init__(limits)
        self.image = image or os.environ.get("AGENTRL_SANDBOX_IMAGE", DEFAULT_IMAGE)
        self._tlock = threading.Lock()  # guards _cid/_stopping against a create still in flight
        self._cid: str | None = None
        self._stopping = False
        self._attach: Any = None  # the hijacked HTTP connection (kept to close it)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._outbuf = bytearray()
        self._stderr_tail: collections.deque[bytes] = collections.deque(maxlen=32)

    def _nproc_rlimit(self) -> bool:
        return False  # the pids cgroup limits the whole container instead

    def _memory_cgroup(self) -> bool:
        return True  # the container's memory cgroup: RLIMIT_AS would only get in its way

    def _init_request(self) -> dict[str, Any]:
        req = super()._init_request()
        req.update(
            hide=["/run", "/var/tmp", "/sys"],  # engine-made writable dirs and the host's sysfs
            files={"/etc/hosts": HOSTS, "/etc/hostname": "sandbox\n"},
            stash=AGENT_DIR,
            oom_counter="self",  # the agent reads its container's memory cgroup events
        )
        return req

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, fn, *args)

    # --- lifecycle
    async def _start(self) -> None:
        sock = await self._in_thread(self._create_sync)
        self._reader, self._writer = await asyncio.open_connection(sock=sock, limit=1 << 20)

    def _create_sync(self) -> socket.socket:
        import docker.errors
        import docker.types

        lim = self.limits
        uid = self._lease_uid()  # a host uid of its own: per-user kernel counters are not shared
        disk = f"size={lim.disk_bytes},mode=1777"
        memory = lim.sandbox_memory_bytes()
        try:
            c = client().containers.create(
                self.image,
                command=["python3", "-I", "-S", "-c", AGENT_SOURCE, self.agent_mode],
                name=self.id,
                labels={LABEL: "1", "agentrl.owner": owner_label()},
                user=f"{uid}:{uid}",
                working_dir="/",
                read_only=True,
                stdin_open=True,
                # mount points for the agent's own inode-capped tmpfs (the engine's have no nr_inodes)
                tmpfs={self.workdir: disk, "/tmp": disk, AGENT_DIR: "size=1m,mode=0755"},
                shm_size=lim.disk_bytes,
                network_mode=None if lim.network else "none",
                mem_limit=memory,
                memswap_limit=memory,
                pids_limit=lim.pids + 4,  # + the agent, the per-exec init and its parent
                nano_cpus=int(lim.cpus * 1e9) if lim.cpus > 0 else None,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                # podman: passing ulimits replaces its defaults, and nproc must stay <= 32768
                ulimits=[
                    docker.types.Ulimit(name="nofile", soft=1024, hard=1024),
                    docker.types.Ulimit(name="nproc", soft=32768, hard=32768),
                ],
                detach=True,
            )
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"image {self.image} not found (no registry: build it, see .ci/docker-engine)") from e
        except docker.errors.APIError as e:
            raise SandboxError(f"container create failed: {e}") from e
        with self._tlock:
            self._cid = c.id
            stopping = self._stopping
        if stopping:  # closed (e.g. cancelled) while the create was in flight
            self._remove_sync()
            raise SandboxError("sandbox closed during creation")
        try:
            # attach before start: the agent's first words cannot be missed
            self._attach = client().api.attach_socket(c.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
            c.start()
        except docker.errors.APIError as e:
            self._remove_sync()  # a container that failed to start is left behind otherwise
            raise SandboxError(f"container start failed: {e}") from e
        raw = getattr(self._attach, "_sock", self._attach)
        if not isinstance(raw, socket.socket) or hasattr(raw, "context"):  # TLS: not an fd asyncio can adopt
            self._remove_sync()
            raise SandboxError("the docker backend needs a plain unix/tcp DOCKER_HOST (TLS is not supported)")
        return raw

    def _remove_sync(self) -> None:
        import docker.errors

        try:
            client().api.remove_container(self._cid or self.id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except Exception:
            pass

    def _stop_sync(self) -> None:
        with self._tlock:
            self._stopping = True
        self._remove_sync()

    async def _stop(self) -> None:
        if self._writer is not None:
            self._writer.close()  # the agent sees EOF and exits; removal follows regardless
            self._writer = None
        await self._in_thread(self._stop_sync)
        if self._attach is not None:
            with contextlib.suppress(Exception):
                self._attach.close()
            self._attach = None

    def kill_sync(self) -> None:
        self._stop_sync()

    async def _agent_died_of_oom(self) -> bool:
        with self._tlock:
            cid, stopping = self._cid, self._stopping
        if cid is None or stopping:
            return False
        return await self._in_thread(_killed_by_sigkill, cid)

    # --- transport: multiplexed frames (8-byte header: stream id, 3 zero bytes, size)
    async def _request(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._reader is None or self._writer is None:
            raise SandboxError("sandbox not started")
        try:
            self._writer.write(encode_request(req))
            await self._writer.drain()
            searched = 0  # the response line ends in a later frame: look for it in the new bytes only
            while (end := self._outbuf.find(b"\n", searched)) < 0:
                searched = len(self._outbuf)
                header = await self._reader.readexactly(8)
                stream, size = struct.unpack(">BxxxL", header)
                payload = await self._reader.readexactly(size)
                if stream == _STDOUT:
                    self._outbuf += payload
                elif stream == _STDERR:
                    self._stderr_tail.append(payload)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            tail = b"".join(self._stderr_tail).decode("utf-8", "replace").strip()[-500:]
            raise SandboxError(f"sandbox {self.id}: container agent gone ({type(e).__name__}): {tail or 'no message'}") from e
        line = bytes(self._outbuf[:end])
        del self._outbuf[: end + 1]
        return json.loads(line)
