"""The weight routes under attack (issue "Nobody gets in", item 2): each test is one attack the
review ran against a real engine, and checks that it fails and changes nothing.

The engine's key is KEY.  "Unchanged" is checked from outside: the served version and the
greedy tokens of a fixed prompt (a different weight changes them; the tiny model is perturbed
strongly enough that each push here does).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from testkit import perturbed_state

from agentrl.auth import auth_headers
from agentrl.inference import start_embedded_engine
from agentrl.weights import WeightSyncError, make_weight_sync
from agentrl.weights.manifest import layout, sign_body, signature
from agentrl.weights.network import chunk_plan

pytestmark = pytest.mark.slow  # one engine, ~20 s per attack on 2 cores (the receiver's own test stays fast)
KEY = "arl-attack-test-key"
PROMPT = [1, 40, 41, 42]


@pytest.fixture(scope="module")
def target(model_dir, tmp_path_factory):
    """An engine of its own (these tests push weights), with a weights dir for disk reloads."""
    wdir = tmp_path_factory.mktemp("weights-dir")
    with start_embedded_engine(model_dir, max_batch_size=4, max_model_len=128, device="cpu",
                               env={"AGENTRL_API_KEY": KEY}, weights_dir=wdir) as eng:
        eng.weights_dir = wdir
        yield eng


def control() -> httpx.AsyncClient:
    """A caller that passes the engine's door (the bearer key) but signs nothing itself."""
    return httpx.AsyncClient(headers=auth_headers(KEY), timeout=60)


async def served(http: httpx.AsyncClient, eng) -> tuple[int, list[int]]:
    """(version, greedy tokens of PROMPT): what a client sees of the served weights."""
    body = {"model": eng.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    r = (await http.post(eng.base_url + "/completions", json=body)).json()
    version = (await http.get(eng.root_url + "/get_weight_version")).json()["weight_version"]
    return version, r["choices"][0]["token_ids"]


def full_manifest(model_dir) -> tuple[list[dict], int, dict[str, torch.Tensor]]:
    state, _ = perturbed_state(model_dir, seed=99)
    manifest, size = layout(list(state.items()))
    return manifest, size, state


def test_shm_route_cannot_write_or_grow_a_host_file(target, model_dir, tmp_path):
    """The review's critical attack: ``/update_weights_from_shm`` mapped any file the engine could
    write (a .py file overwritten, a 10-byte file grown to 1 GiB).  No route takes a path now:
    the engine writes only files it created in its own 0700 directory."""
    victim, small = tmp_path / "victim.py", tmp_path / "small.bin"
    victim.write_text("print('original')\n")
    small.write_bytes(b"0123456789")
    manifest = [{"name": "model.norm.weight", "dtype": "float32", "shape": [64], "offset": 0}]

    async def attack() -> None:
        async with control() as http:
            before = await served(http, target)
            for path, size in ((victim, 4096), (small, 1 << 30)):
                for _ in range(2):  # the second push is the one that copied bytes in
                    r = await http.post(target.root_url + "/update_weights_from_shm",
                                        json={"path": str(path), "size": size, "manifest": manifest})
                    assert r.status_code >= 400, r.text
            # a signed shm begin that names a path gets the engine's own segment, never that path
            m, size, _ = full_manifest(model_dir)
            body = {"transfer": "a" * 32, "transport": "shm", "weight_version": before[0], "size": size,
                    "manifest": m, "lora": False, "path": str(victim), "name": "../../victim.py"}
            answer = (await http.post(target.root_url + "/weights/begin", json=sign_body(KEY, "begin", body))).json()
            seg = Path(answer["path"])
            assert seg != victim and seg.parent.name.startswith("agentrl-")
            dst = os.stat(seg.parent, follow_symlinks=False)
            assert stat.S_IMODE(dst.st_mode) == 0o700 and dst.st_uid == os.getuid(), "the segment dir is private"
            assert os.stat(seg).st_size == size, "the segment is exactly the manifest's size"
            await http.post(target.root_url + "/weights/abort",
                            json={"transfer": "a" * 32, "signature": signature(KEY, "abort", "a" * 32)})
            assert await served(http, target) == before

    asyncio.run(attack())
    assert victim.read_text() == "print('original')\n"
    assert small.read_bytes() == b"0123456789" and small.stat().st_size == 10


def test_unsigned_or_forged_push_is_refused_and_changes_nothing(target, model_dir):
    """Anyone who reached the engine could replace its weights and set its version; a refusal
    named parameters and shapes.  Now every push needs the key's HMAC, checked first."""
    manifest, size, _ = full_manifest(model_dir)
    body = {"transfer": "b" * 32, "transport": "http", "weight_version": 50, "size": size, "manifest": manifest,
            "lora": False, "chunks": [[0, size]]}

    async def attack() -> None:
        async with control() as http:
            before = await served(http, target)
            tries = [
                ("/weights/begin", body),  # unsigned
                ("/weights/begin", sign_body("not-the-key", "begin", body)),  # forged
                ("/weights/begin", {**sign_body(KEY, "begin", body), "weight_version": 51}),  # altered after signing
                ("/update_weight_version", {"weight_version": 50}),
                ("/update_weight_version", {"weight_version": 50, "signature": signature("x", "version", "50")}),
                ("/update_weights_from_disk", {"model_path": "w.safetensors"}),
                ("/weights/commit", {"transfer": "b" * 32}),
                ("/weights/commit", {"transfer": "b" * 32, "signature": "é" * 64}),  # non-ASCII: was a 500
            ]
            for route, payload in tries:
                r = await http.post(target.root_url + route, json=payload)
                assert r.status_code == 401, (route, r.text)
                assert "model." not in r.text and "shape" not in r.text, "a refusal names nothing of the model"
            r = await http.put(target.root_url + "/weights/chunk", params={"transfer": "b" * 32, "index": 0},
                               content=b"\0" * 64, headers={"X-Agentrl-Signature": "0" * 64})
            assert r.status_code == 401
            r = await http.put(target.root_url + "/weights/chunk", params={"transfer": "b" * 32, "index": 0},
                               content=b"\0" * 64, headers={"X-Agentrl-Signature": b"\xe9" * 64})
            assert r.status_code == 401, r.text
            assert await served(http, target) == before

    asyncio.run(attack())


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_nan_push_is_refused_and_the_served_weights_stay(target, model_dir, transport):
    """NaN weights were accepted (the model then answered empty text).  Now a push with NaN or
    Inf is refused before the swap: with shared memory the trainer writes a segment the live
    weights do not use, so even the bytes it wrote never reach the served model."""

    async def attack() -> None:
        sync = make_weight_sync(target.base_url, transport, local_urls=[], api_key=KEY)
        async with control() as http:
            v = (await served(http, target))[0]
            good, _ = perturbed_state(model_dir, seed=1)
            await sync.push(good, version=v + 1)  # the live weights now point into the pushed buffer
            before = await served(http, target)
            for bad_value in (float("nan"), float("inf")):
                bad, _ = perturbed_state(model_dir, seed=2)
                bad["model.norm.weight"][3] = bad_value
                with pytest.raises(WeightSyncError, match="NaN or Inf"):
                    await sync.push(bad, version=v + 2)
                assert await served(http, target) == before
            await sync.push(good, version=v + 2)  # the engine takes the next good push
            assert (await served(http, target))[0] == v + 2
        await sync.close()

    asyncio.run(attack())


def test_partial_push_is_refused(target):
    """A push naming only some tensors was committed as a whole new version."""

    async def attack() -> None:
        sync = make_weight_sync(target.base_url, "shm", api_key=KEY)
        async with control() as http:
            before = await served(http, target)
            with pytest.raises(WeightSyncError, match="partial push refused"):
                await sync.push({"model.norm.weight": torch.full((64,), 3.0)}, version=before[0] + 1)
            assert await served(http, target) == before
        await sync.close()

    asyncio.run(attack())


def test_versions_only_increase(target, model_dir):
    """Anyone could set any weight version, even -5.  Now a lower version is refused (push or
    bump) within a trainer's session, a negative one always; the same version is accepted (a
    repeated push after a partial failure) and changes nothing; a new trainer starts its own."""

    async def attack() -> None:
        sync = make_weight_sync(target.base_url, "http", local_urls=[], api_key=KEY)
        async with control() as http:
            v = (await served(http, target))[0]
            state, _ = perturbed_state(model_dir, seed=5)
            await sync.push(state, version=v + 3)
            before = await served(http, target)
            older, _ = perturbed_state(model_dir, seed=6)
            with pytest.raises(WeightSyncError, match="older than the served version"):
                await sync.push(older, version=v + 2)
            for version in (v + 2, -5):
                r = await http.post(target.root_url + "/update_weight_version",
                                    json={"weight_version": version, "signature": signature(KEY, "version", str(version))})
                assert r.status_code == 409, r.text
            assert await served(http, target) == before
            same = {"weight_version": v + 3, "signature": signature(KEY, "version", str(v + 3))}
            assert (await http.post(target.root_url + "/update_weight_version", json=same)).json()["weight_version"] == v + 3
            await sync.push(state, version=v + 3)  # a repeated push of the same version is taken
            assert await served(http, target) == before
            fresh = make_weight_sync(target.base_url, "http", local_urls=[], api_key=KEY)  # a new run's trainer
            await fresh.push(state, version=1)  # starts its own sequence
            assert (await served(http, target))[0] == 1
            with pytest.raises(WeightSyncError, match="negative"):
                await fresh.push(state, version=-5)
            await fresh.close()
        await sync.close()

    asyncio.run(attack())


def test_stray_begin_does_not_cancel_a_transfer_in_progress(target, model_dir):
    """A stray begin cancelled the trainer's transfer, and anyone could abort it.  Now a begin
    while a transfer is in progress is refused, only its owner can abort, and the transfer
    completes as if nobody had called."""
    manifest, size, state = full_manifest(model_dir)
    buf = torch.zeros(size, dtype=torch.uint8)
    for e, (_, t) in zip(manifest, state.items(), strict=True):
        buf[e["offset"] : e["offset"] + t.numel() * 4].view(torch.float32).view(t.shape).copy_(t)
    data = buf.numpy().tobytes()
    plan = chunk_plan(size, size // 2 + 1)

    async def attack() -> None:
        async with control() as http:
            v = (await served(http, target))[0]
            owner = {"transfer": "c" * 32, "transport": "http", "weight_version": v + 1, "size": size,
                     "manifest": manifest, "lora": False, "chunks": [[o, n] for o, n in plan]}
            r = await http.post(target.root_url + "/weights/begin", json=sign_body(KEY, "begin", owner))
            assert r.status_code == 200, r.text

            async def chunk(i: int) -> httpx.Response:
                o, n = plan[i]
                piece = data[o : o + n]
                return await http.put(target.root_url + "/weights/chunk", params={"transfer": "c" * 32, "index": i},
                                      content=piece, headers={"X-Agentrl-Signature": signature(KEY, "chunk", "c" * 32, str(i), piece)})

            assert (await chunk(0)).status_code == 200
            stray = {**owner, "transfer": "d" * 32, "weight_version": v + 7}
            assert (await http.post(target.root_url + "/weights/begin", json=stray)).status_code == 401
            r = await http.post(target.root_url + "/weights/begin", json=sign_body(KEY, "begin", stray))
            assert r.status_code == 409 and "in progress" in r.text
            assert (await http.post(target.root_url + "/weights/abort", json={"transfer": "c" * 32})).status_code == 401
            assert (await chunk(1)).status_code == 200
            r = await http.post(target.root_url + "/weights/commit",
                                json={"transfer": "c" * 32, "signature": signature(KEY, "commit", "c" * 32, "")})
            assert r.status_code == 200 and r.json()["weight_version"] == v + 1, r.text

    asyncio.run(attack())


def test_oversized_buffer_is_refused(target, model_dir):
    """The buffer size a caller asked for was allocated as asked.  Now it must be the compact
    layout of a manifest that matches the model, checked before anything is allocated."""
    manifest, size, _ = full_manifest(model_dir)
    huge = 1 << 34

    async def attack() -> None:
        async with control() as http:
            before = await served(http, target)
            for transport in ("http", "shm"):
                body = {"transfer": "e" * 32, "transport": transport, "weight_version": before[0] + 1, "size": huge,
                        "manifest": manifest, "lora": False, "chunks": [[0, huge]]}
                assert (await http.post(target.root_url + "/weights/begin", json=body)).status_code == 401
                r = await http.post(target.root_url + "/weights/begin", json=sign_body(KEY, "begin", body))
                assert r.status_code == 400 and "not the manifest's" in r.text, r.text
                grown = [{**manifest[0], "shape": [1 << 20, 1 << 10]}] + manifest[1:]
                grown, grown_size = layout_size(grown)
                body = {**body, "manifest": grown, "size": grown_size, "chunks": [[0, grown_size]]}
                r = await http.post(target.root_url + "/weights/begin", json=sign_body(KEY, "begin", body))
                assert r.status_code == 400 and "shape mismatch" in r.text, r.text
            assert await served(http, target) == before

    asyncio.run(attack())


def layout_size(manifest: list[dict]) -> tuple[list[dict], int]:
    """Re-lay ``manifest`` compactly (as an attacker who knows the format would)."""
    fake = [(e["name"], torch.empty((), dtype=torch.float32).expand(*e["shape"])) for e in manifest]
    return layout(fake)


def test_disk_route_refuses_outside_paths_alike(target, model_dir, tmp_path):
    """The disk-update route loaded any host path and its errors told whether a path existed.
    Now only files inside the engine's weights dir load, and every other path gets the same
    refusal whether or not it exists (symlinks and ``..`` included)."""
    state, _ = perturbed_state(model_dir, seed=11)
    outside = tmp_path / "outside.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(outside))
    (target.weights_dir / "link.safetensors").symlink_to(outside)
    inside = target.weights_dir / "step-1.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(inside))

    def signed(path: str, version: int) -> dict:
        return sign_body(KEY, "disk", {"model_path": path, "weight_version": version, "lora": False})

    async def attack() -> None:
        async with control() as http:
            before = await served(http, target)
            v = before[0]
            answers = set()
            for path in ("/etc/passwd", "/no/such/file", str(outside), str(tmp_path), "../outside.safetensors",
                         f"../{tmp_path.name}/outside.safetensors", "link.safetensors",
                         str(target.weights_dir / "link.safetensors"), "/" + "a" * 300):
                r = await http.post(target.root_url + "/update_weights_from_disk", json=signed(path, v + 1))
                assert r.status_code == 400, (path, r.text)
                answers.add(json.dumps(r.json(), sort_keys=True))
                unsigned = await http.post(target.root_url + "/update_weights_from_disk",
                                           json={"model_path": path, "weight_version": v + 1})
                assert unsigned.status_code == 401
            assert len(answers) == 1, f"refusals differ by path: {answers}"
            assert await served(http, target) == before
            r = await http.post(target.root_url + "/update_weights_from_disk", json=signed("step-1.safetensors", v + 1))
            assert r.status_code == 200 and r.json()["weight_version"] == v + 1, r.text
            r = await http.post(target.root_url + "/update_weights_from_disk", json=signed(str(inside), v + 2))
            assert r.status_code == 200 and r.json()["weight_version"] == v + 2, r.text

    asyncio.run(attack())


def test_adapter_push_must_match_the_adapters_served(target, model_dir):
    """The one partial push allowed is LoRA factors (``lora=True``): pairs that fit the model's
    matrices, at one rank no larger than the matrix, for the same modules every time until a
    full push resets them (a push adapting fewer modules would leave stale merges behind)."""
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    base, _ = perturbed_state(model_dir, seed=21)

    def factors(mods: list[str], rank: int) -> dict[str, torch.Tensor]:
        g, out = torch.Generator().manual_seed(rank), {}
        for m in mods:
            out_f, in_f = base[m + ".weight"].shape
            out[m + ".lora_A"], out[m + ".lora_B"] = torch.randn(rank, in_f, generator=g), torch.randn(out_f, rank, generator=g)
        return out

    async def attack() -> None:
        sync = make_weight_sync(target.base_url, "shm", api_key=KEY)
        async with control() as http:
            v = (await served(http, target))[0]
            await sync.push(base, version=v + 1)
            await sync.push(factors(modules, 4), version=v + 2, lora=True)
            before = await served(http, target)
            # finite factors whose product is Inf: refused whole, the first (finite) module unmerged too
            overflow = factors(modules, 4)
            overflow[modules[0] + ".lora_B"] *= 3  # what a half-done merge would have served
            overflow[modules[1] + ".lora_A"] = torch.full_like(overflow[modules[1] + ".lora_A"], 1e20)
            overflow[modules[1] + ".lora_B"] = torch.full_like(overflow[modules[1] + ".lora_B"], 1e20)
            for bad, why in ((factors(modules[:1], 4), "does not match the adapters"),
                             (factors(modules, 8), "does not match the adapters"),
                             (factors(modules, 65), "do not fit"),
                             (overflow, "contains NaN or Inf")):
                with pytest.raises(WeightSyncError, match=why):
                    await sync.push(bad, version=v + 3, lora=True)
                assert await served(http, target) == before
            await sync.push(base, version=v + 3)  # a full push resets the adapters
            await sync.push(factors(modules[:1], 8), version=v + 4, lora=True)
            assert (await served(http, target))[0] == v + 4
        await sync.close()

    asyncio.run(attack())
