"""The TextArena adapter: a real TextArena game through the agentrl episode loop, the checker,
and `agentrl eval` on the embedded engine."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.plugins import load_environment
from agentrl.rubrics import score_episodes
from agentrl.types import SamplingParams

pytest.importorskip("textarena")
HERE = str(Path(__file__).resolve().parents[1])


def bisect(prompt: str) -> str:
    """Binary search over 1..20 from the guesses and the game's higher/lower feedback so far."""
    lo, hi = 1, 20
    guesses = [int(g) for g in re.findall(r"<\|im_start\|>assistant\n\[(\d+)\]", prompt)]
    hints = re.findall(r"target number is (higher|lower)", prompt)
    for g, h in zip(guesses, hints, strict=False):
        lo, hi = (g + 1, hi) if h == "higher" else (lo, g - 1)
    return f"[{(lo + hi) // 2}]"


async def test_bisection_wins_every_game_and_nonsense_does_not():
    env = load_environment(HERE, num_tasks=6)
    tasks = list(env.dataset())
    won = [await env.rollout(ScriptedClient(bisect), t, SamplingParams(max_tokens=16)) for t in tasks]
    lost = [await env.rollout(ScriptedClient(lambda p: "[1]"), t, SamplingParams(max_tokens=16)) for t in tasks]
    await score_episodes(env.rubric, won + lost)
    assert all(t.error is None and t.stop_reason == "done" for t in won + lost), [t.error for t in won + lost]
    assert all(t.reward == 1.0 for t in won), [t.reward for t in won]  # the game's own win reward
    assert all(t.reward < 1.0 for t in lost) and len({t.reward for t in won}) == 1
    assert all(any("higher" in m.content or "lower" in m.content for m in t.messages if m.role == "user")
               for t in won if len(t.turns) > 1)  # fmt: skip


async def test_the_checker_passes():
    report = await check_environment(load_environment(HERE, num_tasks=6), num_episodes=2)
    assert report.ok, [f"{r.name}: {r.detail}" for r in report.failures()]


@pytest.mark.slow
def test_agentrl_eval_on_the_embedded_engine(tmp_path):
    from agentrl.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", layers=1, hidden=32, heads=2)
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", HERE, "--model", str(model), "-n", "1", "-r", "2",
                        "--max-tokens", "8", "--max-turns", "3", "--out", str(out), "--env-args", '{"num_tasks": 4}'],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(x["env"] == "textarena" and x["error"] is None and x["turns"] >= 1 for x in recs)
