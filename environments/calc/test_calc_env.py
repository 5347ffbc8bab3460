"""The calc quickstart environment: data, tool, reward, demonstrations, contract."""

import json

import pytest
from agentrl_env_calc import CalcEnv, calculator, correct_answer, last_number, load_environment

from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.types import SamplingParams


def key(t):
    return (t.info["a"], t.info["op"], t.info["b"])


@pytest.mark.parametrize("kwargs", [{}, {"max_operand": 9, "ops": "+"}])
def test_datasets_are_seeded_and_disjoint(kwargs):
    env, again = load_environment(num_train=2000, **kwargs), load_environment(num_train=2000, **kwargs)
    train, held = env.dataset(), env.eval_dataset()
    assert [key(t) for t in train[:50]] == [key(t) for t in again.dataset()[:50]]
    assert {key(t) for t in train}.isdisjoint({key(t) for t in held}) and held
    t = train[0]
    assert t.prompt[0].content == f"What is {t.info['a']}{t.info['op']}{t.info['b']}?"
    assert t.answer == eval(f"{t.info['a']}{t.info['op']}{t.info['b']}")
    assert all(0 <= t.info["a"] <= 9 and t.info["op"] == "+" for t in train) or not kwargs
    assert load_environment(num_train=50, seed=1).dataset()[0].prompt != t.prompt


def test_calculator_is_safe_and_exact():
    assert calculator("12*7") == "84" and calculator("(3-10)*2") == "-14" and calculator("7/2") == "3.5"
    for bad in ["__import__('os')", "2**10000", "x+1", "1+", "9" * 300]:
        with pytest.raises(ValueError):
            calculator(bad)


@pytest.mark.parametrize("bomb", ["(((9**64)**64)**64)**64", "(9**64)**64", "(7**60)**60*7**60", "(2**64)**64*(2**64)**64"])
def test_a_power_tower_is_refused_before_it_is_computed(bomb):
    """Attack: an exponent check alone passed (((9**64)**64)**64)**64, whose 53-million-bit power
    ran for minutes in a tool thread nobody can kill, holding the GIL (the env server's /health
    froze). Every intermediate is bounded before it is computed, so this is an error reply."""
    with pytest.raises(ValueError, match="too large"):
        calculator(bomb)
    assert calculator("2**64*2**64") == str(2**128) and calculator("(2**32)**64") == str(2**2048)


def test_a_malformed_number_is_an_error_reply_not_a_warning_on_stderr():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="cannot parse"):
            calculator("1if 1 else 2")  # Python parses this, with a SyntaxWarning
    assert not caught, [str(w.message) for w in caught]


def test_reward_is_numeric_match_on_last_number():
    assert correct_answer("84", 84) == 1.0 and correct_answer("The answer is -14.", -14) == 1.0
    assert correct_answer("84.0", 84) == 1.0 and correct_answer("1,102", 1102) == 1.0
    assert correct_answer("83", 84) == 0.0 and correct_answer("no idea", 84) == 0.0


@pytest.mark.parametrize(
    ("reply", "number"),
    [
        ("-2", -2.0), ("\u22122", -2.0), ("The answer is \u2212202.", -202.0), ("\u20137", -7.0),
        ("\uff0d3", -3.0), ("-2.", -2.0), ("-2.0", -2.0), ("**-2**", -2.0), ("The answer is -2!", -2.0),
        ("1,234", 1234.0), ("1 234", 1234.0), ("-1\u202f234\u202f567", -1234567.0), ("12\u00a0345", 12345.0),
        ("3 - 5 = -2", -2.0), ("3-5=-2", -2.0), ("-2 or 7", 7.0), ("84", 84.0), ("no number", None),
        # the rule is the last number written: a trailing check is read, and "3-5" is 3 minus 5
        ("= -2 (check: 3-5)", 5.0), ("between 1 and 12", 12.0),
        ("7 12 345", 12345.0),
    ],
)
def test_the_answer_is_the_last_number_with_its_sign(reply, number):
    assert last_number(reply) == number


def test_a_minus_sign_glyph_is_not_dropped():
    """Review: U+2212 was read as +: a right negative answer scored 0, a wrong one 1."""
    assert correct_answer("\u22122", -2) == 1.0 and correct_answer("\u2212202", 202) == 0.0
    assert correct_answer("1 234", 234) == 0.0 and correct_answer("1 234", 1234) == 1.0


def test_bad_difficulty_is_rejected():
    with pytest.raises(ValueError):
        CalcEnv(ops="/")


def solver(prompt: str) -> str:
    """Solve like the demonstrations do: call the tool, then repeat its result."""
    if "<|im_start|>tool\n" in prompt:
        return prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    question = prompt.rsplit("What is ", 1)[1].split("?")[0]
    call = json.dumps({"name": "calculator", "arguments": {"expression": question}})
    return f"<tool_call>\n{call}\n</tool_call>"


async def test_solving_episode_scores_one_and_errors_come_back_as_tool_messages():
    env = load_environment(num_train=20)
    trajs = [await env.rollout(ScriptedClient(solver), t, SamplingParams(max_tokens=100)) for t in env.dataset()[:4]]
    await env.rubric.score_group(trajs)
    assert [t.reward for t in trajs] == [1.0] * 4
    assert all(t.metrics["used_calculator"] == 1.0 and len(t.turns) == 2 for t in trajs)

    bad = await env.rollout(ScriptedClient(lambda p: "<tool_call>{oops</tool_call>"), env.dataset()[0])
    assert bad.error is None and bad.stop_reason == "max_turns"  # the episode went on
    assert bad.messages[2].role == "tool" and bad.messages[2].content.startswith("Error: invalid JSON")
    assert bad.metrics["tool_parse_errors"] == 3


def test_demonstrations_are_clean_unless_noisy():
    env = load_environment(num_train=500)
    demos = env.demonstrations(50, seed=3)
    def text(ds):
        return [[(m.role, m.content, [c.arguments for c in m.tool_calls]) for m in d] for d in ds]

    assert len(demos) == 50 and text(demos) == text(env.demonstrations(50, seed=3))
    assert text(demos) != text(env.demonstrations(50, seed=4))
    held = {t.prompt[0].content for t in env.eval_dataset()}
    for d in demos:
        assert [m.role for m in d] == ["user", "assistant", "tool", "assistant"] and d[0].content not in held
        args = json.loads(d[1].tool_calls[0].arguments)
        assert calculator(args["expression"]) == d[2].content
        task = next(t for t in env.dataset() if t.prompt[0].content == d[0].content)
        assert correct_answer(d[3].content, task.answer) == 1.0
    noisy = env.demonstrations(200, seed=3, noise=0.5)
    wrong = 0
    for d in noisy:
        task = next(t for t in env.dataset() if t.prompt[0].content == d[0].content)
        wrong += correct_answer(d[-1].content, task.answer) == 0.0 or len(d) == 2
    assert 40 < wrong < 160


async def test_contract_checklist_passes():
    report = await check_environment(load_environment(num_train=100))
    assert report.ok, report.failures()
    assert {r.name for r in report.results} >= {"dataset", "eval_dataset", "demonstrations", "cleanup", "endpoint_failure"}


def test_tool_latency_is_lognormal_with_the_asked_median_and_p99():
    from agentrl.envs import ToolLatency

    lat = ToolLatency(0.2, 4.0, max_s=1e9, seed=3)
    draws = sorted(lat.sample() for _ in range(40_000))
    median, p99 = draws[len(draws) // 2], draws[int(0.99 * len(draws))]
    assert median == pytest.approx(0.2, rel=0.05) and p99 == pytest.approx(4.0, rel=0.15)
    capped = ToolLatency(0.2, 4.0, max_s=1.0)
    assert max(capped.sample() for _ in range(5000)) == 1.0
    assert ToolLatency(0.0, 0.0).sample() == 0.0
    for bad in [(-1.0, 1.0), (1.0, 0.5)]:
        with pytest.raises(ValueError):
            ToolLatency(*bad)


async def test_slow_calculator_waits_and_keeps_its_schema():
    import time

    fast = load_environment(num_train=20)
    slow = load_environment(num_train=20, tool_latency_median_s=0.05, tool_latency_p99_s=0.05)
    assert slow.tool_schemas() == fast.tool_schemas() or slow.tool_schemas() is None
    assert slow.tools["calculator"].schema == fast.tools["calculator"].schema
    task = slow.dataset()[0]
    t0 = time.perf_counter()
    traj = await slow.rollout(ScriptedClient(solver), task, SamplingParams(max_tokens=100))
    waited = time.perf_counter() - t0
    await slow.rubric.score_group([traj])
    assert traj.reward == 1.0 and waited >= 0.05


async def test_slow_tools_overlap_across_episodes():
    """The delay is an asyncio sleep: 20 episodes that each wait ~0.2 s finish in far less than 20 × 0.2 s."""
    import asyncio
    import time

    env = load_environment(num_train=20, tool_latency_median_s=0.2, tool_latency_p99_s=0.2)
    t0 = time.perf_counter()
    trajs = await asyncio.gather(*[env.rollout(ScriptedClient(solver), t, SamplingParams(max_tokens=100))
                                   for t in env.dataset()[:20]])
    assert all(t.error is None for t in trajs) and time.perf_counter() - t0 < 2.0


def test_bad_tool_latency_is_a_one_line_error():
    from pathlib import Path

    from agentrl.errors import AgentrlError
    from agentrl.plugins import load_environment as load

    with pytest.raises(AgentrlError, match=r"p99_s \(0.1\) must be >= median_s"):
        load(str(Path(__file__).parent), tool_latency_median_s=1.0, tool_latency_p99_s=0.1)
