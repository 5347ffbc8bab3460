"""benchmarks/harness_overhead.py runs both policies end to end and compares equal work.

A tiny budget of the real script (the embedded engine on the tiny model, the scripted policy):
every form makes the native form's model calls and samples its ids, and each form's CPU counts
what it really spent: the subprocess agents report their own (under bwrap they are reaped
inside their pid namespace, where this process's rusage never sees them) and the engine's
part is the engine process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_both_policies_compare_equal_episodes_and_count_every_process(tiny_model):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = ["--rounds", "1", "--episodes", "4", "--subprocess-episodes", "1", "--concurrency", "4",
            "--model", str(tiny_model)]  # fmt: skip
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "harness_overhead.py"), *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "engine policy" in out.stdout and "scripted policy" in out.stdout
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["in_process_ratio"] == result["engine"]["in_process_ratio"] > 0
    for policy in ("engine", "scripted"):
        part = result[policy]
        native = part["native"]
        assert native["episodes"] == 4 and native["errors"] == 0 and native["calls_per_episode"] >= 1
        for form in ("in_process", "subprocess"):
            got = part[form]
            assert got["same_as_native"] == 1.0 and got["calls_per_episode"] == native["calls_per_episode"], (policy, form)
            assert f"{form}_ratio" in part and f"{form}_cpu_ratio" in part
        # a Python interpreter that imports openai costs far more than 50 ms of CPU; the old
        # accounting (this process's children) saw only bwrap's few milliseconds
        assert part["subprocess"]["cpu_ms_per_episode"] > 50
    assert result["engine"]["native"]["engine_cpu_ms_per_episode"] > 0
    assert result["scripted"]["native"]["engine_cpu_ms_per_episode"] == 0
    assert result["scripted"]["in_process_raw"]["same_as_native"] == 1.0
