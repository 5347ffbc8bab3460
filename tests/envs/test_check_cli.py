"""`agentrl env test` on packages a newcomer writes: a correct env passes, and a broken one
fails with a line that names the cause (issue 23, frictions 1, 8 and 9)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from agentrl_cli import agentrl

PAWN_SHOP = '''
"""A pawn shop: each task owns one item; `sell` raises for an item the task does not own."""
import json
import random

from agentrl.envs import ToolEnv
from agentrl.rubrics import Rubric
from agentrl.types import Message, ToolCall

ITEMS = ["clock", "lamp", "radio", "vase", "watch", "guitar", "kettle", "camera"]


def sell(item: str, state) -> str:
    """Sell an item you own to the shop.

    Args:
        item: the item to sell
    """
    if state["closed"]:
        raise RuntimeError("the shop is closed on Sundays")
    if item not in state["owned"]:
        raise ValueError(f"you do not own a {item}")
    state["owned"].remove(item)
    return f"sold the {item} for 10 coins"


def sold(messages, answer) -> float:
    said = " ".join(m.content for m in messages if m.role == "tool")
    return float(answer in said and "sold" in said)


class PawnShop(ToolEnv):
    async def setup(self, task):
        state = await super().setup(task)
        state["owned"] = [task.info.get("item", task.answer)]
        state["closed"] = self.closed
        return state

    def demonstrations(self, n, seed=0):
        rng, tasks, out = random.Random(seed), list(self.dataset()), []
        for _ in range(n):  # demonstrations of random tasks, as a newcomer writes them
            t = rng.choice(tasks)
            call = ToolCall("sell", json.dumps({"item": t.info.get("item", t.answer)}))
            out.append([*t.prompt, Message("assistant", "", tool_calls=[call]),
                        Message("tool", "sold", tool_call_id=call.id, name="sell"), Message("assistant", "done")])
        return out


def load_environment(answers: bool = True, closed: bool = False):
    rows = [{"question": f"You own a {i}. Sell it.", "item": i, **({"answer": i} if answers else {})}
            for i in ITEMS]
    env = PawnShop(tools=[sell], dataset=rows, rubric=Rubric([sold]), max_turns=3, name="pawn-shop")
    env.closed = closed
    return env
'''


def make_package(root: Path, name: str, body: str) -> Path:
    module = name.replace("-", "_")
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""
        [project]
        name = "{name}"
        version = "0.1.0"
        [project.entry-points."agentrl.environments"]
        {name} = "{module}:load_environment"
    """))
    (root / f"{module}.py").write_text(body)
    return root


def test_env_test_passes_a_correct_env_whose_demonstrations_cover_other_tasks(tmp_path):
    """Friction 1: the checker replayed a demonstration written for another task ('you do not
    own a clock' on a task that owns a lamp) and blamed the tool."""
    pkg = make_package(tmp_path / "pawn", "pawn-shop", PAWN_SHOP)
    r = agentrl("env", "test", pkg, "-n", "3", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "always raised" not in r.stdout and "FAIL" not in r.stdout


def test_env_test_names_what_an_always_raising_tool_raised(tmp_path):
    """Friction 9: `sell raised 3/3` without the exception's text."""
    pkg = make_package(tmp_path / "pawn", "pawn-shop", PAWN_SHOP)
    r = agentrl("env", "test", pkg, "-n", "3", "--env-args", '{"closed": true}', timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.strip("│ ").startswith("tools"))
    assert "always raised: sell (RuntimeError: the shop is closed on Sundays)" in " ".join(r.stdout.split()), line


def test_env_test_flags_tasks_without_an_answer(tmp_path):
    """Friction 8: tasks without an answer were not flagged; every episode errored inside the
    rubric with only "'in <string>' requires string as left operand, not NoneType"."""
    pkg = make_package(tmp_path / "pawn", "pawn-shop", PAWN_SHOP)
    r = agentrl("env", "test", pkg, "-n", "3", "--env-args", '{"answers": false}', timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr
    out = " ".join(r.stdout.split())  # the table wraps long details
    assert "8 of 8 tasks have no answer, but reward function(s) sold ask for answer" in out, r.stdout
    assert "its task has no answer" in out, r.stdout  # the episodes' own error says it too


def test_env_test_of_a_sandboxed_env_ends_without_tracebacks():
    """Friction 7: `agentrl env test code` passed, then printed `RuntimeError: Event loop is
    closed` twice (sandbox pools outlived the event loop: nothing closed the environment)."""
    r = agentrl("env", "test", "code", "-n", "2", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr[-3000:]


def test_a_scaffolded_env_comes_with_demonstrations_the_checker_replays(tmp_path):
    """Friction 4: nothing told a newcomer that a fresh model needs demonstrations() for its warm
    start; the scaffold now writes them, and `env test` replays each on its own task."""
    assert agentrl("env", "init", "probe", "--path", tmp_path).returncode == 0
    r = agentrl("env", "test", tmp_path / "probe", "-n", "3", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "4 conversations, 4 replayed on their dataset tasks (rewards [1.0, 1.0, 1.0, 1.0])" in out, r.stdout
    assert "reverse raised 0/3" in out and "rewards [1.0, 1.0, 1.0]" in out, r.stdout
