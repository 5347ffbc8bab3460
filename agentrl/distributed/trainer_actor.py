"""``cluster.trainer_actor = true``: the trainer in its own Ray actor (``trainer_cpus`` / ``trainer_gpus``).

The recipe keeps its shape: :class:`RemoteTrainer` answers what the recipe calls on a
:class:`~agentrl.trainer.Trainer` (``step``, ``state_dict``, ``load_state_dict``,
``merged_model``, ``lora``) by calling the actor, which holds the one real Trainer.

Weights never pass through the driver: :meth:`RemoteTrainer.push_weights` asks the actor to
push, and the actor builds its own WeightSync to the engines' *current* addresses (rebuilt
when a restarted engine comes back elsewhere); engines on the actor's node keep shared
memory under ``weight_transport = "http"``.  Checkpoints and the final model do come to the
driver (its run dir), through Ray's object store, so no filesystem is shared either way.

Death: the actor is never restarted (its optimizer state would be gone and a fresh actor
would silently train from the start model); the run ends with :class:`TrainerDied`, which
names the checkpoint to ``--resume`` from.
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import ray

from agentrl.errors import AgentrlError, TrainerDied
from agentrl.types import Group, SamplingParams


class TrainerActorImpl:
    """The Trainer, in its own process on whatever node Ray placed it (an async actor: the
    heavy calls run in a worker thread so ``info`` still answers during a step)."""

    def __init__(self, model_dir: str, cfg: Any, sampling: SamplingParams, seed: int, threads: int) -> None:
        import torch

        from agentrl.trainer.trainer import Trainer

        torch.set_num_threads(threads)
        self.trainer = Trainer(Path(model_dir), cfg, sampling, seed=seed)
        self.pusher = EnginePush()

    async def info(self) -> dict[str, Any]:
        return {"lora": self.trainer.lora, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def step(self, groups: list[Group]) -> dict[str, float]:
        return await asyncio.to_thread(self.trainer.step, groups)

    async def state_dict(self) -> dict[str, Any]:
        """On the CPU: the driver (maybe a CPU-only head node) unpickles and saves it."""
        return await asyncio.to_thread(lambda: _to_cpu(self.trainer.state_dict()))

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        await asyncio.to_thread(self.trainer.load_state_dict, state)

    async def model_files(self) -> dict[str, bytes]:
        """The current weights as an HF model dir, file name → bytes (LoRA merged)."""

        def save() -> dict[str, bytes]:
            with tempfile.TemporaryDirectory(prefix="agentrl-trainer-") as tmp:
                self.trainer.merged_model().save_pretrained(tmp, safe_serialization=True)
                return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}

        return await asyncio.to_thread(save)

    async def push(self, version: int, urls: list[str], local_urls: list[str], sync_args: dict[str, Any],
                   adapters: bool) -> tuple[float, dict[str, float]]:  # fmt: skip
        """Push the current weights (or LoRA factors) to ``urls``; returns (seconds, the sync's stats)."""
        tensors = await asyncio.to_thread(self.trainer.adapter_tensors if adapters else self.trainer.named_tensors)
        return await self.pusher.push(tensors, version, urls, local_urls, sync_args, adapters)

    async def close(self) -> None:
        await self.pusher.close()


class EnginePush:
    """A trainer actor's WeightSync to the engines' *current* addresses (rebuilt when an engine comes back elsewhere)."""

    def __init__(self) -> None:
        self.sync: Any = None
        self.key: tuple[Any, ...] = ()

    async def push(self, tensors: dict[str, Any], version: int, urls: list[str], local_urls: list[str],
                   sync_args: dict[str, Any], adapters: bool) -> tuple[float, dict[str, float]]:  # fmt: skip
        """(seconds, the sync's stats)."""
        from agentrl.weights.sync import one_bucket

        return await self.push_stream(tensors, one_bucket(tensors), version, urls, local_urls, sync_args, adapters)

    async def push_stream(self, specs: Any, buckets: Any, version: int, urls: list[str], local_urls: list[str],
                          sync_args: dict[str, Any], adapters: bool) -> tuple[float, dict[str, float]]:  # fmt: skip
        """:meth:`push` of tensors arriving in ``buckets`` (``specs``: their names, dtypes, shapes, in order)."""
        from agentrl.weights import make_weight_sync

        key = (tuple(urls), tuple(local_urls), tuple(sorted(sync_args.items())))
        if key != self.key:  # first push, or an engine came back at a new address
            await self.close()
            self.sync, self.key = make_weight_sync(list(urls), local_urls=list(local_urls), **sync_args), key
        lora = {"lora": True} if adapters else {}  # vLLM's sync takes no lora (a LoRA run there pushes merged weights)
        seconds = await self.sync.push_stream(specs, buckets, version, **lora)
        return seconds, dict(getattr(self.sync, "last_stats", {}))

    async def close(self) -> None:
        if self.sync is not None:
            await self.sync.close()
            self.sync = None


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class _ModelFiles:
    """What ``merged_model()`` returns for a remote trainer: ``save_pretrained`` writes its files."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def save_pretrained(self, out: str | Path, **_: Any) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (out / name).write_bytes(data)


class RemoteTrainer:
    """The driver's handle on the trainer actor: the Trainer methods the recipe calls (blocking,
    like the local Trainer's; the recipe runs them off the event loop), plus :meth:`push_weights`."""

    def __init__(self, actor: Any, run_dir: Path, started_ray: bool = False, *, resources: str = "",
                 startup_timeout: float = 600.0) -> None:  # fmt: skip
        self.actor, self.run_dir, self.started_ray, self.resources = actor, run_dir, started_ray, resources
        info = self._get(actor.info.remote(), "start", timeout=startup_timeout)
        self.lora, self.node_id = info["lora"], info["node_id"]
        self.last_push: dict[str, float] = {}

    def _get(self, ref: Any, what: str, timeout: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise AgentrlError(f"the trainer actor was not placed within {timeout:g}s: does the cluster have "
                               f"{self.resources} free? (cluster.trainer_cpus / trainer_gpus)") from None  # fmt: skip
        except ray.exceptions.RayActorError as e:
            if getattr(e, "actor_init_failed", False):  # the Trainer itself failed to build: not a crash to resume
                raise AgentrlError(f"the trainer actor could not start: {_cause(e)}") from None
            from agentrl.trainer.checkpoint import latest_checkpoint

            ckpt = latest_checkpoint(self.run_dir)
            hint = (f"resume from {ckpt} with `agentrl run --resume` (same config)" if ckpt is not None
                    else "no checkpoint was written yet (set trainer.checkpoint_every); start the run again")
            raise TrainerDied(f"the trainer actor died during {what} ({_cause(e)}); {hint}") from None
        except ray.exceptions.RayTaskError as e:  # the actor raised: re-raise the actor's own exception
            if isinstance(e.cause, Exception):
                raise e.cause from e  # the chain keeps the actor-side traceback
            raise

    def step(self, groups: list[Group]) -> dict[str, float]:
        return self._get(self.actor.step.remote([g.drop_env_state() for g in groups]), "an optimizer step")

    def state_dict(self) -> dict[str, Any]:
        return self._get(self.actor.state_dict.remote(), "a checkpoint")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._get(self.actor.load_state_dict.remote(state), "the checkpoint restore")

    def merged_model(self) -> _ModelFiles:
        return _ModelFiles(self._get(self.actor.model_files.remote(), "the final model export"))

    async def push_weights(self, version: int, urls: list[str], local_urls: list[str], sync_args: dict[str, Any],
                           adapters: bool) -> float:  # fmt: skip
        """The actor pushes to ``urls`` (``local_urls``: those on its node, over shared memory)."""
        ref = self.actor.push.remote(version, urls, local_urls, sync_args, adapters)
        seconds, self.last_push = await asyncio.to_thread(self._get, ref, "a weight push")  # may raise WeightSyncError
        return seconds

    def close(self) -> None:
        if not ray.is_initialized():  # Ray already stopped (and any call would start a new one)
            return
        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except Exception:  # already dead: nothing to close
            pass
        ray.kill(self.actor, no_restart=True)
        if self.started_ray:
            from agentrl.distributed.ray_backend import shutdown_ray

            shutdown_ray()


def _cause(e: BaseException) -> str:
    """Ray's death message in one line: its generic first line dropped when more follows, no colours."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].startswith("The actor died"):
        lines = lines[1:]
    text = " ".join(lines) or type(e).__name__
    return text if len(text) <= 400 else text[:200] + " ... " + text[-190:]


def start_trainer_actor(
    cfg: Any, model_dir: Path, run_dir: Path, threads: int, *, name: str | None = None
) -> Any:
    """Place the trainer actor (``cluster.trainer_cpus`` / ``trainer_gpus``) and wait for it to load; with
    ``trainer.world_size = N > 1``, N rank actors of the sharded trainer (:mod:`agentrl.distributed.trainer_ranks`)."""
    from agentrl.distributed.ray_backend import ensure_ray, shutdown_ray

    if cfg.trainer.world_size > 1:
        from agentrl.distributed.trainer_ranks import start_trainer_ranks

        return start_trainer_ranks(cfg, model_dir, run_dir, threads)
    cc = cfg.cluster
    started = ensure_ray(cc.ray_address)
    opts: dict[str, Any] = {"num_cpus": cc.trainer_cpus, "max_restarts": 0, "max_concurrency": 8}
    if cc.trainer_gpus:
        opts["num_gpus"] = cc.trainer_gpus
    opts["name"] = name or trainer_actor_name()
    actor = ray.remote(TrainerActorImpl).options(**opts).remote(
        str(model_dir), cfg.trainer, cfg.rollout.sampling(), cfg.run.seed, threads
    )
    try:
        return RemoteTrainer(actor, run_dir, started, resources=f"{cc.trainer_cpus:g} CPUs, {cc.trainer_gpus:g} GPUs")
    except BaseException:
        ray.kill(actor, no_restart=True)
        if started:
            shutdown_ray()
        raise


def trainer_actor_name(driver_pid: int | None = None) -> str:
    """The Ray actor name of the trainer started by the driver process ``driver_pid``."""
    return f"agentrl-trainer-{driver_pid or os.getpid()}"


__all__ = ["EnginePush", "RemoteTrainer", "TrainerActorImpl", "TrainerDied", "start_trainer_actor", "trainer_actor_name"]
