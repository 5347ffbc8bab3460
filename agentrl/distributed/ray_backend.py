"""Ray backend: inference engines as Ray actors, one OpenAI-compatible address each.

What this implements (``[cluster] backend = "ray"``): ``num_inference`` actors, each owning
one embedded engine process on whatever node Ray places it; the orchestrator (rollout
manager, buffer) and the trainer stay in the driver and reach the engines over HTTP with the
usual :class:`~agentrl.inference.PolicyClient` (load-balanced) and WeightSync.  Ray does the
placement, resources and lifetime; agentrl adds no scheduler or RPC of its own.

Weight transport across nodes needs a path every node can read (``disk`` on a shared
filesystem); ``shm`` works only when trainer and engine share a host (always true for a
local cluster).  Importing this module imports ``ray``; only ``backend = "ray"`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from agentrl.errors import AgentrlError
from agentrl.inference.engine_args import EngineArgs


class RayBackendError(AgentrlError):
    """Ray could not start or place the inference actors."""


@ray.remote
class InferenceActor:
    """Owns one embedded engine child process for the actor's lifetime."""

    def __init__(self, model_dir: str, engine_kwargs: dict[str, Any], advertise_host: str | None):
        from agentrl.inference.launcher import start_embedded_engine

        # Multi-node: listen on all interfaces and advertise this node's IP.
        host = "0.0.0.0" if advertise_host is None else "127.0.0.1"
        self._engine = start_embedded_engine(model_dir, host=host, **engine_kwargs)
        self.model = self._engine.model
        public = advertise_host or ray.util.get_node_ip_address()
        self._url = f"http://{public}:{self._engine.port}/v1"

    def base_url(self) -> str:
        return self._url

    def served_model(self) -> str:
        return self.model

    def pid(self) -> int:
        return self._engine.proc.pid

    def alive(self) -> bool:
        return self._engine.alive

    def stop(self) -> None:
        self._engine.stop()


@dataclass
class RayInferencePool:
    """The engines of a Ray run: ``base_urls`` for PolicyClient/WeightSync, ``stop()`` to end them
    (the same shape as :class:`agentrl.inference.Policy`)."""

    actors: list[Any]
    base_urls: list[str]
    engine_pids: list[int] = field(default_factory=list)
    model: str = ""
    _started_ray: bool = False

    @property
    def started(self) -> bool:
        return True

    def stop(self) -> None:
        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=30)
            except Exception:  # an actor that already died has nothing left to stop
                pass
            ray.kill(a)
        self.actors.clear()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

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
    **engine_kwargs: Any,
) -> RayInferencePool:
    """Start ``num_engines`` inference actors (connecting to ``ray_address`` or a new local cluster).

    ``local_only`` binds each engine to loopback (right for a single-machine cluster);
    set it False on a multi-node cluster so engines listen on their node's address.
    """
    started = False
    if not ray.is_initialized():
        try:
            if ray_address:
                ray.init(address=ray_address, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, log_to_driver=False)
            started = True
        except Exception as e:  # ConnectionError, RuntimeError, ... — all mean "no cluster"
            raise RayBackendError(f"could not start or join a Ray cluster ({ray_address or 'local'}): {e}") from None
    advertise = "127.0.0.1" if local_only else None
    opts: dict[str, Any] = {"num_cpus": num_cpus_per_engine, "max_restarts": 0}
    if num_gpus_per_engine:
        opts["num_gpus"] = num_gpus_per_engine
    kwargs = dict(engine_kwargs, startup_timeout=startup_timeout)
    actors = [
        InferenceActor.options(**opts).remote(str(model_dir), kwargs, advertise) for _ in range(num_engines)
    ]
    try:
        urls = ray.get([a.base_url.remote() for a in actors], timeout=startup_timeout + 60)
        pids = ray.get([a.pid.remote() for a in actors], timeout=60)
        model = ray.get(actors[0].served_model.remote(), timeout=60)
    except Exception as e:
        for a in actors:
            ray.kill(a)
        if started:
            ray.shutdown()
        raise RayBackendError(f"inference actors failed to start: {e}") from None
    return RayInferencePool(actors, urls, pids, model, _started_ray=started)


def open_ray_policy(
    model_dir: str | Path, cluster: Any, args: EngineArgs, *, served_model_name: str | None = None,
    env: dict[str, str] | None = None,
) -> RayInferencePool:
    """``[cluster] backend = "ray"``: ``cluster.num_inference`` embedded engines as Ray actors."""
    return start_inference_actors(
        model_dir, num_engines=cluster.num_inference, ray_address=cluster.ray_address,
        local_only=cluster.ray_address is None, args=args, served_model_name=served_model_name, env=env,
    )
