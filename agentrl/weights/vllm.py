"""Weight push into running ``vllm serve`` engines (vLLM 0.32's dev-mode routes).

Two transfers, one order of control calls: ``/pause?mode=keep`` (requests stay in flight)
→ move the weights → ``/update_weight_version`` (vLLM's weight version, which
``/weight_info`` reports) → ``/reset_prefix_cache`` (no later request may reuse K/V of the
old weights) → ``/resume``.

- ``disk`` (any hardware; the server must see the trainer's filesystem): the tensors go to
  a safetensors file in a private directory, and ``/collective_rpc`` runs every worker's
  ``reload_weights(weights_path=DIR)``.  The trainer side needs no vLLM.
- ``nccl`` (GPU): vLLM's own ``NCCLTrainerWeightTransferEngine`` broadcasts from the
  trainer (rank 0) to the engine's workers; the server was started with
  ``--weight-transfer-config '{"backend": "nccl"}'``.  The trainer's venv needs vLLM for it
  (imported only here, only then).  The group meets by an NCCL unique id that the trainer
  mints and sends over the keyed ``/init_weight_transfer_engine`` route, never by vLLM's
  default TCPStore rendezvous: that store takes any client without a key and the workers
  unpickle what it holds, so whoever reached its port first could run code in the engine.

Every call carries the run's key (``Authorization: Bearer``).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import torch

from agentrl.errors import WeightSyncError
from agentrl.weights.sync import Buckets, NamedTensors, items_of, url_root

Transfer = Literal["disk", "nccl"]


def nccl_ready() -> str | None:
    """Why vLLM's NCCL transfer cannot run in this process (None when it can)."""
    if not torch.cuda.is_available():
        return "the trainer sees no GPU (NCCL moves CUDA tensors)"
    if importlib.util.find_spec("vllm") is None:
        return "the trainer's venv has no vLLM (its NCCL engine runs in the trainer): pip install vllm there"
    return None


def choose_transfer(asked: Literal["auto", "disk", "nccl"]) -> Transfer:
    """``auto``: NCCL when it can run here, else disk.  ``nccl`` that cannot run: ValueError (one line)."""
    why_not = nccl_ready()
    if asked == "nccl" and why_not is not None:
        raise ValueError(f"inference.vllm_weight_transfer = \"nccl\", but {why_not}; use \"disk\" or \"auto\"")
    if asked == "auto":
        return "nccl" if why_not is None else "disk"
    return asked


class VLLMWeightSync:
    """WeightSync for ``vllm serve`` engines: disk reload or vLLM's NCCL engine (module doc)."""

    def __init__(
        self,
        base_urls: str | list[str],
        *,
        api_key: str | None = None,
        transfer: Transfer = "disk",
        work_dir: str | Path | None = None,
        timeout: float = 300.0,
        nccl: NcclSide | None = None,
    ):
        """``nccl``: the trainer's side of vLLM's NCCL group (default: vLLM's own, ``VLLMNccl``)."""
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("VLLMWeightSync needs at least one engine URL")
        if transfer not in ("disk", "nccl"):
            raise ValueError(f"unknown vLLM weight transfer {transfer!r}; use 'disk' or 'nccl'")
        self.roots = [url_root(u) for u in urls]
        self.transfer = transfer
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        base = Path(work_dir) if work_dir else (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
        self._dir: Path | None = None
        self._base = base
        self._last: Path | None = None
        self._nccl = nccl or VLLMNccl()
        self._engines: list[Any] | None = None
        self._source = _Items()
        self._http: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None
        self.last_stats: dict[str, float] = {}

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop or self._http[1].is_closed:
            self._http = (loop, httpx.AsyncClient(timeout=self.timeout, headers=self.headers))
        return self._http[1]

    async def _post(self, root: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = await self._client().post(root + path, **kw)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{root}{path}: {e!r}") from e
        if r.status_code >= 400:
            hint = " (is VLLM_SERVER_DEV_MODE=1 set on that server?)" if r.status_code == 404 else ""
            raise WeightSyncError(f"{root}{path} -> HTTP {r.status_code}{hint}: {r.text[:300]}")
        return r

    async def _all(self, path: str, **kw: Any) -> None:
        await asyncio.gather(*(self._post(root, path, **kw) for root in self.roots))

    async def versions(self) -> list[str | None]:
        """Each server's weight version (``/weight_info``)."""
        out = []
        for root in self.roots:
            r = await self._client().get(root + "/weight_info")
            out.append(r.json().get("weight_version") if r.status_code == 200 else None)
        return out

    async def set_version(self, version: int) -> None:
        """Name the weights the servers hold now (a server started on the warm start: version 0)."""
        await self._all("/update_weight_version", json={"new_version": str(version)})

    # ------------------------------------------------------------------ push

    async def push_stream(self, specs: NamedTensors, buckets: Buckets, version: int) -> float:
        """:meth:`push` of tensors arriving in buckets.  Collected first: vLLM's NCCL engine replays its source and
        its disk reload reads one finished file, so this sync holds the whole set (unlike the embedded engine's)."""
        items: list[tuple[str, torch.Tensor]] = []
        async for bucket in buckets:
            items += items_of(bucket)
        return await self.push(items, version)

    async def push(self, named_tensors: NamedTensors, version: int) -> float:
        t0 = time.perf_counter()
        items = items_of(named_tensors)
        t_paused = t_moved = t0
        await self._all("/pause", params={"mode": "keep"})
        try:
            t_paused = time.perf_counter()
            if self.transfer == "disk":
                path = await asyncio.to_thread(self._write, items, version)
                t_moved = time.perf_counter()
                body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
                await self._all("/collective_rpc", json=body)
                self._drop_old(path)
            else:
                await self._send_nccl(items, version)
                t_moved = time.perf_counter()
            await self.set_version(version)
            # cached prefix blocks hold K/V of the old weights (the client also salts requests by version)
            await self._all("/reset_prefix_cache", params={"reset_running_requests": "false"})
        finally:
            await asyncio.gather(*(self._post(r, "/resume") for r in self.roots), return_exceptions=True)
        t1 = time.perf_counter()
        self.last_stats = {"pause_s": t_paused - t0, "write_s": t_moved - t_paused, "load_s": t1 - t_moved,
                           "total_s": t1 - t0, "bytes": float(sum(t.numel() * t.element_size() for _, t in items))}  # fmt: skip
        return t1 - t0

    # ------------------------------------------------------------------ disk

    def _write(self, items: list[tuple[str, torch.Tensor]], version: int) -> Path:
        """A checkpoint dir vLLM's loader reads: one safetensors file (tied tensors cloned apart)."""
        from safetensors.torch import save_file

        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="agentrl-vllm-weights-", dir=self._base))  # 0700
        path = self._dir / f"v{version}"
        path.mkdir(exist_ok=True)
        tensors, seen = {}, set()
        for name, t in items:
            t = t.to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            tensors[name] = t.clone() if ptr in seen else t
            seen.add(ptr)
        save_file(tensors, str(path / "model.safetensors"))
        return path

    def _drop_old(self, keep: Path) -> None:
        if self._last is not None and self._last != keep:
            shutil.rmtree(self._last, ignore_errors=True)
        self._last = keep

    # ------------------------------------------------------------------ nccl

    async def _send_nccl(self, items: list[tuple[str, torch.Tensor]], version: int) -> None:
        self._source.items = items
        if self._engines is None:  # one NCCL group per server: the trainer is rank 0 in each
            self._engines = []
            for root in self.roots:
                r = await self._client().get(root + "/get_world_size")
                if r.status_code >= 400:
                    raise WeightSyncError(f"{root}/get_world_size -> HTTP {r.status_code}; is VLLM_SERVER_DEV_MODE=1 set?")
                world_size = 1 + int(r.json()["world_size"])
                control = _Control(root, self.headers, self.timeout)
                self._engines.append(await asyncio.to_thread(_open_group, self._nccl, world_size, control,
                                                             self._source, self.timeout))  # fmt: skip
        for engine in self._engines:
            engine.client.version = str(version)
        # each send drives start/update (blocking in the broadcast)/finish on its own server
        await asyncio.gather(*(asyncio.to_thread(e.send_weights) for e in self._engines))

    async def close(self) -> None:
        for engine in self._engines or []:
            try:
                await asyncio.to_thread(engine.shutdown)
            except Exception:
                pass
        self._engines = None
        if self._http is not None and self._http[0] is asyncio.get_running_loop():
            await self._http[1].aclose()
        self._http = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = self._last = None


class _Items:
    """The tensors of the current push, re-iterable (vLLM's engine replays its source each round)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, torch.Tensor]] = []

    def __iter__(self):
        return iter(self.items)


class _Control:
    """vLLM's weight-sync client protocol over HTTP with the run's key (the engine calls it from threads)."""

    def __init__(self, root: str, headers: dict[str, str], timeout: float):
        self.root, self.version = root, None
        self.http = httpx.Client(timeout=timeout, headers=headers)

    def _post(self, path: str, body: dict[str, Any] | None = None) -> None:
        r = self.http.post(self.root + path, json=body)
        if r.status_code >= 400:
            raise WeightSyncError(f"{self.root}{path} -> HTTP {r.status_code}: {r.text[:300]}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version or self.version})


class NcclSide(Protocol):
    """The trainer's side of the NCCL group with one server's workers (``VLLMNccl``; tests fake it)."""

    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (128 bytes): whoever holds it can join the group."""
        ...

    def sender(self, unique_id: bytes, world_size: int, control: Any, source: Any) -> Any:
        """Join the group as rank 0 (blocks until every worker joins); an engine with
        ``send_weights()``, ``shutdown()`` and ``client.version``."""
        ...


def nccl_init_info(unique_id: bytes, world_size: int) -> dict[str, Any]:
    """The workers' ``init_info`` (vLLM 0.32's ``NCCLWeightTransferInitInfo``): unique-id mode,
    the trainer at rank 0, packed broadcasts as vLLM's trainer engine sends them."""
    if len(unique_id) != 128:
        raise ValueError(f"an NCCL unique id is 128 bytes, got {len(unique_id)}")
    return {"nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"), "rank_offset": 1,
            "world_size": world_size, "packed": True}  # fmt: skip


def _open_group(nccl: NcclSide, world_size: int, control: _Control, source: _Items, timeout: float) -> Any:
    """Mint the id, send it to the workers over the keyed route and join as rank 0, both at
    once (each side blocks in NCCL's init until the other arrives)."""
    unique_id = nccl.unique_id()
    joined: dict[str, Any] = {}

    def join() -> None:
        try:
            joined["engine"] = nccl.sender(unique_id, world_size, control, source)
        except BaseException as e:  # noqa: BLE001 - surfaced below, in the caller's thread
            joined["error"] = e

    # a daemon: if the workers never come (the route failed), NCCL's init waits forever
    thread = threading.Thread(target=join, name="agentrl-nccl-join", daemon=True)
    thread.start()
    control.init_weight_transfer_engine(nccl_init_info(unique_id, world_size))  # returns once the group is up
    thread.join(timeout)
    if "error" in joined:
        raise WeightSyncError(f"{control.root}: joining vLLM's NCCL group failed: {joined['error']!r}") from joined["error"]
    if "engine" not in joined:
        raise WeightSyncError(f"{control.root}: the workers joined vLLM's NCCL group but the trainer did not "
                              f"within {timeout:.0f} s")  # fmt: skip
    return joined["engine"]


class VLLMNccl:
    """vLLM 0.32's trainer side: ``ncclGetUniqueId``, ``PyNcclCommunicator.from_unique_id_bytes``
    (through ``uid_init_process_group``) and ``NCCLTrainerWeightTransferEngine`` around it."""

    def unique_id(self) -> bytes:
        import ctypes

        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        uid = NCCLLibrary().ncclGetUniqueId()
        return ctypes.string_at(ctypes.addressof(uid.internal), 128)

    def sender(self, unique_id: bytes, world_size: int, control: Any, source: Any) -> Any:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.nccl_common import uid_init_process_group
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        class Source(WeightSource):
            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in source.items]

            def __iter__(self):  # NCCL moves CUDA tensors: a CPU trainer's are copied over, one at a time
                return ((n, t if t.is_cuda else t.to("cuda")) for n, t in source.items)

        engine = NCCLTrainerWeightTransferEngine(client=control, source=Source(), packed=True)
        engine.model_update_group = uid_init_process_group(unique_id, 0, world_size,
                                                           torch.accelerator.current_device_index())  # fmt: skip
        return engine
