"""How the sharded trainer's ranks are started and talked to: the :class:`Ranks` seam of
:class:`~agentrl.trainer.sharded.ShardedTrainer`.

:class:`ProcessRanks` spawns ``trainer.world_size`` rank processes on this host (one pipe each, gloo on
CPU, nccl with one GPU per rank); under ``cluster.trainer_actor`` they are Ray actors in a placement
group (:class:`agentrl.distributed.trainer_ranks.RayRanks`).  Either way a rank joins the process group
and builds its :class:`~agentrl.trainer.sharded._RankTrainer` with :func:`start_rank`.  A rank that dies
or reports an error raises :class:`RankLost`, which the driver's handle turns into
:class:`~agentrl.errors.TrainerDied`.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from agentrl.errors import AgentrlError, TrainerDied

if TYPE_CHECKING:
    from agentrl.config import TrainerConfig
    from agentrl.trainer.sharded import _RankTrainer
    from agentrl.types import SamplingParams


def resolve_backend(cfg: TrainerConfig) -> str:
    """``trainer.backend`` in force: auto = nccl when each rank can have its own GPU, else gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.backend == "nccl" and gpus < cfg.world_size:
        raise AgentrlError(
            f"trainer.backend = \"nccl\" with trainer.world_size = {cfg.world_size} needs {cfg.world_size} GPUs, "
            f"this host has {gpus}; set trainer.backend = \"gloo\" (CPU) or lower world_size"
        )
    if cfg.backend == "auto":
        return "nccl" if gpus >= cfg.world_size and cfg.device != "cpu" else "gloo"
    return cfg.backend


# ----------------------------------------------------------------------------- the seam


class RankLost(Exception):
    """A rank died or failed (raised by a :class:`Ranks`; :class:`~agentrl.trainer.sharded.ShardedTrainer` makes it
    :class:`~agentrl.errors.TrainerDied`)."""

    def __init__(self, rank: int, how: str) -> None:
        super().__init__(f"rank {rank} {how}")
        self.rank, self.how = rank, how


class Ranks(Protocol):
    """The seam of :class:`~agentrl.trainer.sharded.ShardedTrainer`: how its ranks are started and talked to.
    :class:`ProcessRanks`: rank processes on this host, one pipe each;
    :class:`agentrl.distributed.trainer_ranks.RayRanks`: Ray actors in a placement group.  Every call goes to
    every rank; a rank that dies or fails raises :class:`RankLost`."""

    world: int
    backend: str

    def start(self) -> dict[str, Any]:
        """Wait for every rank to build its trainer; rank 0's ``{"lora": ...}``."""
        ...

    def call(self, method: str, args: tuple[Any, ...], *, every: bool = False,
             on_part: Callable[[Any], None] | None = None) -> Any:  # fmt: skip
        """``_RankTrainer.method(*args)`` on every rank: rank 0's result (``every``: all, in rank order);
        ``on_part`` gets the weight buckets rank 0 sends before its reply."""
        ...

    def save_shards(self, path: str) -> list[tuple[int, int, str] | None]:
        """Every rank's shards into the driver's directory ``path``; per rank None or its failure."""
        ...

    def load_shards(self, path: str) -> None:
        """Every rank reads its shards from the driver's directory ``path``."""
        ...

    def close(self) -> None: ...


class ProcessRanks:
    """``trainer.world_size`` rank processes on this host (spawned), one pipe each; they share the driver's files."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, sampling: SamplingParams | None, seed: int) -> None:
        import torch.multiprocessing as mp

        self.world = cfg.world_size
        self.backend = resolve_backend(cfg)
        ctx = mp.get_context("spawn")
        self._store = rendezvous_dir()
        self._procs, self._conns = [], []
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, name=f"agentrl-trainer-rank{rank}", daemon=True,
                            args=(rank, self.world, self.backend, self._store, str(model_dir), cfg, sampling, seed,
                                  child))  # fmt: skip
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._closed = self._out_of_step = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> dict[str, Any]:
        return self._wait()

    def call(self, method: str, args: tuple[Any, ...], *, every: bool = False,
             on_part: Callable[[Any], None] | None = None) -> Any:  # fmt: skip
        if self._out_of_step:
            raise TrainerDied(f"the sharded trainer's last call was interrupted before every rank replied; cannot run "
                              f"{method} (its replies would be the last call's): start a new trainer (--resume)")  # fmt: skip
        for rank, c in enumerate(self._conns):
            try:
                c.send((method, args))
            except OSError:
                self._lost(rank, None)
        return self._wait(every, on_part)

    def save_shards(self, path: str) -> list[tuple[int, int, str] | None]:
        return self.call("save_shards", (path,), every=True)

    def load_shards(self, path: str) -> None:
        self.call("load_shards", (path,))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self._conns:
            try:
                c.send(("close", ()))
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self._conns:
            c.close()
        shutil.rmtree(self._store, ignore_errors=True)

    def _wait(self, every: bool = False, on_part: Callable[[Any], None] | None = None) -> Any:
        """Every rank's reply (rank 0's returned, or all in rank order); a rank that dies or fails raises RankLost.

        Every rank's reply to this call is read even when ``on_part`` raises (its error is raised after), so the next
        call never reads this one's leftovers; a wait cut short otherwise (Ctrl-C) leaves the ranks out of step."""
        replies: dict[int, Any] = {}
        failed: Exception | None = None
        try:
            while len(replies) < self.world:
                waiting = {c: r for r, c in enumerate(self._conns) if r not in replies}
                sentinels = {self._procs[r].sentinel: r for r in waiting.values()}
                for ready in multiprocessing.connection.wait([*waiting, *sentinels], timeout=5.0):
                    if ready in waiting:
                        rank = waiting[ready]
                        try:
                            kind, value = ready.recv()
                        except (EOFError, OSError):
                            self._lost(rank, None)
                        if kind == "error":
                            self._lost(rank, value)
                        if kind == "part":
                            if on_part is not None and failed is None:
                                try:
                                    on_part(value)
                                except Exception as e:  # noqa: BLE001 - raised once every reply is in
                                    failed = e
                            continue
                        replies[rank] = value
                    else:
                        rank = sentinels[ready]
                        if not self._conns[rank].poll():  # exited without a last word
                            self._lost(rank, None)
        except BaseException:
            if len(replies) < self.world:
                self._out_of_step = True
            raise
        if failed is not None:
            raise failed
        return [replies[r] for r in range(self.world)] if every else replies[0]

    def _lost(self, rank: int, error: str | None) -> None:
        """Raise RankLost for the rank to blame: a killed one before a peer that saw it fail."""
        time.sleep(0.5)  # a peer's collective may fail before the killed rank's exit is visible
        dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None and p.exitcode < 0]
        if error is None or (dead and dead[0] != rank):
            rank, error = (dead[0], None) if dead else (rank, error)
        code = self._procs[rank].exitcode
        if error is not None:
            how = f"failed: {error}"
        elif code is not None and code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        raise RankLost(rank, how)


# ----------------------------------------------------------------------------- one rank process


def rendezvous_dir() -> str:
    """A new private (0700) directory for a process group's rendezvous file (:func:`start_rank`); its maker
    removes it when the ranks are closed."""
    return tempfile.mkdtemp(prefix="agentrl-ranks-")


def start_rank(rank: int, world: int, backend: str, store: str, device: torch.device, model_dir: str,
               cfg: TrainerConfig, sampling: SamplingParams | None, seed: int, conn: Any) -> _RankTrainer:  # fmt: skip
    """Join the process group through the rendezvous file in ``store`` (:func:`rendezvous_dir`) and build this
    rank's trainer on ``device`` (a rank process here, or a Ray rank actor: :mod:`agentrl.distributed.trainer_ranks`);
    ``conn.send`` takes rank 0's weight buckets.

    torch.distributed's store and collectives carry no key: the ranks (always on one host) meet through a file
    in a private directory, not a TCP store (which listens on every interface), and gloo's own connections are
    on loopback; processes of the same user on the host are trusted."""
    import torch.distributed as dist

    # imported here, not on top: agentrl.trainer.sharded imports this module (the driver's Ranks)
    from agentrl.trainer.sharded import _RankTrainer

    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would bind the host's cluster address
    dist.init_process_group(backend, init_method=f"file://{Path(store) / 'store'}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.collective_timeout_s))  # fmt: skip
    return _RankTrainer(model_dir, cfg.model_copy(update={"device": str(device)}), sampling, seed=seed,
                        rank=rank, world=world, conn=conn)  # fmt: skip


def _rank_main(rank: int, world: int, backend: str, store: str, model_dir: str, cfg: TrainerConfig,
               sampling: SamplingParams | None, seed: int, conn) -> None:  # fmt: skip
    """A rank process: build its trainer, then run the driver's calls until ``close`` or the pipe ends."""
    import torch.distributed as dist

    torch.set_num_threads(cfg.num_threads or 1)
    try:
        device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        trainer = start_rank(rank, world, backend, store, device, model_dir, cfg, sampling, seed, conn)
        conn.send(("ok", {"lora": trainer.lora}))
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # the driver is gone
                break
            if method == "close":
                break
            result = getattr(trainer, method)(*args)
            conn.send(("ok", result))  # the driver keeps rank 0's, or every rank's (memory, save_shards)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which names the rank
        try:
            conn.send(("error", first_line(e)))
        except OSError:
            pass
        traceback.print_exc()
        os._exit(1)  # no teardown: a collective with a dead peer could wait again


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 500 characters): how a failed rank is named."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
