"""Weight push into running ``vllm serve`` engines through vLLM's native NCCL routes.

Pinned to the routes of vLLM's dev-mode RL router (``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "nccl"}'``; the launcher is
:mod:`agentrl.inference.vllm`): ``/get_world_size``, ``/init_weight_transfer_engine``,
``/pause?mode=keep``, ``/start_weight_update`` (newer servers), ``/update_weights`` (blocks
while the trainer broadcasts over NCCL), ``/finish_weight_update`` (older:
``/update_weight_version``), ``/reset_prefix_cache`` (so no request after the swap reuses K/V
computed by the old weights), ``/resume``.  The data travels over NCCL from the trainer
(rank 0) to every engine worker, sent by vLLM's own ``NCCLWeightTransferEngine``; this
module only orders the control calls.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import torch

from agentrl.errors import WeightSyncError
from agentrl.weights.sync import NamedTensors, items_of, url_root

# Sender(named_tensors list, group): the trainer-side NCCL broadcast; Init(info) -> group.
SendWeights = Callable[[list[tuple[str, torch.Tensor]], Any], None]
InitTrainer = Callable[[dict[str, Any]], Any]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.roots = [url_root(u) for u in urls]
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
        items = items_of(named_tensors)
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
                # cached prefix blocks hold K/V of the old weights: no new request may reuse them
                # (servers without the route get requests salted with the version: PolicyClient.cache_salt)
                await self._post(r, "/reset_prefix_cache", optional=True, params={"reset_running_requests": "false"})
        finally:
            await asyncio.gather(*[self._post(r, "/resume") for r in self.roots], return_exceptions=True)
        return time.perf_counter() - t0

    async def close(self) -> None:
        await self._http.aclose()
