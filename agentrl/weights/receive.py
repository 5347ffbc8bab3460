"""Engine side of a weight push: who may push, what fits, and the swap into a live model.

:class:`WeightReceiver` is the engine's one owner of weight updates (the routes in
:mod:`agentrl.inference.weight_routes` only parse and answer).  Its rules:

- **Signed.** Every message carries an HMAC of the engine's key
  (:func:`agentrl.weights.manifest.signature`): the begin over the whole manifest, each HTTP
  chunk over its bytes, the commit, the abort, a version bump, a disk reload.  The signature is
  checked before anything else, so a caller without the key learns nothing (no names, shapes,
  paths or transfer ids in the refusal).  An engine without a key refuses every push.
- **The model's own size.** A full push names every tensor of the served model exactly once
  with its exact shape (floating tensors as float32/16/bfloat16, others in their own dtype):
  a partial push is refused.  A LoRA push (``lora: true``) names (A, B) factor pairs of the
  model's 2-D weights, one rank for all, no larger than the matrix; after the first one the
  adapted modules and the rank are fixed until the next full push.  The staging buffer is
  the manifest's compact layout (:func:`~agentrl.weights.manifest.check_layout`), so no caller
  chooses how much the engine allocates.
- **No host path from a caller.** Shared memory lives only in files the engine creates itself
  (``O_CREAT|O_EXCL|O_NOFOLLOW``, at their final size, never grown) in its own 0700 directory
  (``/dev/shm/agentrl-XXXX``); the begin answers the path, signed, to the key holder.  The disk
  transport writes into the engine's weights dir (``--weights-dir``, else a private 0700 one);
  ``/update_weights_from_disk`` reads only inside that dir and answers every path outside it
  with the same refusal, whether or not it exists.
- **One transfer at a time, with its owner.** The transfer id is the trainer's; a begin while
  another transfer is in progress is refused (409) and does not disturb it; only the owner
  (a signed abort) ends it early, or ``idle_timeout_s`` without a message.  A transfer id is
  never reused, so a recorded push cannot be replayed.
- **Checked before the swap.** NaN/Inf anywhere refuses the push; every check runs before any
  weight changes, so a refused push leaves the served weights and the version as they were.
- **Versions only increase.** A push or ``/update_weight_version`` to a lower version is
  refused (409), a negative one always.  The same version is accepted: a push repeated after a
  partial failure, or to an engine restarted under a run, carries the version the other engines
  already have (the weights are the trainer's same state), and a version bump to the current
  version is a no-op.  The order is per trainer session (a random id each weight sync signs
  into its begins): a new run against a running engine starts its own sequence at its step 1.

Shared-memory double buffering: a CPU engine whose dtypes match points its parameters at the
pushed buffer (no copy); the next push is handed another segment, never one the live weights
use, so the trainer never writes into weights being served.

Around it: :mod:`~agentrl.weights.fit` (what a push must fit, and the swap) and
:mod:`~agentrl.weights.staging` (the segments and the weights dir the bytes land in).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from agentrl.errors import RequestError
from agentrl.weights.fit import (
    AdapterSpec,
    check_adapter_manifest,
    check_finite,
    check_full_manifest,
    named_targets,
    swap_in,
)
from agentrl.weights.lora import AdapterMerger
from agentrl.weights.manifest import (
    body_signed_by,
    check_layout,
    manifest_views,
    signature,
    signed_by,
)
from agentrl.weights.staging import SharedSegments, manifest_of, private_dir, read_inside, tensors_of

TRANSPORTS = ("http", "shm", "disk")
REFUSED_UNSIGNED = "weight push refused: missing or wrong signature (the sender must hold this engine's API key)"
# HTTP status of each refusal code (everything else is a 400)
STATUS = {"unauthorized": 401, "transfer_in_progress": 409, "stale_version": 409, "unknown_transfer": 409,
          "transfer_reused": 409}


class Engine(Protocol):  # what the receiver needs of agentrl.inference.engine.Engine
    model: torch.nn.Module
    version: int

    def update_weights(self, apply: Callable[[torch.nn.Module], Any], version: int | None = None) -> int: ...


def _is_id(value: Any, min_len: int = 8) -> bool:
    """A random id as the trainer makes them: ASCII letters or digits, ``min_len``-64 long."""
    return isinstance(value, str) and min_len <= len(value) <= 64 and value.isascii() and value.isalnum()


# ----------------------------------------------------------------------------- the receiver


@dataclass
class Transfer:
    """One push in progress: its owner's id, what it carries and where its bytes land."""

    transfer: str
    transport: str
    version: int | None
    lora: bool
    manifest: list[dict[str, Any]]
    size: int
    buffer: torch.Tensor | None  # uint8 staging buffer (http) or the leased segment (shm)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (offset, nbytes), http only
    received: set[int] = field(default_factory=set)
    path: Path | None = None  # where the trainer writes (shm segment, disk file)
    adapters: AdapterSpec | None = None
    session: str | None = None  # the pushing trainer's (versions never decrease within one)
    last_seen: float = 0.0
    committing: bool = False


class WeightReceiver:
    """The engine's weight updates (module doc: the rules)."""

    def __init__(self, engine: Engine, key: str | None, *, weights_dir: str | Path | None = None,
                 shm_parent: str | None = None, idle_timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``key``: the engine's API key (None: every push is refused).  ``weights_dir``: where
        disk pushes and ``/update_weights_from_disk`` read (default: a private dir made on first use)."""
        self.engine, self.key = engine, key
        self.idle_timeout_s, self.clock = idle_timeout_s, clock
        self.segments = SharedSegments(shm_parent)
        self.adapters = AdapterMerger()
        self.adapter_spec: AdapterSpec | None = None
        self.session: str | None = None  # the session of the last push loaded
        self._weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._own_weights_dir = False
        self.current: Transfer | None = None
        self._used: OrderedDict[str, None] = OrderedDict()  # transfer ids seen (a replayed begin is refused)
        self._lock = threading.Lock()
        self._max_bytes: int | None = None

    # -- limits

    def max_bytes(self) -> int:
        """The most a push of this model can take: 4 bytes per element, plus alignment and headers."""
        if self._max_bytes is None:  # the model's shapes never change
            targets = named_targets(self.engine.model)
            self._max_bytes = sum(4 * t.numel() + 64 for t in targets.values()) + (1 << 20)
        return self._max_bytes

    def weights_dir(self) -> Path:
        if self._weights_dir is None:
            self._weights_dir, self._own_weights_dir = private_dir(None, "agentrl-weights-"), True
        return self._weights_dir

    def _check(self, ok: bool) -> None:
        if not ok:
            raise RequestError(REFUSED_UNSIGNED, code="unauthorized")

    # -- the transfer

    def begin(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start a push (``body``: the signed begin); answers where to write (shm/disk), signed."""
        self._check(body_signed_by(self.key, "begin", body))
        transfer, transport = body.get("transfer"), body.get("transport", "http")
        version, lora, size, manifest = body.get("weight_version"), bool(body.get("lora", False)), body.get("size"), \
            body.get("manifest")
        if not _is_id(transfer, 16):
            raise RequestError("transfer must be 16-64 letters or digits (a fresh random id per push)", param="transfer")
        session = body.get("session")
        if session is not None and not _is_id(session):
            raise RequestError("session must be 8-64 letters or digits", param="session")
        if transport not in TRANSPORTS:
            raise RequestError(f"unknown transport {transport!r}; use one of {TRANSPORTS}", param="transport")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise RequestError("weight_version must be an integer", param="weight_version")
        if not isinstance(size, int) or not isinstance(manifest, list):
            raise RequestError("a begin needs size (bytes) and manifest (a list)")
        check_layout(manifest, size)
        model = self.engine.model
        spec = check_adapter_manifest(model, manifest, self.adapter_spec) if lora else None
        if not lora:
            check_full_manifest(model, manifest)
        if size > self.max_bytes():
            raise RequestError(f"buffer of {size} bytes is larger than the model allows", code="too_large")
        self._check_version(version, session)
        chunks: list[tuple[int, int]] = []
        if transport == "http":
            chunks = self._chunk_plan(body.get("chunks"), size)
        with self._lock:
            self._expire_idle()
            if self.current is not None:
                raise RequestError("another weight transfer is in progress; wait for it, or its owner aborts it "
                              f"(it expires after {self.idle_timeout_s:g}s without a message)",
                              code="transfer_in_progress")
            if transfer in self._used:
                raise RequestError("transfer id already used; every push needs a fresh one", code="transfer_reused")
            self._used[transfer] = None
            while len(self._used) > 1024:
                self._used.popitem(last=False)
            t = Transfer(transfer, transport, version, lora, manifest, size, None, chunks, adapters=spec,
                         session=session, last_seen=self.clock())
            self.current = t
        try:
            answer: dict[str, Any] = {"transfer": transfer}
            if transport == "http":
                t.buffer = torch.empty(max(size, 1), dtype=torch.uint8)
                answer["chunks"] = len(chunks)
            elif transport == "shm":
                live = list(named_targets(model).values())
                seg = self.segments.lease(size, live)
                t.buffer, t.path = seg.buffer, seg.path
            else:
                t.path = self.weights_dir() / f"push-{transfer}.safetensors"
                t.path.unlink(missing_ok=True)
            if t.path is not None:
                answer["path"] = str(t.path)
                answer["signature"] = signature(self.key or "", "lease", transfer, str(t.path), str(size))
            return answer
        except BaseException:
            self._end(t)
            raise

    @staticmethod
    def _chunk_plan(chunks: Any, size: int) -> list[tuple[int, int]]:
        if not isinstance(chunks, list) or not chunks or len(chunks) > 1 << 16:
            raise RequestError("an http begin needs chunks: [[offset, nbytes], ...] (at most 65536)")
        plan, pos = [], 0
        for i, c in enumerate(chunks):
            if not (isinstance(c, list) and len(c) == 2 and all(isinstance(x, int) for x in c)):
                raise RequestError(f"chunk {i} must be [offset, nbytes]")
            off, nbytes = c
            if off != pos or nbytes <= 0:
                raise RequestError(f"chunk {i} starts at {off}, expected {pos}")
            plan.append((off, nbytes))
            pos += nbytes
        if pos != size:
            raise RequestError(f"chunks cover {pos} bytes, the buffer has {size}")
        return plan

    def _expire_idle(self) -> None:  # holds self._lock
        cur = self.current
        if cur is not None and not cur.committing and self.clock() - cur.last_seen > self.idle_timeout_s:
            self._end(cur)

    def _end(self, t: Transfer) -> None:
        if self.current is t:
            self.current = None
        if t.transport == "disk" and t.path is not None:
            t.path.unlink(missing_ok=True)
        t.buffer = None

    def _owned(self, transfer: str) -> Transfer:  # holds self._lock
        self._expire_idle()
        cur = self.current
        if cur is None or cur.transfer != transfer or cur.committing:
            raise RequestError("this transfer is not in progress (finished, aborted, expired or never begun); "
                          "begin a new one", code="unknown_transfer")
        cur.last_seen = self.clock()
        return cur

    def chunk(self, transfer: str, index: int, data: bytes, sig: str | None) -> None:
        """Write one HTTP chunk at its offset (its HMAC checked first)."""
        self._check(signed_by(self.key, sig, "chunk", transfer, str(index), data))
        with self._lock:
            cur = self._owned(transfer)
            if cur.transport != "http" or not 0 <= index < len(cur.chunks):
                raise RequestError(f"this transfer has {len(cur.chunks)} chunks, not index {index}")
            off, nbytes = cur.chunks[index]
            if len(data) != nbytes:
                raise RequestError(f"chunk {index}: {len(data)} bytes, expected {nbytes}")
            buffer = cur.buffer
        assert buffer is not None
        memoryview(buffer.numpy())[off : off + nbytes] = data
        with self._lock:
            if self.current is cur:
                cur.received.add(index)

    def abort(self, transfer: str, sig: str | None) -> None:
        """End the owner's own transfer early (nothing was loaded)."""
        self._check(signed_by(self.key, sig, "abort", transfer))
        with self._lock:
            self._end(self._owned(transfer))

    def commit(self, transfer: str, sig: str | None, sha256: str | None = None) -> dict[str, Any]:
        """Check everything, then swap the pushed weights in as the transfer's version."""
        self._check(signed_by(self.key, sig, "commit", transfer, sha256 or ""))
        with self._lock:
            cur = self._owned(transfer)
            if cur.transport == "http":
                missing = sorted(set(range(len(cur.chunks))) - cur.received)
                if missing:
                    raise RequestError(f"transfer is missing {len(missing)} of {len(cur.chunks)} chunks "
                                  f"(first: {missing[:5]})", code="incomplete_transfer")
            cur.committing = True
        try:
            if cur.transport == "disk":
                views = self._disk_views(cur, sha256)
            else:
                assert cur.buffer is not None
                views = manifest_views(cur.buffer, cur.manifest)
            return self._apply(views, cur.version, cur.lora, cur.adapters, cur.session)
        finally:
            with self._lock:
                self._end(cur)

    def _disk_views(self, t: Transfer, sha256: str | None) -> list[tuple[str, torch.Tensor]]:
        assert t.path is not None
        files = read_inside(self.weights_dir(), t.path.name, self.max_bytes())
        if len(files) != 1 or not sha256 or hashlib.sha256(files[0][1]).hexdigest() != sha256:
            raise RequestError("the weights file's SHA-256 is not the one the commit signed (changed after writing?)",
                          code="checksum_mismatch")
        tensors = tensors_of(files)
        if sorted((e["name"], e["dtype"], e["shape"]) for e in manifest_of(tensors)) != \
                sorted((e["name"], e["dtype"], e["shape"]) for e in t.manifest):
            raise RequestError("the weights file does not hold the tensors its begin named")
        return tensors

    # -- versions and disk reloads

    def _check_version(self, version: int | None, session: str | None = None) -> None:
        """Versions never go below 0 and never decrease within a trainer's session; a new session
        (another trainer process: a new run against a running engine) starts its own sequence."""
        if version is None:
            return
        if version < 0:
            raise RequestError(f"weight version {version} is negative", code="stale_version", param="weight_version")
        if session is not None and session != self.session:
            return
        if version < self.engine.version:
            raise RequestError(f"weight version {version} is older than the served version {self.engine.version}; "
                          "versions only increase", code="stale_version", param="weight_version")

    def set_version(self, version: int, sig: str | None) -> int:
        """``/update_weight_version``: the same weights under a newer version (the same: a no-op)."""
        self._check(signed_by(self.key, sig, "version", str(version)))
        if version == self.engine.version:
            return version

        def bump(_: torch.nn.Module) -> None:
            self._check_version(version)

        return self.engine.update_weights(bump, version)

    def load_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/update_weights_from_disk``: safetensors inside the weights dir, every check of a push."""
        self._check(body_signed_by(self.key, "disk", body))
        version, lora, session = body.get("weight_version"), bool(body.get("lora", False)), body.get("session")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise RequestError("weight_version must be an integer", param="weight_version")
        if session is not None and not _is_id(session):
            raise RequestError("session must be 8-64 letters or digits", param="session")
        self._check_version(version, session)
        tensors = tensors_of(read_inside(self.weights_dir(), body.get("model_path"), self.max_bytes()))
        manifest = manifest_of(tensors)
        spec = check_adapter_manifest(self.engine.model, manifest, self.adapter_spec) if lora else None
        if not lora:
            check_full_manifest(self.engine.model, manifest)
        return self._apply(tensors, version, lora, spec, session)

    # -- the swap

    def _apply(self, views: list[tuple[str, torch.Tensor]], version: int | None, lora: bool,
               spec: AdapterSpec | None, session: str | None = None) -> dict[str, Any]:
        check_finite(views)
        t0 = time.perf_counter()
        count: list[int] = []

        def apply(model: torch.nn.Module) -> None:  # between two decode steps: the version is current here
            self._check_version(version, session)
            if lora:
                count.append(self.adapters.apply(model, views))
            else:
                count.append(swap_in(model, views))
                self.adapters.reset()  # new base weights: adapters merged before no longer apply

        new = self.engine.update_weights(apply, version)
        self.adapter_spec = spec if lora else None
        if session is not None:
            self.session = session
        return {"success": True, "weight_version": new, "num_tensors": count[0] if count else 0,
                "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        """Remove the engine's shared-memory files and its own weights dir."""
        self.segments.close()
        if self._own_weights_dir and self._weights_dir is not None:
            for p in self._weights_dir.iterdir():
                p.unlink(missing_ok=True)
            self._weights_dir.rmdir()

