"""VLLMWeightSync's NCCL path against a recorded copy of vLLM 0.32's dev-mode RL routes.

The fake server mirrors the request shapes of vLLM's router
(vllm/entrypoints/rl/online/api_router.py): body keys, query params, 400 on missing fields.
NCCL needs a GPU: the real path runs in benchmarks/gpu_check.sh; the disk path runs against
the real vLLM in test_vllm_real.py.
"""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import time

import pytest
import torch
import uvicorn
from fastapi import Body, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse

from agentrl.inference.vllm import VLLMArgs, vllm_serve_command
from agentrl.weights import WeightSyncError
from agentrl.weights.vllm import VLLMWeightSync

INIT_FIELDS = {"master_address", "master_port", "nccl_unique_id_b64", "rank_offset", "world_size", "packed",
               "packed_buffer_size_bytes", "packed_num_buffers"}  # fmt: skip


def fake_vllm(world_size: int, *, fail_update: bool = False) -> tuple[FastAPI, list]:
    app, calls = FastAPI(), []

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)):
        calls.append(("get_world_size", None))
        return {"world_size": world_size}

    @app.post("/init_weight_transfer_engine")
    async def init(request: Request):
        # vLLM parses init_info into NCCLWeightTransferInitInfo(**init_info): unknown keys fail, and
        # exactly one rendezvous is named (a base64 unique id, or a TCPStore address and port)
        info = (await request.json()).get("init_info")
        if info is None:
            raise HTTPException(400, "Missing 'init_info' in request body")
        if not set(info) <= INIT_FIELDS or not {"rank_offset", "world_size"} <= set(info):
            raise HTTPException(500, f"Invalid init_info for NCCLWeightTransferEngine: {sorted(info)}")
        if ("nccl_unique_id_b64" in info) == ("master_address" in info or "master_port" in info):
            raise HTTPException(500, "pass nccl_unique_id_b64 OR master_address/master_port, not both")
        calls.append(("init", info))
        return {"message": "Weight transfer initialized"}

    @app.post("/pause")
    async def pause(mode: str = Query("abort")):
        calls.append(("pause", mode))
        return {"status": "paused"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(False), reset_external: bool = Query(False)):
        calls.append(("reset_prefix_cache", reset_running_requests))
        return {"status": "ok"}

    @app.post("/resume")
    async def resume():
        calls.append(("resume", None))
        return {"status": "resumed"}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        info = (await request.json()).get("update_info")
        if info is None:
            raise HTTPException(400, "Missing 'update_info' in request body")
        calls.append(("update_weights", info))
        if fail_update:
            raise HTTPException(500, "boom")
        return {"message": "Weights updated"}

    @app.post("/update_weight_version")
    async def update_weight_version(new_version: str = Body(embed=True)):
        calls.append(("update_weight_version", new_version))
        return {"success": True, "new_version": new_version}

    @app.post("/start_weight_update")
    async def start():
        calls.append(("start_weight_update", None))
        return {"message": "Weight update started"}

    @app.post("/finish_weight_update")
    async def finish(weight_version: str | None = Body(None, embed=True)):
        calls.append(("finish_weight_update", weight_version))
        return {"message": "Weight update finished"}

    return app, calls


class Served:
    def __init__(self, app: FastAPI):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(5)


WEIGHTS = {"model.embed_tokens.weight": torch.zeros(8, 4), "lm_head.weight": torch.ones(8, 4, dtype=torch.bfloat16)}


class FakeNccl:
    """Stands in for vLLM's NCCL side (which needs CUDA): mints ids and returns an engine that makes
    the same calls on its client as vLLM 0.32's ``NCCLTrainerWeightTransferEngine`` (start, update,
    finish per round)."""

    def __init__(self, log):
        self.log = log

    def unique_id(self):
        return os.urandom(128)

    def sender(self, unique_id, world_size, control, source):
        self.log.append(("join", unique_id, world_size))
        return FakeTrainerEngine(control, source, self.log)


class FakeTrainerEngine:
    def __init__(self, control, source, log):
        self.client, self.source, self.log = control, source, log

    def send_weights(self):
        items = list(self.source)
        self.log.append(("send", [n for n, _ in items]))
        self.client.start_weight_update()
        self.client.update_weights({"names": [n for n, _ in items], "dtype_names": [str(t.dtype).split(".")[-1]
                                    for _, t in items], "shapes": [list(t.shape) for _, t in items]})  # fmt: skip
        self.client.finish_weight_update()

    def shutdown(self):
        self.log.append(("shutdown",))


def make_sync(urls, log):
    return VLLMWeightSync(urls, api_key="k", transfer="nccl", nccl=FakeNccl(log))


def test_nccl_push_follows_vllm_route_contract_across_two_engines():
    (app1, calls1), (app2, calls2) = fake_vllm(1), fake_vllm(2)
    log = []
    with Served(app1) as u1, Served(app2) as u2:

        async def go():
            sync = make_sync([u1, u2], log)
            await sync.push(WEIGHTS, version=1)
            await sync.push(WEIGHTS, version=2)
            await sync.close()

        asyncio.run(go())
    # one NCCL group per server, the trainer rank 0 in each: world = 1 + the server's workers; the
    # workers get the id the trainer joined with over the keyed route, and no TCPStore address
    joins = [entry[1:] for entry in log if entry[0] == "join"]
    inits = [a for calls in (calls1, calls2) for n, a in calls if n == "init"]
    assert [w for _, w in joins] == [2, 3] and joins[0][0] != joins[1][0]
    assert inits == [{"nccl_unique_id_b64": base64.b64encode(uid).decode(), "rank_offset": 1, "world_size": w,
                      "packed": True} for uid, w in joins]  # fmt: skip
    order = [name for name, _ in calls1 if name not in ("get_world_size", "init")]
    # no request after the swap may reuse KV blocks computed by the old weights
    assert order == ["pause", "start_weight_update", "update_weights", "finish_weight_update", "update_weight_version",
                     "reset_prefix_cache", "resume"] * 2  # fmt: skip
    assert [a for n, a in calls1 if n == "pause"] == ["keep", "keep"]
    assert [a for n, a in calls2 if n == "finish_weight_update"] == ["1", "2"]
    info = next(a for n, a in calls1 if n == "update_weights")
    assert info == {"names": ["model.embed_tokens.weight", "lm_head.weight"], "dtype_names": ["float32", "bfloat16"],
                    "shapes": [[8, 4], [8, 4]]}  # fmt: skip
    assert ("shutdown",) in log


def test_a_refused_init_fails_the_push_instead_of_waiting_in_ncclcomminit():
    """NCCL's init has no timeout: when the route that carries the id fails, the workers never come,
    so the trainer's join (here one that waits, as NCCL's would) must not be what the push waits on."""
    app, _ = fake_vllm(1)
    never = threading.Event()

    class Waits(FakeNccl):
        def sender(self, unique_id, world_size, control, source):
            never.wait()

    @app.middleware("http")
    async def refuse_init(request, call_next):
        if request.url.path.endswith("/init_weight_transfer_engine"):
            return JSONResponse({"error": "bad key"}, status_code=401)
        return await call_next(request)

    with Served(app) as url:

        async def go():
            sync = VLLMWeightSync(url, api_key="k", transfer="nccl", nccl=Waits([]))
            try:
                with pytest.raises(WeightSyncError, match="init_weight_transfer_engine -> HTTP 401"):
                    await asyncio.wait_for(sync.push(WEIGHTS, version=1), 30)
            finally:
                await sync.close()

        asyncio.run(go())
    never.set()


def test_a_failed_update_raises_and_still_resumes_generation():
    app, calls = fake_vllm(1, fail_update=True)
    with Served(app) as url:

        async def go():
            sync = make_sync(url, [])
            try:
                with pytest.raises(WeightSyncError, match="update_weights"):
                    await sync.push(WEIGHTS, version=1)
            finally:
                await sync.close()

        asyncio.run(go())
    assert calls[-1] == ("resume", None)


def test_serve_command_sets_dtype_eager_memory_guard_and_weight_transfer():
    cpu = vllm_serve_command(["/v/bin/vllm"], "/models/m", port=8001, served_model_name="m",
                             args=VLLMArgs(max_model_len=2048))  # fmt: skip
    assert cpu[:3] == ["/v/bin/vllm", "serve", "/models/m"]
    joined = " ".join(cpu)
    for flag in ("--dtype float32", "--logprobs-mode processed_logprobs", "--tool-call-parser hermes",
                 "--max-model-len 2048", "--port 8001", "--host 127.0.0.1", "--enforce-eager",
                 "--generation-config vllm", "--middleware agentrl_vllm_guard.KeyGuard"):  # fmt: skip
        assert flag in joined, flag
    assert "--weight-transfer-config" not in joined and "--api-key" not in joined  # the key never goes on argv
    gpu = " ".join(vllm_serve_command(["vllm"], "/m", port=1, served_model_name="m",
                                      args=VLLMArgs(gpu=True, nccl=True, kv_cache_gb=3)))  # fmt: skip
    assert '--weight-transfer-config {"backend": "nccl"}' in gpu and "--enforce-eager" not in gpu
    assert f"--kv-cache-memory-bytes {3 * 2**30}" in gpu


def test_tokens_from_a_server_without_versions_get_the_version_current_at_request_start():
    """vLLM returns no per-token versions: a request spanning a push keeps the older version."""
    from agentrl.inference import PolicyClient
    from agentrl.types import SamplingParams

    app = FastAPI()
    started = threading.Event()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        started.set()
        await asyncio.sleep(0.3)
        return {"choices": [{
            "index": 0, "text": "ab", "finish_reason": "stop", "token_ids": [7, 8],
            "prompt_token_ids": body["prompt"], "logprobs": {"token_logprobs": [-0.1, -0.2]},
        }]}  # fmt: skip

    with Served(app) as url:

        async def go():
            client = PolicyClient(url, "m", default_version=3)
            task = asyncio.create_task(client.complete([1, 2], SamplingParams(max_tokens=2)))
            await asyncio.to_thread(started.wait, 5)
            client.default_version = 4  # a weight push lands while the request is in flight
            (out,) = await task
            later = await client.complete([1, 2], SamplingParams(max_tokens=2))
            await client.close()
            return out, later[0]

        out, later = asyncio.run(go())
    assert out.versions == [3, 3] and out.token_ids == [7, 8] and out.logprobs == [-0.1, -0.2]
    assert later.versions == [4, 4]


def test_a_vllm_cli_another_user_could_have_placed_is_refused(tmp_path, monkeypatch):
    """``.venv-vllm/bin/vllm`` is found in the working directory and runs with the run's key in its
    environment: one in a directory others can write to is refused, in one line, not run."""
    from agentrl.errors import EngineStartError
    from agentrl.inference.vllm import find_vllm

    exe = tmp_path / ".venv-vllm" / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert find_vllm() == [str(exe)]
    exe.parent.chmod(0o777)
    with pytest.raises(EngineStartError, match=r"bin is writable by others .*inference.vllm_command"):
        find_vllm()
    from agentrl.auth import _own_group

    exe.parent.chmod(0o775)  # umask 002 with a private group (Ubuntu's default): only we are in it
    if _own_group(exe.parent.stat().st_gid):
        assert find_vllm() == [str(exe)]
    exe.parent.chmod(0o755)
    exe.chmod(0o757)
    with pytest.raises(EngineStartError, match="vllm is writable by others"):
        find_vllm()
