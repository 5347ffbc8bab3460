"""Continued SFT on a time budget (what benchmarks/rl_vs_sft.py gives SFT): the budget ends it."""

from __future__ import annotations

from pathlib import Path

from agentrl.config import SFTConfig
from agentrl.metrics import read_jsonl
from agentrl.plugins import load_environment
from agentrl.recipes.sft import train_sft

GUESS = Path(__file__).resolve().parents[2] / "environments" / "guess"


def test_a_spent_budget_stops_sft_after_one_step_and_still_saves(tmp_path):
    from agentrl.tiny_model import build_tiny_model

    base = build_tiny_model(tmp_path / "tiny", layers=1, hidden=32, heads=2)
    env = load_environment(str(GUESS), high=63, min_width=32, max_turns=6, demo_strategy="random", terse=True,
                           show_interval=True, num_train=50, num_eval=10)
    sft = SFTConfig(steps=50, batch_size=4, num_demos=16)
    out = train_sft(base, env, sft, seed=0, out_dir=tmp_path / "a", progress=False, max_wall_s=0.0)
    assert len(read_jsonl(out / "sft_metrics.jsonl")) == 1 and (out / "config.json").is_file()
    out = train_sft(out, env, sft.model_copy(update={"steps": 3}), seed=0, out_dir=tmp_path / "b", progress=False)
    assert len(read_jsonl(out / "sft_metrics.jsonl")) == 3  # no budget: every step runs
