"""Thin vLLM adapter: launch ``vllm serve`` with the flags agentrl's token path needs.

Token-exact I/O (``return_token_ids``), tools (``--tool-call-parser``), live weights
(``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "nccl"}'``; the
push itself is :class:`agentrl.weights.vllm.VLLMWeightSync`), and μ taken after
temperature/top-k/top-p (``--logprobs-mode processed_logprobs``), the same basis as the
embedded engine.  vLLM does not tag tokens with weight versions, so a run on vLLM tags each
request's tokens with the version current when the request started
(``PolicyClient(default_version=...)``): a token generated across a swap is counted one
version *older* than it is, so the staleness bound stays a bound.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.errors import EngineStartError
from agentrl.inference.launcher import EngineHandle, wait_for_health


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


if __name__ == "__main__":  # pragma: no cover - manual smoke: python -m agentrl.inference.vllm MODEL
    print(" ".join(vllm_serve_command(sys.argv[1], port=8000)))
