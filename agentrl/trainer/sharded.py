"""The sharded trainer: ``trainer.world_size = N`` ranks on torch.distributed, each decoder layer under FSDP2.

:class:`ShardedTrainer` is a handle in the driver with the one-process
:class:`~agentrl.trainer.trainer.Trainer`'s calls (``step``, ``named_tensors``,
``adapter_tensors``, ``load_state_dict``, ``merged_model``, ``close``; ``write_state`` in place of
``state_dict``).  Every call goes to every rank and rank 0 answers.  How the ranks are started and
talked to is one seam, :class:`~agentrl.trainer.ranks.Ranks` (:mod:`agentrl.trainer.ranks`):
:class:`~agentrl.trainer.ranks.ProcessRanks` spawns N rank processes on this host (one pipe each,
gloo on CPU, nccl with one GPU per rank); under ``cluster.trainer_actor`` they are Ray actors in a
placement group (:mod:`agentrl.distributed.trainer_ranks`).  Both run the same :class:`_RankTrainer`
(:func:`~agentrl.trainer.ranks.start_rank`).

No rank holds the whole model at start: it is built on the meta device, sharded, and each rank reads only its own
shards from the safetensors files (:mod:`agentrl.trainer.shard_load`).

How a sharded step stays the one-process step (:class:`_RankTrainer`):

- every rank gets the whole batch and derives the same rows, the same aggregation weights (over
  all trajectories of the update, ``losses.token_weights``) and the same skip decisions;
- each rank runs forward/backward only on its own trajectories (trajectory k on rank k mod N), so
  the sum over ranks of the local losses is the one-process loss, and FSDP2 *sums* the gradients
  (gradient divide factor 1), never averaging per rank;
- every rank runs the same number of forwards (FSDP2 all-gathers each layer per forward): a rank
  with fewer micro-batches pads with a zero-weight copy of a real row whose statistics are dropped;
- the grad norm is the global one (over the DTensor shards), and the loss, entropy and every summed
  statistic are added over ranks before :func:`~agentrl.trainer.losses.summarize` divides, so a
  logged mean is a global token mean, not a mean of per-rank means.

Failures: a rank that dies (or reports an error, e.g. a collective that waited longer than
``trainer.collective_timeout_s`` for a stuck peer) ends the call with :class:`TrainerDied`, one line
naming the rank and the newest checkpoint; the other ranks are terminated, nothing waits forever.

State: a checkpoint (:meth:`ShardedTrainer.write_state`) is written by every rank at once with
``torch.distributed.checkpoint``, each rank its own shards of the weights and AdamW state plus its
RNG states (nothing is gathered; :mod:`agentrl.trainer.checkpoint` renames the directory into place
when all are written); a resume needs the same world size and reads each rank's shards back
(``agentrl export`` puts the shards together into one HF dir).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from agentrl.errors import AgentrlError, CheckpointError, TrainerDied
from agentrl.trainer.checkpoint import (
    SHARDED,
    load_dcp,
    load_tensors,
    rng_state,
    set_rng_state,
)
from agentrl.trainer.logprobs import head_of
from agentrl.trainer.losses import add_stats
from agentrl.trainer.ranks import ProcessRanks, RankLost
from agentrl.trainer.shard_load import Stored, materialise, skeleton
from agentrl.trainer.trainer import Trainer, _Row, adapter_start

if TYPE_CHECKING:
    from agentrl.config import TrainerConfig
    from agentrl.trainer.ranks import Ranks
    from agentrl.types import Group, SamplingParams


# ----------------------------------------------------------------------------- one rank


class _Root(torch.nn.Module):
    """The FSDP2 unit of the weights outside the decoder layers (embeddings, final norm, LM head).

    The trainer calls the decoder and the LM head separately (no [B, T, V] logits), never the
    model's own forward; running the decoder through this module's forward lets FSDP2 gather
    those weights (kept gathered until backward: the LM head, maybe tied to the embeddings,
    runs after it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return fn(**inputs)


def tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this process holds of weights, gradients and optimizer state (a DTensor: its local shard)."""

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"param_bytes": sum(nbytes(p) for p in params),
            "grad_bytes": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer_bytes": sum(nbytes(v) for v in state)}  # fmt: skip


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss() -> int:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    return _status_kib("VmRSS")


def peak_rss() -> int:
    """Peak resident memory since the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM")


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class _RankTrainer(Trainer):
    """One rank: the one-process trainer on its share of each micro-batch schedule (module docstring)."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, sampling: SamplingParams | None, *, seed: int,
                 rank: int, world: int, conn: Any) -> None:  # fmt: skip
        self.rank, self.world, self.conn = rank, world, conn  # conn: rank 0 sends weights out through it
        self._files: dict[str, Stored] | None = None  # where the meta model's shards are read from
        reset_peak_rss()
        self.start_rss = rss()  # torch and the process group, before any of the model
        super().__init__(model_dir, cfg, sampling, seed=seed)
        self.setup_rss, self.setup_peak_rss = rss(), peak_rss()

    def _load(self, model_dir: str | Path) -> torch.nn.Module:
        """The model on the meta device, no weights (:mod:`agentrl.trainer.shard_load`); the whole model only
        where the checkpoint is not safetensors naming every tensor."""
        built = skeleton(model_dir)
        if built is None:
            return super()._load(model_dir)
        model, self._files = built
        return model

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self._files is None:
            model = model.to(self.device)
        decoder = head_of(model)[0]
        layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
        if layers is None:
            raise AgentrlError(f"trainer.world_size > 1: cannot find the decoder layers of {type(decoder).__name__}")
        # bf16 weights in the layers' compute on a GPU; reduced in float32, outputs back to float32
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
              if self.bf16 and self.device.type == "cuda" else MixedPrecisionPolicy())  # fmt: skip
        units = []
        for layer in layers:
            fully_shard(layer, mp_policy=mp)
            units.append(layer)
        self._root = _Root(model)
        fully_shard(self._root, reshard_after_forward=False)
        for unit in [*units, self._root]:
            unit.set_gradient_divide_factor(1.0)  # sum over ranks: each rank's loss holds global weights
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
        if self._files is not None:  # only now does this rank allocate, and only its shards
            materialise(model, self._files, self.device, lambda name, shape: adapter_start(name, shape, self.seed))
        return model

    def _decode(self, decoder: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        return self._root(lambda **kw: decoder(**kw).last_hidden_state, inputs)

    def _micro_batches(self, rows: list[_Row]) -> list[list[_Row]]:
        mine = [r for r in rows if r.traj % self.world == self.rank]
        mbs = super()._micro_batches(mine) if mine else []
        n = self._all_max(len(mbs))
        pad = dataclasses.replace(rows[0], weight=0.0, traj=-1)  # same forwards on every rank; no statistics
        return mbs + [[pad] for _ in range(n - len(mbs))]

    def _micro_step(self, mb: list[_Row]) -> tuple[torch.Tensor, dict[str, float], float]:
        loss, stats, ent = super()._micro_step(mb)
        if mb[0].traj < 0:
            return loss * 0.0, {}, 0.0
        return loss, stats, ent

    def _update(self, part: list[list[_Row]], totals: dict[str, float]) -> tuple[float, float, float]:
        import torch.distributed as dist

        mine: dict[str, float] = {}
        loss, ent, norm = super()._update(part, mine)
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, (loss, ent, mine))
        loss = sum(x[0] for x in every)
        ent = sum(x[1] for x in every)
        for _, _, stats in every:  # rank order: every rank adds the same numbers in the same order
            add_stats(totals, stats)
        return loss, ent, norm

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad for p in params if p.grad is not None]
        norm = _full(torch.nn.utils.get_total_norm(grads))
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, norm)
        return float(norm)

    def _all_max(self, n: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def memory(self) -> dict[str, float]:
        """This rank's bytes of weights, gradients and optimizer state (its shards), its peak RSS, its RSS before and
        after setup and the peak in between (the model built, sharded and filled), whether it had to load the whole
        model, and its RSS before and at the peak of the last weights out (``named_tensors``)."""
        push = getattr(self, "last_push_rss", {})
        return {"rank": self.rank, **tensor_bytes(self.model, self.optimizer), "max_rss_bytes": _max_rss(),
                "start_rss_bytes": self.start_rss, "setup_rss_bytes": self.setup_rss,
                "setup_peak_rss_bytes": self.setup_peak_rss,
                "whole_model_loaded": self._files is None, "push_rss_before_bytes": push.get("before", 0),
                "push_rss_peak_bytes": push.get("peak", 0)}  # fmt: skip

    # weights out: one tensor gathered at a time; rank 0 sends them to the driver a bucket at a time

    def _full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return _full(t)  # a collective: every rank gathers the same tensors in the same order

    def _collect(self, items: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Rank 0 sends each ``trainer.push_bucket_mb`` of gathered tensors to the driver and drops them, so no
        rank holds a full copy of the model (the others drop each tensor at once); returns nothing itself."""
        reset_peak_rss()
        before = rss()
        bucket: dict[str, torch.Tensor] = {}
        size, t = 0, None
        for name, t in items:
            if self.rank != 0:
                continue
            bucket[name] = t = t.detach().to("cpu").contiguous()
            size += t.numel() * t.element_size()
            if size >= self.cfg.push_bucket_mb * 2**20:
                self.conn.send(("part", bucket))
                bucket, size = {}, 0
        if bucket:
            self.conn.send(("part", bucket))
        del bucket, t  # nothing of the weights stays here
        self.last_push_rss = {"before": before, "peak": peak_rss()}
        return {}

    def save_shards(self, path: str) -> tuple[int, int, str] | None:
        """Write this rank's shards of the weights and AdamW state (torch.distributed.checkpoint, a collective),
        then its RNG states and LR schedule; returns None, or the failure: (the rank that failed, errno, what)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        try:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # DTensor shards: nothing gathered
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)  # every rank learns any failure
            torch.save({"rng": rng_state(), "scheduler": self.scheduler.state_dict()},
                       Path(path) / f"rank_{self.rank}.pt")  # fmt: skip
        except (OSError, RuntimeError, CheckpointException) as e:  # a full disk: the run goes on, the save fails
            return _write_error(e, self.rank)
        return None

    def load_shards(self, path: str) -> None:
        """Read this rank's shards (written by the same world size) into its weights and AdamW state."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # the layout to read into (AdamW's made)
        state = {"model": model_sd, "optimizer": optim_sd}
        load_dcp(state, path)  # DCP's metadata and non-tensor items: nothing but its records and plain values load
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        own = load_tensors(Path(path) / f"rank_{self.rank}.pt")
        self.scheduler.load_state_dict(own["scheduler"])
        set_rng_state(own["rng"])


def _write_error(e: BaseException, rank: int) -> tuple[int, int, str]:
    """(the rank that failed, errno, what) for the first OSError behind ``e``: DCP hands every rank the failures
    of all (by rank), so each reports the same one."""
    seen: list[tuple[int, BaseException]] = [(rank, e)]
    while seen:
        at, cur = seen.pop(0)
        if isinstance(cur, OSError):
            return at, cur.errno or 0, str(cur.strerror or cur)
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            seen += [(r, f[0]) for r, f in sorted(failures.items()) if isinstance(f, tuple) and isinstance(f[0], BaseException)]
        seen += [(at, c) for c in (cur.__cause__, cur.__context__) if c is not None]
    return rank, 0, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


# ----------------------------------------------------------------------------- the driver's handle


class ShardedTrainer:
    """The driver's handle on ``trainer.world_size`` ranks (module docstring), started and talked to by a
    :class:`~agentrl.trainer.ranks.Ranks` (default: :class:`~agentrl.trainer.ranks.ProcessRanks`, rank processes on
    this host)."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, sampling: SamplingParams | None = None, *,
                 seed: int = 0, run_dir: str | Path | None = None, ranks: Ranks | None = None) -> None:  # fmt: skip
        """``run_dir``: where checkpoints are, named by :class:`TrainerDied`."""
        self.cfg = cfg
        self.world = cfg.world_size
        self.model_dir = Path(model_dir)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._closed = False
        # one call on the ranks at a time: the recipe's threads (a step; a push after an engine restart) would
        # otherwise interleave collectives and read each other's replies
        self._one_call = threading.RLock()
        self.ranks = ranks if ranks is not None else ProcessRanks(model_dir, cfg, sampling, seed)
        self.backend = self.ranks.backend
        self.lora = bool(self._guard(self.ranks.start)["lora"])

    @property
    def pids(self) -> list[int]:
        return list(getattr(self.ranks, "pids", []))

    # the Trainer's calls

    def step(self, groups: list[Group]) -> dict[str, Any]:
        return self._call("step", groups)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The weights to push, received from rank 0 a bucket at a time (``trainer.push_bucket_mb``)."""
        out: dict[str, torch.Tensor] = {}
        self._call("named_tensors", on_part=out.update)
        return out

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        self._call("adapter_tensors", on_part=out.update)
        return out

    def write_state(self, out: Path) -> None:
        """Checkpoint into ``out`` (a directory :func:`~agentrl.trainer.checkpoint.save_checkpoint` renames into
        place): every rank writes its own shards to ``out/trainer``; a failed write raises OSError."""
        path = Path(out) / SHARDED
        path.mkdir()
        failed = [e for e in self._guard(self.ranks.save_shards, str(path)) if e]
        if failed:
            rank, code, what = failed[0]
            raise OSError(code or errno.EIO, f"rank {rank}: {what}")
        (path / "meta.json").write_text(json.dumps({"world_size": self.world, "lora": self.lora}))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint this world size wrote (:func:`~agentrl.trainer.checkpoint.load_checkpoint`)."""
        if "sharded" not in state:
            raise CheckpointError(
                "this checkpoint was written by the one-process trainer (trainer.world_size = 1); resume it with "
                "world_size = 1, or export it (`agentrl export`) and start a new run from the exported model"
            )
        if state["world_size"] != self.world:
            raise CheckpointError(
                f"{state['sharded']} was written by {state['world_size']} trainer ranks, this run has "
                f"trainer.world_size = {self.world}; resume with --trainer.world_size={state['world_size']}, or "
                "export it (`agentrl export`) and start a new run from the exported model"
            )
        self._guard(self.ranks.load_shards, state["sharded"])

    def memory_by_rank(self) -> list[dict[str, float]]:
        """Per rank: bytes of its weight, gradient and optimizer-state shards, and its peak RSS."""
        return self._call("memory", every=True)

    def merged_model(self):
        """A plain HF model (CPU, float32) with the current weights, LoRA merged."""
        return merged_from_buckets(self.model_dir, lambda load: self._call("named_tensors", on_part=load))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.ranks.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # the plumbing

    def _call(self, method: str, *args: Any, every: bool = False, on_part: Callable[[Any], None] | None = None) -> Any:
        """Run ``method`` on every rank; ``on_part`` takes what rank 0 sends before its reply (weight buckets)."""
        if self._closed:
            raise TrainerDied(f"the sharded trainer is closed; cannot run {method}")
        return self._guard(self.ranks.call, method, args, every=every, on_part=on_part)

    def _guard(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn`` on the ranks; a rank lost stops every rank and raises one line naming it and the newest checkpoint."""
        try:
            with self._one_call:
                return fn(*args, **kw)
        except RankLost as e:
            self.close()
            raise TrainerDied(
                f"trainer rank {e.rank} of {self.world} {e.how}; newest checkpoint: {self._newest_checkpoint()} "
                "(restart with --resume; trainer.collective_timeout_s bounds how long the other ranks wait)"
            ) from None

    def _newest_checkpoint(self) -> str:
        if self.run_dir is None:
            return "none (no run directory)"
        from agentrl.trainer.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(self.run_dir)
        return str(ckpt) if ckpt is not None else "none yet"


def merged_from_buckets(model_dir: str | Path, gather: Callable[[Callable[[dict[str, torch.Tensor]], None]], Any]):
    """The HF model at ``model_dir`` (CPU, float32) with the weights ``gather(load)`` hands ``load`` a bucket at a
    time (each loaded as it comes: no second copy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    unexpected: list[str] = []

    def load(bucket: dict[str, torch.Tensor]) -> None:
        unexpected.extend(model.load_state_dict(bucket, strict=False).unexpected_keys)

    gather(load)
    if unexpected:
        raise RuntimeError(f"the sharded trainer's weights do not fit the model: {unexpected[:3]}")
    return model


def make_trainer(model_dir: str | Path, cfg: TrainerConfig, sampling: SamplingParams | None = None, *, seed: int = 0,
                 run_dir: str | Path | None = None) -> Trainer | ShardedTrainer:  # fmt: skip
    """The one-process trainer, or the sharded one for ``trainer.world_size > 1``."""
    if cfg.world_size > 1:
        return ShardedTrainer(model_dir, cfg, sampling, seed=seed, run_dir=run_dir)
    return Trainer(model_dir, cfg, sampling, seed=seed)
