"""The arithmetic-drill OpenEnv server (``openenv_drill_server``, unchanged) as an agentrl environment.

``url`` names a running server; without one, this starts the server in a child process
(``uvicorn openenv_drill_server:app`` on a free loopback port) and stops it when the process
exits.  The generic adapter (:class:`agentrl.envs.openenv.OpenEnvEnvironment`) does the rest:
the observation's one string field is the prompt/reply, the text is the action's ``answer``.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.envs.openenv import OpenEnvEnvironment
from agentrl.errors import AgentrlError
from agentrl.types import Message, Task


def solve(task: Task, conversation: list[Message]) -> Message:
    """Reference policy: answer the last question asked."""
    a, b = re.findall(r"what is (\d+) \+ (\d+)\?", conversation[-1].content)[-1]
    return Message("assistant", str(int(a) + int(b)))


class DrillEnv(OpenEnvEnvironment):
    max_reward = 1.0  # all three sums right
    system_prompt_text = "Reply with the number only."

    def reference_policy(self) -> Callable[[Task, list[Message]], Message]:
        return solve


def start_server(port: int | None = None, timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """The OpenEnv server in a child process; returns it and its URL once ``/health`` answers."""
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "uvicorn", "openenv_drill_server:app", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]  # fmt: skip
    # its log goes to a file: a pipe nobody reads fills up and then blocks the server mid-episode
    log = tempfile.NamedTemporaryFile(prefix="openenv-drill-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    proc.log_path = log.name  # type: ignore[attr-defined]  # removed by _stop
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log.name).read_text(errors="replace")[-300:]
            raise AgentrlError(f"the OpenEnv drill server exited with {proc.returncode} (log {log.name}): {tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AgentrlError(f"the OpenEnv drill server did not answer /health within {timeout_s:g}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    log_path = getattr(proc, "log_path", None)
    if log_path:
        Path(log_path).unlink(missing_ok=True)


def load_environment(url: str | None = None, num_tasks: int = 100, **kwargs: Any) -> DrillEnv:
    server = None
    if url is None:
        server, url = start_server()
        atexit.register(_stop, server)
    # a reply cut off at max_tokens is still an answer: the drill goes on (on_length="continue")
    env = DrillEnv(url, num_tasks=num_tasks, max_turns=4, name="openenv-drill", on_length="continue",
                   system_prompt=DrillEnv.system_prompt_text, **kwargs)  # fmt: skip
    env.server = server
    return env
