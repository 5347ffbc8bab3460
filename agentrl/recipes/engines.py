"""Phase 4 of `agentrl run`: the policy's engines, the weight push into them, and their supervision.

:func:`open_engines` starts the embedded engine(s) on the warm start (or Ray actors, or
connects to ``inference.base_url``) behind one :class:`~agentrl.inference.PolicyClient`;
:class:`WeightPusher` sends the trainer's weights (or only its LoRA factors) through the
run's :class:`~agentrl.weights.WeightSync`; :class:`Supervisor` restarts an engine that died.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import Config, InferenceConfig, check_devices
from agentrl.errors import AgentrlError, WeightSyncError
from agentrl.metrics import LiveProgress
from agentrl.protocols import TrainingBuffer


@dataclass
class Engines:
    """The policy's endpoints: one client over all of them, the weight sync, engines we started."""

    policy: Any  # agentrl.inference.Policy (or the Ray pool): base_urls, model, stop()
    client: Any  # agentrl.inference.PolicyClient
    sync: Any  # agentrl.weights.WeightSync
    on_vllm: bool
    make_sync: Any = None  # policy -> WeightSync for its current addresses (rebuilt after a restart)
    sync_args: dict[str, Any] = field(default_factory=dict)  # make_weight_sync's settings (a trainer actor's own sync)
    retired_syncs: list[Any] = field(default_factory=list)

    async def close(self) -> None:
        for sync in [self.sync, *self.retired_syncs]:
            with contextlib.suppress(Exception):
                await sync.close()
        await self.client.close()
        await asyncio.to_thread(self.policy.stop)

    def all_alive(self) -> bool:
        """No engine agentrl started has died (checked before each group starts)."""
        dead = getattr(self.policy, "dead", None)
        return dead is None or not dead()

    def rebind(self) -> list[int]:
        """Engines that came back at a new address (a restarted Ray actor): the client's endpoint
        follows it (its pins and load stay) and the weight sync is rebuilt for the new addresses."""
        changed = self.client.rebase(list(self.policy.base_urls))
        if changed and self.make_sync is not None:
            old, self.sync = self.sync, self.make_sync(self.policy)
            self.retired_syncs.append(old)  # closed with the engines (a push may be using it now)
        return changed

    async def check_key(self) -> None:
        """Every engine takes the run's key on its control routes (before any work: a weight push
        it refuses later would end the run after its first step)."""
        for ep in self.client.endpoints:
            try:
                await ep.get("/get_weight_version")
            except Exception as e:  # down, or a server without the route: the probes say so
                if getattr(e, "status", None) in (401, 403):
                    raise AgentrlError(
                        f"the engine at {ep.root} refused this run's API key (HTTP {e.status}): set "
                        "AGENTRL_API_KEY to that engine's key (the file `agentrl serve` printed) and run again"
                    ) from None

    async def metrics(self) -> dict[str, Any]:
        """``engine/...``: restarts, client retries, and per engine (index i) its weight version,
        running sequences and the requests this process sent it (what the engine reports, when it can)."""
        row: dict[str, Any] = {"engine/retries": self.client.retries}
        for i, ep in enumerate(self.client.endpoints):
            row[f"engine/{i}/requests"] = ep.calls
            row[f"engine/{i}/load"] = ep.load
            try:
                if self.on_vllm:  # vLLM's own routes: /weight_info and Prometheus text
                    version = (await ep.get("/weight_info"))["weight_version"]
                    row[f"engine/{i}/version"] = int(version) if str(version).isdigit() else version
                    stats = prometheus_values(await ep.text("/metrics"))
                    row[f"engine/{i}/running"] = stats.get("vllm:num_requests_running", 0.0)
                    row[f"engine/{i}/generated_tokens"] = stats.get("vllm:generation_tokens_total", 0.0)
                else:
                    row[f"engine/{i}/version"] = (await ep.get("/get_weight_version"))["weight_version"]
                    stats = await ep.get("/metrics")
                    row[f"engine/{i}/running"] = stats["running"]
                    row[f"engine/{i}/generated_tokens"] = stats["total_generated_tokens"]
                    row[f"engine/{i}/steps"] = stats.get("steps", 0)
                    if stats.get("draft_tokens"):  # n-gram speculation on: how many drafts it kept
                        row[f"engine/{i}/draft_tokens"] = stats["draft_tokens"]
                        row[f"engine/{i}/draft_acceptance"] = stats["accepted_draft_tokens"] / stats["draft_tokens"]
            except Exception:  # down, restarting, or another engine: the row says nothing rather than fail
                row[f"engine/{i}/down"] = 1
        return row

    async def align(self, pusher: WeightPusher, version: int) -> None:
        """Before the first rollout: the engines serve the trainer's weights, named ``version``.

        Engines agentrl started hold the warm start (version 0); at a resumed step they get a
        push.  An external vLLM gets the warm start pushed too (its weights are unknown): a run
        whose server cannot take a push stops here in one line, before it trains a policy the
        server does not serve.
        """
        external = not getattr(self.policy, "started", True)
        if self.on_vllm and external:
            try:
                await pusher.push(version)
            except WeightSyncError as e:
                raise AgentrlError(
                    f"cannot push the warm start into {', '.join(self.policy.base_urls)} ({e}); start that vllm "
                    "serve with VLLM_SERVER_DEV_MODE=1 on a filesystem it shares with the trainer, or drop "
                    "inference.base_url so agentrl starts vLLM itself"
                ) from None
        elif version > 0:
            await pusher.push(version)
        elif self.on_vllm:
            await self.sync.set_version(version)  # vLLM's weight version names the warm start
        self.tag_version(version)

    def tag_version(self, version: int) -> None:
        # a server that reports no per-token versions (vLLM's /v1/completions): the client tags
        # tokens with the version current when each request started (never newer than the truth)
        self.client.default_version = version


def open_engines(cfg: Config, start_model: Path, threads: int, api_key: str | None = None) -> Engines:
    """Start the engines on the warm start (or connect to ``inference.base_url``); ``api_key``: the
    run's key, which its engines require and its clients and weight pushes send."""
    from agentrl.inference import PolicyClient, engine_devices, open_policy
    from agentrl.weights import make_weight_sync

    ic: InferenceConfig = cfg.inference
    if ic.engine == "vllm":
        return open_vllm(cfg, start_model, threads, api_key)
    args = ic.engine_args()
    n = cfg.cluster.num_inference if cfg.cluster.backend == "local" and not ic.base_url else 1
    # one torch thread per engine by default; a set trainer.num_threads is per engine
    per_engine = threads
    thread_env = {"OMP_NUM_THREADS": str(per_engine)}
    if cfg.cluster.backend == "ray" and not ic.base_url:
        from agentrl.distributed.ray_backend import open_ray_policy

        policy = open_ray_policy(start_model, cfg.cluster, args, served_model_name=ic.model_name, env=thread_env,
                                 api_key=api_key)
    else:
        try:
            devices = None if ic.base_url else engine_devices(ic.device, n, gpu_count(ic.device), cfg.trainer.device)
        except ValueError as e:
            raise AgentrlError(str(e)) from None
        policy = open_policy(start_model, ic.base_url or None, args=args, served_model_name=ic.model_name,
                             env=thread_env, tool_parser=ic.tool_parser, engines=n, devices=devices, api_key=api_key)
    sync_args = {"transport": ic.weight_transport, "engine": "embedded", "bucket_mb": ic.weight_bucket_mb,
                 "timeout": ic.weight_push_timeout_s, "api_key": policy.api_key}  # fmt: skip

    def make_sync(pol: Any) -> Any:
        return make_weight_sync(list(pol.base_urls), local_urls=local_engine_urls(pol), **sync_args)

    try:
        sync = make_sync(policy)
    except ValueError as e:
        policy.stop()
        raise AgentrlError(f"weight sync: {e}") from None
    # prompts are rendered in-process with the served model's own tokenizer: /tokenize round
    # trips cost more CPU than the tiny model's decode step
    client = PolicyClient(
        policy.base_urls, policy.model, timeout=ic.request_timeout_s, max_retries=ic.max_retries,
        tokenizer=str(start_model) if (start_model / "tokenizer_config.json").is_file() else None,
        requests_per_s=cfg.rollout.requests_per_s, tool_parser=ic.tool_parser, api_key=policy.api_key,
        probe_settings=probe_settings(cfg),  # its probe names inference.base_url, not --base-url
    )
    return Engines(policy, client, sync, False, make_sync, sync_args)


def probe_settings(cfg: Config) -> Any:
    """The names the run's endpoint probes give (:class:`agentrl.inference.probe.Settings`):
    ``inference.base_url`` and ``AGENTRL_API_KEY``, or the engines the run started."""
    from agentrl.inference import probe

    return probe.RUN if cfg.inference.base_url else probe.STARTED


def preflight(cfg: Config) -> None:
    """What must hold before anything starts (the warm start takes minutes): devices this host
    has, endpoints at ``inference.base_url`` that answer and take the run's key, an engine and
    weight transfer that can run here.  Raises :class:`AgentrlError`, one line."""
    check_devices(cfg)  # a CUDA device this host lacks: one line naming the setting
    ic = cfg.inference
    if ic.base_url:
        check_endpoints(cfg)
    if ic.engine == "vllm":
        _vllm_preflight(cfg)


def check_endpoints(cfg: Config, timeout: float = 10.0) -> None:
    """Every ``inference.base_url`` answers ``GET /v1/models`` within ``timeout`` seconds and does
    not refuse the run's key (``AGENTRL_API_KEY``) on its weight routes; ``inference.model_name``,
    where set, is a model it serves.  Before the warm start, so a typo costs seconds, not the SFT."""
    import asyncio

    from agentrl.auth import client_key
    from agentrl.inference import probe

    ic = cfg.inference
    asyncio.run(probe.reachable(ic.base_url, client_key(), settings=probe.RUN, control_route="/get_weight_version",
                                model=ic.model_name or None, timeout=timeout))  # fmt: skip


def _vllm_preflight(cfg: Config) -> None:
    """vLLM's part of :func:`preflight`: a weight transfer that can run here, and vLLM's CLI when
    agentrl starts the servers."""
    ic = cfg.inference
    from agentrl.inference.vllm import find_vllm
    from agentrl.weights.vllm import choose_transfer

    try:
        choose_transfer(ic.vllm_weight_transfer)
    except ValueError as e:
        raise AgentrlError(str(e)) from None
    if not ic.base_url:
        if cfg.cluster.backend == "ray":
            raise AgentrlError("inference.engine = \"vllm\" under cluster.backend = \"ray\" needs inference.base_url "
                               "(agentrl starts vLLM itself only in local mode)")  # fmt: skip
        find_vllm(ic.vllm_command)


def open_vllm(cfg: Config, start_model: Path, threads: int, api_key: str | None = None) -> Engines:
    """``vllm serve`` on the warm start (from ``.venv-vllm``), or the servers at ``inference.base_url``.

    Every check that can fail runs before a server starts (one line each): the weight transfer
    (NCCL needs a GPU and vLLM in this venv), vLLM's CLI.  The run's key guards every route of
    the servers agentrl starts; an external server gets ``AGENTRL_API_KEY``, if set.
    """
    from agentrl.auth import client_key, new_key
    from agentrl.inference import PolicyClient
    from agentrl.inference.launcher import Policy
    from agentrl.inference.vllm import VLLMArgs, find_vllm, host_has_gpu, start_vllm_server
    from agentrl.tool_format import chat_template_of, resolve_tool_parser
    from agentrl.weights import make_weight_sync
    from agentrl.weights.vllm import choose_transfer

    ic = cfg.inference
    _vllm_preflight(cfg)  # the endpoints were checked before the warm start (preflight)
    transfer = choose_transfer(ic.vllm_weight_transfer)
    local_tok = start_model if (start_model / "tokenizer_config.json").is_file() else None
    parser = resolve_tool_parser(ic.tool_parser, chat_template_of(local_tok) if local_tok else None).name
    if ic.base_url:
        key = api_key or client_key()
        policy = Policy(list(ic.base_url), ic.model_name or start_model.name, tokenizer_dir=local_tok,
                        tool_parser=parser)  # fmt: skip
    else:
        key = api_key or client_key() or new_key()
        vllm = find_vllm(ic.vllm_command)
        args = VLLMArgs(max_model_len=ic.max_model_len, max_num_seqs=ic.max_batch_size, kv_cache_gb=ic.vllm_kv_cache_gb,
                        gpu=host_has_gpu(), enforce_eager=ic.vllm_enforce_eager, nccl=transfer == "nccl",
                        tool_parser=parser, extra_args=tuple(ic.vllm_args))  # fmt: skip
        n = cfg.cluster.num_inference
        # threads per engine as for the embedded engine, and no core pinning: the trainer shares these cores
        env = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        handles: list[Any] = []
        try:
            for _ in range(n):
                handles.append(start_vllm_server(start_model, api_key=key, args=args, vllm=vllm,
                                                 served_model_name=ic.model_name, env=env))  # fmt: skip
        except BaseException:
            for h in handles:
                with contextlib.suppress(Exception):
                    h.stop()
            raise
        policy = Policy([h.base_url for h in handles], handles[0].model, handles, tokenizer_dir=local_tok,
                        tool_parser=parser)  # fmt: skip
    sync_args = {"engine": "vllm", "api_key": key, "vllm_transfer": transfer, "timeout": ic.weight_push_timeout_s}

    def make_sync(pol: Any) -> Any:
        return make_weight_sync(list(pol.base_urls), **sync_args)

    # the client salts prefix-cache keys with the weight version: no K/V of old weights is reused
    client = PolicyClient(
        policy.base_urls, policy.model, api_key=key or "EMPTY", timeout=ic.request_timeout_s,
        max_retries=ic.max_retries, tokenizer=str(local_tok) if local_tok else None,
        requests_per_s=cfg.rollout.requests_per_s, cache_salt=True, tool_parser=parser,
        support_logprobs=VLLMArgs.max_logprobs,  # K of a top-p/min-p sample (vLLM reports no token_support)
        vllm_generate=policy.started,  # servers agentrl started tag every token with its weight version
        probe_settings=probe_settings(cfg),
    )  # fmt: skip
    return Engines(policy, client, make_sync(policy), True, make_sync, sync_args)


def prometheus_values(text: str) -> dict[str, float]:
    """Prometheus exposition text → metric name: value, summed over label sets (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def gpu_count(device: str) -> int:
    """GPUs the local engines may spread over (none looked for when the device is explicit)."""
    if device not in ("auto", "cuda"):
        return 0
    import torch

    return torch.cuda.device_count()


def local_engine_urls(policy: Any, node_id: str | None = None) -> list[str]:
    """Engines on the trainer's host (they keep shared memory under ``weight_transport = "http"``):
    what a Ray pool says by node (``node_id``: the trainer's, default this process's), else the
    loopback addresses."""
    from urllib.parse import urlparse

    if hasattr(policy, "local_urls"):
        return list(policy.local_urls(node_id))
    return [u for u in policy.base_urls if urlparse(u).hostname in ("127.0.0.1", "localhost", "::1")]


class WeightPusher:
    """Trainer → engines: full weights, or only the LoRA factors to an engine that merges them."""

    def __init__(self, trainer: Any, engines: Engines, lora_push: str):
        # vLLM's weight routes take whole tensors, so it gets the merged matrices; on a CPU host
        # shm with merged matrices is the one place merged is faster (benchmarks/weight_push.py)
        self.trainer, self.engines = trainer, engines
        self.adapters = trainer.lora and not engines.on_vllm and lora_push == "adapters"

    async def push(self, version: int) -> float:
        remote = getattr(self.trainer, "push_weights", None)
        if remote is not None:  # a trainer actor pushes from its own process, to the engines' current addresses
            policy = self.engines.policy
            seconds = await remote(version, list(policy.base_urls), local_engine_urls(policy, self.trainer.node_id),
                                   self.engines.sync_args, self.adapters)  # fmt: skip
        elif self.adapters:
            tensors = await asyncio.to_thread(self.trainer.adapter_tensors)
            seconds = await self.engines.sync.push(tensors, version, lora=True)
        else:
            seconds = await self.engines.sync.push(await asyncio.to_thread(self.trainer.named_tensors), version)
        self.engines.tag_version(version)
        return seconds

    @property
    def last_stats(self) -> dict[str, float]:
        """The last push's numbers (``bytes``, ...), from whichever process pushed."""
        remote = getattr(self.trainer, "last_push", None)
        return remote if remote is not None else getattr(self.engines.sync, "last_stats", {})


class Supervisor:
    """Restarts an embedded engine that died and brings it to the current weights.

    Its in-flight requests fail over to other engines or, with one engine, fail after the
    client's retries: those episodes are errored with kind ``endpoint``, never lost.  Pushes and
    restarts hold one lock, so a push never races a restart.
    """

    def __init__(self, engines: Engines, pusher: WeightPusher, buffer: TrainingBuffer, live: LiveProgress,
                 on_change: Callable[[list[str], bool], Awaitable[None]] | None = None):  # fmt: skip
        """``on_change(urls, down)``: told when an engine goes down or comes back (maybe at a new
        address): rollout workers in other processes hold admission and follow the address."""
        self.engines, self.pusher, self.buffer, self.live = engines, pusher, buffer, live
        self.lock = asyncio.Lock()
        self.restarts = 0
        self.on_change = on_change
        self._told: tuple[tuple[str, ...], bool] | None = None

    async def _tell(self) -> None:
        now = (tuple(self.engines.policy.base_urls), bool(self._dead()))
        if self.on_change is not None and now != self._told:
            await self.on_change(list(now[0]), now[1])
            self._told = now

    def _dead(self) -> list[Any]:
        dead = getattr(self.engines.policy, "dead", None)
        return dead() if dead is not None else []

    async def _refresh(self) -> None:
        refresh = getattr(self.engines.policy, "refresh", None)  # Ray: a health check, off the event loop
        if refresh is not None:
            await asyncio.to_thread(refresh)

    async def watch(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            await self._refresh()
            await self._tell()
            if self._dead():
                await self.revive()

    async def revive(self) -> None:
        async with self.lock:
            for engine in self._dead():
                proc = getattr(engine, "proc", None)
                what = engine.describe() if hasattr(engine, "describe") else f"engine {engine.base_url}"
                cause = f" (exit {proc.returncode})" if proc is not None else ""
                self.live.note(f"{what} died{cause}; restarting it")
                await asyncio.to_thread(engine.restart)
                self.restarts += 1
            self.engines.rebind()  # a restarted actor may serve from a new address
            await self.pusher.push(self.buffer.version)  # the restarted engine is back on the base weights
            await self._tell()  # workers: the new address, admission open again

    async def push(self, version: int) -> float:
        """Push, waiting out (and repairing) an engine that died under it."""
        from agentrl.errors import WeightSyncError

        for _ in range(3):
            async with self.lock:
                try:
                    return await self.pusher.push(version)
                except WeightSyncError:
                    await self._refresh()
                    if not self._dead():
                        raise
            await self.revive()
        return await self.pusher.push(version)
