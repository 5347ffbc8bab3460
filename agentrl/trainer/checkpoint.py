"""Checkpoints: written whole into a temporary directory, then renamed into place.

``RUN_DIR/checkpoints/step_00000020/`` holds ``trainer.pt`` (model, optimizer, LR
schedule, every RNG state), ``state.json`` (buffer + ledger, task-sampler cursor, version,
and whatever the loop adds) and ``COMPLETE`` (the step and each file's size).  A sharded
trainer (``trainer.world_size = N``) writes ``trainer/`` instead of ``trainer.pt``: its
weights and AdamW state with ``torch.distributed.checkpoint``, each rank its own shards
(nothing is gathered), plus ``rank_K.pt`` (rank K's RNG states and LR schedule) and
``meta.json`` (the world size).  :func:`save_checkpoint`:

1. writes everything into ``checkpoints/.tmp-step_00000020/``, fsyncing each file and the
   directory (leftovers of a save that was killed are removed first);
2. renames that directory to ``step_00000020`` and fsyncs ``checkpoints/``.  Should that
   name already be taken (a resumed run saving the same step again) the old directory is
   first moved aside to ``.old-step_…``; a process killed between the two renames leaves
   it there, and the next listing moves it back;
3. only then removes the oldest complete checkpoints beyond ``keep`` (0 = keep all).

So at every instant the newest complete checkpoint on disk is intact: nothing is deleted
before its replacement is complete.  A write that fails (disk full, quota, file too large,
read-only) removes the partial directory and raises :class:`~agentrl.errors.CheckpointError`
naming the path and the free space; the earlier checkpoints are untouched.

``trainer.pt`` and ``rank_K.pt`` hold tensors, numbers and strings only (the RNG states too)
and are read weights-only (:func:`load_tensors`): any program of the user can write into a run
dir, and unpickling any other object would run its code.  ``torch.distributed.checkpoint`` reads
its own ``.metadata`` and non-tensor items with plain pickle: :func:`dcp_reader` and
:func:`weights_only_planner` let through only its records and plain values (:func:`load_dcp`).
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from agentrl.errors import CheckpointError
from agentrl.types import json_default

# what numpy's RNG state (a uint32 array) pickles as: checkpoints written before RNG states were tensors
_LEGACY_NUMPY = [np.zeros(1, np.uint32).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]
MARKER = "COMPLETE"
SHARDED = "trainer"  # a sharded trainer's directory in a checkpoint (module docstring)
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(
    run_dir: Path, step: int, trainer_state: dict[str, Any] | Callable[[Path], Any], state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` (module docstring); returns its directory.

    ``trainer_state``: a state dict (saved as ``trainer.pt``), or a function that writes the
    trainer's own files into the directory it is given (the sharded trainer: every rank its shards).
    ``keep``: complete checkpoints to keep, this one included (0 = all).
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0 (0 = keep all), got {keep}")
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)  # weights and optimizer state: the run's alone
    _recover(root)
    for leftover in root.glob(TMP_PREFIX + "step_*"):  # one writer per run dir: a killed save's
        shutil.rmtree(leftover, ignore_errors=True)
    ckpt = root / checkpoint_name(step)
    tmp = root / (TMP_PREFIX + ckpt.name)
    # 1) everything into the temporary directory
    try:
        tmp.mkdir()
        if callable(trainer_state):
            trainer_state(tmp)
            sizes = _sync_tree(tmp)
        else:
            sizes = {"trainer.pt": _write_durable(tmp / "trainer.pt", lambda f: torch.save(trainer_state, f))}
        sizes["state.json"] = _write_durable(
            tmp / "state.json", lambda f: f.write(json.dumps(state, default=json_default).encode())
        )
        marker = json.dumps({"step": step, "files": sizes}).encode()
        _write_durable(tmp / MARKER, lambda f: f.write(marker))
        _fsync_dir(tmp)
    except (OSError, RuntimeError) as e:
        os_error = _os_error_in(e)
        if os_error is None:  # torch's own failure, not the file system's
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        raise _write_failed(ckpt, tmp, root, os_error) from e
    # 2) into place
    aside = root / (OLD_PREFIX + ckpt.name)
    if ckpt.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(ckpt, aside)
    os.rename(tmp, ckpt)
    _fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    # 3) retention, now that the new one is complete
    if keep:
        for old in complete_checkpoints(run_dir)[:-keep]:
            if old != ckpt:
                shutil.rmtree(old, ignore_errors=True)
    return ckpt


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    _recover(root)
    return sorted(p for p in root.glob("step_*") if (p / MARKER).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def checkpoint_step(ckpt: Path) -> int:
    """The step a checkpoint directory holds (from its name)."""
    return int(Path(ckpt).name.removeprefix("step_"))


def load_checkpoint(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer state for ``Trainer.load_state_dict``, loop state); a damaged one is a CheckpointError.

    A sharded checkpoint's trainer state is only where its files are, ``{"sharded": DIR,
    "world_size": N}``: each rank of the resumed trainer reads its own shards from there."""
    ckpt = Path(ckpt)
    _verify(ckpt)
    if (ckpt / SHARDED / "meta.json").is_file():
        trainer_state = {**json.loads((ckpt / SHARDED / "meta.json").read_text()), "sharded": str(ckpt / SHARDED)}
    else:
        trainer_state = load_tensors(ckpt / "trainer.pt")
    state = json.loads((ckpt / "state.json").read_text())
    return trainer_state, state


def load_tensors(path: Path | IO[bytes], name: str | None = None) -> Any:
    """A checkpoint file written with ``torch.save``, read back weights-only: tensors, numbers,
    strings and containers (and the numpy RNG arrays of checkpoints written before RNG states were
    tensors), never any other object.  A checkpoint directory is a file any program of the user can
    write (an environment's harness program, say), and unpickling anything else runs code: such a
    file is a :class:`CheckpointError`, and nothing in it runs."""
    try:
        with torch.serialization.safe_globals(_LEGACY_NUMPY):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{name or path} holds an object other than tensors and numbers{what}: not loaded, since loading it would run "
            "code; it was not written by agentrl's trainer (or was altered since): resume from another checkpoint"
        ) from None
    except (RuntimeError, EOFError) as e:  # torch's zip reader on a cut-off file; an empty one
        raise unreadable(name or path, e) from None


def unreadable(what: object, e: BaseException) -> CheckpointError:
    """The one line for a checkpoint file that cannot be read back (cut off by a full disk, say)."""
    why = str(e).split(". ")[0].splitlines()[0] if str(e) else type(e).__name__
    return CheckpointError(f"{what} is unreadable (truncated or corrupt): {why}; resume from an earlier checkpoint "
                           "(delete this one's directory) or start without --resume")  # fmt: skip


def load_sharded_weights(sharded_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full model state of a sharded checkpoint (every rank's shards put together), in this process.

    Reads only the weights, not the AdamW state; needs no process group (``agentrl export``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = dcp_reader(sharded_dir).read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load_dcp({"model": model}, sharded_dir, no_dist=True)
    return model


# what torch.distributed.checkpoint's ``.metadata`` pickle names: its own record classes, sizes, dtypes, a path
_DCP_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}  # fmt: skip


class _Forbidden(pickle.UnpicklingError):
    """A global the metadata may not name (one that is not DCP's)."""


class _DCPMetadata(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Forbidden(f"{module}.{name}")


def load_dcp(state: dict[str, Any], path: str | Path, *, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``path`` with :func:`dcp_reader` and
    :func:`weights_only_planner`: a refused ``.metadata`` is its one-line CheckpointError (DCP itself
    swallows a reader's error and tries the rank's own metadata file before failing)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = dcp_reader(path)
    try:
        dcp.load(state, storage_reader=reader, no_dist=no_dist, planner=weights_only_planner())
    except (Exception, CheckpointException):  # DCP's wrapper of every rank's failure is a BaseException
        if reader.refused is not None:
            raise reader.refused from None
        raise


def dcp_reader(path: str | Path) -> Any:
    """A ``FileSystemReader`` for ``path`` whose ``.metadata`` pickles (DCP's own reader runs plain
    ``pickle.load`` on them) are unpickled once, with only DCP's records allowed: the bytes checked are
    the bytes used, so a file swapped after any check runs nothing.  A refused file is a CheckpointError,
    kept in ``reader.refused``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        refused: CheckpointError | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            where = self._get_metadata_path(kwargs.get("rank"))
            try:
                with self.fs.create_stream(where, "rb") as f:
                    metadata = _DCPMetadata(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as e:
                if not isinstance(e, (_Forbidden, AttributeError, ImportError)):  # cut off, or not a pickle at all
                    self.refused = self.refused or unreadable(where, e)
                    raise self.refused from None
                self.refused = self.refused or CheckpointError(
                    f"{where} names an object other than torch.distributed.checkpoint's records ({e}): not loaded, "
                    "since loading it would run code; it was not written by agentrl's trainer (or was altered "
                    "since): resume from another checkpoint"
                )
                raise self.refused from None
            if getattr(metadata, "storage_meta", None) is None:  # what DCP's own read_metadata sets
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))


def weights_only_planner() -> Any:
    """A DCP load planner that reads the non-tensor items (the optimizer's hyperparameters) only when
    a weights-only load can read them (DCP's own unpickles them unrestricted)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WeightsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            # what the weights-only load returned is what is kept: DCP's own load_bytes would parse the
            # same bytes again, unrestricted (any difference between the two unpicklers would run code)
            fqn = read_item.dest_index.fqn
            obj = load_tensors(io.BytesIO(value.read()), name=f"checkpoint item {fqn}")  # raises on any object
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return WeightsOnly()


# ----------------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """Every process-wide RNG a step can draw from: python, numpy, torch CPU and each CUDA device, as
    tensors and numbers (what :func:`load_tensors` reads back; no pickled numpy or python objects)."""
    version, internal, gauss_next = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }  # fmt: skip
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(rng: dict[str, Any]) -> None:
    """Restore :func:`rng_state` (states a checkpoint lacks, e.g. CUDA saved on a CPU host, stay as they are;
    the tuples of checkpoints written before RNG states were tensors are read too)."""
    torch.set_rng_state(rng["torch"])
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]) if isinstance(py, dict) else py)
    npy = rng.get("numpy")
    if isinstance(npy, dict):
        np.random.set_state((npy["name"], npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                             npy["cached_gaussian"]))  # fmt: skip
    elif npy is not None:
        np.random.set_state(npy)
    if rng.get("cuda") and torch.cuda.is_available():
        for device, state in enumerate(rng["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


# ----------------------------------------------------------------------------- internals


def _write_durable(path: Path, write: Callable[[IO[bytes]], Any]) -> int:
    """Write, flush and fsync ``path``; returns its size."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def _sync_tree(root: Path) -> dict[str, int]:
    """fsync every file and directory under ``root``; each file's size by its path relative to it."""
    sizes = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            sizes[str(path.relative_to(root))] = path.stat().st_size
        elif path.is_dir():
            _fsync_dir(path)
    return sizes


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _recover(root: Path) -> None:
    """Finish a swap that a killed save left half done (step 2 of the module docstring)."""
    for aside in root.glob(OLD_PREFIX + "step_*"):
        target = root / aside.name.removeprefix(OLD_PREFIX)
        if (target / MARKER).is_file():
            shutil.rmtree(aside, ignore_errors=True)
        elif (aside / MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)
            os.rename(aside, target)


def _os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (torch.save reports a failed write as a RuntimeError)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _write_failed(ckpt: Path, tmp: Path, root: Path, e: OSError) -> CheckpointError:
    """Remove the partial checkpoint; the one-line error names the path, the cause and the free space."""
    written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if tmp.is_dir() else 0
    shutil.rmtree(tmp, ignore_errors=True)
    free = shutil.disk_usage(root).free
    kept = max((p for p in root.glob("step_*") if (p / MARKER).is_file()), default=None)
    last = f"the last complete checkpoint {kept.name} is intact" if kept else "no earlier checkpoint exists"
    if e.errno == errno.EFBIG:
        fix = "raise the file-size limit (ulimit -f) or set run.dir on a file system that takes larger files"
    elif e.errno in _DISK_FULL:
        fix = "free disk space (or lower trainer.keep_checkpoints, or set run.dir on a larger disk)"
    else:
        fix = "make the run directory writable"
    return CheckpointError(
        f"checkpoint {ckpt} not written: {e.strerror or e} after {_size(written)} "
        f"({_size(free)} free there now); {last}; {fix}, then continue with --resume"
    )


def _verify(ckpt: Path) -> None:
    if not (ckpt / MARKER).is_file():
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no {MARKER} file); pick another step")
    try:
        sizes = json.loads((ckpt / MARKER).read_text()).get("files", {})
    except (ValueError, AttributeError):
        sizes = {}  # a marker from before sizes were recorded
    for name, size in sizes.items():
        actual = (ckpt / name).stat().st_size if (ckpt / name).is_file() else None
        if actual != size:
            raise CheckpointError(
                f"checkpoint {ckpt} is damaged: {name} has {actual} bytes, {size} were written; "
                "resume from an earlier checkpoint (delete this directory)"
            )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
