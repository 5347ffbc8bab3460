"""What both sides of a weight push agree on: the byte layout and the signatures.

A push writes every tensor into one flat byte buffer; the manifest says where each one is:
``[{"name", "dtype", "shape", "offset"}]`` (offset in bytes, aligned to :data:`ALIGN`).
:func:`layout` is the trainer's side (where to write), :func:`manifest_views` the engine's
(a checked view per entry, no copy).  The layout is *compact*: :func:`check_layout` refuses a
manifest whose offsets or total size differ from what :func:`layout` gives for its own
entries, so the buffer an engine allocates is fixed by names, dtypes and shapes alone.

Every message of a push is signed with an HMAC of the engine's key (:func:`signature`): the
begin (the whole manifest), each HTTP chunk's bytes, the commit and the abort; the engine's
answer that hands out a place to write is signed back (a process squatting on a dead engine's
port cannot name a file for the trainer to overwrite).  Each purpose has its own tag, so no
signature of one message is valid for another.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from agentrl.auth import sign, verify
from agentrl.errors import RequestError

ALIGN = 64
SIGNATURE_HEADER = "X-Agentrl-Signature"  # an HTTP chunk's HMAC (its body is raw bytes)

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


def _nbytes(dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> int:
    return dtype.itemsize * int(torch.Size(shape).numel())


def layout(items: list[tuple[str, torch.Tensor]]) -> tuple[list[dict[str, Any]], int]:
    """The manifest for these tensors and the buffer size it needs."""
    manifest, offset = [], 0
    for name, t in items:
        if dtype_name(t.dtype) not in DTYPES:
            raise ValueError(f"cannot push {name!r}: dtype {t.dtype} is not one of {sorted(DTYPES)}")
        manifest.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset})
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return manifest, max(offset, 1)


def check_layout(manifest: list[dict[str, Any]], size: int) -> None:
    """Refuse a manifest that is not the compact layout of its own entries (or malformed)."""
    offset = 0
    for i, entry in enumerate(manifest):
        if not isinstance(entry, dict) or set(entry) != {"name", "dtype", "shape", "offset"}:
            raise RequestError(f"manifest entry {i} must have exactly name, dtype, shape, offset")
        if not isinstance(entry["name"], str) or not entry["name"]:
            raise RequestError(f"manifest entry {i}: name must be a non-empty string")
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        shape = entry["shape"]
        if dtype is None:
            raise RequestError(f"manifest entry {i}: unsupported dtype {entry['dtype']!r}; use one of {sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) or len(shape) > 8:
            raise RequestError(f"manifest entry {i}: shape must be a list of at most 8 sizes >= 0")
        if entry["offset"] != offset:
            raise RequestError(f"manifest entry {i}: offset {entry['offset']!r}, the compact layout has {offset}")
        offset += -(-_nbytes(dtype, shape) // ALIGN) * ALIGN
    if size != max(offset, 1):
        raise RequestError(f"buffer size {size} is not the manifest's {max(offset, 1)} bytes")


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
        offset, nbytes = int(entry["offset"]), _nbytes(dtype, shape)
        if offset < 0 or offset + nbytes > size or offset % dtype.itemsize:
            raise RequestError(f"manifest entry {name!r} lies outside the shared buffer or is misaligned")
        out.append((name, buffer[offset : offset + nbytes].view(dtype).view(shape)))
    return out


# ----------------------------------------------------------------------------- signatures


def canonical(obj: Any) -> bytes:
    """One byte string per JSON value (sorted keys, no spaces): what a signature covers."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def signature(key: str, purpose: str, *parts: bytes | str) -> str:
    """HMAC-SHA256 of ``parts`` under ``key``, tagged with ``purpose`` (begin, chunk, commit, ...)."""
    raw = [p.encode() if isinstance(p, str) else p for p in parts]
    return sign(key, b"agentrl-weights/" + purpose.encode(), *raw)


def signed_by(key: str | None, sig: str | None, purpose: str, *parts: bytes | str) -> bool:
    """Whether ``sig`` is :func:`signature` of ``parts`` under ``key`` (never without a key)."""
    if not key or not isinstance(sig, str):
        return False
    raw = [p.encode() if isinstance(p, str) else p for p in parts]
    return verify(key, sig, b"agentrl-weights/" + purpose.encode(), *raw)


def sign_body(key: str, purpose: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` plus its ``signature`` (over every other field)."""
    return {**body, "signature": signature(key, purpose, canonical(body))}


def body_signed_by(key: str | None, purpose: str, body: dict[str, Any]) -> bool:
    rest = {k: v for k, v in body.items() if k != "signature"}
    return signed_by(key, body.get("signature"), purpose, canonical(rest))
