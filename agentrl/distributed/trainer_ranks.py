"""``cluster.trainer_actor`` with ``trainer.world_size = N``: the sharded trainer's N ranks as Ray actors.

The ranks are the sharded trainer's own (:class:`~agentrl.trainer.sharded._RankTrainer`, built by
:func:`~agentrl.trainer.ranks.start_rank`: the step, the reductions, the checkpoint shards and the
weights out are that code); this module is only the :class:`~agentrl.trainer.ranks.Ranks` seam
for Ray, :class:`RayRanks`, and the driver's handle, :class:`RemoteShardedTrainer` (the
:class:`~agentrl.trainer.sharded.ShardedTrainer` plus what the one-rank
:class:`~agentrl.distributed.trainer_actor.RemoteTrainer` adds: ``push_weights``, ``node_id``,
``last_push``).

Placement: one placement group, one bundle per rank (``cluster.trainer_cpus`` CPUs and
``cluster.trainer_gpus`` GPUs each; ``trainer_gpus = 1``: one GPU per rank and nccl, 0: CPU ranks and
gloo), strategy ``STRICT_PACK``: every rank on one node, so FSDP2's all-gathers stay on that node's
links, and the ranks meet through a file in a private directory of rank 0 (nothing listens for them on any
address: :func:`~agentrl.trainer.ranks.start_rank`); a
cluster without a node that fits all N bundles fails the start with one line (ranks spread over
several nodes are not supported yet).

Files: no filesystem is shared with the driver.  A checkpoint: each rank writes its shards
(``torch.distributed.checkpoint``) into a temporary directory on its node and sends the files back;
the driver writes them into the checkpoint.  A resume sends the checkpoint's files to every rank
through Ray's object store.  Weights out: every rank joins the gathers and rank 0 pushes to the
engines itself, so weights never pass through the driver: the push's manifest comes from the
parameters' shapes before any data, and each bucket (``trainer.push_bucket_mb``) is written into
the engines' staged transfer as it is gathered, so no rank holds a full copy of the model.

Death: a rank actor is never restarted; one that dies (or fails) ends the call with
:class:`~agentrl.errors.TrainerDied` naming the rank and the newest checkpoint, and every other
rank actor is killed (one in a collective with the dead rank would wait ``collective_timeout_s``).
"""

from __future__ import annotations

import asyncio
import os
import queue
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import ray

from agentrl.distributed.trainer_actor import EnginePush, _cause
from agentrl.errors import AgentrlError
from agentrl.trainer.ranks import RankLost, first_line, rendezvous_dir, start_rank
from agentrl.trainer.sharded import ShardedTrainer
from agentrl.types import SamplingParams


class RankActorImpl:
    """One rank of the sharded trainer, in its own Ray actor (async: the trainer's calls run in a thread)."""

    def __init__(self, rank: int, world: int, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.trainer: Any = None
        self.parts: list[dict[str, Any]] = []  # rank 0's weight buckets of the running call (not a push)
        self.feed: _Feed | None = None  # rank 0's weight buckets to the running push
        self.store = ""  # rank 0: the rendezvous directory it made
        self.pusher = EnginePush()

    async def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}  # fmt: skip

    async def rendezvous(self) -> str:
        """Rank 0: the process group's rendezvous directory (STRICT_PACK: every rank is on this node)."""
        self.store = rendezvous_dir()
        return self.store

    async def start(self, backend: str, store: str, model_dir: str, cfg: Any, sampling: SamplingParams,
                    seed: int) -> dict[str, Any]:  # fmt: skip
        import torch

        device = torch.device("cuda:0") if backend == "nccl" else torch.device("cpu")  # Ray shows each rank its GPU

        def build() -> None:
            self.trainer = start_rank(self.rank, self.world, backend, store, device, model_dir, cfg, sampling, seed,
                                      self)  # fmt: skip

        await asyncio.to_thread(build)
        return {"lora": self.trainer.lora}

    def send(self, message: tuple[str, Any]) -> None:
        """The rank's ``conn``: rank 0's weight buckets, to the running push (or kept for the running call)."""
        if self.feed is not None:
            self.feed.put(message[1])
        else:
            self.parts.append(message[1])

    async def call(self, method: str, args: tuple[Any, ...]) -> tuple[list[dict[str, Any]], Any]:
        """``_RankTrainer.method(*args)``, or one of this actor's own calls; (rank 0's buckets, the result)."""
        own = getattr(self, "_" + method, None)
        self.parts = []
        try:
            result = await own(*args) if own is not None else await asyncio.to_thread(getattr(self.trainer, method), *args)
            return self.parts, result
        finally:
            self.parts = []

    async def _save_files(self) -> tuple[tuple[int, int, str] | None, dict[str, bytes]]:
        """This rank's checkpoint files (its shards, rank 0 the metadata, its RNG and schedule), or its failure."""
        tmp = tempfile.mkdtemp(prefix=f"agentrl-rank{self.rank}-")

        def save() -> tuple[tuple[int, int, str] | None, dict[str, bytes]]:
            failed = self.trainer.save_shards(tmp)
            return failed, ({} if failed else {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()})

        try:
            return await asyncio.to_thread(save)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def _load_files(self, files: dict[str, Any]) -> None:
        """Read the shards from a checkpoint's files (name -> object ref; another rank's RNG file is not fetched)."""
        tmp = Path(tempfile.mkdtemp(prefix=f"agentrl-rank{self.rank}-"))
        try:
            for name, ref in files.items():
                if not (name.startswith("rank_") and name != f"rank_{self.rank}.pt"):
                    (tmp / name).write_bytes(await ref)
            await asyncio.to_thread(self.trainer.load_shards, str(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def _push(self, version: int, urls: list[str], local_urls: list[str], sync_args: dict[str, Any],
                    adapters: bool) -> tuple[float, dict[str, float]] | Exception | None:  # fmt: skip
        """Every rank joins the gathers; rank 0 pushes each bucket as it is gathered (the manifest comes first, from
        the parameters' shapes), so it never holds the whole model.  A failed push (WeightSyncError: an engine down)
        is rank 0's answer, not a lost rank: the gathers still run to their end, the ranks are fine."""
        gather = self.trainer.adapter_tensors if adapters else self.trainer.named_tensors
        if self.rank != 0:
            await asyncio.to_thread(gather)
            return None
        self.feed = feed = _Feed()

        def run() -> None:
            try:
                gather()
            finally:
                feed.put(_END)

        gathered = asyncio.ensure_future(asyncio.to_thread(run))  # started first: the other ranks are in it
        try:
            specs = self.trainer.weight_specs(adapters)
            return await self.pusher.push_stream(specs, feed.buckets(), version, urls, local_urls, sync_args, adapters)
        except Exception as e:  # noqa: BLE001 - raised again in the driver, as the one-rank actor's push does
            return e
        finally:
            feed.close()  # buckets the push did not take are dropped: every rank finishes its gathers
            try:
                await gathered  # a failed collective raises here: a lost rank
            finally:
                self.feed = None

    async def close(self) -> None:
        await self.pusher.close()
        if self.store:
            shutil.rmtree(self.store, ignore_errors=True)


class _Feed:
    """Rank 0's weight buckets from the gather (a worker thread, in collectives) to the push (the actor's event loop).
    A bucket is handed over only once the push took the one before (one waits here at most; the gather waits
    meanwhile); once the push has ended (done or failed), buckets are dropped, so the gather never waits on it
    and every rank finishes its collectives."""

    def __init__(self) -> None:
        self.q: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.open = True

    def put(self, item: Any) -> None:
        """From the gather thread: wait until the push took the previous bucket (or has ended)."""
        while self.open:
            try:
                self.q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _get(self) -> Any:
        while self.open:
            try:
                return self.q.get(timeout=0.1)
            except queue.Empty:
                continue
        return _END

    async def buckets(self) -> AsyncIterator[dict[str, Any]]:
        while (item := await asyncio.to_thread(self._get)) is not _END:
            yield item
            del item  # the push wrote it: nothing holds it here while the next one waits

    def close(self) -> None:
        self.open = False
        while not self.q.empty():
            self.q.get_nowait()


_END = object()


class RayRanks:
    """The :class:`~agentrl.trainer.ranks.Ranks` seam for N rank actors in one STRICT_PACK placement group."""

    def __init__(self, model_dir: str | Path, cfg: Any, sampling: SamplingParams, seed: int, *, cpus: float,
                 gpus: float, threads: int, startup_timeout: float = 600.0) -> None:  # fmt: skip
        """``cfg``: the TrainerConfig; ``cpus``/``gpus``: one rank's bundle."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world, self.cfg, self.seed, self.sampling = cfg.world_size, cfg, seed, sampling
        self.model_dir = str(model_dir)
        self.backend = ray_backend(cfg, gpus)
        self.timeout = startup_timeout
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self.what = f"{self.world} bundles of {cpus:g} CPUs, {gpus:g} GPUs on one node (STRICT_PACK)"
        self.pg = placement_group([dict(bundle) for _ in range(self.world)], strategy="STRICT_PACK")
        self.actors = [
            ray.remote(RankActorImpl).options(
                num_cpus=cpus, num_gpus=gpus, max_restarts=0, name=f"agentrl-trainer-rank{rank}-{os.getpid()}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote(rank, self.world, threads)
            for rank in range(self.world)
        ]  # fmt: skip
        self.pids: list[int] = []
        self.node_id = ""
        self._closed = False

    def start(self) -> dict[str, Any]:
        """Place the group, let rank 0 make the rendezvous directory, and build every rank's trainer."""
        try:
            ray.get(self.pg.ready(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise AgentrlError(f"the {self.world} trainer ranks were not placed within {self.timeout:g}s: the cluster "
                               f"needs {self.what} free (cluster.trainer_cpus / trainer_gpus)") from None  # fmt: skip
        infos = self._all([a.info.remote() for a in self.actors])
        self.pids, self.node_id = [i["pid"] for i in infos], infos[0]["node_id"]
        store = self._all([self.actors[0].rendezvous.remote()], ranks=[0])[0]
        refs = [a.start.remote(self.backend, store, self.model_dir, self.cfg, self.sampling, self.seed)
                for a in self.actors]  # fmt: skip
        return self._all(refs)[0]

    def call(self, method: str, args: tuple[Any, ...], *, every: bool = False,
             on_part: Callable[[Any], None] | None = None) -> Any:  # fmt: skip
        shared = ray.put(args)  # one copy in the object store for all ranks (a step's groups)
        replies = self._all([a.call.remote(method, shared) for a in self.actors])
        if on_part is not None:
            for part in replies[0][0]:
                on_part(part)
        results = [r[1] for r in replies]
        return results if every else results[0]

    def save_shards(self, path: str) -> list[tuple[int, int, str] | None]:
        out = []
        for failed, files in self.call("save_files", (), every=True):
            for name, data in files.items():
                (Path(path) / name).write_bytes(data)
            out.append(failed)
        return out

    def load_shards(self, path: str) -> None:
        self.call("load_files", ({p.name: ray.put(p.read_bytes()) for p in Path(path).iterdir() if p.is_file()},))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not ray.is_initialized():  # Ray already stopped (and any call would start a new one)
            return
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=10)
        except Exception:  # noqa: BLE001 - a dead rank: nothing to close
            pass
        for a in self.actors:
            ray.kill(a, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)

    def _all(self, refs: list[Any], ranks: list[int] | None = None) -> list[Any]:
        """The ranks' results (``refs``: one per rank in ``ranks``, default all), in order; a rank that died or
        raised: RankLost naming it (a dead rank before a peer whose collective saw it go)."""
        rank_of = dict(zip(refs, ranks if ranks is not None else range(self.world), strict=True))
        pending, done = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                done[rank_of[ready[0]]] = ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as first:
                failures = {rank_of[ready[0]]: first}
                time.sleep(0.5)
                more, _ = ray.wait(pending, num_returns=len(pending), timeout=2.0) if pending else ([], [])
                for ref in more:
                    try:
                        ray.get(ref)
                    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                        failures[rank_of[ref]] = e
                died = sorted(r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError))
                rank = died[0] if died else min(failures)
                e = failures[rank]
                if isinstance(e, ray.exceptions.RayActorError):
                    raise RankLost(rank, f"died: {_cause(e)}") from None
                raise RankLost(rank, f"failed: {first_line(e.cause if isinstance(e.cause, BaseException) else e)}") from None
        return [done[k] for k in sorted(done)]


def ray_backend(cfg: Any, gpus: float) -> str:
    """``trainer.backend`` for rank actors: auto = nccl when each rank has a GPU (cluster.trainer_gpus = 1), else gloo."""
    if cfg.backend == "nccl" and not gpus:
        raise AgentrlError("trainer.backend = \"nccl\" needs a GPU per rank: set cluster.trainer_gpus = 1, or "
                           "trainer.backend = \"gloo\"")  # fmt: skip
    if cfg.backend == "auto":
        return "nccl" if gpus and cfg.device != "cpu" else "gloo"
    return cfg.backend


class RemoteShardedTrainer(ShardedTrainer):
    """The driver's handle on N rank actors: the sharded trainer's calls, plus the one-rank trainer actor's
    ``push_weights``, ``node_id`` (rank 0's node: engines there get shared memory) and ``last_push``."""

    def __init__(self, ranks: RayRanks, model_dir: str | Path, cfg: Any, run_dir: Path, started_ray: bool) -> None:
        self.started_ray = started_ray
        self.last_push: dict[str, float] = {}
        super().__init__(model_dir, cfg, run_dir=run_dir, ranks=ranks)
        self.node_id = ranks.node_id

    async def push_weights(self, version: int, urls: list[str], local_urls: list[str], sync_args: dict[str, Any],
                           adapters: bool) -> float:  # fmt: skip
        """Rank 0 pushes to ``urls`` (``local_urls``: those on its node, over shared memory); may raise WeightSyncError."""
        answer = await asyncio.to_thread(self._call, "push", version, urls, local_urls, sync_args, adapters)
        if isinstance(answer, Exception):
            raise answer
        seconds, self.last_push = answer
        return seconds

    def close(self) -> None:
        super().close()
        if self.started_ray:
            from agentrl.distributed.ray_backend import shutdown_ray

            shutdown_ray()


def start_trainer_ranks(cfg: Any, model_dir: Path, run_dir: Path, threads: int) -> RemoteShardedTrainer:
    """Place ``trainer.world_size`` rank actors (``cluster.trainer_cpus`` / ``trainer_gpus`` each) and build them."""
    from agentrl.distributed.ray_backend import ensure_ray, shutdown_ray

    cc = cfg.cluster
    started = ensure_ray(cc.ray_address)
    ranks = None
    try:
        ranks = RayRanks(model_dir, cfg.trainer, cfg.rollout.sampling(), cfg.run.seed, cpus=cc.trainer_cpus,
                         gpus=cc.trainer_gpus, threads=threads)  # fmt: skip
        return RemoteShardedTrainer(ranks, model_dir, cfg.trainer, run_dir, started)
    except BaseException:
        if ranks is not None:
            ranks.close()
        if started:
            shutdown_ray()
        raise


__all__ = ["RankActorImpl", "RayRanks", "RemoteShardedTrainer", "start_trainer_ranks"]
