"""vLLM settings that need no vLLM: the start-up refusals, a string base_url, the key guard, metrics."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
from fastapi import FastAPI

from agentrl.config import load_config
from agentrl.inference.vllm_guard import KeyGuard
from agentrl.recipes.engines import prometheus_values
from agentrl.weights.vllm import nccl_ready


def test_a_string_base_url_is_accepted():
    """`--inference.base_url=http://...` on the command line is one string (was: "Input should be a valid list")."""
    cfg = load_config([], ["--inference.base_url=http://127.0.0.1:8000/v1"])
    assert cfg.inference.base_url == ["http://127.0.0.1:8000/v1"]
    two = load_config([], ["--inference.base_url=http://a:1/v1, http://b:2/v1"])
    assert two.inference.base_url == ["http://a:1/v1", "http://b:2/v1"]


def _run(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    model = tmp_path / "model"
    cmd = [sys.executable, "-m", "agentrl.cli", "run", f"--run.dir={tmp_path / 'run'}", f"--model.path={model}",
           "--inference.engine=vllm", *overrides]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(nccl_ready() is None, reason="this host can run NCCL")
def test_nccl_without_a_gpu_is_refused_before_anything_starts(tmp_path):
    r = _run(tmp_path, "--inference.vllm_weight_transfer=nccl")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "vllm_weight_transfer" in r.stderr and "disk" in r.stderr
    assert not (tmp_path / "model").exists()  # refused before the warm start


def test_vllm_without_its_cli_is_refused_before_anything_starts(tmp_path):
    r = _run(tmp_path, f"--inference.vllm_command={tmp_path / 'no-venv' / 'bin' / 'vllm'}")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "install-vllm" in r.stderr or "vllm_command" in r.stderr
    assert not (tmp_path / "model").exists()


def test_the_key_guard_refuses_every_route_but_health():
    app = FastAPI()
    for path in ("/health", "/collective_rpc", "/v1/models"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])

    async def go():
        import os

        os.environ["AGENTRL_API_KEY"] = "sekret"
        try:
            guarded = KeyGuard(app)
        finally:
            del os.environ["AGENTRL_API_KEY"]
        out = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(guarded), base_url="http://t") as http:
            for path in ("/health", "/collective_rpc", "/v1/models"):
                for name, headers in (("none", {}), ("wrong", {"Authorization": "Bearer sekreT"}),
                                      ("right", {"Authorization": "bearer sekret"})):  # fmt: skip
                    out[path, name] = (await http.post(path, headers=headers)).status_code
        return out

    codes = asyncio.run(go())
    assert codes["/health", "none"] == 200
    assert all(codes[p, "none"] == codes[p, "wrong"] == 401 for p in ("/collective_rpc", "/v1/models"))
    assert all(codes[p, "right"] == 200 for p in ("/collective_rpc", "/v1/models"))


def test_the_key_guard_refuses_to_start_without_a_key(monkeypatch):
    monkeypatch.delenv("AGENTRL_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="AGENTRL_API_KEY"):
        KeyGuard(FastAPI())


def test_prometheus_text_is_read_by_metric_name():
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:generation_tokens_total{engine="0",model_name="m"} 120.0
vllm:generation_tokens_total{engine="1",model_name="m"} 30.0
"""
    values = prometheus_values(text)
    assert values["vllm:num_requests_running"] == 3.0 and values["vllm:generation_tokens_total"] == 150.0


def test_a_generate_reply_reads_as_a_completion_with_per_token_versions():
    """vLLM's /inference/v1/generate: weight-version spans become per-token versions; top logprobs give K."""
    from agentrl.inference.client import from_generate, generate_body, support_from_top

    body = generate_body({"model": "m", "prompt": [1, 2], "logprobs": 20, "max_tokens": 4, "temperature": 1.0,
                          "top_p": 0.5, "n": 1, "return_token_ids": True, "cache_salt": "v3"})  # fmt: skip
    assert body["token_ids"] == [1, 2] and body["cache_salt"] == "v3" and body["output_mode"] == "text"
    assert body["sampling_params"] == {"max_tokens": 4, "temperature": 1.0, "top_p": 0.5, "n": 1, "logprobs": 20,
                                       "detokenize": True}  # fmt: skip
    top = [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0}, {"token": "c", "logprob": -9999.0}]
    ch = {"index": 0, "text": "abcd", "token_ids": [5, 6, 7, 8], "finish_reason": "length",
          "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4}],
          "logprobs": {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": top}] * 4}}  # fmt: skip
    out = from_generate(ch, start_version=1)
    assert out["token_versions"] == [3, 3, 4, 4] and out["logprobs"]["token_logprobs"] == [-0.5] * 4
    assert support_from_top(out, 4, 20) == [2, 2, 2, 2]
    unnamed = from_generate({**ch, "weight_versions": [{"version": "default", "start": 0, "end": 4}]}, start_version=1)
    assert unnamed["token_versions"] == [1, 1, 1, 1]  # a version that is not agentrl's: the request-start one
