"""exact-match rubric plugin: extraction, normalisation, numeric equality, the Rubric it builds."""

import math
import re

import pytest
from agentrl_rubric_exact_match import (
    answer_reward,
    exact_match,
    extract_answer,
    has_answer,
    has_tagged,
    last_boxed,
    load_rubric,
    match_answer,
    normalize_text,
    numeric_match,
    parse_number,
    tagged,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.rubrics import Rubric
from agentrl.types import Message, Task, Trajectory


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reasoning...\n<answer> Paris </answer>", "Paris"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("line one\n\nfinal: 42\n\n", "final: 42"),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "exact", "numeric"),
    [
        ("<answer>Paris.</answer>", "paris", 1.0, 0.0),
        ("<answer>**PARIS**</answer>", "Paris", 1.0, 0.0),
        ("<answer>$\\text{Paris}$</answer>", "Paris", 1.0, 0.0),
        ("<answer>London</answer>", "Paris", 0.0, 0.0),
        ("<answer>1,000</answer>", "1000", 0.0, 1.0),
        ("<answer>1000.0</answer>", 1000, 0.0, 1.0),
        ("The answer is 42.", "42", 0.0, 1.0),
        ("<answer>3/4</answer>", "0.75", 0.0, 1.0),
        ("<answer>-$12.50</answer>", "-12.5", 0.0, 1.0),
        ("<answer>1e3</answer>", "1000", 0.0, 1.0),
        ("<answer>41.9999</answer>", "42", 0.0, 0.0),
        ("<answer>x</answer>", ["y", "X"], 1.0, 0.0),
        ("no answer tag at all", None, 0.0, 0.0),
    ],
)
def test_exact_and_numeric_match(completion, answer, exact, numeric):
    assert exact_match(completion, answer) == exact
    assert numeric_match(completion, answer) == numeric


def test_numbers_parse_by_value():
    assert parse_number("1,234.5") == parse_number("1234.50")
    assert parse_number("50%") == parse_number("0.5")
    assert parse_number("3/0") is None and parse_number("abc") is None and parse_number(math.nan) is None
    assert parse_number(True) is None and parse_number(7) == 7


def test_auto_mode_falls_back_to_numbers_only_for_numeric_references():
    assert match_answer("<answer>7.0</answer>", "7")
    assert not match_answer("<answer>7.0</answer>", "seven")
    assert not match_answer("<answer>7.0</answer>", "7", mode="exact")
    with pytest.raises(ValueError):
        answer_reward("fuzzy")


def test_case_sensitive_option():
    strict = answer_reward("exact", case_sensitive=True)
    assert strict("<answer>abc</answer>", "ABC") == 0.0 and strict("<answer>ABC</answer>", "ABC") == 1.0
    assert normalize_text("  A  b ") == "a b"


def test_completion_may_be_messages():
    msgs = [Message("user", "q"), Message("assistant", "<answer>5</answer>"), Message("user", "ok")]
    assert exact_match(msgs, "5") == 1.0 and has_answer(msgs) == 1.0
    assert exact_match([{"role": "assistant", "content": "<answer>5</answer>"}], "5") == 1.0


@settings(max_examples=200, deadline=None)
@given(st.text(), st.one_of(st.none(), st.text(), st.integers(), st.floats(allow_nan=True)))
def test_reward_functions_never_raise(completion, answer):
    for fn in (exact_match, numeric_match, answer_reward()):
        assert fn(completion, answer) in (0.0, 1.0)


@pytest.mark.parametrize(
    ("reply", "answer", "matches"),
    [
        ("<answer>1e400</answer>", "3", False),  # float(10**400) would raise OverflowError
        ("<answer>-1e400</answer>", 1e308, False),
        ("<answer>" + "9" * 400 + "</answer>", "1e400", True),  # within 1e-6 relative
        ("<answer>" + "9" * 400 + "</answer>", 2.5, False),
        ("<answer>1e400</answer>", "1e400", True),
        ("<answer>1e-400</answer>", "0", True),  # within 1e-9 absolute
        ("<answer>" + "7" * 4000 + "/3</answer>", "3", False),
        ("the count is " + "1" * 4400, "3", False),  # past int()'s digit limit: no number
    ],
)
def test_huge_numbers_compare_without_raising(reply, answer, matches):
    assert numeric_match(reply, answer) == float(matches)
    assert answer_reward()(reply, answer) == float(matches)


# (reference, reply, score) under the default rubric (mode="auto")
NUMERIC_GOLDEN = [
    # integers as written compare exactly: the default rel_tol=1e-6 once let these through
    (1234567, "<answer>1234568</answer>", 0.0),
    ("1000000", "<answer>1000001</answer>", 0.0),
    (12345678901234567891, "<answer>12345678901234567890</answer>", 0.0),
    ("12345678901234567891", "<answer>12345678901234567891</answer>", 1.0),
    (1234567, "<answer>1234568.0</answer>", 0.0),  # a decimal reply to an integer: float noise only
    (1234567.0, "<answer>1234568</answer>", 0.0),  # an integral float reference is an integer
    (1234567, "<answer>1234567.0</answer>", 1.0),
    ("42", "<answer>41.9999999999</answer>", 1.0),
    ("1/3", "<answer>0.3333333</answer>", 1.0),  # no decimal is 1/3: tolerance
    ("1/3", "<answer>0.33</answer>", 0.0),
    ("3/4", "<answer>0.7500001</answer>", 0.0),
    ("0.1", "<answer>0.1000001</answer>", 1.0),  # a decimal reference: tolerance
    # an expression or a hedge is not its last number
    ("4", "<answer>\\frac{3}{4}</answer>", 0.0),
    ("0.75", "<answer>\\frac{3}{4}</answer>", 1.0),
    ("0.75", "\\boxed{\\frac{3}{4}}", 1.0),
    ("-0.75", "\\boxed{-\\dfrac{3}{4}}", 1.0),
    ("10", "<answer>2^{10}</answer>", 0.0),
    ("16", "<answer>sqrt(16)</answer>", 0.0),
    ("16", "<answer>\\sqrt{16}</answer>", 0.0),
    ("-3", "<answer>5 - 3</answer>", 0.0),
    ("-3", "<answer>x - 3</answer>", 0.0),
    ("4", "<answer>3 * 4</answer>", 0.0),
    ("5", "<answer>5 m^2</answer>", 0.0),
    (5, "<answer>7 apples or 5</answer>", 0.0),
    ("5", "<answer>5 dollars and 3 cents</answer>", 0.0),
    # one number among words still counts
    ("-3", "<answer>x = -3</answer>", 1.0),
    ("-3", "<answer>the answer is -3</answer>", 1.0),
    ("12", "<answer>x = 12 apples</answer>", 1.0),
    ("42", "The answer is 42.", 1.0),
    # percents: N% is N/100 and N
    ("50", "<answer>50%</answer>", 1.0),
    ("50", "<answer>50\\%</answer>", 1.0),
    ("0.5", "<answer>50%</answer>", 1.0),
    ("5", "<answer>50%</answer>", 0.0),
    ("1000", "<answer>1{,}000</answer>", 1.0),
]


@pytest.mark.parametrize(("reference", "reply", "score"), NUMERIC_GOLDEN)
def test_numeric_golden(reference, reply, score):
    assert answer_reward()(reply, reference) == score
    assert numeric_match(reply, reference) == score


def _findall_tag(text, tag="answer"):  # the regex the tag reader replaced (quadratic on unclosed tags)
    return re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL | re.IGNORECASE)


def _last_boxed_by_rescanning(text):  # the brace scan last_boxed replaced
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        depth = 1
        for i in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[m.end() : i]
    return None


_PIECES = st.sampled_from(["<answer>", "</answer>", "<ANSWER>", "\\boxed{", "\\fbox {", "{", "}", "x", " ", "\n", "."])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=30).map("".join))
def test_linear_readers_agree_with_the_regex_and_the_rescan(text):
    assert tagged(text, "answer") == _findall_tag(text)
    assert has_tagged(text, "answer") == bool(_findall_tag(text))
    assert last_boxed(text) == _last_boxed_by_rescanning(text)


@pytest.mark.parametrize(
    "reply",
    ["\\boxed{" * 30_000, "<answer>" * 30_000, "<answer>x" + "." * 1_000_000 + "</answer>",
     "<answer>" + "*" * 100_000 + "</answer>", "\\boxed{" + "{" * 100_000],
    ids=["unclosed_boxes", "unclosed_tags", "full_stops", "wrappers", "unclosed_braces"],
)
@pytest.mark.timeout(120)  # a stall guard, not a speed test: linear takes well under a second
def test_a_hostile_reply_is_read_in_linear_time(reply):
    # the first three were quadratic: about 4 minutes, 30 s and 80 s at these sizes (x4 below: 16x that)
    reply = reply if reply.startswith("<answer>x") else reply * 4
    assert answer_reward()(reply, "3") == 0.0 and has_answer(reply) in (0.0, 1.0)


async def test_load_rubric_scores_trajectories():
    rubric = load_rubric(mode="numeric", format_weight=0.5)
    assert isinstance(rubric, Rubric)
    task = Task(prompt=[Message("user", "2+2?")], answer="4")
    good = Trajectory(task=task, messages=[*task.prompt, Message("assistant", "<answer>4.0</answer>")])
    untagged = Trajectory(task=task, messages=[*task.prompt, Message("assistant", "It is 4")])
    wrong = Trajectory(task=task, messages=[*task.prompt, Message("assistant", "<answer>5</answer>")])
    await rubric.score_group([good, untagged, wrong])
    assert [t.reward for t in (good, untagged, wrong)] == [1.5, 1.0, 0.5]
    assert good.metrics["numeric_match"] == 1.0 and untagged.metrics["has_answer"] == 0.0


def test_plugin_is_discoverable_by_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="agentrl.rubrics") if e.name == "exact-match"]
    assert ep.load() is load_rubric


async def test_loaded_by_name_and_used_by_an_environment():
    from agentrl.envs import SingleTurnEnv
    from agentrl.envs.check import ScriptedClient
    from agentrl.errors import AgentrlError
    from agentrl.plugins import load_rubric as load_plugin

    rubric = load_plugin("exact_match", mode="numeric")  # '-' and '_' are alike
    env = SingleTurnEnv(dataset=[{"question": "How many legs has a spider?", "answer": "8"}], rubric=rubric)
    task = next(iter(env.dataset()))
    right = await env.rollout(ScriptedClient(lambda p: "Spiders have <answer>8</answer> legs."), task)
    wrong = await env.rollout(ScriptedClient(lambda p: "<answer>6</answer>"), task)
    await rubric.score_group([right, wrong])
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    with pytest.raises(AgentrlError, match="rejected its arguments"):
        load_plugin("exact-match", nonsense=1)
