"""Engine side of a weight push: load named tensors into a live model.

``copy_named_tensors`` (any transport), ``load_safetensors_path`` / ``read_safetensors``
(the disk transport), :class:`SharedWeights` (the shared-memory transport, read through
the manifest format of :mod:`agentrl.weights.manifest`).  LoRA factors are merged by
:class:`agentrl.weights.lora.AdapterMerger`.  Everything raises
:class:`~agentrl.errors.RequestError` for a push that does not fit the model, before any
weight is changed where the transport allows it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from agentrl.errors import RequestError
from agentrl.weights.manifest import manifest_views


def _named_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict(keep_vars=True))


def check_named_tensors(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs, every name and shape checked before anything is copied."""
    targets = _named_targets(model)
    pairs = []
    for name, t in tensors:
        dst = targets.get(name)
        if dst is None:
            raise RequestError(f"unknown weight name {name!r} (model has e.g. {next(iter(targets))!r})")
        if tuple(dst.shape) != tuple(t.shape):
            raise RequestError(f"shape mismatch for {name!r}: model {tuple(dst.shape)}, got {tuple(t.shape)}")
        if not torch.is_floating_point(t) and torch.is_floating_point(dst):
            raise RequestError(f"dtype mismatch for {name!r}: model {dst.dtype}, got {t.dtype}")
        pairs.append((dst, t))
    return pairs


def copy_named_tensors(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy tensors into the model's parameters/buffers by name, all checked first."""
    pairs = check_named_tensors(model, tensors)
    for dst, t in pairs:
        dst.data.copy_(t)
    return len(pairs)


def _safetensors_files(path: str | Path) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise RequestError(f"no safetensors weights at {str(p)!r}", code="weights_not_found", param="model_path")
    return files


def read_safetensors(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a .safetensors file (or of all such files in a directory), on the CPU."""
    from safetensors.torch import load_file

    return [item for f in _safetensors_files(path) for item in load_file(str(f)).items()]


def load_safetensors_path(model: torch.nn.Module, path: str | Path) -> int:
    """Load every tensor from a .safetensors file, or all such files in a directory."""
    return copy_named_tensors(model, read_safetensors(path))


class SharedWeights:
    """Weights in one flat shared-memory file (``/dev/shm``) described by a manifest.

    Manifest entries: ``{"name", "dtype", "shape", "offset"}`` (offset in bytes).  On a CPU
    engine whose parameter dtypes match, the parameters are re-pointed at views of the
    mapped file (no copy): a later push is the writer filling the file while generation is
    paused.  Otherwise (CUDA engine, dtype change) each tensor is copied into the model.
    """

    def __init__(self) -> None:
        self.path: str | None = None
        self.size = 0
        self.buffer: torch.Tensor | None = None
        self.aliased: set[str] = set()

    def apply(self, model: torch.nn.Module, path: str, manifest: list[dict[str, Any]], size: int) -> int:
        views = self.views(path, manifest, size)
        pairs = check_named_tensors(model, views)  # every entry checked before any weight changes
        for (name, view), (dst, _) in zip(views, pairs, strict=True):
            if name not in self.aliased:
                if dst.device.type == "cpu" and dst.dtype == view.dtype:
                    dst.data = view
                    self.aliased.add(name)
                else:
                    dst.data.copy_(view)
        return len(pairs)

    def views(self, path: str, manifest: list[dict[str, Any]], size: int) -> list[tuple[str, torch.Tensor]]:
        """Map the file (once per path/size) and return a checked view per manifest entry."""
        if self.path != path or self.size != size:
            if not Path(path).is_file():
                raise RequestError(f"no shared-memory weights file {path!r}", code="weights_not_found")
            self.buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self.path, self.size, self.aliased = path, size, set()
        assert self.buffer is not None
        return manifest_views(self.buffer, manifest)
