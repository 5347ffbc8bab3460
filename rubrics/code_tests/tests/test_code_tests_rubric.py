"""code-tests rubric: real sandboxes, honest and hostile solutions."""

from __future__ import annotations

import pytest
from agentrl_rubric_code_tests import extract_code, load_rubric, values_equal

from agentrl.sandbox import why_unavailable
from agentrl.types import Message, Task, Trajectory

INFO = {"entry_point": "add", "tests": [{"args": [1, 2], "expected": 3}, {"args": [-5, 5], "expected": 0},
                                        {"args": [10, 20], "expected": 30}, {"args": [0.1, 0.2], "expected": 0.3}]}  # fmt: skip


@pytest.fixture(scope="module")
def backend():
    for b in ("bwrap", "docker"):
        if why_unavailable(b) is None:
            return b
    pytest.skip("no isolating sandbox backend (bwrap or docker) here")


def traj(reply: str) -> Trajectory:
    t = Trajectory(task=Task(prompt=[Message("user", "write add")], info=INFO), messages=[])
    t.messages = [Message("user", "write add"), Message("assistant", reply)]
    return t


def fenced(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\n"


SOLUTIONS = {
    "correct": ("def add(a, b):\n    return a + b", 1.0),
    "partly": ("def add(a, b):\n    return a + b if isinstance(a, int) else 0", 0.75),
    "raises": ("def add(a, b):\n    raise ValueError('no')", 0.0),
    "syntax_error": ("def add(a, b) return a+b", 0.0),
    "fakes_output_and_exits": (
        "import json, os, sys\n"
        "print(json.dumps({'results': [{'ok': True, 'value': 3}] * 4, 'error': None}))\n"
        "os._exit(0)", 0.0),
    "rewrites_the_harness_report": (
        "import json, glob, os, sys, atexit\n"
        "req = sys.modules['__main__'].req\n"
        "def forge():\n"
        "    json.dump({'results': [{'ok': True, 'value': 42}] * 4, 'error': None}, open(req['out'], 'w'))\n"
        "    os._exit(0)\n"
        "def add(a, b):\n    forge()", 0.0),
    "hangs": ("def add(a, b):\n    while True: pass", 0.0),
    "kills_its_own_harness": ("import os\nos.system('kill -9 -1')\ndef add(a, b):\n    return a + b", 0.0),
}  # fmt: skip


async def test_rewards_by_solution(backend):
    rubric = load_rubric(backend=backend, timeout_s=2.0)
    trajs = {name: traj(fenced(code)) for name, (code, _) in SOLUTIONS.items()}
    await rubric.score_group(list(trajs.values()))
    got = {name: t.reward for name, t in trajs.items()}
    assert got == {name: want for name, (_, want) in SOLUTIONS.items()}
    assert all(t.error is None for t in trajs.values())  # the code's faults are data, not errors
    assert trajs["correct"].metrics["all_tests_passed"] == 1.0 and trajs["partly"].metrics["all_tests_passed"] == 0.0
    await rubric.close()


async def test_no_code_scores_zero_without_a_sandbox(backend):
    rubric = load_rubric(backend=backend)
    t = traj("I think the answer is 3.")
    await rubric.score(t)
    assert t.reward == 0.0 and t.metrics["code_found"] == 0.0
    await rubric.close()


def test_extract_code_and_value_equality():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f(x):\n    return x") == "def f(x):\n    return x"
    assert extract_code("no code") is None
    assert values_equal([1, [2.0000000001]], [1, [2]]) and not values_equal(True, 1) and not values_equal([1], [1, 2])


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    assert "code-tests" in {ep.name for ep in entry_points(group="agentrl.rubrics")}
