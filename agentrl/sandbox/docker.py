"""Docker backend: one container per sandbox, through the Docker Engine API at $DOCKER_HOST.

Works with Docker and with podman's Docker-compatible service (what CI runs, see
``.ci/docker-engine``).  The container: read-only root, size-capped tmpfs for /work, /tmp
and /dev/shm, ``network_mode="none"`` (podman ignores ``network_disabled``), all
capabilities dropped, no-new-privileges, uid 65534, a memory cgroup limit (swap off) and a
pids limit on top of the per-process rlimits.  Pid 1 is a tiny reaper; each request is one
``exec`` of the agent in ``once`` mode, so a wedged command never wedges the transport.

Every container carries the ``agentrl.sandbox`` label and its owner (host, pid, process
start time) so that ``agentrl sandbox prune`` can remove the ones a killed run left.
Podman quirks honoured here: OOM shows as exit 137 with ``OOMKilled`` false; a container
that failed to start is left behind (removed explicitly); no registry (the image must be
local — ``.ci/docker-engine`` builds ``local/base:latest``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import os
import socket
import tarfile
import threading
import time
from typing import Any

from agentrl.sandbox.base import (
    AGENT_SOURCE,
    LABEL,
    AgentSandbox,
    SandboxError,
    SandboxLimits,
)

DEFAULT_IMAGE = "local/base:latest"
AGENT_DIR = "/.agentrl"
_INIT = "import os,time\nwhile 1:\n try: os.waitpid(-1,0)\n except ChildProcessError: time.sleep(1)"
_ENV_REQUEST_MAX = 100_000  # bigger requests travel as a file (one env var holds < 128 KiB)
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


def _tar(name: str, data: bytes, mode: int, uid: int = 0) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.uid, info.gid, info.mtime = len(data), mode, uid, uid, int(time.time())
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class DockerSandbox(AgentSandbox):
    """A container per sandbox; the agent runs once per request via ``exec``."""

    backend = "docker"
    agent_mode = "once"
    grace_s = 30.0  # engine round trips under load are slower than a local pipe

    def __init__(self, limits: SandboxLimits | None = None, *, image: str | None = None) -> None:
        super().__init__(limits)
        self.image = image or os.environ.get("AGENTRL_SANDBOX_IMAGE", DEFAULT_IMAGE)
        self._tlock = threading.Lock()  # guards _cid/_stopping against a create still in flight
        self._cid: str | None = None
        self._stopping = False

    def _nproc_rlimit(self) -> bool:
        return False  # uid 65534 is shared by every container: the pids cgroup limits instead

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, fn, *args)

    # --- lifecycle
    async def _start(self) -> None:
        await self._in_thread(self._create_sync)

    def _create_sync(self) -> None:
        import docker.errors
        import docker.types

        lim = self.limits
        disk = f"size={lim.disk_bytes},mode=1777"
        try:
            c = client().containers.create(
                self.image,
                command=["python3", "-I", "-S", "-c", _INIT],
                name=self.id,
                labels={LABEL: "1", "agentrl.owner": owner_label()},
                user="65534:65534",
                working_dir=self.workdir,
                read_only=True,
                tmpfs={self.workdir: disk, "/tmp": disk, AGENT_DIR: "size=1m,mode=0755"},
                shm_size=lim.disk_bytes,
                network_mode=None if lim.network else "none",
                mem_limit=lim.memory_bytes + (128 << 20),  # + the agent's own footprint
                memswap_limit=lim.memory_bytes + (128 << 20),
                pids_limit=lim.pids + 4,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                # podman: passing ulimits replaces its defaults, and nproc must stay <= 32768
                ulimits=[
                    docker.types.Ulimit(name="nofile", soft=lim.open_files, hard=lim.open_files),
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
            c.start()
            c.put_archive(AGENT_DIR, _tar("agent.py", AGENT_SOURCE.encode(), 0o444))
        except docker.errors.APIError as e:
            self._remove_sync()  # a container that failed to start is left behind otherwise
            raise SandboxError(f"container start failed: {e}") from e

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
        await self._in_thread(self._stop_sync)

    def kill_sync(self) -> None:
        self._stop_sync()

    # --- transport
    async def _request(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        return await self._in_thread(self._request_sync, json.dumps(req))

    def _request_sync(self, line: str) -> dict[str, Any]:
        import docker.errors

        api = client().api
        cid = self._cid or self.id
        env = {"AGENTRL_REQ": line}
        try:
            if len(line) > _ENV_REQUEST_MAX:
                name = f".agentrl-req-{os.urandom(6).hex()}.json"
                api.put_archive(cid, "/tmp", _tar(name, line.encode(), 0o600, uid=65534))
                env = {"AGENTRL_REQ_FILE": f"/tmp/{name}"}
            exec_id = api.exec_create(
                cid, ["python3", "-I", "-S", f"{AGENT_DIR}/agent.py", "once"],
                environment=env, user="65534:65534", workdir=self.workdir,
            )["Id"]  # fmt: skip
            out = api.exec_start(exec_id, demux=True)
        except docker.errors.APIError as e:
            raise SandboxError(f"docker exec failed: {e}") from e
        stdout, stderr = out if isinstance(out, tuple) else (out, b"")
        lines = (stdout or b"").strip().splitlines()
        if not lines:
            why = (stderr or b"").decode("utf-8", "replace").strip()[-500:]
            raise SandboxError(f"agent gave no answer (container gone?): {why or 'no message'}")
        return json.loads(lines[-1])
