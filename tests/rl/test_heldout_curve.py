"""benchmarks/heldout.py: the time-to-reward benchmarks' held-out curve and threshold rule."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_module import load_benchmark

from agentrl.trainer.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _heldout():
    return load_benchmark("heldout")


def test_first_at_can_ask_the_target_to_hold():
    first_at = _heldout().first_at
    curve = [(0.0, 0.4), (10.0, 0.62), (20.0, 0.5), (30.0, 0.61), (40.0, 0.65)]
    assert first_at(curve, 0.6) == 10.0
    assert first_at(curve, 0.6, hold=2) == 30.0  # the lone 0.62 at 10 s does not count
    assert first_at(curve, 0.7) is None
    assert first_at(curve, 0.6, hold=3) is None  # two in a row at the end are not three


def test_each_checkpoint_is_scored_with_its_own_weights_at_its_versions_seconds(tmp_path):
    from agentrl.tiny_model import build_tiny_model

    run = tmp_path / "run"
    build_tiny_model(run / "final", layers=1, hidden=32, heads=2)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    marks = {}
    for version in (2, 4, 6):  # each checkpoint's final norm carries its version, to see which one was scored
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["model.norm.weight"][0] = float(version)
        marks[version] = float(version)
        save_checkpoint(run, version, {"model": state}, {}, keep=0)
    rows = [{"version": v, "time/rl_wall_s": 1.5 * v + 0.25} for v in range(1, 7)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    def score(m, version):
        seen.append((version, float(m.state_dict()["model.norm.weight"][0])))
        return version / 10

    curve = _heldout().checkpoint_curve(run, score, start=0.05)
    assert curve == [(0.0, 0.05), (3.2, 0.2), (6.2, 0.4), (9.2, 0.6)]  # 1.5 * v + 0.25, rounded
    assert seen == [(v, marks[v]) for v in (2, 4, 6)]
