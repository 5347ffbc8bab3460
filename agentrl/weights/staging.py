"""Where pushed weights land, always in places the engine made: shared-memory segments in its
own 0700 directory (created at their final size, never one a live weight points into), and
safetensors read only from inside the engine's weights dir (no symlink, no path outside).
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.errors import RequestError

# ----------------------------------------------------------------------------- shared memory


def private_dir(parent: str | None, prefix: str) -> Path:
    """A new directory only this user can enter (mkdtemp: 0700, a random name, never reused)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        raise OSError(f"{path} is not a private directory")
    return path


@dataclass
class Segment:
    """One shared-memory file the engine created, mapped at its final size."""

    path: Path
    size: int
    buffer: torch.Tensor  # uint8 over the mapping (keeps it alive)

    def holds(self, t: torch.Tensor) -> bool:
        start = self.buffer.data_ptr()
        return t.device.type == "cpu" and start <= t.data_ptr() < start + self.size


class SharedSegments:
    """The engine's shared-memory files: created by the engine, in its own 0700 directory."""

    def __init__(self, parent: str | None = None) -> None:
        self.parent = parent if parent is not None else ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.dir: Path | None = None
        self.segments: list[Segment] = []

    def lease(self, size: int, live: Iterable[torch.Tensor]) -> Segment:
        """A segment of ``size`` bytes no live weight points into (the others are dropped)."""
        live = list(live)
        busy = [s for s in self.segments if any(s.holds(t) for t in live)]
        free = [s for s in self.segments if s not in busy]
        pick = next((s for s in free if s.size == size), None)
        for s in free:
            if s is not pick:
                s.path.unlink(missing_ok=True)  # the mapping goes with its last tensor
        self.segments = busy + ([pick] if pick is not None else [])
        if pick is None:
            pick = self._create(size)
            self.segments.append(pick)
        return pick

    def _create(self, size: int) -> Segment:
        if self.dir is None:
            self.dir = private_dir(self.parent, "agentrl-")
        path = self.dir / f"w-{secrets.token_hex(8)}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return Segment(path, size, torch.frombuffer(mapping, dtype=torch.uint8))

    def close(self) -> None:
        for s in self.segments:
            s.path.unlink(missing_ok=True)
        self.segments = []
        if self.dir is not None:
            for p in self.dir.iterdir():
                p.unlink(missing_ok=True)
            self.dir.rmdir()
            self.dir = None


# ----------------------------------------------------------------------------- the weights dir, read safely


def read_inside(root: Path, model_path: str, max_bytes: int) -> list[tuple[str, bytes]]:
    """The bytes of ``model_path`` (a .safetensors file, or a dir of them) inside ``root``.

    Any path that is not lexically inside ``root`` gets one refusal, decided before the file
    system is touched (so it tells nothing about what exists elsewhere); inside, no component
    may be a symlink and every file is opened with ``O_NOFOLLOW`` and must be regular.
    """
    outside = RequestError("model_path must name a safetensors file or dir inside the engine's weights dir "
                      "(start the engine with --weights-dir to choose it)", code="weights_not_found",
                      param="model_path")
    if not isinstance(model_path, str) or not model_path or "\x00" in model_path:
        raise outside
    given, root = Path(os.path.abspath(root)), Path(os.path.realpath(root))
    target = Path(os.path.normpath(os.path.join(root, model_path)))
    if os.path.isabs(model_path) and (target == given or given in target.parents):
        target = root / target.relative_to(given)  # the dir as named, not as resolved
    if target != root and root not in target.parents:
        raise outside
    if os.path.realpath(target) != str(target):  # a symlink somewhere on the way: it may point out
        raise outside
    missing = RequestError(f"no safetensors weights at {str(target.relative_to(root))!r} in the weights dir",
                      code="weights_not_found", param="model_path")
    try:
        st = os.stat(target, follow_symlinks=False)
    except OSError:
        raise missing from None
    names = sorted(p.name for p in target.iterdir() if p.name.endswith(".safetensors")) if stat.S_ISDIR(st.st_mode) \
        else [target.name]
    base = target if stat.S_ISDIR(st.st_mode) else target.parent
    if not names:
        raise missing
    out, total = [], 0
    dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                raise missing from None
            with os.fdopen(fd, "rb") as f:
                fst = os.fstat(f.fileno())
                if not stat.S_ISREG(fst.st_mode):
                    raise missing
                total += fst.st_size
                if total > max_bytes:
                    raise RequestError(f"weights at {str(target.relative_to(root))!r} are larger than the model allows "
                                  f"({total} > {max_bytes} bytes)", code="too_large", param="model_path")
                out.append((name, f.read(max_bytes + 1)))
    finally:
        os.close(dir_fd)
    return out


def tensors_of(files: list[tuple[str, bytes]]) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load as load_bytes

    out = []
    for name, data in files:
        try:
            out.extend(load_bytes(data).items())
        except Exception as e:  # a malformed file is the pusher's error, not the engine's crash
            raise RequestError(f"{name} is not a readable safetensors file ({type(e).__name__})") from None
    return out


def manifest_of(tensors: list[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """The (name, dtype, shape) of loaded tensors, in the manifest's shape (offsets unused: 0)."""
    return [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": 0}
            for n, t in tensors]
