"""Thin vLLM adapter: launch ``vllm serve`` and push weights through vLLM's native RL routes.

Pinned to the routes of vLLM's dev-mode RL router (``vllm/entrypoints/serve/dev/rlhf/
api_router.py``; served only with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "nccl"}'``):

=====================================  =========================================================
``GET  /get_world_size``               ``{"world_size": int}`` (TP·PP·DP of the server)
``POST /init_weight_transfer_engine``  ``{"init_info": {master_address, master_port, rank_offset, world_size}}``
``POST /pause?mode=keep``              freeze in-flight requests; they resume on new weights
``POST /start_weight_update``          (newer vLLM; a 404 on older servers is tolerated)
``POST /update_weights``               ``{"update_info": {names, dtype_names, shapes, packed}}`` —
                                       blocks while the trainer broadcasts over NCCL
``POST /finish_weight_update``         ``{"weight_version": str}`` (older: ``/update_weight_version``
                                       ``{"new_version": str}``)
``POST /resume``
=====================================  =========================================================

The data itself travels over NCCL from the trainer (rank 0) to every engine worker
(ranks ``rank_offset …``), sent by vLLM's own ``NCCLWeightTransferEngine`` on the trainer
side; this module only orders the control calls.  vLLM does not tag tokens with weight
versions, so a run on vLLM tags each request's tokens with the version current when the
request started (``PolicyClient(default_version=...)``): a token generated across a swap is
counted one version *older* than it is — the staleness bound stays a bound.

Logprobs: the server is started with ``--logprobs-mode processed_logprobs`` so μ is taken
after temperature/top-k/top-p, the same basis as agentrl's embedded engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from agentrl.inference.launcher import EngineHandle, EngineStartError, wait_for_health
from agentrl.weights import NamedTensors, WeightSyncError, _items, _root

# Sender(named_tensors list, group) — the trainer-side NCCL broadcast; Init(info) -> group.
SendWeights = Callable[[list[tuple[str, torch.Tensor]], Any], None]
InitTrainer = Callable[[dict[str, Any]], Any]


def vllm_serve_command(
    model: str | Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``vllm serve`` command line agentrl runs (token-exact I/O, tools, live weights)."""
    cmd = [
        "vllm", "serve", str(model),
        "--host", host, "--port", str(port),
        "--served-model-name", served_model_name or Path(model).name,
        "--weight-transfer-config", json.dumps({"backend": "nccl"}),
        "--logprobs-mode", "processed_logprobs",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return [*cmd, *extra_args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm_server(
    model: str | Path,
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    startup_timeout: float = 900.0,
    **kwargs: Any,
) -> EngineHandle:
    """Run ``vllm serve`` in a child process (dev-mode routes on) and wait for ``/health``."""
    if shutil.which("vllm") is None:
        raise EngineStartError("`vllm` is not installed here; `pip install agentrl[vllm]` on a GPU machine")
    port = port or _free_port()
    name = kwargs.get("served_model_name") or Path(model).name
    log_path = Path(tempfile.mkdtemp(prefix="agentrl-vllm-")) / "vllm.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            vllm_serve_command(model, port=port, host=host, **kwargs),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
        )
    port = wait_for_health(proc, host, lambda: port, log_path, timeout=startup_timeout, what="vllm serve", poll_s=1.0)
    return EngineHandle(proc, host, port, name, log_path)


def _nccl_init_trainer(info: dict[str, Any]) -> Any:
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    return NCCLWeightTransferEngine.trainer_init(info)


def _nccl_send(items: list[tuple[str, torch.Tensor]], group: Any) -> None:
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerSendWeightsArgs,
        NCCLWeightTransferEngine,
    )

    NCCLWeightTransferEngine.trainer_send_weights(
        iterator=iter(items), trainer_args=NCCLTrainerSendWeightsArgs(group=group, packed=True)
    )


class VLLMWeightSync:
    """WeightSync for running ``vllm serve`` engines via vLLM's native NCCL weight transfer."""

    def __init__(
        self,
        base_urls: str | list[str],
        *,
        master_address: str | None = None,
        master_port: int | None = None,
        init_trainer: InitTrainer = _nccl_init_trainer,
        send_weights: SendWeights = _nccl_send,
        timeout: float = 600.0,
    ):
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("VLLMWeightSync needs at least one engine URL")
        self.roots = [_root(u) for u in urls]
        self.master_address = master_address or socket.gethostbyname(socket.gethostname())
        self.master_port = master_port or _free_port()
        self._init_trainer, self._send = init_trainer, send_weights
        self._http = httpx.AsyncClient(timeout=timeout)
        self._group: Any = None

    async def _post(self, root: str, path: str, *, optional: bool = False, **kw: Any) -> httpx.Response | None:
        try:
            r = await self._http.post(root + path, **kw)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{root}{path}: {e!r}") from e
        if optional and r.status_code == 404:
            return None
        if r.status_code >= 400:
            raise WeightSyncError(f"{root}{path} -> {r.status_code}: {r.text[:300]}")
        return r

    async def _connect(self) -> None:
        """Rendezvous: trainer is rank 0, each engine's workers follow at their rank offset."""
        sizes = []
        for root in self.roots:
            r = await self._http.get(root + "/get_world_size")
            if r.status_code >= 400:
                raise WeightSyncError(f"{root}/get_world_size -> {r.status_code}; is VLLM_SERVER_DEV_MODE=1 set?")
            sizes.append(int(r.json()["world_size"]))
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        inits = [
            self._post(root, "/init_weight_transfer_engine", json={"init_info": {
                "master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": off, "world_size": world,
            }})  # fmt: skip
            for root, off in zip(self.roots, offsets, strict=True)
        ]
        info = {"master_address": self.master_address, "master_port": self.master_port, "world_size": world}
        # the servers block in init until the trainer joins the group: run both sides at once
        trainer = asyncio.to_thread(self._init_trainer, info)
        *_, self._group = await asyncio.gather(*inits, trainer)

    async def push(self, named_tensors: NamedTensors, version: int) -> float:
        t0 = time.perf_counter()
        items = _items(named_tensors)
        if self._group is None:
            await self._connect()
        update_info = {
            "names": [n for n, _ in items],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "packed": True,
        }
        await asyncio.gather(*[self._post(r, "/pause", params={"mode": "keep"}) for r in self.roots])
        try:
            await asyncio.gather(*[self._post(r, "/start_weight_update", optional=True) for r in self.roots])
            # each /update_weights blocks inside the NCCL broadcast the trainer sends now
            receives = [self._post(r, "/update_weights", json={"update_info": update_info}) for r in self.roots]
            await asyncio.gather(*receives, asyncio.to_thread(self._send, items, self._group))
            for r in self.roots:
                done = await self._post(r, "/finish_weight_update", optional=True, json={"weight_version": str(version)})
                if done is None:
                    await self._post(r, "/update_weight_version", json={"new_version": str(version)})
        finally:
            await asyncio.gather(*[self._post(r, "/resume") for r in self.roots], return_exceptions=True)
        return time.perf_counter() - t0

    async def close(self) -> None:
        await self._http.aclose()


if __name__ == "__main__":  # pragma: no cover - manual smoke: python -m agentrl.inference.vllm MODEL
    print(" ".join(vllm_serve_command(sys.argv[1], port=8000)))
