"""Weight sync in one package: trainer-side push, engine-side receive, the shared manifest.

Trainer side: :func:`make_weight_sync` returns the :class:`WeightSync` for the run's engines
(``push(named_tensors, version)``): :class:`~agentrl.weights.push.EmbeddedWeightSync` (shm or
disk, full weights or LoRA factors), :class:`~agentrl.weights.network.HttpWeightSync` (HTTP chunks
to engines on other hosts, shm to those on the trainer's) or :class:`~agentrl.weights.vllm.VLLMWeightSync`
(``vllm serve``: disk reload, or vLLM's NCCL engine on a GPU).
Engine side: :mod:`agentrl.weights.receive` (who may push, one transfer at a time, versions),
:mod:`agentrl.weights.fit` (what fits the model, the swap), :mod:`agentrl.weights.staging` (the
engine's private shared memory and weights dir) and :mod:`agentrl.weights.lora` (merge adapter
factors).  The byte layout and the signatures both sides agree on: :mod:`agentrl.weights.manifest`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from agentrl.errors import WeightSyncError
from agentrl.weights.sync import NamedTensors, WeightSync

__all__ = ["NamedTensors", "WeightSync", "WeightSyncError", "make_weight_sync"]


def make_weight_sync(
    base_urls: str | list[str],
    transport: Literal["shm", "disk", "http"] = "shm",
    *,
    engine: Literal["embedded", "vllm"] = "embedded",
    work_dir: str | Path | None = None,
    timeout: float = 300.0,
    local_urls: list[str] | None = None,
    bucket_mb: float | None = None,
    api_key: str | None = None,
    vllm_transfer: Literal["disk", "nccl"] = "disk",
) -> WeightSync:
    """The WeightSync for these engines: agentrl's embedded engine (shm/disk/http) or ``vllm serve``
    (``vllm_transfer``: disk or nccl, :func:`agentrl.weights.vllm.choose_transfer`).

    ``transport="http"``: ``local_urls`` are the engines on the trainer's host (they keep shm);
    the others are streamed to over HTTP in ``bucket_mb`` chunks (:mod:`agentrl.weights.network`).
    ``api_key``: the engines' key (default ``AGENTRL_API_KEY``); their weight routes need it.
    """
    if engine == "vllm":
        from agentrl.weights.vllm import VLLMWeightSync

        return VLLMWeightSync(base_urls, api_key=api_key, transfer=vllm_transfer, timeout=timeout)
    if engine != "embedded":
        raise ValueError(f"no weight sync for engine {engine!r}; use 'embedded' or 'vllm'")
    if transport == "http":
        from agentrl.weights.network import DEFAULT_BUCKET_MB, HttpWeightSync

        return HttpWeightSync(base_urls, local_urls=local_urls, bucket_mb=bucket_mb or DEFAULT_BUCKET_MB,
                              timeout=timeout, api_key=api_key)
    from agentrl.weights.push import EmbeddedWeightSync

    return EmbeddedWeightSync(base_urls, transport, work_dir=work_dir, timeout=timeout, api_key=api_key)
