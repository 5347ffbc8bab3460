"""Network weight transport (``inference.weight_transport = "http"``): chunks, checksums, versions,
and a push that a dead or hung engine cannot block.

Two real engines run as separate processes, each with its own temp root, and the trainer pushes
to them over HTTP only (no shared file: the engine never opens a path the trainer wrote).
"""

from __future__ import annotations

import asyncio
import os
import socket

import httpx
import pytest
import torch
from testkit import perturbed_state
from transformers import AutoModelForCausalLM

from agentrl.auth import auth_headers
from agentrl.errors import RequestError, WeightSyncError
from agentrl.inference import start_embedded_engine
from agentrl.weights import make_weight_sync
from agentrl.weights.manifest import layout, sign_body, signature
from agentrl.weights.network import HttpWeightSync, chunk_plan
from agentrl.weights.receive import WeightReceiver

KEY = "arl-network-test-key"

# ----------------------------------------------------------------------------- the receiver alone


class StubEngine:
    """What the receiver needs of an engine, as strict as the real one's update_weights (the real
    engine runs the same receiver in the tests below)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.version = model, 0

    def update_weights(self, apply, version=None) -> int:
        with torch.no_grad():
            apply(self.model)
        self.version = self.version + 1 if version is None else int(version)
        return self.version


def _begin(rx, transfer, data, manifest, bucket, version, key=KEY):
    body = {"transfer": transfer, "transport": "http", "weight_version": version, "size": len(data),
            "manifest": manifest, "lora": False, "chunks": [[o, n] for o, n in chunk_plan(len(data), bucket)]}
    return rx.begin(sign_body(key, "begin", body))


def _chunk(rx, transfer, i, piece, key=KEY):
    rx.chunk(transfer, i, piece, signature(key, "chunk", transfer, str(i), piece))


def test_receiver_checks_every_chunk_and_the_transfer(small_model):
    """Catches: a forged or corrupted chunk loaded, a transfer committed with a chunk missing, a
    chunk of one push written into another, a stray begin replacing the transfer in progress, a
    transfer that never finishes holding the engine forever, a replayed transfer id."""
    model = AutoModelForCausalLM.from_pretrained(small_model)
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    manifest, size = layout(list(state.items()))
    data = bytearray(size)
    for e, t in zip(manifest, state.values(), strict=True):
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        data[e["offset"] : e["offset"] + len(raw)] = raw
    data = bytes(data)
    bucket = size // 3 + 1
    now = [0.0]
    rx = WeightReceiver(StubEngine(model), KEY, idle_timeout_s=60, clock=lambda: now[0])
    _begin(rx, "t1" * 8, data, manifest, bucket, 3)
    with pytest.raises(RequestError, match="signature"):  # flipped byte: the HMAC no longer matches
        rx.chunk("t1" * 8, 0, b"\xff" + data[1:bucket], signature(KEY, "chunk", "t1" * 8, "0", data[:bucket]))
    with pytest.raises(RequestError, match="signature"):
        _chunk(rx, "t1" * 8, 0, data[:bucket], key="someone-else")
    _chunk(rx, "t1" * 8, 0, data[:bucket])
    with pytest.raises(RequestError, match="missing 2 of 3"):
        rx.commit("t1" * 8, signature(KEY, "commit", "t1" * 8, ""))
    with pytest.raises(RequestError, match="in progress") as stray:  # a signed begin of another push waits
        _begin(rx, "t2" * 8, data, manifest, bucket, 4)
    assert stray.value.code == "transfer_in_progress"
    with pytest.raises(RequestError, match="signature"):  # only the owner aborts
        rx.abort("t1" * 8, "0" * 64)
    now[0] += 61  # the owner went quiet: its transfer expires, a new one may begin
    _begin(rx, "t2" * 8, data, manifest, bucket, 4)
    with pytest.raises(RequestError, match="not in progress"):
        _chunk(rx, "t1" * 8, 1, data[bucket : 2 * bucket])
    for i, (o, n) in enumerate(chunk_plan(size, bucket)):
        _chunk(rx, "t2" * 8, i, data[o : o + n])
    assert rx.commit("t2" * 8, signature(KEY, "commit", "t2" * 8, ""))["weight_version"] == 4
    for name, t in model.state_dict().items():
        assert torch.equal(t, state[name]), name
    with pytest.raises(RequestError, match="already used"):  # a recorded push cannot be replayed
        _begin(rx, "t2" * 8, data, manifest, bucket, 5)
    with pytest.raises(RequestError, match="starts at"):
        rx.begin(sign_body(KEY, "begin", {"transfer": "t3" * 8, "transport": "http", "weight_version": 5,
                                          "size": size, "manifest": manifest, "lora": False,
                                          "chunks": [[0, 300], [400, size - 400]]}))


# ----------------------------------------------------------------------------- real engines over HTTP


async def _greedy_and_version(http: httpx.AsyncClient, eng, prompt: list[int]) -> tuple[list[int], int]:
    body = {"model": eng.model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}
    r = (await http.post(eng.base_url + "/completions", json=body)).json()
    version = (await http.get(eng.root_url + "/get_weight_version")).json()["weight_version"]
    return r["choices"][0]["token_ids"], version


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

    Catches: a push that goes through a file (a disk file appears in an engine's temp root), weights that arrive
    corrupted or misplaced (greedy tokens differ from the pushed model's), a version not applied,
    one slow engine failing the whole push, an engine left behind for good."""
    model = small_model
    roots = [tmp_path / "node-a", tmp_path / "node-b"]
    for r in roots:
        r.mkdir()
    engines = [start_embedded_engine(model, max_batch_size=4, max_model_len=64, device="cpu",
                                     env={"TMPDIR": str(r), "OMP_NUM_THREADS": "1", "AGENTRL_API_KEY": KEY}) for r in roots]
    hung, hung_url = _hung_server()
    prompt = [1, 40, 41, 42]
    try:
        async def scenario() -> None:
            sync = make_weight_sync([e.base_url for e in engines] + [hung_url], "http", local_urls=[],
                                    bucket_mb=0.0625, timeout=4.0, api_key=KEY)
            assert isinstance(sync, HttpWeightSync) and not sync.local
            async with httpx.AsyncClient(timeout=30, headers=auth_headers(KEY)) as http:
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
            dead = make_weight_sync([hung_url], "http", local_urls=[], timeout=1.0, api_key=KEY)
            with pytest.raises(WeightSyncError, match="reached no engine.*timed out"):
                await dead.push(state3, version=4)
            await dead.close()

        asyncio.run(scenario())
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


def test_the_trainer_maps_only_an_agentrl_segment_whatever_the_engine_answers(tmp_path):
    """The engine answers the segment's path (signed); an engine that is not ours (a compromised
    one holds the key) could name any file of the trainer's of the right size: only a path shaped
    like the engine's own segments is mapped, so the push cannot overwrite, say, a source file."""
    from agentrl.weights.sync import map_segment

    victim = tmp_path / "train.py"
    victim.write_bytes(b"x" * 64)
    seg_dir = tmp_path / "agentrl-abcd"
    seg_dir.mkdir()
    seg = seg_dir / "w-0123456789abcdef.bin"
    seg.write_bytes(b"\0" * 64)
    (seg_dir / "w-0123456789abcdef.py").write_bytes(b"x" * 64)
    for path in (victim, seg_dir / "w-0123456789abcdef.py", tmp_path / "w-0123456789abcdef.bin"):
        if path.name.endswith(".bin"):
            path.write_bytes(b"x" * 64)
        with pytest.raises(WeightSyncError, match="not an agentrl segment path"):
            map_segment(str(path), 64)
    assert victim.read_bytes() == b"x" * 64
    with pytest.raises(WeightSyncError, match="not an agentrl segment path"):  # resolved against the trainer's cwd
        map_segment(os.path.relpath(seg), 64)
    buf = map_segment(str(seg), 64)
    buf[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    del buf
    assert seg.read_bytes()[:4] == bytes([1, 2, 3, 4])
