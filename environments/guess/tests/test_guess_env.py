"""guess env: contract checker, feedback correctness, bisection always wins, bad replies are data."""

import re
from pathlib import Path

import pytest
from agentrl_env_guess import GuessEnv, binary_search_policy, narrow, parse_guess
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.envs import as_gymnasium
from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.plugins import load_environment
from agentrl.types import Message, SamplingParams

SAMPLING = SamplingParams(max_tokens=64)


@pytest.mark.parametrize(
    ("text", "guess"),
    [
        ("<guess>42</guess>", 42),
        ("maybe 10... no, <guess> 17 </guess>", 17),
        ("I'll say 63", 63),
        ("between 1 and 100, my guess: 50", 50),
        ("3.5", None),
        ("no idea", None),
        ("9" * 40, None),
    ],
)
def test_parse_guess(text, guess):
    assert parse_guess(text) == guess


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parse_guess_never_raises(text):
    assert parse_guess(text) is None or isinstance(parse_guess(text), int)


async def test_passes_the_contract_checker():
    # by directory: this checkout's package, whichever copy of it is installed
    env = load_environment(str(Path(__file__).parents[1]), num_train=50, num_eval=20, terse=True, show_interval=True)
    assert isinstance(env, GuessEnv) and env.version == "0.2.0"
    report = await check_environment(env, num_episodes=4)
    assert report.ok, report.failures()


@pytest.mark.parametrize("min_width", [100, 16])
async def test_bisection_always_solves_within_the_budget(min_width):
    env = GuessEnv(num_train=40, num_eval=10, min_width=min_width, turn_penalty_weight=0.5)
    client = ScriptedClient(binary_search_policy)
    trajs = [await env.rollout(client, t, SAMPLING) for t in env.dataset()]
    await env.rubric.score_group(trajs)
    for t in trajs:
        assert t.error is None and t.stop_reason == "done", t.messages
        assert t.metrics["solved"] == 1.0 and t.metrics["guesses"] <= env.max_turns - 1
        assert t.reward == pytest.approx(1.0 + 0.5 * t.metrics["turn_penalty"])
        assert t.messages[-1].content.startswith("Correct!")


async def test_feedback_points_at_the_secret():
    env = GuessEnv(num_train=5, num_eval=5)
    task = next(iter(env.dataset()))
    state = await env.setup(task)
    secret = task.answer
    below = (await env.step(state, Message("assistant", f"<guess>{secret - 1}</guess>")))[0].content
    above = (await env.step(state, Message("assistant", f"<guess>{secret + 1}</guess>")))[0].content
    outside = (await env.step(state, Message("assistant", "<guess>500</guess>")))[0].content
    assert f"higher than {secret - 1}" in below and f"lower than {secret + 1}" in above
    assert "between 1 and 100" in outside and state.metrics["out_of_range"] == 1
    assert not env.done(state) and state.metrics["guesses"] == 3


async def test_always_wrong_guesser_loses_at_max_turns():
    env = GuessEnv(num_train=3, num_eval=5)
    trajs = [await env.rollout(ScriptedClient(lambda p: "<guess>0</guess>"), t, SAMPLING) for t in env.dataset()]
    await env.rubric.score_group(trajs)
    assert all(t.stop_reason == "max_turns" and t.reward == 0.0 for t in trajs)
    assert all(t.metrics["turn_penalty"] == -1.0 and t.metrics["out_of_range"] == env.max_turns for t in trajs)


async def test_replies_without_a_number_get_feedback_and_are_counted():
    env = GuessEnv(num_train=1, num_eval=5)
    traj = await env.rollout(ScriptedClient(lambda p: "hmm"), next(iter(env.dataset())), SAMPLING)
    assert traj.error is None and traj.metrics["invalid_replies"] == env.max_turns
    assert "could not find a number" in traj.messages[3].content


def test_eval_split_never_repeats_a_training_task():
    env = GuessEnv(min_width=16, num_train=500, num_eval=100)
    key = lambda t: (t.info["low"], t.info["high"], t.answer)  # noqa: E731
    assert not {key(t) for t in env.dataset()} & {key(t) for t in env.eval_dataset()}


def test_bad_arguments_are_one_line_errors():
    from agentrl.errors import AgentrlError

    with pytest.raises(AgentrlError, match="low"):
        load_environment("guess", low=5, high=3)


def test_as_gymnasium_plays_guess():
    genv = as_gymnasium(GuessEnv(num_train=10, num_eval=5))
    check_env(genv, skip_render_check=True)
    obs, _ = genv.reset(seed=0)
    transcript, reward, terminated = obs, 0.0, False
    while not terminated:
        obs, reward, terminated, truncated, info = genv.step(binary_search_policy(transcript))
        assert not truncated
        transcript += "\n" + obs
    assert reward == 1.0 and info["metrics"]["solved"] == 1.0
    genv.close()


def _assistant_guesses(convo):
    return [parse_guess(m.content) for m in convo if m.role == "assistant"]


@pytest.mark.parametrize("strategy", ["bisect", "random", "linear"])
def test_demonstrations_are_legal_games_of_their_strategy(strategy):
    env = GuessEnv(high=63, min_width=32, max_turns=6, num_train=300, num_eval=10, demo_strategy=strategy)
    demos = env.demonstrations(300, seed=1)
    solved = 0
    tasks = [env.dataset()[(1 + i) % 300] for i in range(300)]
    for task, convo in zip(tasks, demos, strict=True):
        lo, hi = task.info["low"], task.info["high"]
        guesses = _assistant_guesses(convo)
        assert 1 <= len(guesses) <= env.max_turns
        for g in guesses:  # every guess is a number still possible
            assert lo <= g <= hi
            lo, hi = narrow((lo, hi), task.answer, g)
        if strategy == "bisect":
            assert guesses[0] == (task.info["low"] + task.info["high"]) // 2
        if strategy == "linear":
            assert guesses == list(range(task.info["low"], task.info["low"] + len(guesses)))
        solved += guesses[-1] == task.answer
    rate = solved / len(demos)
    assert {"bisect": rate == 1.0, "random": 0.4 < rate < 0.85, "linear": rate < 0.3}[strategy], rate


def test_mixed_demonstrations_bisect_a_fraction_of_moves_and_count_up_otherwise():
    env = GuessEnv(low=1, high=31, min_width=24, max_turns=5, num_train=400, num_eval=10, demo_strategy="mixed",
                   demo_bisect_frac=0.3)
    demos = env.demonstrations(400, seed=0)
    mid = low = 0
    for task, convo in zip(env.dataset(), demos, strict=True):
        lo, hi = task.info["low"], task.info["high"]
        for g in _assistant_guesses(convo):
            if g == (lo + hi) // 2:  # bisection (the two coincide only on 1-2 numbers left)
                mid += 1
            else:
                assert g == lo, (g, lo, hi)
                low += 1
            lo, hi = narrow((lo, hi), task.answer, g)
    assert 0.25 < mid / (mid + low) < 0.36, mid / (mid + low)
    solved = sum(_assistant_guesses(c)[-1] == t.answer for t, c in zip(env.dataset(), demos, strict=True))
    assert 0.25 < solved / 400 < 0.46  # ~0.36: between counting up (~0.19) and bisection (1.0)
    with pytest.raises(ValueError, match="demo_bisect_frac"):
        GuessEnv(demo_strategy="mixed", demo_bisect_frac=1.5)


def test_random_demonstrations_are_seeded():
    env = GuessEnv(num_train=50, num_eval=10, demo_strategy="random")
    assert env.demonstrations(20, seed=3) == env.demonstrations(20, seed=3)
    assert env.demonstrations(20, seed=3) != env.demonstrations(20, seed=4)


async def test_show_interval_states_the_numbers_still_possible():
    env = GuessEnv(high=63, min_width=63, num_train=5, num_eval=5, show_interval=True)
    task = next(iter(env.dataset()))
    state = await env.setup(task)
    secret = task.answer
    lo_reply = (await env.step(state, Message("assistant", f"<guess>{secret - 1}</guess>")))[0].content
    assert lo_reply.endswith(f"It is between {secret} and 63.")
    hi_reply = (await env.step(state, Message("assistant", f"<guess>{secret + 2}</guess>")))[0].content
    assert hi_reply.endswith(f"It is between {secret} and {secret + 1}.")
    plain = GuessEnv(high=63, min_width=63, num_train=5, num_eval=5)
    state = await plain.setup(task)
    assert "between" not in (await plain.step(state, Message("assistant", f"<guess>{secret - 1}</guess>")))[0].content


async def test_turn_budget_is_the_episode_length_and_bisection_meets_it():
    env = GuessEnv(high=63, min_width=32, max_turns=6, num_train=60, num_eval=5, show_interval=True)
    trajs = [await env.rollout(ScriptedClient(binary_search_policy), t, SAMPLING) for t in env.dataset()]
    assert all(t.stop_reason == "done" and len(t.turns) <= 6 for t in trajs)
    losing = [await env.rollout(ScriptedClient(lambda p: "<guess>0</guess>"), t, SAMPLING) for t in env.dataset()[:3]]
    assert all(len(t.turns) == 6 and t.stop_reason == "max_turns" for t in losing)


def test_bad_strategy_or_budget_is_rejected():
    with pytest.raises(ValueError, match="demo_strategy"):
        GuessEnv(demo_strategy="psychic")
    with pytest.raises(ValueError, match="max_turns"):
        GuessEnv(max_turns=0)


@pytest.mark.parametrize("weight", [0.5, 1.0, 3.0])
async def test_a_late_win_beyond_the_env_budget_still_beats_a_loss(weight):
    """A rollout limit above the env's max_turns (rollout.max_turns, eval --max-turns) let a win
    on guess 18 score 1 - 17/7 = -1.43 with weight 1: worse than losing (-1)."""
    env = GuessEnv(num_train=200, num_eval=5, turn_penalty_weight=weight)
    task = next(t for t in env.dataset() if 12 <= t.answer <= 20)

    def count_up(prompt: str) -> str:
        return f"<guess>{len(re.findall('lower|higher', prompt)) + 1}</guess>"

    win = await env.rollout(ScriptedClient(count_up), task, SAMPLING, max_turns=30)
    loss = await env.rollout(ScriptedClient(lambda p: "<guess>0</guess>"), task, SAMPLING, max_turns=30)
    await env.rubric.score_group([win, loss])
    assert win.metrics["solved"] == 1.0 and win.metrics["guesses"] > env.max_turns
    assert loss.reward == -weight < win.reward
    assert env.reward_range[0] <= win.reward <= env.reward_range[1]
    assert -1.0 <= win.metrics["turn_penalty"] <= 0.0


@pytest.mark.parametrize("kwargs", [{"low": 1, "high": 5, "min_width": 5}, {"low": 1, "high": 7, "min_width": 7}])
def test_a_range_too_small_for_a_split_is_refused(kwargs):
    with pytest.raises(ValueError, match=r"num_eval=100.*low=1"):
        GuessEnv(**kwargs)
