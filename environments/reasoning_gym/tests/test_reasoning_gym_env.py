"""reasoning-gym env: real families, scored by reasoning-gym's checkers, through the contract checker."""

import time

import pytest
from agentrl_env_reasoning_gym import ReasoningGymEnv, extract_answer, families
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.errors import AgentrlError
from agentrl.plugins import load_environment
from agentrl.rubrics import score_episodes
from agentrl.types import SamplingParams, Task

FAMILIES = ["leg_counting", "basic_arithmetic", "word_sorting", "fraction_simplification", "spell_backward"]
SAMPLING = SamplingParams(max_tokens=512)


def oracle(env: ReasoningGymEnv, wrap=lambda a: f"Let me think.\n<answer>{a}</answer>"):
    """Replies with the reference answer of whichever task is in the prompt."""
    answers = {t.prompt[-1].content: t.answer for t in [*env.dataset(), *env.eval_dataset()]}

    def policy(prompt: str) -> str:
        for question, answer in answers.items():
            if question in prompt:
                return wrap(answer)
        raise AssertionError("unknown question")

    return policy


@pytest.mark.parametrize("family", FAMILIES)
async def test_family_passes_the_contract_checker(family):
    env = load_environment("reasoning-gym", task=family, size=6, eval_size=4)
    report = await check_environment(env, num_episodes=3)
    assert report.ok, report.failures()


@pytest.mark.parametrize("family", FAMILIES[:3])
async def test_references_score_one_and_wrong_answers_zero(family):
    env = ReasoningGymEnv(family, size=4, eval_size=2)
    right = [await env.rollout(ScriptedClient(oracle(env)), t, SAMPLING) for t in env.dataset()]
    wrong = [await env.rollout(ScriptedClient(lambda p: "<answer>definitely not this</answer>"), t, SAMPLING)
             for t in env.dataset()]
    await env.rubric.score_group(right + wrong)
    assert [t.reward for t in right] == [1.0] * 4 and [t.reward for t in wrong] == [0.0] * 4
    assert all(t.metrics["has_answer_tag"] == 1.0 and t.stop_reason == "done" for t in right)


async def test_untagged_answer_falls_back_to_the_last_line():
    env = ReasoningGymEnv("basic_arithmetic", size=3, eval_size=1)
    trajs = [await env.rollout(ScriptedClient(oracle(env, lambda a: f"Working...\nSo:\n{a}\n")), t, SAMPLING)
             for t in env.dataset()]
    await env.rubric.score_group(trajs)
    assert [t.reward for t in trajs] == [1.0] * 3 and trajs[0].metrics["has_answer_tag"] == 0.0


def test_extract_answer():
    assert extract_answer("a\n<answer> 12 </answer>\nb <answer>13</answer>") == "13"
    assert extract_answer("thinking\n\n  final 7  \n") == "final 7"
    assert extract_answer("   ") is None


async def test_partial_credit_comes_from_the_family_checker():
    # countdown gives 0.01 for a well-formed but wrong expression (its own rule)
    env = ReasoningGymEnv("countdown", size=2, eval_size=1)
    task = env.dataset()[0]
    assert env.score(f"<answer>{task.answer}</answer>", task) == 1.0
    assert 0.0 < env.score("<answer>1+1</answer>", task) < 1.0


@pytest.mark.parametrize("partial_credit", [False, True])
async def test_a_padded_answer_earns_nothing_unless_partial_credit_is_asked_for(partial_credit):
    """The default checker pays len(reference)/len(answer) for an answer holding the reference:
    padding an unsure answer with digits would beat committing to one."""
    env = load_environment("reasoning-gym", task="leg_counting", size=4, eval_size=1, partial_credit=partial_credit)
    task = env.dataset()[0]
    replies = [f"<answer>{task.answer}</answer>", f"<answer>{task.answer}1</answer>", "<answer>x</answer>"]
    client = ScriptedClient(lambda p: replies.pop(0))
    trajs = [await env.rollout(client, task, SAMPLING) for _ in range(3)]
    await score_episodes(env.rubric, trajs)
    padded = len(task.answer) / (len(task.answer) + 1)  # the checker's own partial credit
    assert [t.metrics["rg_checker_score"] for t in trajs] == [1.0, padded, 0.0]
    assert [t.reward for t in trajs] == [1.0, padded if partial_credit else 0.0, 0.0]


async def test_families_interleave_and_configs_reach_reasoning_gym():
    env = load_environment("reasoning-gym", task="leg_counting,gcd", size=3, eval_size=2,
                           config={"leg_counting": {"min_animals": 2, "max_animals": 2}})
    assert [t.info["family"] for t in env.dataset()] == ["leg_counting", "gcd"] * 3
    legs = [t for t in env.dataset() if t.info["family"] == "leg_counting"]
    assert all(len(t.info["metadata"]["animals"]) == 2 for t in legs)


def test_task_read_back_from_json_scores_the_same():
    env = ReasoningGymEnv("word_sorting", size=3, eval_size=1)
    task = Task.from_dict(__import__("json").loads(__import__("json").dumps(env.dataset()[2].to_dict())))
    fresh = ReasoningGymEnv("word_sorting", size=3, eval_size=1)  # e.g. another process
    assert fresh.score(f"<answer>{task.answer}</answer>", task) == 1.0
    assert fresh.score("<answer>x</answer>", task) == 0.0


def test_eval_split_shares_no_question_with_train():
    env = ReasoningGymEnv("gcd", size=50, eval_size=30)
    assert not {t.prompt[-1].content for t in env.dataset()} & {t.prompt[-1].content for t in env.eval_dataset()}


def test_bad_names_and_configs_are_one_line_errors():
    with pytest.raises(AgentrlError, match="did you mean leg_counting"):
        load_environment("reasoning-gym", task="leg_count")
    with pytest.raises(AgentrlError, match="min_animals"):
        load_environment("reasoning-gym", task="leg_counting", config={"min_animals": 0}, size=2)
    with pytest.raises(AgentrlError):
        load_environment("reasoning-gym", task="gcd", config={"no_such_option": 1})
    assert len(families()) > 50


def _reference(reply: str) -> str | None:
    """What extract_answer returned when it called reasoning-gym's extractor (a regex, quadratic
    on unclosed tags): its answer, else the reply's last non-empty line."""
    from reasoning_gym.utils import extract_answer as rg_extract

    tagged = rg_extract(reply, tag_name="answer")
    lines = [ln.strip() for ln in reply.strip().splitlines() if ln.strip()]
    return tagged if tagged is not None else (lines[-1] if lines else None)


TAGGED = [
    "<answer>12</answer>", "<answer> 12 </answer>", "<answer>\n12\n</answer>", "<answer></answer>",
    "a <answer>1</answer> b <answer>2</answer> c", "<answer>1<answer>2</answer>",
    "<answer>1</answer></answer>", "<answer>a</answer> <answer>b", "</answer><answer>x</answer>",
    "<answer>  \t x y \n </answer>", "<answer>\n\n12\n\n</answer>", "<ANSWER>12</ANSWER>", "<answer>12",
    "no tags", "<answer>a</answer><answer></answer>", "<answer><answer></answer></answer>",
]


@pytest.mark.parametrize("reply", TAGGED)
def test_tagged_answers_match_reasoning_gyms_extractor(reply):
    assert extract_answer(reply) == _reference(reply)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["<answer>", "</answer>", " ", "\n", "x", "12", "<", ">", "answer"]), max_size=14))
def test_tagged_answers_match_reasoning_gyms_extractor_on_any_mix(parts):
    reply = "".join(parts)
    assert extract_answer(reply) == _reference(reply)


def _best_of(fn, arg, repeats=5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(arg)
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("unit", ["<answer>", "<answer> x", "<answer>x</answer>"])
def test_hostile_replies_take_linear_time(unit):
    """Review: the regex took 4.6 s on "<answer>" * 8000 (64 KB), on the event loop. 8x the input
    must cost about 8x the time, not 64x (best of a few runs; a generous factor, no wall clock)."""
    small, large = unit * 250, unit * 2000
    assert extract_answer(unit * 8000) is not None  # 64+ KB, handled
    assert _best_of(extract_answer, large) < 20 * max(_best_of(extract_answer, small), 1e-6)


def test_a_family_named_twice_is_refused():
    with pytest.raises(ValueError, match="leg_counting.*twice"):
        ReasoningGymEnv("leg_counting,leg_counting", size=2, eval_size=1)
    env = ReasoningGymEnv("leg_counting,gcd", size=3, eval_size=1)
    assert len({t.id for t in env.dataset()}) == len(env.dataset()) == 6
