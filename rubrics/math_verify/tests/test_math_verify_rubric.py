"""math-verify rubric plugin: equivalence via math-verify, off the event loop, as a Rubric."""

import asyncio
import os
import threading
from pathlib import Path

import pytest
from agentrl_rubric_math_verify import answer_text, has_answer, is_equivalent, load_rubric, math_equivalent

from agentrl.rubrics import Rubric
from agentrl.types import Message, Task, Trajectory


@pytest.mark.parametrize(
    ("prediction", "reference", "equivalent"),
    [
        ("so the answer is \\boxed{0.5}", "1/2", True),
        ("<answer>1/2</answer>", "\\frac{1}{2}", True),
        ("$\\boxed{\\frac{1}{\\sqrt{2}}}$", "$\\sqrt{2}/2$", True),
        ("$(x+1)^2$", "x^2+2x+1", True),
        ("The final answer is $\\{2, 1\\}$", "\\{1,2\\}", True),
        ("The answer is 4", "3", False),
        ("I have no idea", "3", False),
        ("", "3", False),
    ],
)
def test_is_equivalent(prediction, reference, equivalent):
    assert is_equivalent(prediction, reference) is equivalent


# MATH stores bare LaTeX references; read bare, math-verify took their leading number, so the
# prefix number scored and the right answer did not.  (reference, reply, score)
MATH_STYLE_GOLDEN = [
    ("3\\sqrt{2}", "The answer is \\boxed{3\\sqrt{2}}.", 1.0),
    ("3\\sqrt{2}", "The answer is \\boxed{3}.", 0.0),
    ("$3\\sqrt{2}$", "<answer>3\\sqrt{2}</answer>", 1.0),
    ("$3\\sqrt{2}$", "<answer>3</answer>", 0.0),
    ("2\\pi", "The answer is \\boxed{2\\pi}.", 1.0),
    ("2\\pi", "The answer is \\boxed{2}.", 0.0),
    ("[0, 1)", "The answer is \\boxed{[0, 1)}.", 1.0),
    ("[0, 1)", "The answer is \\boxed{1}.", 0.0),
    ("(-\\infty, 3]", "<answer>(-\\infty, 3]</answer>", 1.0),
    ("(-\\infty, 3]", "<answer>3</answer>", 0.0),
    ("2x+1", "<answer>2x+1</answer>", 1.0),
    ("2x+1", "<answer>2x+7</answer>", 0.0),
    ("2x+1", "<answer>2</answer>", 0.0),
    ("x^2+1", "<answer>1+x^2</answer>", 1.0),
    ("1+x^2", "<answer>x^2+1</answer>", 1.0),
    ("1+x^2", "<answer>1</answer>", 0.0),
    ("6-2\\sqrt{5}", "So $x = 6-2\\sqrt{5}$", 1.0),
    ("6-2\\sqrt{5}", "\\boxed{6}", 0.0),
    ("4\\sqrt{3}", "\\boxed{4}", 0.0),
    ("y = 2x + 3", "\\boxed{y=2x+3}", 1.0),
    ("y = 2x + 3", "\\boxed{3}", 0.0),
    ("(3,-2)", "\\boxed{(3, -2)}", 1.0),
    ("(3,-2)", "\\boxed{3}", 0.0),
    ("2x", "\\boxed{2}", 0.0),
    # what worked before still works: numbers, fractions, percents, sets, delimited references
    ("-3", "\\boxed{-3}", 1.0),
    ("1,000", "\\boxed{1000}", 1.0),
    ("1/2", "<answer>0.5</answer>", 1.0),
    ("\\dfrac12", "\\boxed{\\frac{1}{2}}", 1.0),
    ("\\frac{\\sqrt 3}{2}", "\\boxed{\\frac{\\sqrt{3}}{2}}", 1.0),
    ("10\\%", "\\boxed{10\\%}", 1.0),
    ("\\{2,1\\}", "<answer>1, 2</answer>", 1.0),
    ("5", "<answer>x = 5</answer>", 1.0),
    ("5", "<answer>The answer is 5</answer>", 1.0),
    ("1024", "<answer>2**10</answer>", 1.0),
    ("7", "<answer>\\boxed{7}</answer>", 1.0),
    ("\\boxed{3\\sqrt{2}}", "\\boxed{3}", 0.0),
]


@pytest.mark.parametrize(("reference", "reply", "score"), MATH_STYLE_GOLDEN)
def test_bare_latex_references_golden(reference, reply, score):
    assert float(is_equivalent(reply, reference)) == score


async def test_bare_latex_references_through_the_reward_function():
    got = await asyncio.gather(*(math_equivalent(reply, ref) for ref, reply, _ in MATH_STYLE_GOLDEN[:8]))
    assert got == [score for _, _, score in MATH_STYLE_GOLDEN[:8]]


def test_answer_tags_are_read_through():
    assert answer_text("work... <answer> 7 </answer>") == "7"
    assert answer_text("\\boxed{7}") == "\\boxed{7}"


def test_is_equivalent_works_off_the_main_thread():
    # math-verify's SIGALRM timeouts only work on the main thread; elsewhere they are disabled
    out = []
    t = threading.Thread(target=lambda: out.append(is_equivalent("\\boxed{2}", "2")))
    t.start()
    t.join()
    assert out == [True]


async def test_math_equivalent_runs_in_worker_processes_concurrently():
    rewards = await asyncio.gather(
        math_equivalent("\\boxed{\\frac{2}{4}}", "0.5"),
        math_equivalent("\\boxed{3}", ["4", "3"]),
        math_equivalent("\\boxed{3}", "4"),
        math_equivalent([Message("assistant", "<answer>\\pi</answer>")], "\\pi"),
    )
    assert rewards == [1.0, 1.0, 0.0, 1.0]


async def test_load_rubric_scores_a_group():
    rubric = load_rubric(format_weight=0.1)
    assert isinstance(rubric, Rubric)
    task = Task(prompt=[Message("user", "Simplify 2/4.")], answer="\\frac{1}{2}")
    replies = ["\\boxed{0.5}", "one half is 1/2", "\\boxed{2}"]
    trajs = [Trajectory(task=task, messages=[*task.prompt, Message("assistant", r)]) for r in replies]
    await rubric.score_group(trajs)
    assert [round(t.reward, 6) for t in trajs] == [1.1, 1.0, 0.1]
    assert [t.metrics["has_answer"] for t in trajs] == [1.0, 0.0, 1.0]
    assert all(t.error is None for t in trajs)


async def test_a_hung_check_scores_zero_alone_and_its_worker_is_killed(tmp_path, monkeypatch):
    # a check deaf to SIGALRM on each worker, honest checks queued behind them: the hung ones
    # score 0 and their processes die; the queued ones are neither cancelled nor failed
    import agentrl_rubric_math_verify as mv

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # spawned workers import the job
    import mv_worker_jobs

    mv._reset_pool()  # workers started from here on see the path
    monkeypatch.setattr(mv, "_check_in_worker", mv_worker_jobs.check_or_hang)
    monkeypatch.setattr(mv, "_wall_limit_s", lambda timeout: 3.0, raising=False)
    pid_files = [tmp_path / "hung-0", tmp_path / "hung-1"]
    checks = [(f"HANG:{pid_files[0]}", "1"), (f"HANG:{pid_files[1]}", "1"), ("\\boxed{2}", "2"),
              ("\\boxed{3}", "2"), ("<answer>1/2</answer>", "0.5"), ("\\boxed{x^2}", "x^2")]  # fmt: skip
    try:
        got = await asyncio.gather(*(mv.check_async(p, r) for p, r in checks), return_exceptions=True)
        assert got == [False, False, True, False, True, True]
        for f in pid_files:
            with pytest.raises(ProcessLookupError):
                os.kill(int(f.read_text()), 0)
        assert await mv.check_async("\\boxed{4}", "4")  # fresh workers serve what comes next
    finally:
        mv._reset_pool()


@pytest.mark.timeout(60)  # a stall guard: linear takes milliseconds
def test_answer_tags_are_read_in_linear_time():
    # re.findall(r"<answer>(.*?)</answer>") rescans to the end from each unclosed tag: about 30 s
    # for 30,000 of them, minutes for these 120,000
    reply = "<answer>" * 120_000 + "\\boxed{2}"
    assert answer_text(reply) == reply and has_answer(reply) == 1.0 and has_answer("<answer>" * 120_000) == 0.0
    assert answer_text("<ANSWER>1</answer> <answer>2</Answer> <answer>3") == "2"


def test_has_answer():
    assert has_answer("\\boxed{1}") == 1.0 and has_answer("<answer>1</answer>") == 1.0 and has_answer("1") == 0.0


def test_plugin_is_discoverable_by_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="agentrl.rubrics") if e.name == "math-verify"]
    assert ep.load() is load_rubric


async def test_loaded_by_name_and_used_by_an_environment():
    from agentrl.envs import SingleTurnEnv
    from agentrl.envs.check import ScriptedClient
    from agentrl.plugins import load_rubric as load_plugin

    rubric = load_plugin("math-verify")
    env = SingleTurnEnv(dataset=[{"question": "Expand (x+1)^2.", "answer": "x^2+2x+1"}], rubric=rubric)
    task = next(iter(env.dataset()))
    right = await env.rollout(ScriptedClient(lambda p: "It is $\\boxed{x^2 + 2x + 1}$"), task)
    wrong = await env.rollout(ScriptedClient(lambda p: "It is $\\boxed{x^2 + 1}$"), task)
    await rubric.score_group([right, wrong])
    assert (right.reward, wrong.reward) == (1.0, 0.0)
