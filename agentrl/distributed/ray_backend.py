"""Ray backend: inference engines as supervised Ray actors, one OpenAI-compatible address each.

What this implements (``[cluster] backend = "ray"``): ``cluster.num_inference`` actors, each
owning one embedded engine process on whatever node Ray places it (``cluster.engine_cpus`` /
``engine_gpus`` per actor).  Everything else reaches the engines over HTTP with the usual
:class:`~agentrl.inference.PolicyClient` (load-balanced) and WeightSync.  Ray does the
placement, resources and lifetime; agentrl adds no scheduler or RPC of its own.

Supervision: the actors are created with Ray's ``max_restarts``; an actor whose engine process
died exits so Ray restarts it.  :meth:`RayInferencePool.refresh` (run by the recipe's
:class:`~agentrl.recipes.engines.Supervisor` off the event loop) health-checks every actor;
:meth:`RayInferencePool.dead` answers from that cache (cheap enough for admission control);
``handle.restart()`` waits for Ray's restart (or starts a new actor once Ray gave up) and
records the engine's new address, which the supervisor hands to the client and the weight
sync before pushing the current weights into it.

Weight transport across nodes: ``inference.weight_transport = "http"`` (no shared filesystem);
:meth:`RayInferencePool.local_urls` tells which engines share the trainer's node (they keep
shared memory).  Importing this module imports ``ray``; only ``backend = "ray"`` does.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from agentrl.errors import AgentrlError
from agentrl.inference.engine_args import EngineArgs

HEALTH_TIMEOUT_S = 5.0


class RayBackendError(AgentrlError):
    """Ray could not start or place the inference actors."""


def ensure_ray(address: str | None) -> bool:
    """Join ``address`` (or start a local cluster of this process's own) unless Ray is up; True if
    we started it (end it with :func:`shutdown_ray`)."""
    if ray.is_initialized():
        return False
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, log_to_driver=False, _temp_dir=_private_cluster_dir())
    except Exception as e:  # ConnectionError, RuntimeError, ... — all mean "no cluster"
        shutdown_ray()
        raise RayBackendError(f"could not start or join a Ray cluster ({address or 'local'}): {e}") from None
    _hide_ray_token()  # joined or ours: its token file exists now
    return True


_private: dict[str, Path] = {}  # the local cluster this process started: its directory


def _private_cluster_dir() -> str:
    """Ray's session directory for a local cluster, inside a 0700 one of ours.  Left to itself Ray
    makes ``/tmp/ray`` and the session's sockets and logs world-writable (0777, no sticky bit: any
    local user could swap a socket in or read the logs), and writes its token, ``~/.ray/auth_token``,
    with the umask's mode: the token is made here first, 0600 in a 0700 ``~/.ray`` (one already
    there is narrowed to 0600), unless ``RAY_AUTH_*`` names another."""
    old = _private.pop("dir", None)  # a cluster ended by a bare ray.shutdown(): Ray is down here
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    top = Path(tempfile.mkdtemp(prefix="agentrl-ray-"))  # 0700
    _private["dir"] = top
    atexit.register(shutil.rmtree, top, True)  # a process that never called shutdown_ray
    if not any(v in os.environ for v in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        token = Path.home() / ".ray" / "auth_token"  # where Ray's ray.init() looks for it
        token.parent.mkdir(mode=0o700, exist_ok=True)
        try:
            fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            if token.stat().st_mode & 0o077 and token.stat().st_uid == os.getuid():
                token.chmod(0o600)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))  # what Ray's own generator writes
    return str(top / "r")


def _hide_ray_token() -> None:
    """Ray's token files, joined cluster or our own, are masked from harness programs: the token
    starts code on the cluster."""
    from agentrl.auth import hide_key_files

    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    hide_key_files(p for p in (Path.home() / ".ray" / "auth_token", Path(named) if named else None)
                   if p is not None and p.is_file())  # fmt: skip


def shutdown_ray() -> None:
    """End the Ray connection; a local cluster of ours also loses its directory."""
    if ray.is_initialized():
        ray.shutdown()
    top = _private.pop("dir", None)
    if top is not None:
        shutil.rmtree(top, ignore_errors=True)


def engine_actor_name(index: int, driver_pid: int | None = None) -> str:
    """The Ray actor name of engine ``index`` started by the driver process ``driver_pid``."""
    return f"agentrl-engine-{driver_pid or os.getpid()}-{index}"


def current_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


@ray.remote
class InferenceActor:
    """Owns one embedded engine child process for the actor's lifetime."""

    def __init__(self, model_dir: str, engine_kwargs: dict[str, Any], advertise_host: str | None):
        from agentrl.inference.launcher import start_embedded_engine

        # Multi-node: listen on this node's cluster address only (never 0.0.0.0: every interface,
        # a sandbox with network=True included), and advertise it
        host = advertise_host or ray.util.get_node_ip_address()
        self._engine = start_embedded_engine(model_dir, host=host, **engine_kwargs)
        self._info = {"url": self._engine.base_url, "model": self._engine.model,
                      "pid": self._engine.proc.pid, "node_id": current_node_id(), "actor_pid": os.getpid()}

    def info(self) -> dict[str, Any]:
        """Address, served model, engine pid, node; an actor whose engine died exits (Ray restarts it)."""
        if not self._engine.alive:
            os._exit(1)
        return self._info

    def stop(self) -> None:
        self._engine.stop()


@dataclass
class RayEngine:
    """One engine slot of the pool: what :class:`~agentrl.recipes.engines.Supervisor` restarts."""

    pool: RayInferencePool
    index: int

    @property
    def base_url(self) -> str:
        return self.pool.base_urls[self.index]

    def describe(self) -> str:
        return f"Ray engine actor {self.index} ({self.base_url})"

    def restart(self) -> None:
        self.pool.restart(self.index)


@dataclass
class RayInferencePool:
    """The engines of a Ray run: ``base_urls`` for PolicyClient/WeightSync, ``stop()`` to end them
    (the same shape as :class:`agentrl.inference.Policy`)."""

    actors: list[Any]
    base_urls: list[str]
    engine_pids: list[int] = field(default_factory=list)
    model: str = ""
    node_ids: list[str] = field(default_factory=list)
    spawn: Any = None  # index -> a new actor handle (once Ray gave up restarting one)
    startup_timeout: float = 300.0
    restarts: int = 0
    _down: set[int] = field(default_factory=set)
    _started_ray: bool = False
    api_key: str | None = None  # every engine's key (all routes but /health need it)

    @property
    def started(self) -> bool:
        return True

    def local_urls(self, node_id: str | None = None) -> list[str]:
        """Engines on ``node_id`` (default: this process's node): they share its memory."""
        here = node_id or current_node_id()
        return [u for u, n in zip(self.base_urls, self.node_ids, strict=True) if n == here]

    def refresh(self) -> list[int]:
        """Health-check every actor (blocking, up to HEALTH_TIMEOUT_S): an actor that does not
        answer, or answers from a new address (Ray restarted it), is down until restarted."""
        refs = [a.info.remote() for a in self.actors]
        down = set()
        for i, ref in enumerate(refs):
            try:
                info = ray.get(ref, timeout=HEALTH_TIMEOUT_S)
            except Exception:  # RayActorError, ActorUnavailableError, GetTimeoutError: not serving now
                down.add(i)
                continue
            if info["url"] != self.base_urls[i] or info["pid"] != self.engine_pids[i]:
                down.add(i)  # restarted by Ray behind our back: new address, base weights
        self._down = down
        return sorted(down)

    def dead(self) -> list[RayEngine]:
        """Engines found down by the last :meth:`refresh` (no Ray call: admission asks this often)."""
        return [RayEngine(self, i) for i in sorted(self._down)]

    def restart(self, index: int) -> None:
        """Wait for Ray's restart of actor ``index`` (a new actor if Ray gave up); record its address."""
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                info = ray.get(self.actors[index].info.remote(), timeout=min(30.0, self.startup_timeout))
                break
            except ray.exceptions.ActorUnavailableError as e:  # Ray is restarting it: ask again
                last = e
                time.sleep(0.5)
            except ray.exceptions.RayActorError as e:  # died for good (restarts used up): start a fresh one
                if self.spawn is None:
                    raise RayBackendError(f"engine actor {index} died and cannot be replaced: {e}") from None
                self.actors[index] = self.spawn(index)
                last = e
            except Exception as e:  # restarting: ask again
                last = e
                time.sleep(0.5)
        else:
            raise RayBackendError(f"engine actor {index} did not come back within {self.startup_timeout:g}s: {last}")
        self.base_urls[index], self.engine_pids[index], self.node_ids[index] = info["url"], info["pid"], info["node_id"]
        self._down.discard(index)
        self.restarts += 1

    def stop(self) -> None:
        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=30)
            except Exception:  # an actor that already died has nothing left to stop
                pass
            ray.kill(a, no_restart=True)
        self.actors.clear()
        if self._started_ray:
            shutdown_ray()

    def __enter__(self) -> RayInferencePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_inference_actors(
    model_dir: str | Path,
    *,
    num_engines: int = 1,
    ray_address: str | None = None,
    num_cpus_per_engine: float = 1.0,
    num_gpus_per_engine: float = 0.0,
    local_only: bool = True,
    startup_timeout: float = 300.0,
    max_restarts: int = -1,
    resources: dict[str, float] | None = None,
    api_key: str | None = None,
    **engine_kwargs: Any,
) -> RayInferencePool:
    """Start ``num_engines`` inference actors (connecting to ``ray_address`` or a new local cluster).

    ``local_only`` binds each engine to loopback (right for a single-machine cluster);
    set it False on a multi-node cluster so engines listen on their node's address.
    ``max_restarts``: how often Ray restarts a dead actor (-1: always).  ``api_key`` (default
    ``AGENTRL_API_KEY``, else a new one): every engine requires it (``pool.api_key``).
    """
    from agentrl.auth import client_key, new_key

    key = api_key or client_key() or new_key()
    started = ensure_ray(ray_address)
    advertise = "127.0.0.1" if local_only else None
    opts: dict[str, Any] = {"num_cpus": num_cpus_per_engine, "max_restarts": max_restarts}
    if num_gpus_per_engine:
        opts["num_gpus"] = num_gpus_per_engine
    if resources:
        opts["resources"] = resources
    kwargs = dict(engine_kwargs, startup_timeout=startup_timeout, api_key=key)

    def spawn(index: int) -> Any:  # named, so an operator (or a test) can find engine i of this driver
        name = engine_actor_name(index)
        return InferenceActor.options(name=name, **opts).remote(str(model_dir), kwargs, advertise)

    actors = [spawn(i) for i in range(num_engines)]
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=startup_timeout + 60)
    except Exception as e:
        for a in actors:
            ray.kill(a, no_restart=True)
        if started:
            shutdown_ray()
        raise RayBackendError(f"inference actors failed to start: {e}") from None
    return RayInferencePool(
        actors, [i["url"] for i in infos], [i["pid"] for i in infos], infos[0]["model"],
        [i["node_id"] for i in infos], spawn, startup_timeout, _started_ray=started, api_key=key,
    )


def open_ray_policy(
    model_dir: str | Path, cluster: Any, args: EngineArgs, *, served_model_name: str | None = None,
    env: dict[str, str] | None = None, api_key: str | None = None,
) -> RayInferencePool:
    """``[cluster] backend = "ray"``: ``cluster.num_inference`` embedded engines as Ray actors."""
    return start_inference_actors(
        model_dir, num_engines=cluster.num_inference, ray_address=cluster.ray_address,
        local_only=cluster.ray_address is None, args=args, served_model_name=served_model_name, env=env,
        num_cpus_per_engine=cluster.engine_cpus, num_gpus_per_engine=cluster.engine_gpus,
        max_restarts=cluster.max_restarts, api_key=api_key,
    )
