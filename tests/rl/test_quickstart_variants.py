"""benchmarks/quickstart_variants.py --score-every: real runs of the quickstart, their checkpoints
scored afterwards on held-out tasks (tiny model, a few steps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quickstart_variants.py"


def _common(model: Path) -> str:
    small = {
        "model.path": str(model), "sft.enabled": "false", "env.name": "calc", "rollout.group_size": "4",
        "rollout.max_in_flight": "16", "rollout.max_tokens": "24", "trainer.batch_groups": "2",
        "buffer.filter_zero_variance": "false", "trainer.steps": "4", "eval.num_tasks": "6",
        "trainer.num_threads": "1", "inference.max_batch_size": "16",
    }
    return "--common=" + ",".join(f"--{k}={v}" for k, v in small.items())


def test_each_variant_is_run_then_its_checkpoints_are_scored(tiny_model):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "120", "--rounds", "1", "--score-every", "2",
                           "--target", "0.0", _common(tiny_model), "--variant", "base=",
                           "--variant", "short=--trainer.lr=1e-3,--trainer.steps=2"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # trainer.steps from --common reached both runs, and the variant's own override came after it
    assert out["steps"] == {"base": [4], "short": [2]}
    for name, versions in (("base", 2), ("short", 1)):
        (run,) = out["runs"][name]
        curve = run["curve"]
        # the warm start at 0 s, then the checkpoints of versions 2 (and 4), in RL seconds
        assert len(curve) == 1 + versions and curve[0] == [0.0, out["warm_start"]], curve
        assert 0 < curve[1][0] <= curve[-1][0]
        assert all(0.0 <= r <= 1.0 for _, r in curve)
        assert run["final"] == curve[-1][1] and run["best"] == max(r for _, r in curve)
        assert run["to_target_s"] == 0.0  # any curve is at 0.0 from its first point
    assert out["to_target_s"] == {"base": [0.0], "short": [0.0]}


@pytest.mark.parametrize("override", ["--run.seed=7", "--rollout.max_tokens=48", "--sft.steps=3"])
def test_a_variant_may_not_change_what_the_shared_evaluator_scores(tiny_model, override):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--score-every", "2", _common(tiny_model),
                           "--variant", "a=", "--variant", f"b={override}"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "shares one warm start" in proc.stderr and "--common" in proc.stderr


@pytest.mark.parametrize("where", ["--common=--eval.every=5", "--variant=b=--trainer.checkpoint_every=3"])
def test_the_settings_the_script_owns_are_refused(where):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--variant", "a=", where],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "sets --run.dir" in proc.stderr


def test_an_override_may_hold_a_list():
    from benchmark_module import load_benchmark

    parse = load_benchmark("quickstart_variants").parse_variant
    assert parse("b=--trainer.betas=[0.9,0.95],--trainer.lr=1e-4") == (
        "b", ["--trainer.betas=[0.9,0.95]", "--trainer.lr=1e-4"])
