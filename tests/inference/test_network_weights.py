"""Network weight transport (``inference.weight_transport = "http"``): chunks, checksums, versions,
and a push that a dead or hung engine cannot block.

Two real engines run as separate processes, each with its own temp root, and the trainer pushes
to them over HTTP only (no shared file: the engine never opens a path the trainer wrote).
"""

from __future__ import annotations

import asyncio
import glob
import os
import socket
import zlib

import httpx
import pytest
import torch
from testkit import perturbed_state

from agentrl.errors import RequestError, WeightSyncError
from agentrl.inference import start_embedded_engine
from agentrl.weights import make_weight_sync
from agentrl.weights.network import ChunkReceiver, HttpWeightSync, chunk_plan

# ----------------------------------------------------------------------------- the receiver alone


def _plan(data: bytes, bucket: int) -> list[list[int]]:
    return [[o, n, zlib.crc32(data[o : o + n])] for o, n in chunk_plan(len(data), bucket)]


def test_receiver_checks_every_chunk_and_the_transfer():
    """Catches: a corrupted chunk loaded, a transfer committed with a chunk missing, a chunk of an
    older push written into a newer one, a chunk plan with a gap."""
    data = bytes(range(256)) * 4  # 1024 bytes: one float32 tensor of 256
    manifest = [{"name": "w", "dtype": "float32", "shape": [256], "offset": 0}]
    rx = ChunkReceiver()
    rx.begin("t1", len(data), manifest, _plan(data, 300), 3, False)
    with pytest.raises(RequestError, match="CRC-32"):
        rx.chunk("t1", 0, b"\xff" + data[1:300])
    rx.chunk("t1", 0, data[:300])
    with pytest.raises(RequestError, match="missing 3 of 4"):
        rx.take("t1")
    rx.begin("t2", len(data), manifest, _plan(data, 512), 4, False)  # a new push replaces t1
    with pytest.raises(RequestError, match="not in progress"):
        rx.chunk("t1", 1, data[300:600])
    rx.chunk("t2", 1, data[512:])
    rx.chunk("t2", 0, data[:512])
    done = rx.take("t2")
    assert done.version == 4 and bytes(done.buffer.numpy()) == data
    with pytest.raises(RequestError, match="expected 300"):
        rx.begin("t3", len(data), manifest, [[0, 300, 0], [400, 624, 0]], 5, False)


# ----------------------------------------------------------------------------- real engines over HTTP


async def _greedy_and_version(http: httpx.AsyncClient, eng, prompt: list[int]) -> tuple[list[int], int]:
    body = {"model": eng.model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}
    r = (await http.post(eng.base_url + "/completions", json=body)).json()
    version = (await http.get(eng.root_url + "/get_weight_version")).json()["weight_version"]
    return r["choices"][0]["token_ids"], version


KEY = "arl-test-network-weights"  # both engines share the run's key


def _hung_server() -> tuple[socket.socket, str]:
    """A port that accepts connections and never answers (a hung engine)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s, f"http://127.0.0.1:{s.getsockname()[1]}/v1"


@pytest.mark.slow
def test_http_push_reaches_each_engine_on_its_own(tmp_path, small_model):
    """Two engines with separate temp roots get the weights over HTTP only; a hung engine times
    out without holding the others back; an engine that was down rejoins at the current version.

    Catches: a push that goes through a file (a shm/disk file appears), weights that arrive
    corrupted or misplaced (greedy tokens differ from the pushed model's), a version not applied,
    one slow engine failing the whole push, an engine left behind for good."""
    model = small_model
    roots = [tmp_path / "node-a", tmp_path / "node-b"]
    for r in roots:
        r.mkdir()
    engines = [start_embedded_engine(model, max_batch_size=4, max_model_len=64, device="cpu",
                                     env={"TMPDIR": str(r), "OMP_NUM_THREADS": "1"}, api_key=KEY) for r in roots]
    hung, hung_url = _hung_server()
    prompt = [1, 40, 41, 42]
    try:
        async def scenario() -> None:
            sync = make_weight_sync([e.base_url for e in engines] + [hung_url], "http", local_urls=[],
                                    bucket_mb=0.0625, timeout=4.0, api_key=KEY)
            assert isinstance(sync, HttpWeightSync) and not sync.local
            async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as http:
                state, ref = perturbed_state(model, seed=1)
                await sync.push(state, version=1)
                assert [r.ok for r in sync.results] == [True, True, False]
                assert "timed out" in sync.behind[url_root(hung_url)]
                assert sync.last_stats["chunks"] > 1, "the model spans several buckets"
                expect = _reference_greedy(ref, prompt)
                for eng in engines:
                    assert await _greedy_and_version(http, eng, prompt) == (expect, 1)
                # engine b goes down: the push still reaches a, and b rejoins on the next one
                engines[1].stop()
                state2, ref2 = perturbed_state(model, seed=2)
                await sync.push(state2, version=2)
                assert url_root(engines[1].base_url) in sync.behind
                assert await _greedy_and_version(http, engines[0], prompt) == (_reference_greedy(ref2, prompt), 2)
                await asyncio.to_thread(engines[1].restart)
                assert (await _greedy_and_version(http, engines[1], prompt))[1] == 0  # back on the base weights
                state3, ref3 = perturbed_state(model, seed=3)
                await sync.push(state3, version=3)
                assert url_root(engines[1].base_url) not in sync.behind
                expect3 = _reference_greedy(ref3, prompt)
                for eng in engines:
                    assert await _greedy_and_version(http, eng, prompt) == (expect3, 3)
            await sync.close()
            # no engine at all: the push says so, naming each engine's cause
            dead = make_weight_sync([hung_url], "http", local_urls=[], timeout=1.0)
            with pytest.raises(WeightSyncError, match="reached no engine.*timed out"):
                await dead.push(state3, version=4)
            await dead.close()

        asyncio.run(scenario())
        assert not glob.glob(f"/dev/shm/agentrl-weights-{os.getpid()}-*"), "the http push wrote a shared file"
        for r in roots:
            assert not list(r.iterdir()), f"an engine wrote into its temp root {r}"
    finally:
        hung.close()
        for eng in engines:
            eng.stop()


def url_root(url: str) -> str:
    return url.removesuffix("/v1")


def _reference_greedy(model: torch.nn.Module, prompt: list[int], n: int = 6) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
