"""benchmarks/engine_vs_vllm.py --quick: both servers start, serve the same rounds, and the ratio comes out.

Skipped where ``.venv-vllm`` is absent (``bash .ci/install-vllm``; ``.ci/run`` builds it).  The
quick mode starts one ``vllm serve`` on the tiny model (~1.5 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.errors import EngineStartError
from agentrl.inference.vllm import find_vllm

try:
    VLLM = find_vllm()
except EngineStartError:
    VLLM = None

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(VLLM is None, reason="no .venv-vllm: bash .ci/install-vllm")]  # fmt: skip


def test_quick_mode_prints_both_sides_and_their_ratio():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_vs_vllm.py"), "--quick",
                          "--vllm", " ".join(VLLM)], capture_output=True, text=True, timeout=1100, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # every request made exactly its 16 tokens on both servers (the script refuses a short one)
    assert out["requests"] == 8 and out["new_tokens"] == 16
    assert out["embedded_tok_s_tiny"] > 0 and out["vllm_tok_s_tiny"] > 0
    assert out["ratio_tiny"] == pytest.approx(out["embedded_tok_s_tiny"] / out["vllm_tok_s_tiny"], rel=0.01)
    assert out["ratio_smollm"] is None  # quick mode: the tiny model only
    assert "[tiny] round 1/1 embedded" in run.stderr and "[tiny] round 1/1     vllm" in run.stderr


def test_unknown_model_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_vs_vllm.py"), "--models", "tiny,gpt5"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["engine_vs_vllm: error: unknown --models entry 'gpt5'; give tiny, "
                                               "smollm or tiny,smollm"]  # fmt: skip
