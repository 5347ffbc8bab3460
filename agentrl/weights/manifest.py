"""The weight manifest both sides of a shared-memory push agree on.

A push writes every tensor into one flat byte buffer; the manifest says where each one is:
``[{"name", "dtype", "shape", "offset"}]`` (offset in bytes, aligned to :data:`ALIGN`).
:func:`layout` is the trainer's side (where to write), :func:`manifest_views` the engine's
(a checked view per entry, no copy).
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.errors import RequestError

ALIGN = 64

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout(items: list[tuple[str, torch.Tensor]]) -> tuple[list[dict[str, Any]], int]:
    """The manifest for these tensors and the buffer size it needs."""
    manifest, offset = [], 0
    for name, t in items:
        if dtype_name(t.dtype) not in DTYPES:
            raise ValueError(f"cannot push {name!r}: dtype {t.dtype} is not one of {sorted(DTYPES)}")
        manifest.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return manifest, max(offset, 1)


def manifest_views(buffer: torch.Tensor, manifest: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """A typed, shaped view of ``buffer`` (uint8) per manifest entry; refuses entries outside it."""
    size = buffer.numel()
    out = []
    for entry in manifest:
        name = entry["name"]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise RequestError(f"unsupported dtype {entry['dtype']!r} for {name!r}")
        shape = tuple(entry["shape"])
        offset, nbytes = int(entry["offset"]), dtype.itemsize * int(torch.Size(shape).numel())
        if offset < 0 or offset + nbytes > size or offset % dtype.itemsize:
            raise RequestError(f"manifest entry {name!r} lies outside the shared buffer or is misaligned")
        out.append((name, buffer[offset : offset + nbytes].view(dtype).view(shape)))
    return out
