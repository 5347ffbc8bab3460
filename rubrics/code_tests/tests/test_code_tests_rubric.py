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
    # a value the checker cannot compare, or a report it cannot parse or should not read, is a
    # failed test: an exception out of the rubric would drop the episode, escaping the 0
    "returns_a_huge_int": ("def add(a, b):\n    return 10 ** 400", 0.0),
    "returns_floats_for_ints": ("def add(a, b):\n    return float(a + b)", 1.0),  # 3.0 == 3, as an assert sees it
    "off_by_a_little": ("def add(a, b):\n    return a + b + 1e-7", 0.25),  # no tolerance for an int: only 0.3 passes
    "nests_the_report_too_deep": (
        "import os, sys\n"
        "def add(a, b):\n"
        "    open(sys.modules['__main__'].req['out'], 'w').write('[' * 100000)\n"
        "    os._exit(0)", 0.0),
    "pads_the_report_past_the_cap": (  # right values, but 3 MB a report: never read
        "import json, os, sys\n"
        "def add(a, b):\n"
        "    values = [3, 0, 30, 0.3]\n"
        "    report = {'results': [{'ok': True, 'value': v} for v in values], 'error': None, 'pad': 'x' * 3_000_000}\n"
        "    json.dump(report, open(sys.modules['__main__'].req['out'], 'w'))\n"
        "    os._exit(0)", 0.0),
}  # fmt: skip


async def test_rewards_by_solution(backend):
    rubric = load_rubric(backend=backend, timeout_s=2.0)
    trajs = {name: traj(fenced(code)) for name, (code, _) in SOLUTIONS.items()}
    await rubric.score_group(list(trajs.values()))
    errored = {name: t.error[:80] for name, t in trajs.items() if t.error is not None}
    assert errored == {}  # the code's faults are data, not errors
    got = {name: t.reward for name, t in trajs.items()}
    assert got == {name: want for name, (_, want) in SOLUTIONS.items()}
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
    assert values_equal([1, [2.0000000001]], [1, [2.0]]) and not values_equal([1, [2.0000000001]], [1, [2]]) and not values_equal([1], [1, 2])
    assert not values_equal(True, 1) and not values_equal(1, True) and values_equal(False, False)


ADD = "def add(a, b):\n    return a + b\n"
USAGE = "print(add(2, 3))  # 5\n"
WRONG = "def add(a, b):\n    return 3\n"
# (entry point, reply, the code graded): the last block defining the entry point, else the last block
EXTRACT_GOLDEN = [
    ("add", f"```python\n{ADD}```\nExample usage:\n```python\n{USAGE}```", ADD),
    ("add", f"```python\n{ADD}```\n```python\n{WRONG}```", WRONG),  # as in a file: the later def wins
    ("add", f"```python\n{ADD}```\n```python\ndef add_one(a):\n    return a + 1\n```", ADD),
    ("add", f"```python\n{ADD}```\n```python\n# def add(a, b): see above\n{USAGE}```", ADD),
    ("add", f"```python\nasync def add(a, b):\n    return a\n```\n```\n{USAGE}```", "async def add(a, b):\n    return a\n"),
    ("add", f"```python\nx = 1\n```\n```python\n{USAGE}```", USAGE),  # nothing defines it: the last block
    (None, f"```python\n{ADD}```\n```python\n{USAGE}```", USAGE),
]


@pytest.mark.parametrize(("entry_point", "reply", "code"), EXTRACT_GOLDEN)
def test_extract_code_picks_the_block_defining_the_entry_point(entry_point, reply, code):
    assert extract_code(reply, entry_point) == code


# (reply, tests_passed) for INFO: only the picked block runs, under the tests, so which block
# is picked can never earn a pass the code itself does not
REPLY_GOLDEN = [
    (f"Here it is:\n```python\n{ADD}```\nExample usage:\n```python\n{USAGE}```\n", 1.0),
    (f"```python\n{WRONG}```\nChecking it:\n```python\nassert add(1, 2) == 3\n```", 0.25),
    (f"```python\n{ADD}```\nbetter:\n```python\n{WRONG}```", 0.25),
    (f"```python\n{ADD}```\nor, shorter:\n```python\nadd = lambda a, b: a + b\n```", 1.0),  # defines no `def`: ADD
    ("```python\nimport sys\n```\n```python\ns = '''\ndef add(a, b): pass'''\n```", 0.0),  # a def in a string
]


@pytest.mark.parametrize(("reply", "score"), REPLY_GOLDEN)
async def test_rewards_by_reply(backend, reply, score):
    rubric = load_rubric(backend=backend, timeout_s=5.0)
    t = traj(reply)
    await rubric.score(t)
    assert (t.reward, t.error) == (score, None)
    await rubric.close()


def test_ints_compare_exactly_and_nothing_raises():
    assert values_equal(1307674368000, 1307674368000)
    assert not values_equal(1307674368001, 1307674368000)  # 15! off by one is wrong
    assert values_equal(3.0, 3) and not values_equal(2.9999999, 3)  # an int is expected: exactly, as == compares
    assert not values_equal(1.307674368001e12, 1307674368000) and not values_equal(float(2**60), 2**60 + 1)
    assert values_equal(3, 3.0) and values_equal(0.30000000000000004, 0.3)  # a float is expected
    assert values_equal(10**400, 10**400) and not values_equal(10**400, 10**400 + 1)
    assert not values_equal(10**400, 3) and not values_equal(10**400, 0.3) and not values_equal(-(10**400), 1e308)
    assert not values_equal(float("inf"), 10**400) and not values_equal(float("nan"), 0.5)


async def test_a_large_honest_report_is_read_and_scored(backend):
    # 20k floats a value: ~400 kB of report, parsed off the event loop, still within the cap
    info = {"entry_point": "halves", "tests": [{"args": [20000], "expected": [i / 2 for i in range(20000)]},
                                               {"args": [3], "expected": [0.0, 0.5, 1.0]}]}  # fmt: skip
    task = Task(prompt=[Message("user", "write halves")], info=info)
    t = Trajectory(task=task, messages=[*task.prompt, Message("assistant", fenced(
        "def halves(n):\n    return [i / 2 for i in range(n)]"))])  # fmt: skip
    rubric = load_rubric(backend=backend, timeout_s=5.0)
    await rubric.score(t)
    assert (t.reward, t.error) == (1.0, None)
    await rubric.close()


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    assert "code-tests" in {ep.name for ep in entry_points(group="agentrl.rubrics")}


async def test_a_malformed_test_in_the_dataset_errors_naming_it_not_a_silent_zero(backend):
    """The report's checks turn anything the model writes into a failed test; a dataset's own bug
    (a test without args or expected) must not hide behind them as a 0 on every episode."""
    task = Task(prompt=[Message("user", "write add")], info={"entry_point": "add", "tests": [{"args": [1, 2]}]})
    t = Trajectory(task=task, messages=[*task.prompt, Message("assistant", fenced("def add(a, b):\n    return a + b"))])
    rubric = load_rubric(backend=backend, timeout_s=5.0)
    await rubric.score(t)
    assert t.error is not None and 'task.info["tests"] must be a list of' in t.error, t.error
    await rubric.close()
