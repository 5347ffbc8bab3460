"""Keys on the engine (README "Keys and ports"), each test an attack on a real engine process:
a caller without the key pauses it, sets its version, replaces its weights; a keyed engine
serves strangers; a client that should send the key does not."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import httpx
import openai
import pytest

from agentrl.auth import KEY_ENV, read_key
from agentrl.errors import EndpointError, WeightSyncError
from agentrl.inference import PolicyClient, start_embedded_engine
from agentrl.types import SamplingParams
from agentrl.weights import make_weight_sync
from tests.inference.conftest import ENGINE_KEY, MAX_MODEL_LEN

# every control and weight route, with a body that would do harm if it got through
CONTROL = [
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("GET", "/get_weight_version", None),
    ("POST", "/update_weight_version", {"weight_version": -5}),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/metrics", None),
    ("POST", "/update_weights_from_disk", {"model_path": "/etc/hostname"}),
    ("POST", "/update_weights_from_shm", {"path": "/tmp/x", "size": 10, "manifest": []}),
    ("POST", "/weights/begin", {"transfer": "t", "size": 8, "manifest": [], "chunks": [[0, 8, 0]]}),
    ("PUT", "/weights/chunk?transfer=t&index=0", None),
    ("POST", "/weights/commit", {"transfer": "t"}),
    ("GET", "/openapi.json", None),
    ("GET", "/no-such-route", None),  # default deny: a route added later is guarded too
]
OPENAI = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]


def _refused(r: httpx.Response, key: str) -> None:
    assert r.status_code == 401, (r.request.url, r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]  # says how to fix
    assert key not in r.text  # never the key itself
    assert r.headers["www-authenticate"] == "Bearer"


def test_control_routes_refuse_callers_without_the_key(engine):
    version = httpx.get(engine.root_url + "/get_weight_version", headers=engine.headers).json()["weight_version"]
    with httpx.Client(base_url=engine.root_url, timeout=30) as http:
        for method, path, body in CONTROL:
            _refused(http.request(method, path, json=body), engine.api_key)
            wrong = {"Authorization": "Bearer " + engine.api_key[:-1]}  # all but the last character
            _refused(http.request(method, path, json=body, headers=wrong), engine.api_key)
        assert http.get("/health").status_code == 200  # open, for load balancers and the launcher
        # nothing the refused calls asked for happened
        state = http.get("/is_paused", headers=engine.headers).json()
        assert state == {"is_paused": False}
        assert http.get("/get_weight_version", headers=engine.headers).json()["weight_version"] == version
        # the key opens them
        assert http.post("/pause", headers=engine.headers).json() == {"is_paused": True}
        assert http.post("/resume", headers=engine.headers).json() == {"is_paused": False}


def test_a_made_key_is_written_0600_and_leaves_the_openai_routes_open(engine, model_dir):
    key_file = engine.tmp_dir / "api_key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert read_key(key_file) == engine.api_key and len(engine.api_key) > 40
    with httpx.Client(base_url=engine.root_url, timeout=60) as http:
        for method, path, body in OPENAI:
            assert http.request(method, path, json=body).status_code == 200, path
        models = http.get("/v1/models").text
    assert str(model_dir) not in models and str(model_dir.parent) not in models  # no host path


def test_an_explicit_key_guards_every_route_but_health(keyed_engine):
    with httpx.Client(base_url=keyed_engine.root_url, timeout=60) as http:
        for method, path, body in OPENAI + CONTROL:
            _refused(http.request(method, path, json=body), ENGINE_KEY)
        assert http.get("/health").status_code == 200
    with openai.OpenAI(base_url=keyed_engine.base_url, api_key=ENGINE_KEY, max_retries=0) as c:
        assert c.completions.create(model=keyed_engine.model, prompt="Hi", max_tokens=2).choices
    with openai.OpenAI(base_url=keyed_engine.base_url, api_key="guess", max_retries=0) as c, \
            pytest.raises(openai.AuthenticationError):
        c.models.list()


async def test_clients_read_the_key_from_the_environment(keyed_engine, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    async with PolicyClient(keyed_engine.base_url, keyed_engine.model, max_retries=0) as pc:
        with pytest.raises(EndpointError, match="401"):
            await pc.complete([1, 2, 3], SamplingParams(max_tokens=2))
    monkeypatch.setenv(KEY_ENV, ENGINE_KEY)
    async with PolicyClient(keyed_engine.base_url, keyed_engine.model, max_retries=0) as pc:
        assert (await pc.complete([1, 2, 3], SamplingParams(max_tokens=2)))[0].token_ids


@pytest.fixture
def own_engine(model_dir):
    """An engine of this test's own: the push below moves its version, which only increases,
    and the session's shared engine must stay at version 0 for the tests after this one."""
    with start_embedded_engine(model_dir, max_batch_size=4, max_model_len=MAX_MODEL_LEN, device="cpu") as eng:
        yield eng


async def test_a_weight_push_needs_the_key(own_engine, hf_model, monkeypatch):
    engine = own_engine
    monkeypatch.delenv(KEY_ENV, raising=False)
    tensors = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    version = httpx.get(engine.root_url + "/get_weight_version", headers=engine.headers).json()["weight_version"]
    stranger = make_weight_sync(engine.base_url, "shm")
    try:
        with pytest.raises(WeightSyncError, match="no API key to sign"):  # refused before it sends
            await stranger.push(tensors, version + 1)
        forger = make_weight_sync(engine.base_url, "shm", api_key="arl-not-the-key")
        with pytest.raises(WeightSyncError, match="401"):
            await forger.push(tensors, version + 1)
        await forger.close()
    finally:
        await stranger.close()
    assert httpx.get(engine.root_url + "/get_weight_version", headers=engine.headers).json()["weight_version"] == version
    owner = make_weight_sync(engine.base_url, "shm", api_key=engine.api_key)
    try:
        await owner.push(tensors, version + 1)
    finally:
        await owner.close()
    assert httpx.get(engine.root_url + "/get_weight_version", headers=engine.headers).json()["weight_version"] == version + 1


def test_agentrl_serve_writes_its_made_key_0600_and_prints_where(model_dir, tmp_path):
    key_file = tmp_path / "keys" / "engine.key"
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "serve", str(model_dir), "--port", "0", "--device", "cpu",
         "--max-model-len", "64", "--key-file", str(key_file)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True,
    )  # fmt: skip
    try:
        lines, url = [], None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (url and any("API key" in ln for ln in lines)):
            line = proc.stderr.readline()
            assert line, "agentrl serve exited: " + "".join(lines)
            lines.append(line)
            if "serving" in line:
                url = line.split(" on ")[1].split()[0].removesuffix("/v1")
        key = read_key(key_file)
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        said = "".join(lines)
        assert str(key_file) in said and key not in said  # where, never what
        _refused(httpx.post(url + "/pause"), key)
        assert httpx.post(url + "/pause", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
