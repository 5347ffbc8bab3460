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


def test_an_engine_process_reuses_freed_memory_instead_of_faulting_it_in_every_step():
    """``keep_freed_memory`` (the server and its core call it): a step's worth of logits- and
    prefill-sized tensors, allocated and freed 20 times, page-faults nothing once the process
    keeps freed memory; glibc's defaults map the tensor over 32 MiB afresh every step (the
    smaller ones only in some address-space layouts: glibc raises its threshold for them, so a
    total over all sizes failed this test both ways, in about half the runs).  Per step, the
    median: the heap can still settle in a step after the warm-up (a one-time first touch)."""
    step = ("import resource, sys, torch\n"
            "from agentrl.inference.launcher import keep_freed_memory\n"
            "if sys.argv[1] == 'keep': assert keep_freed_memory()\n"
            "def step():\n"
            "    a, c = torch.ones(64, 49152), torch.ones(2048, 1536)\n"
            "    b, d = a.double(), torch.ones(2048, 3072)\n"
            "    del b, d\n"
            "    return a, c, torch.ones(4096, 3072)\n"
            "for _ in range(3): step()\n"
            "faults = []\n"
            "for _ in range(20):\n"
            "    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "    step()\n"
            "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)\n"
            "print(*faults)\n")
    faults = {mode: sorted(map(int, subprocess.run([sys.executable, "-c", step, mode], capture_output=True, text=True,
                                                   check=True, timeout=120).stdout.split()))
              for mode in ("default", "keep")}  # fmt: skip
    median = {mode: f[len(f) // 2] for mode, f in faults.items()}
    assert median["default"] > 10_000, faults  # 48 MiB a step at least: the cost this removes
    assert median["keep"] < median["default"] / 100, faults



@pytest.mark.parametrize("glibc_max", [None, 32 << 20, 0])
def test_keep_freed_memory_never_freezes_glibcs_threshold_low(monkeypatch, glibc_max):
    """Older glibc (2.34 at least) refuses an mmap threshold over 32 MiB, and any of these mallopt calls
    switches off the threshold glibc raises by itself: the trim and pad settings alone would
    leave every tensor over 128 KiB a fresh mmap for good.  So: 256 MiB, else 32 MiB, else
    nothing at all (a C library that refuses both)."""
    import ctypes

    from agentrl.inference import launcher

    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        ok = glibc_max is None or param != launcher._M_MMAP_THRESHOLD or value <= glibc_max
        calls.append((param, value))
        return int(ok)

    monkeypatch.setattr(ctypes, "CDLL", lambda _name: type("Libc", (), {"mallopt": staticmethod(mallopt)})())
    done = launcher.keep_freed_memory()
    thresholds = [v for p, v in calls if p == launcher._M_MMAP_THRESHOLD]
    others = [p for p, _ in calls if p != launcher._M_MMAP_THRESHOLD]
    if glibc_max == 0:
        assert not done and not others, calls
    else:
        assert done and thresholds[-1] == min(256 << 20, glibc_max or 256 << 20), calls
        assert sorted(others) == [launcher._M_TOP_PAD, launcher._M_TRIM_THRESHOLD], calls

@pytest.mark.slow
def test_server_streaming_and_weight_tests_pass_in_split_mode():
    """The engine's own route tests, run again against split engines."""
    here = Path(__file__).parent
    files = [str(here / f) for f in ("test_server.py", "test_streaming.py", "test_weights.py")]
    env = {**os.environ, "AGENTRL_TEST_SERVER_PROCESS": "split"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files], env=env,
                         capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
