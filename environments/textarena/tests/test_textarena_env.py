"""The TextArena adapter: a real TextArena game through the agentrl episode loop, the checker,
and `agentrl eval` on the embedded engine."""

import json
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.plugins import load_environment
from agentrl.rubrics import score_episodes
from agentrl.types import Message, SamplingParams

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


async def _secret(env, task) -> int:
    state = await env.setup(task)
    try:
        return state["game"].game_number  # GuessTheNumber's secret (the wrappers pass attributes on)
    finally:
        await env.cleanup(state)


async def test_held_out_tasks_are_games_the_training_set_lacks():
    """GuessTheNumber has 20 secrets: seeds repeat them, so tasks are keyed on the game."""
    env = load_environment(HERE, num_tasks=6)
    train, held = list(env.dataset()), list(env.eval_dataset())
    seen = [await _secret(env, t) for t in train]
    assert len(set(seen)) == 6 and held and not {await _secret(env, t) for t in held} & set(seen)
    big = load_environment(HERE, num_tasks=200)  # 200 + 20 asked for, only 20 games: warn and split what there is
    with pytest.warns(UserWarning, match=r"only 20 distinct games in \d+ seeds.*200 training \+ 20 held-out.*18 \+ 2"):
        train, held = list(big.dataset()), list(big.eval_dataset())
    seen = [await _secret(big, t) for t in train]
    assert len(set(seen)) == 18 and len(held) == 2 and not {await _secret(big, t) for t in held} & set(seen)
    with warnings.catch_warnings():  # unset: every game there is, split the same way, and no warning
        warnings.simplefilter("error")
        default = load_environment(HERE)
        assert (len(default.dataset()), len(default.eval_dataset())) == (18, 2)


async def test_a_move_the_game_cannot_process_is_an_invalid_move_not_an_error():
    """int() of a 5000-digit guess raises inside the game: the policy must not escape a bad
    episode by making it an error (never trained on); it scores textarena's -1 penalty."""
    env = load_environment(HERE, num_tasks=2)
    tr = await env.rollout(ScriptedClient(lambda p: "[" + "1" * 5000 + "]"), env.dataset()[0],
                           SamplingParams(max_tokens=20_000))  # fmt: skip
    await score_episodes(env.rubric, [tr])
    assert tr.error is None and tr.stop_reason == "done", tr.error
    assert tr.reward == -1.0 and tr.metrics["invalid_move"] == 1.0


async def test_our_own_bugs_in_step_are_not_taken_for_invalid_moves():
    env = load_environment(HERE, num_tasks=2)
    state = await env.setup(env.dataset()[0])

    def broken(action):
        raise KeyError("ours")

    state["game"].step = broken
    with pytest.raises(KeyError):
        await env.step(state, Message("assistant", "[5]"))


async def test_the_system_prompt_comes_first():
    env = load_environment(HERE, num_tasks=2, system_prompt="Be brief.")
    prompts: list[str] = []
    tr = await env.rollout(ScriptedClient(lambda p: prompts.append(p) or "[5]"), env.dataset()[0], SamplingParams(max_tokens=16))
    assert tr.messages[0] == Message("system", "Be brief.") and tr.messages[1].content.startswith("[GAME]")
    assert "Be brief." in prompts[0]


async def test_each_episode_plays_on_its_own_random_state():
    """Bandit draws its payouts from ``random`` during play: one task must be the same game
    whatever runs beside it, and the process's own ``random`` stream must not move."""
    env = load_environment(HERE, game="Bandit-v0", num_tasks=2)
    task, other = list(env.dataset())[:2]

    async def payouts(beside: bool) -> list[str]:
        a = await env.setup(task)
        b = await env.setup(other) if beside else None
        out = []
        for _ in range(12):
            out += [m.content for m in await env.step(a, Message("assistant", "[red]"))]
            if b is not None:
                await env.step(b, Message("assistant", "[blue]"))
                random.random()  # someone else drawing from the process's stream
        return out

    random.seed(7)
    alone = await payouts(False)
    assert random.random() == random.Random(7).random()  # setup and step left the stream alone
    assert await payouts(True) == alone


@pytest.mark.parametrize("game", ["TicTacToe-v0", "QuantumTicTacToe-v0"])  # the second takes 1 player silently
def test_multi_player_games_are_refused_naming_the_game(game):
    with pytest.raises(Exception, match="only single-player games are supported") as e:
        load_environment(HERE, game=game)
    assert game in str(e.value) and "\n" not in str(e.value)
