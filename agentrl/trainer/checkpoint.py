"""Atomic checkpoints: a step counts only once its marker file exists.

``RUN_DIR/checkpoints/step_00000020/`` holds ``trainer.pt`` (model, optimizer, LR
schedule, RNG) and ``state.json`` (buffer + ledger, task-sampler cursor, version, and
whatever the loop adds).  Both are written to temporary names, fsynced and renamed;
only then is ``COMPLETE`` written and fsynced, together with the directory.  A process
killed at any point leaves either a complete checkpoint or one without a marker, which
:func:`latest_checkpoint` ignores.  Older complete checkpoints beyond ``keep`` are removed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from agentrl.types import json_default

MARKER = "COMPLETE"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, trainer_state: dict[str, Any], state: dict[str, Any], keep: int = 2) -> Path:
    root = Path(run_dir) / "checkpoints"
    ckpt = root / f"step_{step:08d}"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)
    _write_durable(ckpt / "trainer.pt", lambda f: torch.save(trainer_state, f))
    _write_durable(ckpt / "state.json", lambda f: f.write(json.dumps(state, default=json_default).encode()))
    _fsync_dir(ckpt)
    _write_durable(ckpt / MARKER, lambda f: f.write(str(step).encode()))
    _fsync_dir(ckpt)
    _fsync_dir(root)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return ckpt


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / MARKER).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_checkpoint(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer state for ``Trainer.load_state_dict``, loop state)."""
    trainer_state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False)
    state = json.loads((ckpt / "state.json").read_text())
    return trainer_state, state
