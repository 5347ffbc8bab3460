"""The WeightSync protocol every transport implements, and what the trainer-side transports share:
the signed begin/commit/abort of a push (:mod:`agentrl.weights.receive` has the engine's rules)."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import secrets
import stat
import struct
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx
import torch

from agentrl.errors import WeightSyncError
from agentrl.weights.manifest import DTYPES, dtype_name, sign_body, signature, signed_by

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
# the tensors of one push, a few at a time, in the order of the push's specs (a sharded trainer's gather)
Buckets = AsyncIterator[NamedTensors]


@runtime_checkable
class WeightSync(Protocol):
    """Trainer → engines: ``push`` loads tensors into every engine as one weight version."""

    async def push(self, named_tensors: NamedTensors, version: int) -> float:
        """Load these tensors into every engine as weight ``version``; return seconds taken."""
        ...

    async def push_stream(self, specs: NamedTensors, buckets: Buckets, version: int) -> float:
        """:meth:`push` of tensors that arrive in ``buckets``; ``specs``: their names, dtypes and shapes in that
        order (tensors on the ``meta`` device will do), known before any data."""
        ...

    async def close(self) -> None: ...


def items_of(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return [(name, t.detach()) for name, t in items]


async def one_bucket(items: NamedTensors) -> Buckets:
    """The whole set as one bucket: a plain push is a stream of one."""
    yield items


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A spec: the dtype and (global, for a shard) shape of ``t`` without its data."""
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


async def checked_buckets(manifest: list[dict[str, Any]],
                          buckets: Buckets) -> AsyncIterator[list[tuple[dict[str, Any], torch.Tensor]]]:
    """Each bucket's tensors with their manifest entries, in order; a tensor that is not the manifest's next (name,
    dtype, shape), or a stream that ends short: WeightSyncError before anything is committed."""
    i = 0
    async for bucket in buckets:
        part = []
        for name, t in items_of(bucket):
            want = manifest[i] if i < len(manifest) else None
            got = {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
            if want is None or any(want[k] != got[k] for k in got):
                raise WeightSyncError(f"weight push: tensor {i} arrived as {got}, the manifest has "
                                      f"{ {k: want[k] for k in got} if want else 'no more tensors'}")  # fmt: skip
            part.append((want, t))
            i += 1
        yield part
    if i != len(manifest):
        raise WeightSyncError(f"weight push: the tensors stopped after {i} of {len(manifest)} (the gather failed?); "
                              "nothing was committed")


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (uint8, CPU, contiguous)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
              "int32": "I32"}  # fmt: skip
assert set(_ST_DTYPES) == set(DTYPES)


class SafetensorsWriter:
    """A safetensors file written one tensor at a time: the header first, from the manifest (every name, dtype and
    shape is known before any data), then each tensor's bytes as it arrives; the SHA-256 as it goes.  Created here
    (``O_EXCL``, never through a link), 0600."""

    def __init__(self, path: str | os.PathLike[str], manifest: list[dict[str, Any]]):
        header, off = {}, 0
        for e in manifest:
            n = DTYPES[e["dtype"]].itemsize * int(torch.Size(e["shape"]).numel())
            header[e["name"]] = {"dtype": _ST_DTYPES[e["dtype"]], "shape": e["shape"], "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.file = os.fdopen(fd, "wb")
        self.sha = hashlib.sha256()
        self._out(struct.pack("<Q", len(raw)) + raw)

    def _out(self, data: bytes | memoryview) -> None:
        self.sha.update(data)
        self.file.write(data)

    def write(self, entry: dict[str, Any], t: torch.Tensor) -> None:
        self._out(memoryview(flat_bytes(t).numpy()))

    def finish(self) -> str:
        """Close the file; its SHA-256 (hex)."""
        self.file.close()
        return self.sha.hexdigest()

    def close(self) -> None:
        self.file.close()


def url_root(url: str) -> str:
    """``http://host:port/v1`` → ``http://host:port`` (weight routes live at the root)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def new_transfer() -> str:
    """A fresh transfer id (engines refuse one they have seen: a push cannot be replayed)."""
    return secrets.token_hex(16)


def need_key(key: str | None) -> str:
    if not key:
        raise WeightSyncError("no API key to sign the weight push with: set AGENTRL_API_KEY to the engines' key "
                              "(a run hands its own key to its weight sync)")
    return key


async def call(http: httpx.AsyncClient, method: str, url: str, **kw: Any) -> Any:
    """One weight-route request; a refusal becomes a WeightSyncError with the engine's message."""
    try:
        r = await http.request(method, url, **kw)
    except httpx.HTTPError as e:
        raise WeightSyncError(f"{url}: {e!r}") from e
    if r.status_code >= 400:
        try:
            msg = r.json()["error"]["message"]
        except Exception:
            msg = r.text[:300]
        raise WeightSyncError(f"{url} → {r.status_code}: {msg}")
    return r.json()


async def begin(http: httpx.AsyncClient, root: str, key: str, *, transfer: str, transport: str, version: int,
                manifest: list[dict[str, Any]], size: int, lora: bool, session: str,
                chunks: list[list[int]] | None = None) -> dict[str, Any]:
    """Open a transfer on one engine; a place to write (shm, disk) must come back signed.
    ``session``: the weight sync's id (versions never decrease within one session)."""
    body: dict[str, Any] = {"transfer": transfer, "transport": transport, "weight_version": version,
                            "size": size, "manifest": manifest, "lora": lora, "session": session}
    if chunks is not None:
        body["chunks"] = chunks
    answer = await call(http, "POST", root + "/weights/begin", json=sign_body(key, "begin", body))
    if "path" in answer and not signed_by(key, answer.get("signature"), "lease", transfer, str(answer["path"]),
                                           str(size)):
        raise WeightSyncError(f"{root}: the engine's answer to a weight push is not signed with the run's key "
                              "(another process on its port?); nothing was written")
    return answer


async def commit(http: httpx.AsyncClient, root: str, key: str, transfer: str, sha256: str | None = None) -> Any:
    body: dict[str, Any] = {"transfer": transfer, "signature": signature(key, "commit", transfer, sha256 or "")}
    if sha256 is not None:
        body["sha256"] = sha256
    return await call(http, "POST", root + "/weights/commit", json=body)


async def abort(http: httpx.AsyncClient, root: str, key: str, transfer: str) -> None:
    """End our own transfer (best effort: a dead engine's transfer expires by itself)."""
    try:
        await http.post(root + "/weights/abort", json={"transfer": transfer,
                                                        "signature": signature(key, "abort", transfer)}, timeout=5.0)
    except httpx.HTTPError:
        pass


_SEGMENT_NAME = re.compile(r"w-[0-9a-f]{16}\.bin")  # agentrl.weights.staging.SharedSegments


def map_segment(path: str, size: int) -> torch.Tensor:
    """The engine's shared-memory segment, mapped for writing (uint8).  Only a regular file of
    exactly ``size`` bytes owned by this user, named as the engine names its segments
    (``agentrl-*/w-<16 hex>.bin``), is mapped: the trainer never grows or follows a link, and an
    engine that is not ours cannot point the push at some other file of the trainer's."""
    p = Path(path)
    if not (p.is_absolute() and _SEGMENT_NAME.fullmatch(p.name) and p.parent.name.startswith("agentrl-")):
        raise WeightSyncError(f"the engine named {path} as its shared-memory segment: not an agentrl segment path")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
            raise WeightSyncError(f"the engine's shared-memory segment {path} is not a {size}-byte file of this user")
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)
