"""``server_process = "split"``: the engine core in a process of its own, behind the same routes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from procs import descendants
from tool_call_model import MAX_MODEL_LEN

from agentrl.inference import start_embedded_engine

KEY = "arl-core-test-key-0123"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def split_engine(model_dir):
    return start_embedded_engine(model_dir, max_batch_size=4, max_model_len=MAX_MODEL_LEN, device="cpu",
                                 api_key=KEY, server_process="split", startup_timeout=900)


def core_of(eng) -> int:
    (core,) = descendants(eng.proc.pid)
    return core


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_split_answers_as_the_same_process_engine(engine, model_dir, tools, tool_prompt):
    """Seeded requests give the same tokens, μ, versions, support and text whichever process runs the loop."""
    bodies = [
        ("/v1/completions", {"prompt": [1, 5, 9, 13], "max_tokens": 12, "seed": 3, "temperature": 0.8, "logprobs": 2,
                             "return_token_ids": True, "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": tool_prompt}], "tools": tools,
                                  "max_tokens": 40, "seed": 5, "temperature": 0, "return_token_ids": True}),
        ("/v1/completions", {"prompt": [1, 7, 8], "max_tokens": 10, "seed": 4, "stop": ["a"], "return_token_ids": True}),
    ]
    with split_engine(model_dir) as split:
        for path, body in bodies:
            same = httpx.post(engine.root_url + path, json={**body, "model": engine.model}, timeout=60).json()
            other = httpx.post(split.root_url + path, json={**body, "model": split.model}, headers=HEADERS,
                               timeout=60).json()  # fmt: skip
            for a, b in zip(same["choices"], other["choices"], strict=True):
                for k in ("token_ids", "token_versions", "token_support", "finish_reason", "logprobs", "message", "text"):
                    assert a.get(k) == b.get(k), (path, k)
            assert same["usage"] == other["usage"]
        m = httpx.get(split.root_url + "/metrics", headers=HEADERS).json()
        assert m["total_generated_tokens"] > 0 and m["max_batch_size"] == 4


def test_a_dead_core_fails_requests_with_a_named_503_and_the_server_exits(model_dir):
    with split_engine(model_dir) as eng:
        core = core_of(eng)
        assert httpx.post(eng.root_url + "/pause", headers=HEADERS).status_code == 200  # hold the request in flight
        answer: list[httpx.Response] = []
        body = {"model": eng.model, "prompt": [1, 2, 3], "max_tokens": 50, "ignore_eos": True}
        waiter = threading.Thread(target=lambda: answer.append(
            httpx.post(eng.base_url + "/completions", json=body, headers=HEADERS, timeout=60)))
        waiter.start()
        while httpx.get(eng.root_url + "/metrics", headers=HEADERS).json()["queue_depth"] == 0:
            time.sleep(0.02)
        os.kill(core, signal.SIGKILL)
        waiter.join(60)
        assert answer, "the request in flight hung after its core died"
        r = answer[0]
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "engine_core_died" and "killed by signal SIGKILL" in err["message"], err
        assert eng.proc.wait(timeout=60) == 1, "the server keeps running without its core"
        assert "engine core process died (killed by signal SIGKILL)" in eng.log_path.read_text()


@pytest.mark.parametrize("how", ["kill", "ctrl-c"])
def test_the_core_ends_with_its_front_end(model_dir, how):
    """No orphaned core: a SIGKILLed front end (the core sees its channel close), or Ctrl-C to both
    (the core ignores it; the front end shuts down and ends the core)."""
    with split_engine(model_dir) as eng:
        core = core_of(eng)
        if how == "kill":
            os.kill(eng.proc.pid, signal.SIGKILL)
        else:
            os.kill(core, signal.SIGINT)  # what a terminal's Ctrl-C sends the whole process group
            os.kill(eng.proc.pid, signal.SIGINT)
            # a clean shutdown; uvicorn then re-raises the Ctrl-C it caught (the same-process server does too)
            assert eng.proc.wait(timeout=60) in (0, -signal.SIGINT)
        assert gone(core, within=60), f"the engine core {core} outlived its front end ({how})"


def test_a_watched_child_exits_once_its_parent_is_gone():
    """``exit_with_parent``, the watchdog the server and its core both start: a SIGKILLed parent
    (no channel to close, no parent-death signal) still takes the child down within a few seconds."""
    child = ("import sys, time; from agentrl.inference.launcher import exit_with_parent; "
             "exit_with_parent(int(sys.argv[1])); print('watching', flush=True); time.sleep(120)")
    parent = ("import os, subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid())]); "
              "print(p.pid, flush=True); time.sleep(120)")
    with subprocess.Popen([sys.executable, "-c", parent, child], stdout=subprocess.PIPE, text=True) as proc:
        pid = int(proc.stdout.readline())
        assert proc.stdout.readline() == "watching\n"
        assert not gone(pid, within=1.5), "the child exited while its parent lived"
        proc.kill()
        assert gone(pid, within=10), f"the child {pid} outlived its killed parent"


@pytest.mark.slow
def test_server_streaming_and_weight_tests_pass_in_split_mode():
    """The engine's own route tests, run again against split engines."""
    here = Path(__file__).parent
    files = [str(here / f) for f in ("test_server.py", "test_streaming.py", "test_weights.py")]
    env = {**os.environ, "AGENTRL_TEST_SERVER_PROCESS": "split"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files], env=env,
                         capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
