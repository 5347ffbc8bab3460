"""The WeightSync protocol every transport implements, and helpers they share."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@runtime_checkable
class WeightSync(Protocol):
    """Trainer → engines: ``push`` loads tensors into every engine as one weight version."""

    async def push(self, named_tensors: NamedTensors, version: int) -> float:
        """Load these tensors into every engine as weight ``version``; return seconds taken."""
        ...

    async def close(self) -> None: ...


def items_of(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return [(name, t.detach()) for name, t in items]


def url_root(url: str) -> str:
    """``http://host:port/v1`` → ``http://host:port`` (weight routes live at the root)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url
